"""Exl3MoeMlp: exllamav3's fused EXL3 MoE MLP on a Vulkan device.

Weights are uploaded once, one buffer per projection and kind (all experts back to back). A forward is
routing prep + the stage bodies of shaders/include/moe_stages.glsl, either as split dispatches with pipeline
barriers or as one persistent dispatch with spin barriers (vkmoe.sched decides; see docs/DESIGN.md).
"""
from collections import OrderedDict
import dataclasses
import functools
import os
import time
from typing import NamedTuple
import weakref

import numpy as np

from .. import forksafe, knobs, layout
from ..exl3 import Exl3Tensor
from ..layout import ACTIVATIONS, DISPATCH_MODES, MAX_TOP_K, MOE_BINDINGS
from ..layout import ROUTE_MAX_EXPERTS as MAX_EXPERTS
from ..sched import occupancy
from ..sched.plan import DecisionInputs, coop_split_reason, decide, persistent_plan
from ..exl3.reference import F32_MAX, check_op_routing
from ..vk import CommandRecorder, DeviceClosedError, GpuTime, PushConstants, VkmoeError, expect_device
from ..vk import fastcall
from ..vk.errors import closed_op_error
from ..vk.fastcall import BoundedRule, IndexRule
from . import kernels
from .device_array import CallTransfers, DeviceArray, RepeatedArrays, make_room_for_bound, resolve_out
from .host_arrays import describe, dispatch_of, host_array, out_dtype_of
from .plan import moe_plan
from .record_args import all_or_nothing, check_buffers, check_recorder, check_rows
from .recorded_call import HOT_CALLS_MAX, POISON_F32, RecordedCall
from .timeline import Timeline

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # names used in type hints only
    from ..vk import Buffer, Device

# Checked on every call: dtype objects compare ~5x faster than a dtype with numpy scalar types (no conversion).
_F16, _F32, _I32 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.int32)
_WEIGHT_DTYPES = frozenset(map(np.dtype, (np.float16, np.float32, np.float64)))
STATUS_BYTES = 16       # after the (m, H) output in the readback buffer: the persistent launch's abort word


def _pipeline_key(pipe):
    """A pipeline's key in the co-residency cache: its binary's name and digest and its specialization."""
    return (f"{pipe.name}@{kernels.binary_digest(pipe.name)}:"
            + ",".join(f"{k}={int(v)}" for k, v in sorted(pipe.spec.items())))


class MoePush(PushConstants):
    fields = [("m", "<u4"), ("top_k", "<u4"), ("E", "<u4"), ("H", "<u4"), ("I", "<u4"), ("max_chunks", "<u4"),
              ("splits_gu", "<u4"), ("kt_gu", "<u4"), ("splits_d", "<u4"), ("kt_d", "<u4"),
              ("act_limit", "<f4"), ("num_workgroups", "<u4"), ("spin_limit", "<u4"), ("loop_budget", "<u4"),
              ("mode", "<u4"), ("shared_add", "<u4")]




def moe_spec(plan, bits, codebook, activation, persistent=False):
    """The specialization constants of the MoE shaders for batch plan `plan` (ops.plan.MoePlan) of a layer with
    `bits` {"gate", "up", "down"} (gate 0: gateless), `codebook` and `activation`; persistent: the persistent
    kernel's (where stage 3 runs may differ between the paths: same bits, MoePlan.stage3_in_down*)."""
    in_down = plan.stage3_in_down_persistent if persistent else plan.stage3_in_down
    return {layout.SPEC_MOE_K_GATE: bits["gate"] or bits["up"], layout.SPEC_MOE_K_UP: bits["up"],
            layout.SPEC_MOE_K_DOWN: bits["down"], layout.SPEC_MOE_CB: layout.CODEBOOKS[codebook],
            layout.SPEC_MOE_ROWS: plan.rows, layout.SPEC_MOE_ACT: ACTIVATIONS[activation],
            layout.SPEC_MOE_DIRECT: plan.direct, layout.SPEC_MOE_STAGE3_IN_DOWN: in_down,
            layout.SPEC_MOE_TOKEN_SUM_PASS: plan.token_sum_pass and not persistent}


def split_kernels(device, plan, spec, H, I, gated):
    """The split path's dispatches for `plan`, in order: [(stage, Pipeline, grid)] with stage "route", "gate_up"
    and "down". Routing (workgroup 0) and stage 1 (the rest) share the first; direct mode (plan.direct) has no
    routing pass. With plan.coop the GEMM stages run on cooperative matrices (their fp16 decode as the linear's
    coop build)."""
    grids = layout.split_grids(plan, H, I, gated)
    if plan.coop:
        cspec = coop_spec(device, spec)
        shaders = (("moe_route", False, spec),
                   (kernels.coop_moe_name(device, "gate_up", plan.rows), False, cspec),
                   (kernels.coop_moe_name(device, "down", plan.rows), False, cspec))
    else:
        shaders = (("moe_route", False, spec), ("moe_gate_up", True, spec), ("moe_down", True, spec))
    shaders += (("moe_token_sum", False, spec),)
    return [(stage, kernels.pipeline(device, shader, MoePush, s, decode=decode, binding_count=MOE_BINDINGS), grid)
            for stage, (shader, decode, s), grid in zip(("route", "gate_up", "down", "token_sum"), shaders, grids)
            if grid is not None]


def coop_spec(device, spec):
    """The specialization of the cooperative-matrix stages: the MoE's, plus the device's fused-fp16 quirk (their
    decode is the packed fp16 one)."""
    return {**spec, layout.SPEC_F16_FMA_FUSED: kernels.f16_fma_fused(device)}


def coop_discovery_kernel(device, spec, stage, rows):
    """The discovery build of cooperative-matrix `stage` ("gate_up" or "down") for chunks of `rows` rows: the
    stage's own source and specialization with the persistent kernel's co-residency discovery mode, for counting how
    many of its workgroups the device keeps resident (Exl3MoeMlp.co_resident_coop); it never runs the stage."""
    return kernels.pipeline(device, kernels.coop_moe_name(device, stage, rows), MoePush, coop_spec(device, spec),
                            binding_count=MOE_BINDINGS, build="discover")


def paced_spin_spec(device):
    """{SPEC_MOE_PACED_SPIN: True} on a driver with a loop cap (its spins are bounded in iterations, so the
    persistent kernel's waits spin with the whole workgroup, which makes an iteration last longer: moe_stages.glsl
    moe_spin_paced), else {}."""
    capped = device.quirks.get("loop_iteration_cap")
    return {layout.SPEC_MOE_PACED_SPIN: True} if capped else {}


def persistent_kernel(device, spec, clock=False):
    """The persistent kernel's pipeline (the whole forward in one dispatch) for MoE specialization `spec`, with
    the device's paced-spin specialization (paced_spin_spec) added; clock=True: its timing build (the same kernel
    with clock marks: vkmoe.ops.timeline)."""
    return kernels.pipeline(device, "moe_persistent", MoePush, {**spec, **paced_spin_spec(device)}, decode=True,
                            binding_count=MOE_BINDINGS, build="clock" if clock else "")


def _clock_requested(device):
    """Whether a layer made now runs the persistent kernel's timing build (VKMOE_PERSISTENT_CLOCK: read when a layer
    is made, since the pipelines and the scratch sizes of its shapes depend on it); raises where `device` cannot."""
    clock = knobs.get("VKMOE_PERSISTENT_CLOCK")
    if clock and not device.features.get("shaderDeviceClock"):
        raise VkmoeError(f"VKMOE_PERSISTENT_CLOCK=1: {device.name} lacks VK_KHR_shader_clock's shaderDeviceClock, "
                         "which the persistent kernel's timing build reads")
    return clock


