"""The launch contract between the host and vkmoe's shaders, owned here and nowhere else.

Everything both sides must agree on: the band width, limits, specialization-constant ids, activation, codebook
and abort codes, the word layout of the `route` and `sync` buffers, scratch sizes, per-phase item counts and
the split path's grids. The shader build (`setup.py build_shaders`) writes `glsl_header()` to
`shaders/include/generated/moe_layout.glsl`, which the shaders include, and rebuilds it whenever this file
changes; `tests/test_layout.py` fails if a header and this module disagree.

A leaf module: it imports nothing from vkmoe, so every layer may import it (vk, exl3, sched, ops, the CPU tier),
and setup.py loads it by path, before the package can be imported.
"""

# ------------------------------------------------------------------------------------------------ geometry
BAND = 128              # columns of one band = one Hadamard block = the GEMM's unit of output columns
TILE = 16               # a trellis tile is 16 x 16
WORKGROUP_SIZE = 256    # invocations of every vkmoe compute workgroup
MAX_TOP_K = 32          # per-token slot loops in moe_stages.glsl are unrolled to this
ROUTE_MAX_EXPERTS = 1024            # the split routing's shared counters (3 words per expert)
PERSISTENT_ROUTE_MAX_EXPERTS = 256  # the persistent kernel's, kept inside 16 KiB of shared memory
MAX_GRID_X = 65535      # the smallest maxComputeWorkGroupCount[0] Vulkan allows: larger grids fold into y
MOE_BINDINGS = 21       # descriptor bindings shared by every MoE shader (moe_bindings.glsl)
MOE_SYNC_BINDING = 18   # of them, the sync words (the co-residency discovery binds its own words there)

# ------------------------------------------------------------------------------------- codes shared with C
ACTIVATIONS = {"silu": 0, "gelu": 1, "relu2": 2, "swiglu_oai": 3, "gelu_erf": 4}  # ACT_* (also native/vkn.h)
GATELESS_ACTIVATIONS = ("relu2",)
CODEBOOKS = {"3inst": 0, "mcg": 1, "mul1": 2}  # CB_*
# The MoE op's launch modes (its dispatch= argument, VKMOE_DISPATCH): auto lets sched.plan decide.
DISPATCH_MODES = ("auto", "persistent", "split")

# Abort codes the persistent kernel leaves in sync word SYNC_ABORT (0 = it ran to the end); sync.glsl sets them.
ABORT_SPIN, ABORT_LOCK, ABORT_BARRIER = 1, 2, 3
ABORT_REASONS = {ABORT_SPIN: "a spin ran out of its bound", ABORT_LOCK: "a ticket lock timed out",
                 ABORT_BARRIER: "a grid barrier timed out"}

