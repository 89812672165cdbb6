"""How GEMM work is cut into workgroups: rows per pass, k-splits, and the loop-cap bound on lavapipe 22.3."""
from dataclasses import dataclass

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


def rows_for(m):
    return 1 if m <= 1 else 4 if m <= 4 else 8 if m <= 8 else 16


def gemm_plan(device, m, k, n, target_workgroups=None):
    rows = rows_for(m)
    row_chunks = -(-m // rows)
    tiles_k = k // 16
    bands = n // 128
    if target_workgroups is None:
        target_workgroups = 4 * (device.compute_units or 16)
    splits = max(1, min(tiles_k // 4 or 1, -(-target_workgroups // (bands * row_chunks))))
    kt_per_split = -(-tiles_k // splits)
    if device.quirks.get("loop_iteration_cap"):
        kt_per_split = min(kt_per_split, 4 * CAPPED_K_ITERATIONS)
    splits = -(-tiles_k // kt_per_split)
    return GemmPlan(rows, row_chunks, splits, kt_per_split)