def _check_experts(name, tensors, k, n, allow_none=False):
    if tensors is None:
        if allow_none:
            return None
        raise ValueError(f"{name} must be a non-empty list of vkmoe.Exl3Tensor, got None")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(f"{name} must be a non-empty list of vkmoe.Exl3Tensor (one per expert), got {type(tensors).__name__}")
    for e, t in enumerate(tensors):
        if not isinstance(t, Exl3Tensor):
            raise TypeError(f"{name}[{e}] must be a vkmoe.Exl3Tensor, got {type(t).__name__}")
        if (t.k, t.n) != (k, n):
            raise ValueError(f"{name}[{e}] has shape (k={t.k}, n={t.n}); expected (k={k}, n={n})")
        if t.bits != tensors[0].bits:
            raise ValueError(f"{name}[{e}] has {t.bits} bits but {name}[0] has {tensors[0].bits}: all experts of "
                             "a projection must share the bit width")
        if t.codebook != tensors[0].codebook:
            raise ValueError(f"{name}[{e}] uses codebook {t.codebook!r} but {name}[0] uses {tensors[0].codebook!r}")
        if t.bias is not None:
            raise ValueError(f"{name}[{e}] has a bias; the fused MoE op (like exllamav3's) takes experts without bias")
    return list(tensors)


def parse_dispatch(dispatch):
    """The dispatch mode: the argument wins, then VKMOE_DISPATCH, then "auto"."""
    if dispatch is None:
        return knobs.get("VKMOE_DISPATCH")
    return dispatch_of(dispatch)


class _Projection:
    """All experts of one projection on the device: trellis words back to back, suh (E, k), svh (E, n)."""

    def __init__(self, device, tensors):
        self.bits, self.k, self.n, self.E = tensors[0].bits, tensors[0].k, tensors[0].n, len(tensors)
        mem = device.memory
        trellis_bytes = sum(t.trellis.nbytes for t in tensors)
        self.trellis = mem.allocate(trellis_bytes)
        offset = 0
        for t in tensors:
            self.trellis.upload(t.trellis, offset)
            offset += t.trellis.nbytes
        self.suh = mem.allocate(len(tensors) * self.k * 2)
        self.suh.upload(np.stack([t.suh for t in tensors]).astype(np.float16))
        self.svh = mem.allocate(len(tensors) * self.n * 2)
        self.svh.upload(np.stack([t.svh for t in tensors]).astype(np.float16))
        self.buffers = (self.trellis, self.suh, self.svh)

    def close(self):
        for b in self.buffers:
            b.close()


class _Scratch:
    """The per-batch-size device buffers of one layer: routing tables, fp16 stage buffers, GEMM partials,
    per-(token, slot) output rows and the self-resetting counters."""

    def __init__(self, device, plan, H, I, rows_kind="device", clock=False):
        self.plan = plan
        size = layout.scratch_bytes(plan, H, I, clock)
        # The persistent kernel needs room for both GEMMs' partials; where that exceeds the device's buffer range
        # the batch runs split only (the split dispatches reuse the space).
        self.persistent_fits = size["partial"] <= device.memory.max_range
        if not self.persistent_fits:
            if plan.stage3_in_down:  # its split path needs both GEMMs' partials too: the band tails instead
                self.plan = plan = dataclasses.replace(plan, stage3_in_down=False, stage3_in_down_persistent=False)
                size = layout.scratch_bytes(plan, H, I, clock)
            size["partial"] = size["partial_split"]
        self.sync_words = size["sync"] // 4
        names = ("route", "states", "inter", "partial", "rows", "sync")
        # all or nothing: a batch too large for the device allocates nothing, and the error names hidden (the
        # caller's batch); the io buffers are smaller than "states" and "rows"
        batch = f"hidden: {plan.m} rows x top_k {plan.top_k}: the routed op's"
        self.buffers = device.memory.allocate_all([size[k] for k in names],
                                                  kinds=[rows_kind if k == "rows" else "device" for k in names],
                                                  names=[f"{batch} {_SCRATCH_ROLES[k]}" for k in names])
        self.route, self.states, self.inter, self.partial, self.rows, self.sync = self.buffers
        self.last_status = 0  # the abort word the last submitted persistent launch left (read with its output)
        self.last_grid = 0    # the grid of the last persistent launch recorded on this scratch (persistent_timeline)
        self.reset_sync()

    def reset_sync(self):
        self.sync.upload(np.zeros(self.sync_words, np.uint32))

    def abort_code(self):
        """The abort code the last persistent launch on this scratch left (0 = none; layout.ABORT_*)."""
        return int(self.sync.download(np.uint32, (layout.SYNC_ABORT + 1,))[layout.SYNC_ABORT])

    def close(self):
        for b in self.buffers:
            b.close()


# What each scratch buffer of layout.scratch_bytes holds, for the oversized-batch error.
_SCRATCH_ROLES = {"route": "routing table", "states": "fp16 gate/up input rows", "inter": "fp16 down input rows",
                  "partial": "fp32 k-split partials", "rows": "fp32 (token, slot) output rows", "sync": "sync words"}


class _Recording:
    """A forward recorded by _record_run (its recorder, the scratch it uses and the RecordedCall that runs it) and
    the descriptor sets its commands use: the recorder does not free them, so an evicted recording frees them here
    (else every re-recording would take new sets for good)."""

    def __init__(self, rec, sets, scratch, call=None):
        self.rec, self.sets, self.scratch, self.call = rec, sets, scratch, call

    def close(self):
        try:
            with self.rec.device.use():  # a concurrent Device.close() waits for this instead of racing it
                self.rec.close()
                for s in self.sets:
                    s.free()
        except DeviceClosedError:
            pass  # the device destroyed them with everything made from it


class RunResult(NamedTuple):
    """What one submitted forward gave: the output, the submission ((CommandRecorder, its submission number):
    the GPU time is read from the timestamps when asked for) and the abort code (0: the output is valid)."""
    out: np.ndarray
    submitted: tuple
    abort_code: int

    @property
    def gpu_time(self) -> GpuTime:
        rec, number = self.submitted
        return rec.gpu_time_of(number)

    @property
    def gpu_ms(self) -> float:
        return self.gpu_time.ms


class _SplitPath:
    """The three split dispatches: always safe, nothing to check after the submission."""
    mode = "split"
    key = "split"
    reads_status = False

    def __init__(self, moe):
        self._moe = moe

    def record(self, cmd, scratch, buffers, beside_first=None):
        return self._moe._record_split(cmd, scratch, buffers, beside_first)

    def check(self, scratch):
        return 0

    @staticmethod
    def first_dispatch_writes_output(scratch):
        """Whether the first dispatch may write the output: the routing pass's stage 1 zeroes the rows of tokens
        with no valid slot; in direct mode the first dispatch (gate/up) writes none (the down dispatch zeroes
        them), so the output's poison fill may run beside it (_record_run)."""
        return not scratch.plan.direct


class _PersistentPath:
    """One persistent dispatch of launch plan `pplan`; after the submission, `check` reads the abort code."""
    mode = "persistent"
    reads_status = True  # the abort word is copied behind the output in the same submission

    def __init__(self, moe, pplan):
        self._moe, self.pplan = moe, pplan
        self.key = ("persistent", pplan.workgroups, pplan.spin_limit, pplan.loop_budget)

    def record(self, cmd, scratch, buffers):
        return self._moe._record_persistent(cmd, scratch, buffers, self.pplan)

    @staticmethod
    def first_dispatch_writes_output(scratch):
        """Its one dispatch writes the output: the poison fill needs a barrier of its own before it."""
        return True

    def check(self, scratch):
        return scratch.last_status


class _CallPlan:
    """What a call of one shape (m, top_k) and dispatch argument resolved, kept for the next such call (a decode
    loop makes the same call thousands of times): the mode requested, the shape's scratch, sched's Decision, the
    path it chose and that path's recording (made at the first run: decided_mode plans without running). Valid
    while the decision's inputs are unchanged: `stamp` is what _DECISION_INPUTS() gave when it was made (None for
    a split request, which reads none). Evicting the shape drops it."""
    __slots__ = ("shape", "requested", "scratch", "decision", "path", "recording", "stamp")

    def __init__(self, shape, requested, scratch, decision, path, stamp):
        self.shape, self.requested, self.scratch, self.decision = shape, requested, scratch, decision
        self.path, self.recording, self.stamp = path, None, stamp


class _HotCall:
    """A numpy call signature that already ran split through the native call path, kept so that the next call of
    the same signature skips the layers of the general path (a decode loop makes the same call thousands of times:
    they cost about 3 of the 7 us of vkmoe's host time per call on the dev machine, tools/profile_host). Valid while
    `plan` is still the call plan of `plan_key` and its recording is `recording` (evicting the shape, re-planning
    or close() drops them); `prepared` is the NativeCall's per-dtype part (NativeCall.prepare)."""
    __slots__ = ("plan_key", "plan", "recording", "native", "prepared")

    def __init__(self, plan_key, plan, recording, native, prepared):
        self.plan_key, self.plan, self.recording, self.native = plan_key, plan, recording, native
        self.prepared = prepared