# ------------------------------------------------------------------------------ specialization-constant ids
# MoE shaders (moe_bindings.glsl)
SPEC_MOE_K_GATE, SPEC_MOE_K_UP, SPEC_MOE_K_DOWN, SPEC_MOE_CB, SPEC_MOE_ROWS, SPEC_MOE_ACT = 0, 1, 2, 3, 4, 5
SPEC_MOE_DIRECT = 6     # direct mode: every (token, slot) row its own chunk, no routing pass (moe_stages.glsl)
SPEC_MOE_PACED_SPIN = 7  # moe_persistent.comp: whole-workgroup spins, for a driver with a loop cap (moe_spin_paced)
SPEC_MOE_STAGE3_IN_DOWN = 8  # stage 3 run by each down item for its own k-range, into its shared memory (moe_stages.glsl)
SPEC_MOE_TOKEN_SUM_PASS = 9  # the down tails write the (token, slot) rows only; moe_token_sum.comp sums the tokens
# exl3_linear.comp and exl3_dequant.comp (the first two)
SPEC_LINEAR_K, SPEC_LINEAR_CB, SPEC_LINEAR_ROWS, SPEC_LINEAR_HAS_BIAS, SPEC_LINEAR_DIRECT = 0, 1, 2, 3, 4
SPEC_LINEAR_ACT_IN = 5  # exl3_linear.comp direct mode: x = act(gate, up) of a block's shared expert (ACT_*; -1: x)
# every decoding shader's f16 build (exl3_decode.glsl): the driver fuses the fp16 fma exactly
SPEC_F16_FMA_FUSED = 15
# every shader that runs the 128-point Hadamard transform (hadamard128.glsl): the subgroup size of the subgroup
# transform, 0 for the shared-memory one (vkmoe/ops/kernels.py: hadamard_subgroup)
SPEC_HAD_SUBGROUP = 14
# exl3_linear_coop.comp (cooperative matrices): rows of a workgroup tile in its narrow and wide builds, k-tiles
# decoded per k-step, the one matrix shape it multiplies (M, N, K: fp16 x fp16 -> fp32, subgroup scope), the
# subgroup size it is written for (8 subgroups of 32 = one per 16-column tile of the band) and its row padding
# in shared memory (fp16 elements: keeps rows 16-byte aligned and off one bank).
COOP_ROWS_NARROW, COOP_ROWS_WIDE = 64, 128
COOP_KSTEP = 4
COOP_SHAPE = (16, 16, 16)
COOP_SUBGROUP = 32
COOP_PAD = 8
# The MoE's cooperative-matrix stages (moe_gate_up_coop.comp, moe_down_coop.comp) store whole 16-row m-tiles of a
# chunk's partial: chunk c's rows start this many rows per chunk past its sorted position (moe_partial_rows).
COOP_MOE_ROW_SLACK = TILE - 1
# Rows of the MoE cooperative-matrix stages' tile, so the most rows of one of their chunks. 16 (one m-tile), not
# the linear's 64: at prefill sizes most experts hold a few to a few dozen rows, and the 16-row tile needs 74
# registers instead of 118, less shared memory (what sets these stages' occupancy: docs/DESIGN.md) and multiplies
# no empty m-tiles;
# it ran DeepSeek-V3 m = 256 in 7.5 ms instead of 15.8 and the Qwen3 shape's m = 1024 in 2.35 ms instead of 2.60
# (BENCHMARKS.md, sixth session), even though an expert of 64 rows then decodes its weights four times (the wide
# build below halves that where experts hold many rows).
COOP_MOE_ROWS = 16
# The MoE's cooperative-matrix stages, by the name in their shaders' file names (moe_{stage}_coop.comp).
COOP_MOE_STAGES = ("gate_up", "down")
# Rows of the stages' wide build (moe_*_coop_wide): for experts that hold many rows each, where the 16-row tile
# decodes an expert's weights once per 16 rows (ops.plan.coop_moe_rows, VKMOE_COOPMAT_MOE_WIDE_ROWS). Its 23.3 KB
# of shared memory (the Hadamard's rows borrowed from the A tile: coop_moe_shared_bytes) keep it at two workgroups
# per SM on the H100, as the 16-row tile (counted; at 25.4 KB, before the borrowing, it lost, past the cliff where
# 25.9 KB was counted one per SM: BENCHMARKS.md, thirty-eighth, forty-second and forty-third sessions).
COOP_MOE_ROWS_WIDE = 32
# The most rows of an FMA-path expert chunk (GEMM_ROWS: ops.plan.rows_for, VKMOE_MOE_ROWS).
MOE_ROWS_MAX = 16

# ------------------------------------------------------------------------------------ sync buffer (words)
# Counters reset themselves; the host zero-fills once at creation and again only after an aborted launch.
# The persistent kernel's counters are polled by spinning workgroups; the words its workgroups only add to (the
# ticket, the user counts that say when a polled counter can be reset) lie in other 128-byte lines (SYNC_LINE),
# so that their atomics do not queue behind the polls of a hot line.
SYNC_LINE = 32         # words per 128-byte line
SYNC_ABORT = 0         # abort code (ABORT_*)
SYNC_ROUTED = 2        # persistent: 1 once workgroup 0 has written the chunk table
SYNC_STAGE1_DONE = 3   # persistent: workgroups done with their share of routing + stage 1
SYNC_TICKET = 32       # persistent: work items handed out after the first round (item = grid + ticket)
SYNC_PHASE1_USERS = 64  # persistent, routed: workgroups done with SYNC_ROUTED and SYNC_STAGE1_DONE
SYNC_COUNTERS = 96     # arrival counters: gate/up bands, down bands, token bands; then per-chunk progress

# The persistent kernel's timing build (moe_persistent.comp with MOE_CLOCK; VKMOE_PERSISTENT_CLOCK, tools/bench_moe
# --timeline): invocation 0 of each workgroup stores the device's realtime clock (VK_KHR_shader_clock, 64 bits as
# two words) at these marks, in CLOCK_WORDS_PER_WG words per workgroup behind both GEMMs' partials (clock_offset);
# a mark the workgroup never reached reads 0. "first_*" marks are those of the workgroup's first item of that
# stage; the tails' marks only where that item was its band's last arrival. Then two words: the number of the
# workgroup's dependency waits that spun, and their total time (ns, low 32 bits). "gate_up_done": the workgroup
# has no gate/up item left (its next item is a down item, or none); "end": its last store, counter resets included.
CLOCK_MARKS = ("start", "first_gate_up_gemm", "first_gate_up_arrival", "first_stage3_end", "gate_up_done",
               "first_wait_begin", "first_wait_end", "first_down_gemm", "first_down_arrival", "first_stage5_end",
               "down_done", "end")
