"""How GEMM work is cut into workgroups: rows per pass, k-splits, and the loop-cap bound on lavapipe 22.3."""
from dataclasses import dataclass

from .. import knobs
from ..layout import BAND, TILE, ceil_div

# Per-invocation k-loop iterations allowed on drivers that silently stop long loops (lavapipe 22.3 stops at
# 65,536 iterations per invocation, all loops counted): each k-loop iteration may cost up to ~280 inner
# iterations if the driver does not unroll, so 128 keeps a whole invocation far below the cap.
CAPPED_K_ITERATIONS = 128


@dataclass(frozen=True)
class GemmPlan:
    rows: int          # GEMM_ROWS specialization: rows accumulated per pass (1, 4, 8 or 16)
    row_chunks: int    # ceil(m / rows)
    splits: int        # k-splits per band
    kt_per_split: int  # k-tiles (16 deep) per split


def default_target_workgroups(device):
    """How many workgroups a GEMM dispatch aims for: VKMOE_GEMM_WG_PER_CU (default 3, what the H200 keeps resident
    per SM for these pipelines: 10 % faster than 4 at m = 1..4, BENCHMARKS.md) per compute unit."""
    return knobs.get("VKMOE_GEMM_WG_PER_CU") * (device.compute_units or 16)


def rows_for(m):
    return 1 if m <= 1 else 4 if m <= 4 else 8 if m <= 8 else 16


def gemm_plan(device, m, k, n, target_workgroups=None):
    rows = rows_for(m)
    row_chunks = ceil_div(m, rows)
    tiles_k = k // TILE
    bands = n // BAND
    if target_workgroups is None:
        target_workgroups = default_target_workgroups(device)
    splits, kt_per_split = _splits(device, tiles_k, bands * row_chunks, target_workgroups)
    return GemmPlan(rows, row_chunks, splits, kt_per_split)


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

    @property
    def R(self):
        return self.m * self.top_k

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _splits(device, tiles_k, work, target, forced=None):
    """(k-splits, k-tiles per split) so that `work` independent items x splits reach about `target`
    workgroups (or `forced` splits), with at least 4 k-tiles per split, capped where the driver has a loop cap."""
    wanted = forced if forced else ceil_div(target, max(1, work))
    splits = max(1, min(max(1, tiles_k // 4), wanted))
    kt = ceil_div(tiles_k, splits)
    if device.quirks.get("loop_iteration_cap"):
        kt = min(kt, 4 * CAPPED_K_ITERATIONS)
    return ceil_div(tiles_k, kt), kt


def moe_plan(device, m, top_k, E, H, I, gated, target_workgroups=None):
    R = m * top_k
    active = min(E, R)
    rows = knobs.get("VKMOE_MOE_ROWS") or rows_for(ceil_div(R, max(1, active)))  # the knob is for tuning
    max_chunks = active + ceil_div(R, rows)
    expected_chunks = max(active, ceil_div(R, rows))
    if target_workgroups is None:
        target_workgroups = default_target_workgroups(device)
    forced = knobs.get("VKMOE_MOE_SPLITS") or (None, None)  # a tuning knob, like VKMOE_MOE_ROWS
    splits_gu, kt_gu = _splits(device, H // TILE, expected_chunks * (I // BAND) * (2 if gated else 1), target_workgroups,
                               forced[0])
    splits_d, kt_d = _splits(device, I // TILE, expected_chunks * (H // BAND), target_workgroups, forced[1])
    return MoePlan(m, top_k, rows, max_chunks, splits_gu, kt_gu, splits_d, kt_d)