# A call plan's validity check: what sched's decision reads, and what this module's part of it reads:
# VKMOE_DISPATCH (a call without dispatch=), VKMOE_DECODE and VKMOE_HADAMARD (they pick the persistent pipeline
# whose co-resident count the decision uses: co_resident).
_DECISION_INPUTS = DecisionInputs("VKMOE_DISPATCH", "VKMOE_DECODE", "VKMOE_HADAMARD")


def _run_report(mode, requested, reason, fallback, plan, pplan, gpu_ms, wall_ms):
    """The `last_run` dict (one shape for every outcome)."""
    ran_persistent = mode == "persistent"
    return {"mode": mode, "requested": requested, "reason": reason, "fallback_reason": fallback,
            "plan": plan.as_dict() if plan else None, "persistent_plan": pplan.as_dict() if pplan else None,
            "workgroups": pplan.workgroups if ran_persistent else None,
            "groups": pplan.groups if ran_persistent else None, "gpu_ms": gpu_ms, "wall_ms": wall_ms}


def _check_call_routing(E, arrays):
    """check_op_routing on a call's (hidden, ids, weights): RecordedCall.run's `check` (see _submit)."""
    check_op_routing(arrays[1], arrays[2], E)


def _release_layer(recorded, scratch, io, projections):
    """Free a layer's device objects (emptying its dicts in place). close() calls it, and so does a finalizer
    when the layer is dropped without close(); it must not reference the layer itself."""
    for rec in recorded.values():
        rec.close()
    for s in scratch.values():
        s.close()
    for bufs in io.values():
        for b in bufs:
            b.close()
    for p in {id(p): p for p in projections}.values():
        p.close()
    recorded.clear()
    scratch.clear()
    io.clear()