CLOCK_WAITS = 2 * len(CLOCK_MARKS)      # word: waits that spun; + 1: their total ns
CLOCK_WORDS_PER_WG = 32
CLOCK_MAX_WORKGROUPS = 8192             # the timing area's size: grids up to this many workgroups

# The persistent kernel's push-constant `mode` (moe_bindings.glsl): run the MoE, or measure its own co-residency.
MOE_MODE_RUN, MOE_MODE_DISCOVER = 0, 1

# ----------------------------------------------------------------------------------- route buffer (words)
# [0] rows routed, [1] chunks; then (expert, first sorted row, rows) per chunk; then per sorted row its flat
# index t * top_k + slot, then per sorted row its expert; then per token its number of valid slots.
ROUTE_ROWS, ROUTE_CHUNKS = 0, 1
ROUTE_HEADER = 16
ROUTE_CHUNK_WORDS = 3

# ----------------------------------------------------------------- the 128-point Hadamard transform
# The subgroup transform (a subgroup owns a row, 128 / S consecutive elements per invocation) runs on subgroup
# sizes S in this range; the shared-memory transform splits a row over HAD_SHARED_LANES invocations (2 elements
# each) and so transforms HAD_SHARED_ROWS rows per pass (its had_buf). A pass has at most HAD_MAX_PASS_ROWS rows.
HAD_SUBGROUP_MIN, HAD_SUBGROUP_MAX = 8, 128
HAD_SHARED_LANES = 64
HAD_SHARED_ROWS = WORKGROUP_SIZE // HAD_SHARED_LANES
HAD_MAX_PASS_ROWS = WORKGROUP_SIZE // HAD_SUBGROUP_MIN
HAD_MAX_VALS = BAND // HAD_SUBGROUP_MIN  # elements per invocation at most (hadamard128.glsl's had_v)
# Rows one stage-1 item or one exl3_had_in workgroup transforms: 4 passes of 8 rows with subgroups of 32, one
# pass on lavapipe's 8, 8 passes of the shared-memory transform.
HAD_ITEM_ROWS = 32
STAGE1_PAIRS_PER_ITEM = HAD_ITEM_ROWS // 2  # (row, 128-block) pairs per stage-1 work item: a gate and an up row each
# (row, 128-block) units per exl3_had_in workgroup: one pass of the shared-memory transform (a subgroup transform's
# pass leaves half its rows idle). Small: a decode-size linear has few units (16 for k = 2048 at m = 1), and 32 per
# workgroup ran them all in ONE workgroup (H200, 2048 x 768 at m = 1: 19.3 us vs 14.0 with 4 per workgroup); at
# prefill sizes the input Hadamard is under 1 % of the linear either way.
HAD_IN_UNITS_PER_WG = HAD_SHARED_ROWS
# The FMA GEMM core's shared reduction buffer (exl3_gemm.glsl's gemm_red): 4 k-slices x 4 rows x one band, in words.
GEMM_RED_WORDS = 4 * 4 * BAND
# Direct mode: a gate/up item builds its A row for the 128-blocks holding its k-tiles in that buffer (64 words per
# block of packed fp16 pairs); a k-range of DIRECT_MAX_KT tiles spans at most DIRECT_MAX_KT / 8 + 1 blocks wherever
# it starts.
DIRECT_MAX_KT = 8 * (GEMM_RED_WORDS // (BAND // 2) - 1)
# Stage 3 in the down items (SPEC_MOE_STAGE3_IN_DOWN): a down item's A is its chunk's rows x the 128-blocks of I its
# k-range spans, stage 3 applied, in the same buffer: at most this many (row, block) units.
STAGE3_IN_DOWN_MAX_UNITS = GEMM_RED_WORDS // (BAND // 2)

# ------------------------------------------------------------------------ the device block (router, shared)
# moe_router.comp's family (spec constant) and moe_block_elem.comp's operation (push constant `mode`)
ROUTER_FAMILIES = {"std": 0, "dots": 1, "sqrtsp": 2, "sqrtsp_hash": 3}  # ROUTER_*
ROUTER_WEIGHT_KINDS = {"float16": 0, "bfloat16": 1, "float32": 2}        # WKIND_*: the checkpoint's router dtype
# router GEMV: experts per workgroup (grid E / this x m, so no loop grows with E or m); 4 left half of the H200's
# SMs idle at E = 256 and was 1.1-4.5 us slower there
ROUTER_EXPERTS_PER_WG = 1
ROUTER_MAX_GROUPS = 64        # dots: n_group limit (router_select.glsl's shared group scores)
SOFTPLUS_THRESHOLD = 20.0     # sqrt(softplus): x itself above this (torch's default; routing.py uses the same)
ELEM_TO_F16, ELEM_ACTIVATE, ELEM_ADD_SHARED, ELEM_TO_F32 = 0, 1, 2, 3  # moe_block_elem.comp modes
# MoePush.shared_add: what the routed experts' token sums add to out (a device block's fused shared sum:
# moe_stages.glsl moe_out_value): nothing, the shared output, or the shared output x sigmoid(its gate logit)
SHARED_ADD_NONE, SHARED_ADD_PLAIN, SHARED_ADD_GATED = 0, 1, 2
SPEC_ROUTER_WKIND, SPEC_ROUTER_X_F32, SPEC_ROUTER_FAMILY = 0, 1, 2


def ceil_div(a, b):
    return -(-a // b)


def gate_up_projections(gated):
    return 2 if gated else 1


# ------------------------------------------------------------------------------------------ buffer sizes
def route_words(m, top_k, max_chunks):
    return ROUTE_HEADER + ROUTE_CHUNK_WORDS * max_chunks + 2 * m * top_k + m


def sync_words(m, max_chunks, H, I):
    # header, gate/up band arrivals, down band arrivals, token band arrivals, per-chunk gate/up progress
    # (counters_chunk_done in moe_bindings.glsl: I-bands through stage 3, what a persistent down item waits for),
    # then from the next line on per chunk the down items past their wait (counters_chunk_users)
    return chunk_users_word(m, max_chunks, H, I) + max_chunks


def chunk_users_word(m, max_chunks, H, I):
    """First word of the per-chunk user counts (counters_chunk_users in moe_bindings.glsl): the line after the
    per-chunk progress counters, which down items poll."""
    progress_end = (SYNC_COUNTERS + max_chunks * (I // BAND) + max_chunks * (H // BAND) + m * (H // BAND)
                    + max_chunks)
    return -(-progress_end // SYNC_LINE) * SYNC_LINE


def moe_partial_rows(plan):
    """Rows of one k-split of the MoE GEMM partials (partial_rows in moe_stages.glsl): R, plus the slack of the
    cooperative-matrix stages' whole m-tiles (partial_row0)."""
    return plan.m * plan.top_k + (COOP_MOE_ROW_SLACK * plan.max_chunks if getattr(plan, "coop", False) else 0)


def clock_offset(plan, H, I):
    """Byte offset of the persistent timing build's clock words in the partials buffer: past both GEMMs' partials."""
    P = moe_partial_rows(plan)
    return 4 * (2 * plan.splits_gu * P * I + plan.splits_d * P * H)


def scratch_bytes(plan, H, I, clock=False):
    """Bytes of each per-batch-shape MoE scratch buffer, by binding name (plan: ops.plan.MoePlan); clock=True: the
    partials buffer also holds the timing build's clock words (clock_offset)."""
    R = plan.m * plan.top_k
    P = moe_partial_rows(plan)
    clock_bytes = 4 * CLOCK_WORDS_PER_WG * CLOCK_MAX_WORKGROUPS if clock else 0
    return {
        "route": 4 * route_words(plan.m, plan.top_k, plan.max_chunks),
        "states": 2 * (2 * R * H),      # fp16 [2][R][H]: gate and up inputs
        "inter": 2 * (R * I),           # fp16 [R][I]: down input
        # fp32 k-split partials: gate/up [2][splits_gu][P][I], then down [splits_d][P][H] (P = moe_partial_rows;
        # partial_down in moe_stages.glsl: the persistent kernel runs a chunk's down GEMM while others are in
        # gate/up); the split dispatches need only the larger of the two ("partial_split")
        "partial": 4 * (2 * plan.splits_gu * P * I + plan.splits_d * P * H) + clock_bytes,
        # (both with stage 3 in the down items: their stage 3 reads the gate/up partials)
        "partial_split": 4 * (2 * plan.splits_gu * P * I + plan.splits_d * P * H if plan.stage3_in_down
                              else max(2 * plan.splits_gu * P * I, plan.splits_d * P * H)),
        "rows": 4 * (R * H),            # fp32 [R][H]: one row per (token, slot)
        "sync": 4 * sync_words(plan.m, plan.max_chunks, H, I),
    }


def linear_counter_words(row_chunks, n):
    """exl3_linear.comp's arrival counters: one per (row chunk, band)."""
    return row_chunks * (n // BAND)


# ------------------------------------------------------------------------------- work items and the grids
def stage1_items(m, top_k, H):
    return ceil_div(m * top_k * (H // BAND), STAGE1_PAIRS_PER_ITEM)


def gate_up_items_per_chunk(I, gated, splits_gu):
    return (I // BAND) * gate_up_projections(gated) * splits_gu


def down_items_per_chunk(H, splits_d):
    return (H // BAND) * splits_d


def fold_grid(groups):
    """A 1-D count of workgroups as an (x, y) grid within MAX_GRID_X (the shader recombines them)."""
    x = min(groups, MAX_GRID_X)
    return x, ceil_div(groups, x)


def split_grids(plan, H, I, gated):
    """The split path's dispatches: routing (workgroup 0) + stage 1, gate/up (+3), down (+5), the token sums; in
    direct mode (plan.direct) the first is None: there is no routing pass and each gate/up item does its own stage
    1; the last is None unless plan.token_sum_pass (else the down tails sum the tokens): one invocation per (token,
    column) of the output."""
    return (None if getattr(plan, "direct", False) else fold_grid(1 + stage1_items(plan.m, plan.top_k, H)),
            (gate_up_items_per_chunk(I, gated, plan.splits_gu), plan.max_chunks),
            (down_items_per_chunk(H, plan.splits_d), plan.max_chunks),
            fold_grid(ceil_div(plan.m * H, WORKGROUP_SIZE)) if getattr(plan, "token_sum_pass", False) else None)


def linear_grid(plan, n):
    """exl3_linear.comp: (bands, k-splits, row chunks)."""
    return n // BAND, plan.splits, plan.row_chunks


def had_in_grid(m, k):
    """exl3_had_in.comp: one workgroup per HAD_IN_UNITS_PER_WG (row, 128-block) units, folded into (x, y) (a
    k = 2048 linear passes 65535 workgroups at m = 16384)."""
    return fold_grid(ceil_div(m * (k // BAND), HAD_IN_UNITS_PER_WG))


# Bytes of one shared line of the cooperative-matrix tiles (a column of weights or a row of A: a padded k-step of
# fp16) and of the shared-memory Hadamard's rows (hadamard128.glsl's had_buf, fp32).
COOP_LINE_BYTES = 2 * (COOP_KSTEP * TILE + COOP_PAD)
HAD_SHARED_BYTES = 4 * HAD_SHARED_ROWS * BAND


def coop_shared_bytes(rows):
    """Shared memory of exl3_linear_coop.comp with `rows` rows per tile: the decoded weights (a band of columns,
    each a padded k-step of fp16), the A rows of the k-step (fp16, padded) and the shared-memory Hadamard's rows
    (fp32), plus the 16-byte arrival flag."""
    return BAND * COOP_LINE_BYTES + rows * COOP_LINE_BYTES + HAD_SHARED_BYTES + 16


def coop_moe_shared_bytes(rows=COOP_MOE_ROWS):
    """Shared memory of moe_gate_up_coop.comp / moe_down_coop.comp built for chunks of `rows` rows (COOP_MOE_ROWS,
    or COOP_MOE_ROWS_WIDE: the _wide builds): the linear's tile of that many rows (coop_shared_bytes) less the
    shared-memory Hadamard's rows, which lie in the A tile (moe_stages.glsl), plus the tile's A row indices and
    stage 5's token-done flags (one word per chunk row)."""
    assert rows * COOP_LINE_BYTES >= HAD_SHARED_BYTES, "the Hadamard's rows must fit the A tile they borrow"
    return coop_shared_bytes(rows) - HAD_SHARED_BYTES + 4 * rows + 4 * rows


def dequant_grid(k, n):
    """exl3_dequant.comp: one invocation per 8-lane share of a tile."""
    return ceil_div((k // TILE) * (n // TILE) * 8, WORKGROUP_SIZE)


# ------------------------------------------------------------------------------------- the GLSL header
def _defines():
    yield "BAND", f"{BAND}u"
    yield "MAX_TOP_K", str(MAX_TOP_K)
    yield "ROUTE_MAX_EXPERTS", str(ROUTE_MAX_EXPERTS)
    yield "PERSISTENT_ROUTE_MAX_EXPERTS", str(PERSISTENT_ROUTE_MAX_EXPERTS)
    for name, value in ACTIVATIONS.items():
        yield f"ACT_{name.upper()}", str(value)
    for name, value in CODEBOOKS.items():
        yield f"CB_{name.upper()}", str(value)
    for name in ("SPIN", "LOCK", "BARRIER"):
        yield f"ABORT_{name}", f"{globals()['ABORT_' + name]}u"
    for name in ("K_GATE", "K_UP", "K_DOWN", "CB", "ROWS", "ACT", "DIRECT", "PACED_SPIN", "STAGE3_IN_DOWN",
                 "TOKEN_SUM_PASS"):
        yield f"SPEC_MOE_{name}", str(globals()["SPEC_MOE_" + name])
    for name in ("K", "CB", "ROWS", "HAS_BIAS", "DIRECT", "ACT_IN"):
        yield f"SPEC_LINEAR_{name}", str(globals()["SPEC_LINEAR_" + name])
    yield "SPEC_F16_FMA_FUSED", str(SPEC_F16_FMA_FUSED)
    yield "SPEC_HAD_SUBGROUP", str(SPEC_HAD_SUBGROUP)
    for name in ("SHARED_LANES", "SHARED_ROWS", "MAX_PASS_ROWS", "MAX_VALS", "IN_UNITS_PER_WG"):
        yield f"HAD_{name}", f"{globals()['HAD_' + name]}u"
    for name in ("COOP_ROWS_NARROW", "COOP_ROWS_WIDE", "COOP_KSTEP", "COOP_PAD", "COOP_MOE_ROW_SLACK", "COOP_MOE_ROWS",
                 "COOP_MOE_ROWS_WIDE", "MOE_ROWS_MAX", *(f"SYNC_{n}" for n in ("LINE", "ABORT", "TICKET", "ROUTED", "STAGE1_DONE", "PHASE1_USERS", "COUNTERS")),
                 "MOE_MODE_RUN", "MOE_MODE_DISCOVER", "ROUTE_ROWS", "ROUTE_CHUNKS", "ROUTE_HEADER", "ROUTE_CHUNK_WORDS",
                 "STAGE1_PAIRS_PER_ITEM", "GEMM_RED_WORDS"):
        yield name, f"{globals()[name]}u"  # unsigned constants, under their own names
    for i, name in enumerate(CLOCK_MARKS):
        yield f"CLOCK_{name.upper()}", f"{i}u"
    yield "CLOCK_WAITS", f"{CLOCK_WAITS}u"
    yield "CLOCK_WORDS_PER_WG", f"{CLOCK_WORDS_PER_WG}u"
    for name, value in ROUTER_FAMILIES.items():
        yield f"ROUTER_{name.upper()}", f"{value}u"
    for name, value in ROUTER_WEIGHT_KINDS.items():
        yield f"WKIND_{name.upper()}", f"{value}u"
    yield "ROUTER_EXPERTS_PER_WG", f"{ROUTER_EXPERTS_PER_WG}u"
    yield "ROUTER_MAX_GROUPS", f"{ROUTER_MAX_GROUPS}u"
    yield "SOFTPLUS_THRESHOLD", f"{SOFTPLUS_THRESHOLD:.1f}"
    for name in ("TO_F16", "ACTIVATE", "ADD_SHARED", "TO_F32"):
        yield f"ELEM_{name}", f"{globals()['ELEM_' + name]}u"
    for name in ("NONE", "PLAIN", "GATED"):
        yield f"SHARED_ADD_{name}", f"{globals()['SHARED_ADD_' + name]}u"
    for name in ("WKIND", "X_F32", "FAMILY"):
        yield f"SPEC_ROUTER_{name}", str(globals()["SPEC_ROUTER_" + name])


def glsl_defines():
    """{macro name: value text} of the generated header."""
    return dict(_defines())


def glsl_header():
    lines = ["// Generated from vkmoe/layout.py by `setup.py build_shaders`: edit that file, not this one.",
             "#ifndef MOE_LAYOUT_GLSL", "#define MOE_LAYOUT_GLSL"]
    lines += [f"#define {name} {value}" for name, value in _defines()]
    lines.append("#endif")
    return "\n".join(lines) + "\n"
