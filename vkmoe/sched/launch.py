"""One MoE forward in the chosen dispatch mode, with the persistent path's safety net: a launch that aborted
(a bounded spin ran out) is re-run in split mode on the same inputs, and `moe.last_run` says why."""
import time

from .plan import auto_switch_point, persistent_plan

ABORT_REASONS = {1: "a spin ran out of its bound", 2: "a ticket lock timed out", 3: "a grid barrier timed out",
                 4: "a self-check failed"}


def choose_mode(moe, mode, scratch):
    """(mode to launch, PersistentPlan or None, reason). A split request never plans the persistent kernel."""
    if mode == "split":
        return "split", None, "split requested"
    if mode == "auto":
        limit, source = auto_switch_point(moe.device)
        if scratch.plan.m > limit:
            return "split", None, f"auto: split for m={scratch.plan.m} (persistent only up to m={limit}: {source})"
    plan = persistent_plan(moe.device, scratch.plan, moe.E, moe.H, moe.I, moe.gated, moe.co_resident(scratch.plan))
    if mode == "persistent":
        if plan.allowed:
            return "persistent", plan, "persistent requested: " + plan.reason
        return "split", plan, "persistent requested but not possible: " + plan.reason
    if not plan.trusted:
        return "split", plan, "auto: " + plan.reason
    return "persistent", plan, "auto: " + plan.reason


def run_forward(moe, mode, hidden, ids, weights, m, top_k):
    start = time.perf_counter()
    scratch = moe._scratch_for(m, top_k)
    chosen, pplan, reason = choose_mode(moe, mode, scratch)
    fallback = None
    if chosen == "persistent":
        out, gpu_ms, abort_code = moe.run_persistent(hidden, ids, weights, m, top_k, pplan)
        if abort_code:
            fallback = (f"persistent launch aborted ({ABORT_REASONS.get(abort_code, abort_code)}; grid "
                        f"{pplan.workgroups} from {pplan.source}): re-ran in split mode")
            scratch.reset_sync()
            out, gpu_ms, _ = moe.run_split(hidden, ids, weights, m, top_k)
            chosen = "split"
    else:
        out, gpu_ms, _ = moe.run_split(hidden, ids, weights, m, top_k)
        if mode != "split":
            fallback = reason
    moe.last_run = {"mode": chosen, "requested": mode, "reason": reason, "fallback_reason": fallback,
                    "plan": scratch.plan.as_dict(), "persistent_plan": pplan.as_dict() if pplan else None,
                    "workgroups": pplan.workgroups if chosen == "persistent" else None,
                    "groups": pplan.groups if chosen == "persistent" else None,
                    "gpu_ms": gpu_ms, "wall_ms": (time.perf_counter() - start) * 1e3}
    return out