class Exl3MoeMlp:
    """The routed experts of one MoE layer.

    gate, up, down: lists of Exl3Tensor, one per expert (gate None for the gateless "relu2"). gate/up map
    hidden H -> intermediate I, down maps I -> H. `moe(hidden, expert_ids, expert_weights)` returns (m, H)
    float32; `moe.last_run` says how it ran.
    """

    def __init__(self, device: "Device", gate: "list[Exl3Tensor] | None", up: "list[Exl3Tensor]",
                 down: "list[Exl3Tensor]", activation: str = "silu", act_limit: float = 0.0,
                 dispatch: "str | None" = None):
        expect_device(device)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.activation, self.gated = activation, activation != "relu2"
        clock = _clock_requested(device)  # before any weight reaches the device
        if not self.gated and gate is not None:
            raise ValueError("activation 'relu2' is gateless: pass gate=None")
        if self.gated and gate is None:
            raise ValueError(f"activation {activation!r} needs gate projections (gate=None is only for 'relu2')")
        if not isinstance(up, (list, tuple)) or not up or not isinstance(up[0], Exl3Tensor):
            raise TypeError("up must be a non-empty list of vkmoe.Exl3Tensor (one per expert)")
        H, I = up[0].k, up[0].n
        up = _check_experts("up", up, H, I)
        gate = _check_experts("gate", gate, H, I, allow_none=True)
        down = _check_experts("down", down, I, H)
        E = len(up)
        for name, group in (("gate", gate), ("down", down)):
            if group is not None and len(group) != E:
                raise ValueError(f"{name} has {len(group)} experts but up has {E}")
        codebooks = {t[0].codebook for t in (gate, up, down) if t is not None}
        if len(codebooks) != 1:
            raise ValueError(f"gate, up and down must share one codebook, got {sorted(codebooks)}")
        if E > MAX_EXPERTS:
            raise ValueError(f"{E} experts: vkmoe supports at most {MAX_EXPERTS} per layer")
        try:
            self.act_limit = float(act_limit)
        except (TypeError, ValueError):
            raise TypeError(f"act_limit must be a number, got {act_limit!r}") from None
        if not np.isfinite(self.act_limit) or self.act_limit < 0:
            raise ValueError(f"act_limit must be finite and >= 0 (0 = no clamp), got {act_limit!r}")
        parse_dispatch(dispatch)  # validated now; VKMOE_DISPATCH is read again at each call
        self._dispatch_arg = dispatch
        limit = device.limits.maxStorageBufferRange
        for name, group in (("gate", gate), ("up", up), ("down", down)):
            if group is not None and sum(t.trellis.nbytes for t in group) > limit:
                raise ValueError(f"the {name} trellises of all experts need {sum(t.trellis.nbytes for t in group)} "
                                 f"bytes, more than this device's maxStorageBufferRange ({limit})")
        self._setup(device, codebooks.pop(), E, H, I,
                    _Projection(device, gate) if gate is not None else None,
                    _Projection(device, up), _Projection(device, down), clock)

    @classmethod
    def from_projections(cls, device, codebook, gate, up, down, activation="silu", act_limit=0.0, dispatch=None):
        """Build from projections already on the device (objects with bits, k, n, E, buffers = (trellis, suh,
        svh) and close(); see _Projection). For tools that fill weights on the device (benchmarks)."""
        self = cls.__new__(cls)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.activation, self.gated = activation, activation != "relu2"
        if self.gated != (gate is not None):
            raise ValueError("gate projections are required exactly when the activation is gated")
        self.act_limit = float(act_limit)
        parse_dispatch(dispatch)
        self._dispatch_arg = dispatch
        self._setup(device, codebook, up.E, up.k, up.n, gate, up, down, _clock_requested(device))
        return self

    def _setup(self, device, codebook, E, H, I, gate, up, down, clock):
        self.device = device
        self.clock = clock  # the persistent kernel's timing build (_clock_requested)
        self.E, self.H, self.I = E, H, I
        # The experts the GEMM plans assume: the whole layer's for a shard of it (vkmoe.ops.sharded), so that a
        # shard's k-splits, hence its bits, are those of the whole layer.
        self.plan_experts = E
        # Where the per-(token, slot) rows live: device memory; "readback" (host-visible) for a shard, whose rows
        # the host reads after every call (slot_rows) without a staging copy.
        self.rows_kind = "device"
        self.codebook = codebook
        self.bits = {"gate": gate.bits if gate is not None else 0, "up": up.bits, "down": down.bits}
        self._up, self._down = up, down
        self._gate = gate if gate is not None else up  # gateless: bound, never read
        # Per batch shape (m, top_k), least recently used first: at most VKMOE_SHAPE_CACHE shapes that calls
        # used, plus those pinned by record() (_scratch_for evicts, in place: the finalizer holds these dicts).
        self._scratch = OrderedDict()
        self._io = {}
        self._recorded = {}   # (m, top_k, path key[, hidden Buffer, out Buffer]) -> _Recording (the last two: bound)
        self._repeated = RepeatedArrays()  # DeviceArray pairs the calls passed (bound from their second call on)
        # (m, top_k, dispatch argument: None or a mode) -> _CallPlan. Not a resource the finalizer frees: its
        # paths reference the layer (close() and _evict_shapes drop plans with what they use).
        self._plans = {}
        # (every input's shape and dtype, dispatch argument) -> _HotCall (__call__'s hot path)
        self._hot = {}
        self._pinned = set()  # shapes passed to record(): a caller's command buffer uses their scratch
        self._closed = False  # (_scratch_locked raises once set: close() empties the plans and the hot calls, so
                              # every call, record and stage list gets there)
        # One forward at a time per layer (the io and scratch buffers are per layer), and no eviction under a
        # running one; reentrant: _forward holds it around _launch_locked.
        self._call_lock = forksafe.RLock()
        self._transfers = CallTransfers(device)      # DeviceArray copies riding on a call's one submission
        self._split_path = _SplitPath(self)
        self._check_routing = functools.partial(_check_call_routing, E)  # a __call__'s routing rules (_submit)
        self._last_run = None  # the last_run dict, or the parts to make it from (see last_run)
        # A layer dropped without close() still frees its device memory (not at interpreter exit: by then the
        # process gives everything back anyway).
        projections = (gate, up, down) if gate is not None else (up, down)
        self._resources = (self._recorded, self._scratch, self._io, projections)
        weakref.finalize(self, _release_layer, *self._resources).atexit = False

    @property
    def last_run(self):
        """How the last call ran: a dict (README, "moe.last_run"), made when first read: a runtime calling every
        layer for every token rarely reads it, and its gpu_ms is a driver call (vkmoe.vk.GpuTime). The previous
        call's report, if not read before a next call submits the same recording (shape and mode), loses its
        gpu_ms (NaN): seen only when that call fails afterwards (a read from another thread waits for a running
        call, then reads that call's report)."""
        with self._call_lock:  # (its GPU time is read before another call can submit)
            report = self._last_run
            if type(report) is tuple:  # (what _launch_locked keeps: the dict's parts, the GPU time unread)
                mode, requested, decision, fallback, plan, rec, submission, wall_ms = report
                report = self._last_run = _run_report(mode, requested, decision.reason, fallback, plan,
                                                      decision.plan, rec.gpu_time_of(submission).ms, wall_ms)
            return report

    @property
    def dispatch(self):
        """The dispatch mode a call without `dispatch=` uses now (the constructor's argument, else VKMOE_DISPATCH)."""
        return parse_dispatch(self._dispatch_arg)

    # --------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_safetensors(cls, device: "Device", path: "str | os.PathLike | dict", prefix: str,
                         activation: str = "silu", act_limit: float = 0.0, dispatch: "str | None" = None,
                         num_experts: "int | None" = None) -> "Exl3MoeMlp":
        """Load `{prefix}.experts.{e}.{gate,up,down}_proj` (exllamav3 names) from a .safetensors file, a model
        directory (one file, several, or shards listed by model.safetensors.index.json) or a dict of arrays.
        `num_experts` (from the model config) makes a file whose last experts are missing an error."""
        from ..exl3 import load_moe_experts

        experts = load_moe_experts(path, prefix, num_experts)
        gate = experts.get("gate")
        if gate is None and activation != "relu2":
            raise ValueError(f"{prefix}: no gate_proj tensors; a gateless layer needs activation='relu2'")
        return cls(device, gate, experts["up"], experts["down"], activation, act_limit, dispatch)

    # ----------------------------------------------------------------------------------------- recording
    def _spec(self, plan, persistent=False):
        return moe_spec(plan, self.bits, self.codebook, self.activation, persistent)

    def _scratch_for(self, m, top_k):
        """The scratch of batch shape (m, top_k), made on first use. A server sees every m, so a new shape first
        evicts the least recently used ones beyond VKMOE_SHAPE_CACHE (pinned shapes excepted)."""
        with self._call_lock:
            return self._scratch_locked(m, top_k)

    def _scratch_locked(self, m, top_k):
        """_scratch_for for a caller holding the call lock (a call's path: re-entering it costs ~0.3 us)."""
        if self._closed:
            raise closed_op_error(self)
        key = (m, top_k)
        scratch = self._scratch.get(key)
        if scratch is not None:
            self._scratch.move_to_end(key)
            return scratch
        self._evict_shapes(knobs.get("VKMOE_SHAPE_CACHE") - 1)
        plan = moe_plan(self.device, m, top_k, self.plan_experts, self.H, self.I, self.gated)
        self._scratch[key] = _Scratch(self.device, plan, self.H, self.I, self.rows_kind, self.clock)
        return self._scratch[key]

    def _evict_shapes(self, keep):
        """Free the recordings, io buffers and scratch of the least recently used unpinned shapes until `keep`
        remain. Called with the call lock held, so no call is using them."""
        shapes = [k for k in self._scratch if k not in self._pinned]
        for shape in shapes[:max(0, len(shapes) - keep)]:
            for key in [k for k in self._plans if k[:2] == shape]:
                del self._plans[key]
            for key in [k for k in self._recorded if k[:2] == shape]:
                self._recorded.pop(key).close()
            for b in self._io.pop(shape, ()):
                b.close()
            self._scratch.pop(shape).close()

    def _push(self, plan, pplan=None, **override):
        values = dict(m=plan.m, top_k=plan.top_k, E=self.E, H=self.H, I=self.I, max_chunks=plan.max_chunks,
                      splits_gu=plan.splits_gu, kt_gu=plan.kt_gu, splits_d=plan.splits_d, kt_d=plan.kt_d,
                      act_limit=self.act_limit, num_workgroups=pplan.workgroups if pplan else 0,
                      spin_limit=pplan.spin_limit if pplan else 0, loop_budget=pplan.loop_budget if pplan else 0,
                      mode=layout.MOE_MODE_RUN, shared_add=layout.SHARED_ADD_NONE)
        values.update(override)
        return MoePush(**values)

    def _bindings(self, scratch, hidden_buf, ids_buf, weights_buf, out_buf, shared=None):
        """The descriptor set's buffers (moe_bindings.glsl); shared: None or a block's (shared output, gate logits
        or None) for the token sums to add (_check_shared); absent ones bound to hidden_buf, which is not read there."""
        g, u, d = self._gate, self._up, self._down
        s_out, s_gate = shared if shared is not None else (hidden_buf, None)
        return (hidden_buf, ids_buf, weights_buf, out_buf, *g.buffers, *u.buffers, *d.buffers, scratch.route,
                scratch.states, scratch.inter, scratch.partial, scratch.rows, scratch.sync, s_out,
                s_gate if s_gate is not None else hidden_buf)

    def _check_shared(self, shared, m):
        """A record()'s `shared`: None or (out16, gate) with out16 a (m, H) fp16 buffer and gate None or an (m,)
        fp32 buffer of gate logits; returns its SHARED_ADD_* code."""
        if shared is None:
            return layout.SHARED_ADD_NONE
        if not isinstance(shared, tuple) or len(shared) != 2:
            raise TypeError(f"shared: expected None or (shared output buffer, gate logits buffer or None), got "
                            f"{shared!r}")
        s_out, s_gate = shared
        sizes = {"shared[0] (the shared output)": (s_out, m * self.H * 2)}
        if s_gate is not None:
            sizes["shared[1] (the gate logits)"] = (s_gate, m * 4)
        check_buffers(self.device, sizes)
        return layout.SHARED_ADD_PLAIN if s_gate is None else layout.SHARED_ADD_GATED

    def _split_stages(self, scratch, buffers, shared_add=layout.SHARED_ADD_NONE):
        """The split dispatches, each a function(cmd) -> descriptor set recording one dispatch (no barrier); a
        barrier must follow each. Routing (workgroup 0) and stage 1 (the rest) share the first; direct mode
        (plan.direct) has no routing pass, only the gate/up and down dispatches."""
        plan = scratch.plan
        push = self._push(plan, shared_add=shared_add)

        def stage(pipe, grid):
            def run(cmd):
                dset = pipe.bind(*buffers)
                cmd.dispatch(pipe, dset, grid, push)
                return dset
            return run

        return [stage(pipe, grid) for _, pipe, grid in
                split_kernels(self.device, plan, self._spec(plan), self.H, self.I, self.gated)]

    def _record_split(self, cmd, scratch, buffers, beside_first=None, shared_add=layout.SHARED_ADD_NONE):
        """The split dispatches, a barrier after each; beside_first(cmd): commands recorded beside the first
        dispatch (before its barrier)."""
        sets = []
        for i, stage in enumerate(self._split_stages(scratch, buffers, shared_add)):
            sets.append(stage(cmd))
            if i == 0 and beside_first is not None:
                beside_first(cmd)
            cmd.barrier()
        return sets

    def _persistent_pipeline(self, plan):
        return persistent_kernel(self.device, self._spec(plan, persistent=True), self.clock)

    def co_resident(self, plan):
        """How many workgroups of the persistent pipeline for this batch plan the device keeps resident at once,
        measured by that pipeline itself in its discovery mode (once per pipeline and device; vkmoe.sched.occupancy)."""
        pipe = self._persistent_pipeline(plan)
        with self._call_lock:  # the shape's buffers are in use until the measurement ends
            return self._measure_co_resident(pipe, _pipeline_key(pipe), plan)

    def co_resident_coop(self, plan, stage):
        """How many workgroups of cooperative-matrix `stage` ("gate_up" or "down") of coop batch plan `plan` the
        device keeps resident at once, counted by the stage's discovery build (coop_discovery_kernel: same source and
        specialization; cached as co_resident). For studying the split path's occupancy (tools/profile_moe
        --co-resident): the split dispatches themselves need no co-residency."""
        if not plan.coop:
            raise ValueError(f"co_resident_coop: plan for m={plan.m} runs the FMA stages, not cooperative matrices")
        if stage not in layout.COOP_MOE_STAGES:
            raise ValueError(f"co_resident_coop: stage must be {' or '.join(map(repr, layout.COOP_MOE_STAGES))}, "
                             f"got {stage!r}")
        pipe = coop_discovery_kernel(self.device, self._spec(plan), stage, plan.rows)
        with self._call_lock:
            return self._measure_co_resident(pipe, _pipeline_key(pipe), plan)

    def _measure_co_resident(self, pipe, key, plan):
        scratch = self._scratch_for(plan.m, plan.top_k)
        hb, ib, wb, ob = self._io_for(plan.m, plan.top_k)

        def record(rec, words, launched, loop_budget):
            bufs = list(self._bindings(scratch, hb, ib, wb, ob))
            bufs[layout.MOE_SYNC_BINDING] = words  # the sync binding holds the discovery's words
            dset = pipe.bind(*bufs)
            rec.dispatch(pipe, dset, launched, self._push(plan, num_workgroups=launched, loop_budget=loop_budget,
                                                          mode=layout.MOE_MODE_DISCOVER))
            return dset

        return occupancy.measure(self.device, key, record)

    def _record_persistent(self, cmd, scratch, buffers, pplan, shared_add=layout.SHARED_ADD_NONE):
        plan = scratch.plan
        pipe = self._persistent_pipeline(plan)
        dset = pipe.bind(*buffers)
        cmd.dispatch(pipe, dset, pplan.workgroups, self._push(plan, pplan, shared_add=shared_add))
        cmd.barrier()
        scratch.last_grid = pplan.workgroups
        return [dset]

    def persistent_timeline(self, m: int, top_k: int) -> "Timeline":
        """The clock marks the last persistent launch of batch shape (m, top_k) stored, after its submission
        completed: a layer made with VKMOE_PERSISTENT_CLOCK=1 only (vkmoe.ops.timeline)."""
        if not self.clock:
            raise VkmoeError("persistent_timeline: this layer runs the persistent kernel without clock marks; make "
                             "it with VKMOE_PERSISTENT_CLOCK=1")
        with self._call_lock:
            scratch = self._scratch.get((m, top_k))
            grid = scratch.last_grid if scratch is not None else 0
            if not grid:
                raise VkmoeError(f"persistent_timeline: no persistent launch of shape (m={m}, top_k={top_k}) was "
                                 "recorded on this layer")
            if grid > layout.CLOCK_MAX_WORKGROUPS:
                raise VkmoeError(f"persistent_timeline: the grid of {grid} workgroups exceeds the timing area's "
                                 f"{layout.CLOCK_MAX_WORKGROUPS}")
            words = scratch.partial.download(np.uint32, (grid, layout.CLOCK_WORDS_PER_WG),
                                             offset=layout.clock_offset(scratch.plan, self.H, self.I))
        return Timeline(words)

    def record(self, cmd: CommandRecorder, hidden_buf: "Buffer", ids_buf: "Buffer",
               weights_buf: "Buffer", out_buf: "Buffer", m: int, top_k: int, mode: str = "split", shared=None):
        """Append the forward of m tokens to a recording CommandRecorder. hidden_buf: (m, H) fp16; ids_buf:
        (m, top_k) int32 (ids outside [0, E) are skipped); weights_buf: (m, top_k) float32; out_buf receives
        (m, H) float32. Ends with a barrier. Returns the GEMM plan. shared: None, or (out16, gate) of a device
        block whose shared expert ran before (vkmoe.ops.block): out16 (m, H) fp16, gate None or (m,) fp32 gate
        logits; out then receives the routed sum + out16 (· sigmoid(gate)), the block's sum pass done by the
        token sums.

        mode "split" (default) is always safe. mode "persistent" records the single dispatch as the launch plan
        allows it; a recorded launch cannot re-run itself, so check `aborted(m, top_k)` after the submission
        (and call `reset_after_abort(m, top_k)` and re-run split if it says so). __call__ does all of that."""
        check_recorder(self.device, cmd)
        if check_rows(m) == 0:
            return None
        self._check_record(hidden_buf, ids_buf, weights_buf, out_buf, m, top_k)
        if mode not in ("split", "persistent"):
            raise ValueError(f"mode must be 'split' or 'persistent', got {mode!r}")
        shared_add = self._check_shared(shared, m)
        with self._call_lock:
            self._pinned.add((m, top_k))  # the caller's command buffer uses this scratch: never evicted
            scratch = self._scratch_for(m, top_k)
        buffers = self._bindings(scratch, hidden_buf, ids_buf, weights_buf, out_buf, shared)
        if mode == "split":
            with all_or_nothing(cmd, "Exl3MoeMlp.record()"):
                self._record_split(cmd, scratch, buffers, shared_add=shared_add)
        elif mode == "persistent":
            if scratch.plan.coop:
                raise ValueError(f"mode='persistent' is not possible here: {coop_split_reason(scratch.plan)}")
            pplan = persistent_plan(self.device, scratch.plan, self.E, self.H, self.I, self.gated,
                                    self.co_resident(scratch.plan), scratch.persistent_fits)
            if not pplan.allowed:
                raise ValueError(f"mode='persistent' is not possible here: {pplan.reason}")
            with all_or_nothing(cmd, "Exl3MoeMlp.record()"):
                self._record_persistent(cmd, scratch, buffers, pplan, shared_add)
        return scratch.plan

    def _check_record(self, hidden_buf, ids_buf, weights_buf, out_buf, m, top_k):
        if not 1 <= top_k <= MAX_TOP_K:
            raise ValueError(f"top_k={top_k}: expected 1 <= top_k <= {MAX_TOP_K}")
        check_buffers(self.device, {"hidden_buf": (hidden_buf, m * self.H * 2), "ids_buf": (ids_buf, m * top_k * 4),
                                    "weights_buf": (weights_buf, m * top_k * 4), "out_buf": (out_buf, m * self.H * 4)})

    def split_stages(self, hidden_buf: "Buffer", ids_buf: "Buffer", weights_buf: "Buffer", out_buf: "Buffer",
                     m: int, top_k: int, shared=None):
        """record(mode="split")'s dispatches (three; two in direct mode; four with the token-sum pass) as separate
        steps, for a caller that records independent work beside them (vkmoe.ops.block): functions(cmd) -> descriptor
        set, each recording one dispatch and no barrier; the caller puts a barrier after each. Arguments and pinning
        as record(); m >= 1.
        With `shared`, the shared output must be written before the first dispatch where the routing pass zeroes
        the rows of tokens with no valid slot (three or four dispatches), else before the last."""
        check_rows(m, minimum=1)
        self._check_record(hidden_buf, ids_buf, weights_buf, out_buf, m, top_k)
        shared_add = self._check_shared(shared, m)
        with self._call_lock:
            self._pinned.add((m, top_k))
            scratch = self._scratch_for(m, top_k)
        return self._split_stages(scratch, self._bindings(scratch, hidden_buf, ids_buf, weights_buf, out_buf, shared),
                                  shared_add)

    def moe_plan(self, m: int, top_k: int):
        """The MoePlan (vkmoe.ops.plan) that split_stages follows for m tokens: e.g. `.direct` (two dispatches, no
        routing pass: the down dispatch zeroes the rows of tokens with no valid slot) or `.token_sum_pass` (a last
        dispatch that only sums each token's (token, slot) rows into the output)."""
        with self._call_lock:
            return self._scratch_for(check_rows(m, minimum=1), top_k).plan

    def decided_mode(self, m: int, top_k: int, dispatch=None) -> str:
        """"split" or "persistent": the mode vkmoe.sched picks now for a call of m tokens (for callers that record
        the forward themselves, e.g. vkmoe.ops.block)."""
        arg = self._dispatch_key(dispatch)
        with self._call_lock:
            return self._plan_locked(m, top_k, arg).decision.mode

    def split_plan(self, m: int, top_k: int):
        """(plan key, plan) of a call of m tokens without dispatch= where vkmoe.sched decides split now, else None:
        for a caller that keeps its own recording of the forward for as long as plan_holds says that decision
        stands (vkmoe.ops.block's hot calls)."""
        arg = self._dispatch_key(None)
        with self._call_lock:
            plan = self._plan_locked(m, top_k, arg)
            return ((m, top_k, arg), plan) if plan.decision.mode == "split" else None

    def plan_holds(self, plan_key, plan) -> bool:
        """Whether `plan` (split_plan's, or a hot call's) is still the plan of its key, with the decision's inputs
        unchanged (not evicted, re-planned or closed); counts as a use of its shape (LRU eviction)."""
        with self._call_lock:
            return self._plan_holds_locked(plan_key, plan)

    def _plan_holds_locked(self, plan_key, plan):
        if self._plans.get(plan_key) is not plan or (plan.stamp is not None and plan.stamp != _DECISION_INPUTS()):
            return False
        self._scratch.move_to_end(plan.shape)
        return True

    def release_shape(self, m: int, top_k: int) -> None:
        """Unpin a shape record() pinned, once no recording of the caller's uses it any more: it becomes an
        ordinary cached shape, freed when VKMOE_SHAPE_CACHE newer ones push it out."""
        with self._call_lock:
            self._pinned.discard((m, top_k))
            self._evict_shapes(knobs.get("VKMOE_SHAPE_CACHE"))

    def status_buffer(self, m: int, top_k: int):
        """The buffer whose word layout.SYNC_ABORT holds the abort code of the last persistent launch for this
        shape: a caller copies it behind its output in the same submission (as __call__ does)."""
        return self._scratch_for(m, top_k).sync

    def aborted(self, m: int, top_k: int) -> int:
        """The abort code left by the last persistent launch for this batch shape (0 = none)."""
        return self._scratch_for(m, top_k).abort_code()

    def reset_after_abort(self, m: int, top_k: int) -> None:
        self._scratch_for(m, top_k).reset_sync()

    # ------------------------------------------------------------------------------------------ validation
    def _check_inputs(self, hidden, expert_ids, expert_weights, experts=None, routing=True):
        """Shapes, dtypes and routing of a call; `experts`: how many experts the ids address (default this op's;
        the whole layer's for a layer split over devices, vkmoe.ops.sharded). routing=False leaves the routing
        values (check_op_routing) to the caller: __call__ has the call check them as it writes them (_submit)."""
        E = self.E if experts is None else experts
        # (each shape read once: every .shape makes a tuple, and this runs on every call)
        if isinstance(hidden, np.ndarray):
            shape = hidden.shape
            if len(shape) != 2 or shape[1] != self.H:
                raise ValueError(f"hidden: expected shape (m, {self.H}) float16, got {describe(hidden)}")
        elif isinstance(hidden, DeviceArray):
            shape = hidden.check("hidden", self.device, (None, self.H), _F16).shape
        else:
            raise ValueError(f"hidden: expected shape (m, {self.H}) float16, got {describe(hidden)}")
        dtype = hidden.dtype
        if dtype is not _F16 and dtype != _F16:  # (numpy's builtin dtypes are singletons: `is` is the usual answer)
            raise TypeError(f"hidden must be float16, got {hidden.dtype}")
        m = shape[0]
        ids_shape = expert_ids.shape if isinstance(expert_ids, np.ndarray) else None
        if ids_shape is None or len(ids_shape) != 2 or ids_shape[0] != m:
            raise ValueError(f"expert_ids: expected shape ({m}, top_k) (m from hidden), got {describe(expert_ids)}")
        if expert_ids.dtype.kind not in "iu":
            raise TypeError(f"expert_ids must be an integer array, got {expert_ids.dtype}")
        top_k = ids_shape[1]
        if not 1 <= top_k <= min(E, MAX_TOP_K):
            raise ValueError(f"expert_ids has top_k={top_k}; expected 1 <= top_k <= {min(E, MAX_TOP_K)} "
                             f"(the number of experts, {E}, and vkmoe's limit {MAX_TOP_K})")
        if not isinstance(expert_weights, np.ndarray) or expert_weights.shape != ids_shape:
            raise ValueError(f"expert_weights: expected shape {ids_shape} (that of expert_ids), got "
                             f"{describe(expert_weights)}")
        dtype = expert_weights.dtype
        if dtype is not _F32 and dtype not in _WEIGHT_DTYPES:
            raise TypeError(f"expert_weights must be float16/float32, got {expert_weights.dtype}")
        if routing:
            check_op_routing(expert_ids, expert_weights, E)
        return m, top_k

    # -------------------------------------------------------------------------------------------- forward
    def __call__(self, hidden, expert_ids, expert_weights, dispatch=None, out=None, out_dtype=np.float32):
        """hidden (m, H) float16, expert_ids (m, top_k) integers, expert_weights (m, top_k) float16/float32:
        numpy arrays, CPU tensors through DLPack (torch: no copy), anything with __array__, or lists; hidden may
        be a DeviceArray. out: None (return numpy of out_dtype: float32, or float16), "device" (return a new
        DeviceArray) or a DeviceArray (m, H) float32 to write and return."""
        hot_key = None  # (a numpy call of float32 output: a signature the hot path may take, _run_hot)
        if out is None and (out_dtype is np.float32 or out_dtype is _F32) and type(hidden) is np.ndarray and \
                type(expert_ids) is np.ndarray and type(expert_weights) is np.ndarray and \
                (dispatch is None or type(dispatch) is str):
            # Every input's shape and dtype: run_prepared copies exactly the slots' sizes from each array, so an
            # input the key leaves out would go unchecked (and be read past its end).
            hot_key = (hidden.shape, expert_ids.shape, expert_weights.shape, hidden.dtype, expert_ids.dtype,
                       expert_weights.dtype, dispatch)
            hot = self._hot.get(hot_key)
            if hot is not None:
                result = self._run_hot(hot, hidden, expert_ids, expert_weights)
                if result is not None:
                    return result
                self._hot.pop(hot_key, None)  # (stale: the general path below makes it again)
        dtype = out_dtype_of(out_dtype)
        # (numpy arrays, the usual case, skip host_array's call: three calls cost ~0.5 us on every decode step)
        if type(hidden) is not np.ndarray and not isinstance(hidden, DeviceArray):
            hidden = host_array(hidden, "hidden")
        if type(expert_ids) is not np.ndarray:
            expert_ids = host_array(expert_ids, "expert_ids")
        if type(expert_weights) is not np.ndarray:
            expert_weights = host_array(expert_weights, "expert_weights")
        m = self._check_inputs(hidden, expert_ids, expert_weights, routing=False)[0]  # (routing: by the call)
        if out is None:
            result = self._forward(hidden, expert_ids, expert_weights, dispatch, check=True)
            if hot_key is not None:
                self._keep_hot(hot_key, dispatch, hidden, expert_ids, expert_weights)
            return result if dtype is _F32 else result.astype(dtype, copy=False)
        target = resolve_out(out, self.device, (m, self.H), _F32, (('hidden', hidden),))
        try:
            self._forward(hidden, expert_ids, expert_weights, dispatch, check=True, target=target,
                          bind_target=target is out)
        except BaseException:
            if target is not out:
                target.close()
            raise
        return target

    def _run_hot(self, hot, hidden, ids, weights):
        """__call__ of a signature that ran before (_HotCall): the same checks, submission and last_run as the
        general path, or None, having run nothing, where the entry is stale or an input is not C-contiguous (the
        caller then takes the general path)."""
        with self._call_lock:
            start = time.perf_counter()
            plan = hot.plan
            if not self._plan_holds_locked(hot.plan_key, plan) or plan.recording is not hot.recording or \
                    not fastcall.enabled():
                return None
            try:
                with self.device.use():  # (the io buffers are mapped: see _submit)
                    out = hot.native.run_prepared(hot.prepared, (hidden, ids, weights), self._check_routing)
            except ValueError:
                if all(a.flags.c_contiguous for a in (hidden, ids, weights)):
                    raise  # (a bad routing value: check_op_routing's error)
                return None
            rec = hot.recording.rec
            fallback = plan.decision.reason if plan.requested == "persistent" else None  # (as _launch_locked's)
            self._last_run = ("split", plan.requested, plan.decision, fallback, plan.scratch.plan, rec,
                              rec.submissions, (time.perf_counter() - start) * 1e3)
            return out

    def _keep_hot(self, key, dispatch, hidden, ids, weights):
        """After a numpy call that ran: keep its signature as a _HotCall where the next one can take the hot path
        (split mode, as planned, through the native call path; a persistent plan reads its abort word after every
        launch and keeps the general path)."""
        with self._call_lock:
            plan_key = (hidden.shape[0], ids.shape[1], self._dispatch_key(dispatch))
            plan = self._plans.get(plan_key)
            recording = plan.recording if plan is not None else None
            if recording is None or plan.decision.mode != "split" or plan.path is not self._split_path:
                return
            native = recording.call.native
            prepared = native.prepare((hidden.dtype, ids.dtype, weights.dtype)) if native is not None else None
            if prepared is None:
                return
            if len(self._hot) >= HOT_CALLS_MAX:
                self._hot.clear()
            self._hot[key] = _HotCall(plan_key, plan, recording, native, prepared)

    def slot_rows(self, hidden, ids, weights, dispatch=None):
        """The per-(token, slot) outputs (m, top_k, H) float32 of a forward whose `ids` are this op's own (ids
        outside [0, E) are skipped and their rows are unspecified: the caller masks them): what the device sums
        per token in slot order. For a layer split over several devices (vkmoe.ops.sharded). Inputs as checked by
        the caller."""
        m, top_k = ids.shape
        if m == 0:
            return np.zeros((0, top_k, self.H), np.float32)
        with self._call_lock:  # the shape's scratch (and its rows) stays until they are read
            self._forward(hidden, ids, weights, dispatch)
            return self._scratch_for(m, top_k).rows.download(np.float32, (m, top_k, self.H))

    def _forward(self, hidden, ids, weights, dispatch, check=False, target=None, bind_target=False):
        """Run inputs whose shapes and dtypes are checked in the resolved dispatch mode; check=True: the routing
        values are checked too (check_op_routing, as they are written: _submit), else ids outside [0, E) are
        skipped on the device. target: None (returns the output as numpy) or the DeviceArray it goes to;
        bind_target: the caller's own array, which may be bound in place of the output buffer (RepeatedArrays)."""
        m, top_k = ids.shape
        arg = self._dispatch_key(dispatch)
        if m == 0:
            self._last_run = _run_report("none", parse_dispatch(arg), "m = 0: nothing to run", None, None, None,
                                         0.0, 0.0)
            return np.zeros((0, self.H), np.float32)
        # (_submit writes the inputs into the mapped input buffers, converting ids to int32, weights to float32)
        with self._call_lock:  # the shape's scratch stays (no eviction) until its last use in _launch_locked
            start = time.perf_counter()  # (last_run's wall_ms counts the planning, as it counted the decision)
            plan = self._plan_locked(m, top_k, arg)
            bound = self._repeated.binding(plan.shape, hidden, target if bind_target else None)
            return self._launch_locked(plan, hidden, ids, weights, check, target, start, bound)

    def _dispatch_key(self, dispatch):
        """A call's dispatch argument as its plans are keyed: None (VKMOE_DISPATCH, read when planning) or the
        mode it names (checked: a bad one raises)."""
        arg = dispatch if dispatch is not None else self._dispatch_arg
        if arg is None or (type(arg) is str and arg in DISPATCH_MODES):
            return arg
        return parse_dispatch(arg)

    def _plan_locked(self, m, top_k, arg):
        """The _CallPlan of shape (m, top_k) and dispatch argument `arg` (_dispatch_key), made again when the
        decision's inputs changed (the caller holds the call lock)."""
        stamp = None if arg == "split" else _DECISION_INPUTS()
        plan = self._plans.get((m, top_k, arg))
        if plan is None or plan.stamp != stamp:
            return self._make_plan(m, top_k, arg, stamp)
        self._scratch.move_to_end(plan.shape)  # a use of the shape, as _scratch_locked counts one (LRU eviction)
        return plan

    def _make_plan(self, m, top_k, arg, stamp):
        requested = parse_dispatch(arg)
        scratch = self._scratch_locked(m, top_k)  # (a new shape may evict others, and their plans)
        decision = self._decide(scratch, requested)
        path = _PersistentPath(self, decision.plan) if decision.mode == "persistent" else self._split_path
        plan = self._plans[(m, top_k, arg)] = _CallPlan((m, top_k), requested, scratch, decision, path, stamp)
        return plan

    def _launch_locked(self, plan, hidden, ids, weights, check, target, start, bound=None):
        """Run a call as `plan` says; a persistent launch that aborted (a bounded spin ran out) is re-run split on
        the same inputs. Sets last_run (its wall time from `start`, a perf_counter()); returns the output.
        bound: the call's DeviceArray buffers to bind (RepeatedArrays), or None."""
        if bound is not None:
            recording = self._recording(plan.shape, plan.path, bound)
        else:
            recording = plan.recording
            if recording is None:
                recording = plan.recording = self._recording(plan.shape, plan.path)
        out = self._submit(recording, plan.path, hidden, ids, weights, check, target)
        decision, fallback = plan.decision, None
        mode = decision.mode
        if mode == "persistent":
            abort = plan.path.check(plan.scratch)
            if abort:
                why = layout.ABORT_REASONS.get(abort, abort)
                fallback = (f"persistent launch aborted ({why}; grid {decision.plan.workgroups} from "
                            f"{decision.plan.source}): re-ran in split mode")
                plan.scratch.reset_sync()
                recording, mode = self._recording(plan.shape, self._split_path, bound), "split"
                out = self._submit(recording, self._split_path, hidden, ids, weights, check, target)
        elif plan.requested == "persistent":  # a request not honoured; an ordinary auto decision is only `reason`
            fallback = decision.reason
        # (the report, with its GPU time, is made only if read: see last_run)
        rec = recording.rec
        self._last_run = (mode, plan.requested, decision, fallback, plan.scratch.plan, rec, rec.submissions,
                          (time.perf_counter() - start) * 1e3)
        return out

    def _decide(self, scratch, requested):
        """vkmoe.sched's Decision for a call of `scratch`'s shape in mode `requested`."""
        return decide(self.device, scratch.plan, requested, self.E, self.H, self.I, self.gated,
                      lambda: self.co_resident(scratch.plan), scratch.persistent_fits)

    def _io_for(self, m, top_k):
        """(hidden, ids, weights, out) buffers of a batch shape: the inputs where the host writes and the device
        reads them, the output (+ STATUS_BYTES) where the device writes and the host reads it, so a call needs
        no staging copies (vkmoe/vk/memory.py: "upload" and "readback" memory)."""
        key = (m, top_k)
        io = self._io.get(key)
        if io is None:
            self._scratch_for(m, top_k)  # registers the shape first: its io goes when it is evicted
            io = self._io[key] = tuple(self.device.memory.allocate_all(
                [m * self.H * 2, m * top_k * 4, m * top_k * 4, m * self.H * 4 + STATUS_BYTES],
                kinds=["upload", "upload", "upload", "readback"]))
        return io

    def _recording(self, shape, path, bound=None):
        """The _Recording of `path` for batch shape (m, top_k), recorded on first use (the caller holds the call
        lock): the output poisoned with NaN first (an element no stage writes stays NaN), the path's commands,
        and for a path that reads_status the sync area's abort word copied behind the output. bound: the
        (hidden, out) Buffers (either may be None) it binds in place of the io buffers (RepeatedArrays)."""
        key = (*shape, path.key) if bound is None else (*shape, path.key, *bound)
        recording = self._recorded.get(key)
        if recording is None:
            if bound is not None:  # the oldest recordings of other arrays for this shape and path go first
                make_room_for_bound(self._recorded, key[:3], _Recording.close)
            recording = self._recorded[key] = self._record_run(*shape, path, bound)
        return recording

    def _submit(self, recording, path, hidden, ids, weights, check, target=None):
        """Write the inputs, submit `recording` (of `path`) ONCE, wait; returns the output (None where it goes to
        the DeviceArray `target`) and leaves the abort word in the scratch's last_status. The caller holds the
        call lock (one forward at a time per layer: the io and scratch buffers are per layer).
        hidden may be a DeviceArray, and so may the output: copied by recorded copies riding on the same
        submission (CallTransfers), or bound in `recording` itself (RepeatedArrays). ids and weights: any integer / float arrays of shape (m, top_k), written
        as int32 / float32. check=True: their values are checked first (check_op_routing; the native path does it
        in C as it copies them)."""
        call = recording.call
        # The io buffers are mapped: written and read under ONE hold of the device (a closed device's memory
        # is unmapped; close() waits for this block instead).
        with self.device.use():
            out = call.run(self._transfers, (hidden, ids, weights), target, _F32,
                           self._check_routing if check else None)
            recording.scratch.last_status = call.status_word() if path.reads_status else 0
        return out

    def _record_run(self, m, top_k, path, bound=None):
        """_recording's recording: the output poisoned with NaN, path.record's commands between two timestamps,
        the abort word copied behind the io output (path.reads_status), a host barrier. Where the path's first
        dispatch writes no output (path.first_dispatch_writes_output), the poison fill runs beside that dispatch,
        ordered before the later ones by its barrier, and inside the timestamps: a barrier of its own before the
        forward cost the H200 about 4 us of wall time per call (BENCHMARKS.md, sixteenth session). bound:
        (hidden, out) Buffers bound in place of the io ones (None entries: the io ones)."""
        hb, ib, wb, ob = self._io_for(m, top_k)
        bound_hidden, bound_out = bound if bound is not None else (None, None)
        hidden_buf = hb if bound_hidden is None else bound_hidden
        out_buf = ob if bound_out is None else bound_out
        scratch = self._scratch_for(m, top_k)
        rec = CommandRecorder(self.device, timestamps=2)
        try:
            rec.begin()

            # an element no stage writes stays NaN (a caller's array: its own bytes only; it may sit in a bigger buffer)
            def poison(cmd):
                cmd.fill(out_buf, POISON_F32, nbytes=None if out_buf is ob else m * self.H * 4)

            bindings = self._bindings(scratch, hidden_buf, ib, wb, out_buf)
            # (a path that does not say, e.g. a test's, is taken to write the output from its first dispatch)
            writes = getattr(path, "first_dispatch_writes_output", None)
            if writes is not None and not writes(scratch):
                rec.timestamp()
                sets = path.record(rec, scratch, bindings, beside_first=poison)
            else:
                poison(rec)
                rec.barrier()
                rec.timestamp()
                sets = path.record(rec, scratch, bindings)
            rec.timestamp()
            if path.reads_status:  # path.record ended with a barrier: the kernel's abort word is final
                rec.copy(scratch.sync, ob, 4, dst_offset=m * self.H * 4)
            rec.host_barrier()
            rec.end()
        except BaseException:  # a recording that failed (e.g. on a closed device) leaves nothing behind
            _Recording(rec, (), scratch).close()
            raise
        # The routing rules as C checks them (check_op_routing's: ids in [0, E), no expert twice in a row,
        # weights finite in float32)
        call = RecordedCall(rec, [(hb, _F16, (m, self.H)), (ib, _I32, (m, top_k), IndexRule(self.E, top_k)),
                                  (wb, _F32, (m, top_k), BoundedRule(F32_MAX))], (ob, _F32, (m, self.H)),
                            bound_inputs=() if bound_hidden is None else (0,), bound_output=bound_out is not None)
        # record_body returns the descriptor sets it bound (None: none to free with the recording)
        return _Recording(rec, sets or (), scratch, call)

    def _run_path(self, path, hidden, ids, weights, m, top_k, check=False, target=None, bound=None):
        """Run `path` once (the caller holds the call lock); returns a RunResult. bound: as _recording's."""
        recording = self._recording((m, top_k), path, bound)
        out = self._submit(recording, path, hidden, ids, weights, check, target)
        rec = recording.rec
        return RunResult(out, (rec, rec.submissions), path.check(recording.scratch))

    def run_split(self, hidden, ids, weights, m, top_k, check=False):
        """Upload, run the split path (output poisoned first), wait; returns a RunResult (abort_code 0)."""
        with self._call_lock:
            return self._run_path(self._split_path, hidden, ids, weights, m, top_k, check)

    def run_persistent(self, hidden, ids, weights, m, top_k, pplan, check=False):
        """Upload, run the persistent kernel, wait; returns a RunResult. A non-zero abort code means the output
        is not valid (the caller re-runs split after resetting the sync area)."""
        with self._call_lock:
            return self._run_path(_PersistentPath(self, pplan), hidden, ids, weights, m, top_k, check)

    def forward_sorted(self, hidden: np.ndarray, expert_count, token_sorted, weight_sorted,
                       dispatch: "str | None" = None, out_dtype=np.float32) -> np.ndarray:
        """exllamav3's kernel inputs: expert_count (E or E+1 entries; the last one, the sentinel, is ignored
        when E+1), token_sorted (token index per routed pair, grouped by expert), weight_sorted (matching
        routing weights). Rebuilt into per-token (ids, weights) and run as __call__."""
        dtype = out_dtype_of(out_dtype)
        hidden = host_array(hidden, "hidden")
        expert_count, token_sorted = host_array(expert_count, "expert_count"), host_array(token_sorted, "token_sorted")
        weight_sorted = host_array(weight_sorted, "weight_sorted")
        for name, value in (("expert_count", expert_count), ("token_sorted", token_sorted)):
            if np.asarray(value).dtype.kind not in "iu":  # a float index would be truncated silently
                raise TypeError(f"{name} must be an integer array, got dtype {np.asarray(value).dtype}")
        expert_count = np.asarray(expert_count).astype(np.int64).reshape(-1)
        token_sorted = np.asarray(token_sorted).astype(np.int64).reshape(-1)
        weight_sorted = np.asarray(weight_sorted).astype(np.float32).reshape(-1)
        if expert_count.shape[0] not in (self.E, self.E + 1):
            raise ValueError(f"expert_count must have {self.E} or {self.E + 1} entries, got {expert_count.shape[0]}")
        if (expert_count < 0).any():
            raise ValueError("expert_count has negative entries")
        total = int(expert_count[:self.E].sum())
        if token_sorted.shape[0] < total or weight_sorted.shape[0] != token_sorted.shape[0]:
            raise ValueError(f"token_sorted and weight_sorted need >= {total} matching entries, got "
                             f"{token_sorted.shape[0]} and {weight_sorted.shape[0]}")
        m = hidden.shape[0] if isinstance(hidden, np.ndarray) and hidden.ndim == 2 else -1
        if m < 0:
            raise ValueError("hidden must be a (m, H) float16 array")
        if total and (token_sorted[:total].min() < 0 or token_sorted[:total].max() >= m):
            raise ValueError(f"token_sorted entries must lie in [0, {m})")
        if not np.isfinite(weight_sorted[:total]).all():
            raise ValueError("weight_sorted contains NaN or Inf")
        experts = np.repeat(np.arange(self.E), expert_count[:self.E])
        per_token = np.bincount(token_sorted[:total], minlength=m)
        top_k = max(1, int(per_token.max()) if m else 1)
        if top_k > MAX_TOP_K:
            raise ValueError(f"token_sorted routes a token to {top_k} experts; vkmoe supports at most {MAX_TOP_K}")
        pairs = experts.astype(np.int64) * max(m, 1) + token_sorted[:total]
        if np.unique(pairs).size != pairs.size:
            raise ValueError("token_sorted names the same token twice for one expert")
        ids = np.full((m, top_k), -1, np.int64)
        weights = np.zeros((m, top_k), np.float32)
        fill = np.zeros(m, np.int64)
        for e, t, w in zip(experts, token_sorted[:total], weight_sorted[:total]):
            ids[t, fill[t]] = e
            weights[t, fill[t]] = w
            fill[t] += 1
        # Tokens with fewer pairs than top_k keep id -1 there: skipped on the device like exllamav3's sentinel.
        return self._call_with_skips(hidden, ids, weights, dispatch).astype(dtype, copy=False)

    def _call_with_skips(self, hidden, ids, weights, dispatch):
        if hidden.dtype != np.float16 or hidden.shape[1] != self.H:
            raise ValueError(f"hidden must be (m, {self.H}) float16")
        return self._forward(hidden, ids, weights, dispatch)

    def close(self):
        with self._call_lock:  # after a call running in another thread, never under it
            self._closed = True
            self._hot.clear()  # (so a later call takes the general path, which raises closed_op_error)
            self.last_run  # noqa: B018 - made now, while the recording whose GPU time it reads exists
            self._transfers.close()
            self._plans.clear()  # (they hold recordings freed next)
            _release_layer(*self._resources)
            self._pinned.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
