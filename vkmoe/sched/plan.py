"""The persistent launch plan: how many workgroups one dispatch may have on THIS device, and whether to trust it.

Sources, in order of trust: a probe measurement cached by `tools/probe_residency` for (driver, device, pipeline
variant); the vendor's compute-unit count (VK_NV_shader_sm_builtins, VK_AMD_shader_core_properties2,
VK_ARM_shader_core_builtins, or lavapipe's worker threads), one workgroup per compute unit; else nothing, and
then auto mode does not use the persistent kernel. Drivers known to lack forward-progress guarantees between
workgroups stay off in auto mode unless forced.
"""
from dataclasses import asdict, dataclass

from .. import knobs, layout
from ..layout import PERSISTENT_ROUTE_MAX_EXPERTS
from ..vk.cachefile import LOCATION_VARIABLES
from . import residency

# The stand-in probe's variant whose verdict (spin barrier, message passing) the persistent kernel relies on: 256
# invocations, 16 KiB of shared memory (the kernel uses < 16 KiB: had_buf 2 KiB, gemm_red 8 KiB, routing 3.5 KiB).
PERSISTENT_VARIANT = (256, 16384)
DENY = ("moltenvk", "apple", "mali")  # default-deny: no forward progress guarantee observed/known


@dataclass
class PersistentPlan:
    allowed: bool           # may the persistent kernel run (forced mode included)
    trusted: bool           # may auto mode choose it
    workgroups: int         # grid: groups x workgroups per group (vkmoe runs one group spanning the grid)
    groups: int
    source: str             # where the co-resident count came from
    reason: str             # why (not) persistent
    spin_limit: int         # iterations of one barrier spin before it gives up
    loop_budget: int        # total spin iterations per invocation (below a driver loop cap)

    def as_dict(self):
        return asdict(self)


def _co_resident(device, measured):
    """(workgroups, source, trusted) for the persistent kernel. `measured`: what the persistent pipeline itself
    measured in its discovery mode (vkmoe.sched.occupancy), or None when it was not measured."""
    forced = knobs.get("VKMOE_PERSISTENT_GRID")
    if forced:
        return forced, "VKMOE_PERSISTENT_GRID (forced; not checked against residency)", True
    entry = residency.lookup(device, PERSISTENT_VARIANT)
    if entry is not None and not entry.get("persistent"):
        # The stand-in probe saw barrier timeouts or message-passing violations on this device.
        return 0, f"probe cache: {entry.get('reason')}", False
    per_cu = _workgroups_per_cu()
    if measured is not None:
        count = int(measured.get("min", 0))
        if count < 1:
            return 0, "the persistent pipeline's discovery measured no co-resident workgroup", False
        grid, source = count, (f"{count} co-resident workgroups of this pipeline (its own discovery, min of "
                               f"{len(measured.get('samples', []))} of {measured.get('launched')} launched)")
        if per_cu and device.compute_units and per_cu * device.compute_units < grid:
            grid = per_cu * device.compute_units
            source += f", capped at {per_cu} per compute unit (VKMOE_PERSISTENT_WG_PER_CU)"
        return grid, source, True
    if device.compute_units:
        return int(device.compute_units), f"{device.compute_units_source}: one workgroup per compute unit", True
    return 0, "no co-resident count for this device (run `vkmoe probe`)", False


def _workgroups_per_cu():
    """VKMOE_PERSISTENT_WG_PER_CU: an optional cap on the persistent grid in workgroups per compute unit (default
    none: as many as the pipeline measured co-resident)."""
    return knobs.get("VKMOE_PERSISTENT_WG_PER_CU")


def work_loop_iterations(moe_plan, E, H, I, gated):
    """A generous bound on the loop iterations one invocation may spend on work items if it ended up doing all
    of them (tickets are dynamic, so one workgroup can). Only matters on drivers with a loop cap."""
    p = moe_plan
    # ~40 per Hadamard pass of the shared-memory transform (the one with loops), HAD_SHARED_ROWS rows a pass
    stage1 = layout.stage1_items(p.m, p.top_k, H) * layout.ceil_div(2 * layout.STAGE1_PAIRS_PER_ITEM, layout.HAD_SHARED_ROWS) * 40
    gate_up = p.max_chunks * layout.gate_up_items_per_chunk(I, gated, p.splits_gu) * (p.kt_gu // 4 + 80)
    # a down item's own stage 3 (stage3_in_down): its rows x blocks units, HAD_SHARED_ROWS a pass
    stage3 = layout.ceil_div(p.rows * (p.kt_d // 8 + 2), layout.HAD_SHARED_ROWS) * 40 if p.stage3_in_down_persistent else 0
    down = p.max_chunks * layout.down_items_per_chunk(H, p.splits_d) * (p.kt_d // 4 + 80 + stage3)
    return 2000 + stage1 + gate_up + down


def persistent_plan(device, moe_plan, E, H, I, gated, measured=None, scratch_fits=True):
    """The launch plan of the persistent kernel; `measured` is the pipeline's own co-resident count
    (Exl3MoeMlp.co_resident), which the grid never exceeds; `scratch_fits`: the batch's scratch has room for the
    persistent kernel's GEMM partials (both GEMMs' at once)."""
    workgroups, source, trusted = _co_resident(device, measured)
    name = f"{device.name} {device.driver_name}".lower()
    cap = device.quirks.get("loop_iteration_cap")
    # Iterations of 32 polls. A CPU driver's co-resident workgroups are threads the OS may leave waiting while a
    # spinning one runs: on Mesa 25 (no loop cap) 200,000 iterations lasted 0.43 s beside a loaded test run, and
    # on Mesa 22.3 a wait of a golden layer's persistent launch ran out of its bound in a CI run beside the other
    # lavapipe's suite (moe_spin_paced); 2,000,000 (~4 s) is the bound on Mesa 25. A GPU keeps its workgroups
    # running: 65,536 (about a second of polls).
    spin_limit = 2_000_000 if device.device_type == "cpu" else 1 << 16
    loop_budget = 0xFFFFFFFF

    def plan(allowed, ok_auto, reason):
        return PersistentPlan(allowed, ok_auto and allowed, max(workgroups, 0), 1, source, reason,
                              spin_limit, loop_budget)

    if getattr(moe_plan, "coop", False):
        return plan(False, False, coop_split_reason(moe_plan))
    if not scratch_fits:
        return plan(False, False, "this batch's GEMM partials for the persistent kernel (gate/up and down at once) "
                                  "exceed the device's maxStorageBufferRange: the split path is used")
    if E > PERSISTENT_ROUTE_MAX_EXPERTS:
        return plan(False, False, f"{E} experts: the persistent kernel routes at most {PERSISTENT_ROUTE_MAX_EXPERTS}")
    if workgroups < 1:
        return plan(False, False, source)
    # A forced grid (VKMOE_PERSISTENT_GRID) or a cached measurement can exceed what one dispatch may launch;
    # the dispatch would then fail to record, so such a grid is refused here and the batch runs split.
    limit = device.limits.maxComputeWorkGroupCount[0]
    if workgroups > limit:
        return plan(False, False, f"a grid of {workgroups} workgroups ({source}) exceeds this device's "
                                  f"maxComputeWorkGroupCount[0] ({limit}): the split path is used")
    if cap:
        # Every loop iteration of an invocation counts against the cap, spins included: spins get what the
        # work cannot use, with a margin.
        work = work_loop_iterations(moe_plan, E, H, I, gated)
        budget = int(cap * 0.9) - work
        if budget < 3 * 256:
            return plan(False, False, f"the driver ends loops after {cap} iterations and this batch's work may "
                                      f"need {work}: the split path is used")
        loop_budget = budget
        spin_limit = budget
    denied = next((d for d in DENY if d in name), None)
    if denied:
        return plan(True, False, f"{device.name}: persistent mode is off by default on {denied} drivers "
                                 "(no forward-progress guarantee); VKMOE_DISPATCH=persistent forces it")
    return plan(True, trusted, f"{workgroups} workgroups from {source}")


def auto_switch_point(device):
    """(largest batch size for which auto mode takes the persistent path, where that number came from).

    From measurements only: VKMOE_PERSISTENT_MAX_M, else the crossover `tools/bench_moe --store-crossover`
    measured on this device (the smallest over the shapes measured), else 0: without a measurement auto mode
    keeps to the split path (on the NVIDIA H200 split was faster at every batch size, BENCHMARKS.md)."""
    forced = knobs.get("VKMOE_PERSISTENT_MAX_M")
    if forced is not None:
        return forced, "VKMOE_PERSISTENT_MAX_M"
    shapes = residency.crossover_entries(device)  # read-only, shared: no copy
    if not shapes:
        return 0, "no measured crossover for this device (`vkmoe bench --store-crossover`)"
    shape, entry = min(shapes.items(), key=lambda kv: kv[1]["max_m"])
    return int(entry["max_m"]), f"measured crossover ({shape}, {entry.get('measured_at', '?')})"


def auto_prefers_persistent(device, m, dims):
    """(whether auto mode takes the persistent path for a batch of m tokens of a layer of `dims` ({"E", "H", "I",
    "top_k"}), why). VKMOE_PERSISTENT_MAX_M first; then a crossover measured on a shape of exactly these dims: its
    per-batch-size wins, where persistent beat split by more than the run-to-run spread (`tools/bench_moe
    --store-crossover`). A batch size between two measured ones goes persistent only if both won, one below the
    smallest measured follows the smallest, one above the largest runs split (nothing measured there). On the H200
    persistent won at m = 16 only (BENCHMARKS.md, twelfth session), which a largest-m switch point cannot say.
    Without such an entry: auto_switch_point (the smallest max_m over the shapes measured)."""
    if knobs.get("VKMOE_PERSISTENT_MAX_M") is None:
        for shape, entry in residency.crossover_entries(device).items():
            if entry.get("dims") == dims:
                measured, wins = entry["measured"], set(entry["wins"])
                below = [x for x in measured if x <= m]
                above = [x for x in measured if x >= m]
                near = ([below[-1]] if below else []) + ([above[0]] if above else [])
                won = bool(above) and all(x in wins for x in near)
                return won, (f"measured on this layer's shape ({shape}, {entry.get('measured_at', '?')}): persistent "
                             f"won at m = {sorted(wins) or 'none'} of {measured}")
    limit, source = auto_switch_point(device)
    return m <= limit, f"persistent only up to m={limit}: {source}"


@dataclass(frozen=True)
class Decision:
    """How one forward should run: sched's whole answer (ops runs it, checks it and falls back)."""
    mode: str                      # "split" or "persistent"
    plan: "PersistentPlan | None"  # None when split was requested (then no persistent plan is consulted)
    reason: str


def coop_split_reason(moe_plan):
    """Why a batch planned on cooperative matrices runs split (a sentence)."""
    return (f"m={moe_plan.m} runs the MoE GEMMs on cooperative matrices (VKMOE_COOPMAT, VKMOE_COOPMAT_MOE_MIN_ROWS), "
            "which only the split path has: the persistent kernel's FMA GEMMs would give other bits than split")


def decide(device, moe_plan, requested, E, H, I, gated, co_resident=lambda: None, scratch_fits=True):
    """The Decision for a batch planned as `moe_plan` when `requested` ("auto", "persistent" or "split").
    `co_resident()` gives the persistent pipeline's own measured co-residency (ops measures it once per pipeline);
    it is called only when the persistent kernel is still a candidate, so a split decision measures nothing.
    Not on every call: Exl3MoeMlp keeps its answer while DecisionInputs says nothing it reads changed."""
    if requested == "split":  # no persistent knob is read: a bad VKMOE_PERSISTENT_* must not break split
        return Decision("split", None, "split requested")
    if getattr(moe_plan, "coop", False):  # split and persistent must give the same bits: split only
        prefix = "persistent requested but not possible: " if requested == "persistent" else "auto: split: "
        return Decision("split", None, prefix + coop_split_reason(moe_plan))
    if requested == "auto":
        wanted, why = auto_prefers_persistent(device, moe_plan.m, dict(E=E, H=H, I=I, top_k=moe_plan.top_k))
        if not wanted:
            return Decision("split", None, f"auto: split for m={moe_plan.m} ({why})")
    # A forced grid is not checked against residency (_co_resident): nothing to measure (a discovery costs seconds
    # on a CPU driver, and under load it ran past its host timeout in a CI run)
    measured = None if knobs.get("VKMOE_PERSISTENT_GRID") else co_resident()
    plan = persistent_plan(device, moe_plan, E, H, I, gated, measured, scratch_fits)
    if requested == "persistent":
        if plan.allowed:
            return Decision("persistent", plan, "persistent requested: " + plan.reason)
        return Decision("split", plan, "persistent requested but not possible: " + plan.reason)
    if not plan.trusted:
        return Decision("split", plan, "auto: " + plan.reason)
    return Decision("persistent", plan, "auto: " + plan.reason)


# The knobs decide() reads (the persistent plan's and the auto switch point's), beside the residency cache.
DECISION_KNOBS = ("VKMOE_PERSISTENT_MAX_M", "VKMOE_PERSISTENT_GRID", "VKMOE_PERSISTENT_WG_PER_CU")


class DecisionInputs:
    """What decide() reads beyond its arguments, as one value that a memo of its answers compares on every call
    (Exl3MoeMlp keeps its call plans so: ~1 us a call where auto's decide() took ~5): the knobs it reads and
    `caller_knobs` (what the caller's co_resident callback reads), the variables that place the residency cache,
    and the cache's version (residency.version: a store by this process seen at once, by another within
    STAT_INTERVAL_S, as decide() itself would see it). The pipeline's co-resident count is measured once per process
    (occupancy) and stored in the cache, which changes its version. Equal values: decide() answers as before."""

    def __init__(self, *caller_knobs):
        self._watch = knobs.Watch(*caller_knobs, *DECISION_KNOBS, *LOCATION_VARIABLES)

    def __call__(self):
        return self._watch.texts(), residency.version()
