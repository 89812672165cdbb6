"""A whole MoE block on one Vulkan device: router, routed experts, shared experts and the sum, recorded into one
command buffer (vkmoe.models.SparseMoeBlock builds it for the vulkan backend; docs/DESIGN.md, "The device block").

Phases (one barrier after each; the dispatches inside a phase are independent), split mode:
    [fp32 hidden -> fp16 | Gemma 4: router / routed-in RMSNorms]
    shared up + gate input Hadamards, shared gate GEMV
    router (one dispatch), shared up + gate GEMMs
    routed: routing + stage 1, shared activation
    routed: gate/up GEMM, shared down input Hadamard
    routed: down GEMM, shared down GEMM
    [Gemma 4: routed-out RMSNorm] -> out += shared (· sigmoid(gate)) (Gemma 4: += RMSNorm(shared))
Fused shared sum (_fuses_shared_sum: m = 1, the shared down in the linear's direct mode, no RMSNorms, no latent
projections, routed experts in direct mode or persistent): the shared down builds its row from act(gate, up) itself
and runs beside the routed gate/up, and the routed experts' token sums add its output (Exl3MoeMlp's `shared`):
    router, shared up + gate GEMMs | routed gate/up, shared down GEMM | routed down (+ shared)
Otherwise the routed and the shared chains end together (the shared down GEMM beside the routed down): with the routed
experts in direct mode (two dispatches, no routing pass) the shared activation runs beside the routed gate/up GEMM
at m = 1 and in a phase of its own before it at m > 1. Without a shared expert: router, then the routed experts'
dispatches. A persistent routed launch runs alone, after the shared expert's phases. At m = 1 the shared (and
latent) linears have no input Hadamard dispatches (the linear's direct mode: ops.plan.gemm_plan), so their phases
hold only the GEMMs; an empty phase is skipped.
NemotronH's LatentMoE: fc1_latent_proj's input Hadamard joins the router phase and its GEMM the next (with the
shared up GEMM), so the routed experts start one phase later and run at the latent width L into an fp32 (m, L)
sum; then fp16(sum), fc2_latent_proj's Hadamard, its GEMM and out = fp32(fc2), each a phase, before the shared sum.
"""
from collections import OrderedDict

import numpy as np

from .. import forksafe, knobs, layout
from ..vk import CommandRecorder, PushConstants, expect_device, fastcall
from ..vk.errors import closed_op_error
from . import kernels
from .device_array import (CallTransfers, DeviceArray, close_recording, last_gpu_ms, refuse_shared_memory,
                           resolve_out)
from .plan import default_target_workgroups
from .record_args import all_or_nothing, check_recorder, check_rows
from .recorded_call import HOT_CALLS_MAX, POISON_F32, RecordedCall
from .router import RouterGemv, check_tokens

_F32 = np.dtype(np.float32)


# The shared expert's up and gate GEMMs run side by side (beside the router): each plans its k-splits for this
# fraction of the device's GEMM workgroups (ops.plan.default_target_workgroups), not all of them, so that the pair
# is about one round instead of two. H200, DeepSeek-V3 shape, tools/bench_decode --layers 16, the router + shared
# up/gate phase, us (m = 1 | m = 4): all 396 workgroups each 24.5 | 35.3 (two runs), 2/3 (264) 21.7 | 32.9, 1/2 (198)
# 22.1 | 37.6, 1/3 (132) 21.5 | 38.8 (BENCHMARKS.md, fifteenth session).
SHARED_GEMM_SHARE = (2, 3)


def shared_gemm_workgroups(device):
    num, den = SHARED_GEMM_SHARE
    return max(1, default_target_workgroups(device) * num // den)


class ElemPush(PushConstants):
    fields = [("pairs", "<u4"), ("cols", "<u4"), ("mode", "<u4"), ("act", "<u4"), ("limit", "<f4"),
              ("has_gate", "<u4")]


class NormPush(PushConstants):
    fields = [("H", "<u4"), ("eps", "<f4"), ("scale", "<f4"), ("x_f32", "<u4"), ("y_f32", "<u4"),
              ("accumulate", "<u4")]


class _Scratch:
    """The device buffers of one batch size m (all device-local; a caller's recording may use them). z16, e16:
    Gemma 4's normed router input and routed-expert input; xl (fp16), rl (fp32), r16 (fp16), y16 (fp16, (m, H)):
    LatentMoE's fc1 output, routed sum, its fp16 copy and fc2's output (L = 0: none)."""

    def __init__(self, device, m, H, E, top_k, shared_n, normed, L=0):
        names = ["x16", "logits", "ids", "weights", "gate_logits", "u", "g", "p", "s", "z16", "e16",
                 "xl", "rl", "r16", "y16"]
        sizes = [m * H * 2, m * E * 4, m * top_k * 4, m * top_k * 4, m * 4, m * shared_n * 2, m * shared_n * 2,
                 m * shared_n * 2, m * H * 2, m * H * 2 * normed, m * H * 2 * normed,
                 m * L * 2, m * L * 4, m * L * 2, m * H * 2 * bool(L)]
        self.buffers = device.memory.allocate_all([max(16, n) for n in sizes])
        for name, buf in zip(names, self.buffers):
            setattr(self, name, buf)

    def close(self):
        for b in self.buffers:
            b.close()


def _call_inputs(hidden, tokens, residual):
    """A __call__'s inputs by name, in the order of its recording's input slots (None: absent)."""
    return {"x": hidden, "tokens": tokens, "residual": residual}


def _call_key(m, inputs, mode):
    """The key of the __call__ recording for m rows, these inputs (_call_inputs: their dtypes) and mode."""
    return m, tuple((name, None if a is None else a.dtype) for name, a in inputs.items()), mode


class DeviceMoeBlock:
    """router: a vkmoe.ops.router.DeviceRouter (closed with the block); moe: the Exl3MoeMlp of the routed
    experts; shared: None or {"up", "down"[, "gate"]} Exl3Linear (gate absent when the activation is gateless);
    shared_gate_weight: None or (1, H) (sigmoid gate of the shared output); activation / shared_act_limit: the
    shared expert's; norms: None or {"router", "routed_in", "routed_out", "shared_out": (H,) RMSNorm weight}
    with `eps` (Gemma 4: the router and the routed experts read the normed residual, which calls then pass);
    latent: None or {"in": H -> L, "out": L -> H} Exl3Linear (NemotronH's LatentMoE: `moe` runs at width L)."""

    def __init__(self, device, router, moe, top_k, shared=None, shared_gate_weight=None, activation="silu",
                 shared_act_limit=0.0, norms=None, eps=1e-6, latent=None):
        expect_device(device)
        self.device, self.router, self.moe, self.top_k = device, router, moe, top_k
        self.latent = latent
        self.H, self.E, self.L = moe.H, router.E, 0
        if latent is not None:
            self.H, self.L = latent["in"].k, moe.H
            if (latent["in"].n, latent["out"].k, latent["out"].n) != (self.L, self.L, self.H):
                raise ValueError(f"latent: expected fc1 {self.H}x{self.L} and fc2 {self.L}x{self.H} (the routed "
                                 f"experts' width {self.L}), got {latent['in'].k}x{latent['in'].n} and "
                                 f"{latent['out'].k}x{latent['out'].n}")
            if norms is not None:
                raise ValueError("latent: a LatentMoE block has no RMSNorms (norms must be None)")
        self.shared = shared
        self.shared_n = shared["up"].n if shared else 0
        self.gate_gemv = RouterGemv(device, shared_gate_weight) if shared_gate_weight is not None else None
        self.activation, self.act_limit = activation, float(shared_act_limit)
        self.act = layout.ACTIVATIONS[activation]
        self.norms, self.eps = None, float(eps)
        if norms is not None:
            self.norms = {role: device.memory.allocate(self.H * 4) for role in norms}
            for role, weight in norms.items():
                self.norms[role].upload(np.ascontiguousarray(weight, dtype=np.float32))
        self._scratch = {}   # m -> _Scratch
        # (m, input dtypes, mode) -> (input buffers, out buffer, recorder, descriptor sets) of __call__, least
        # recently used first: at most VKMOE_SHAPE_CACHE; an evicted m's scratch goes unless record() pinned it.
        self._calls = OrderedDict()
        self._pinned = set()  # the m of every record() by a caller: its command buffer uses that scratch
        # (hidden shape, hidden dtype) -> (call key, its _calls entry, routed plan key, plan, prepared): __call__'s hot
        # path for numpy hidden (Exl3MoeMlp's hot calls, the same idea)
        self._hot = {}
        self._closed = False  # (_general_call and _scratch_for raise once set, before the routed op would name
                              # itself; close() empties the hot calls, so every call and record gets there)
        self._dummy = device.memory.allocate(16)  # the token ids of a router that reads none
        # The routed experts' token sums add the shared output where _fuses_shared_sum allows it (tests set it
        # False on a block to compare the two recordings bit for bit).
        self._fuse_shared_sum = True
        self._transfers = CallTransfers(device)
        self._lock = forksafe.RLock()  # one call at a time: the scratch and io buffers are per block
        self.last_gpu_time = None  # the last call's vkmoe.vk.GpuTime (last_gpu_ms reads it)
        self.last_mode = None

    # --------------------------------------------------------------------------------------------- record
    def _scratch_for(self, m):
        if self._closed:
            raise closed_op_error(self)
        if m not in self._scratch:
            self._scratch[m] = _Scratch(self.device, m, self.H, self.E, self.top_k, self.shared_n,
                                        self.norms is not None, self.L)
        return self._scratch[m]

    def _elem(self, cmd, mode, bufs, elements, cols=1, has_gate=False):
        pipe = kernels.pipeline(self.device, "moe_block_elem", ElemPush)
        dset = pipe.bind(*bufs)
        pairs = elements // 2
        cmd.dispatch(pipe, dset, layout.fold_grid(layout.ceil_div(pairs, layout.WORKGROUP_SIZE)),
                     ElemPush(pairs=pairs, cols=cols, mode=mode, act=self.act, limit=self.act_limit,
                              has_gate=int(has_gate)))
        return dset

    def _rmsnorm(self, cmd, role, x_buf, x_f32, y_buf, y_f32, m, scale=1.0, accumulate=False):
        pipe = kernels.pipeline(self.device, "moe_block_rmsnorm", NormPush)
        dset = pipe.bind(x_buf, self.norms[role], y_buf)
        cmd.dispatch(pipe, dset, m, NormPush(H=self.H, eps=self.eps, scale=scale, x_f32=int(x_f32),
                                             y_f32=int(y_f32), accumulate=int(accumulate)))
        return dset

    def record_buffers(self, cmd, x_buf, x_f32, tokens_buf, out_buf, m, mode="split", residual=None, pin=True):
        """Append the block for m tokens: x_buf (m, H) fp32 (x_f32) or fp16, tokens_buf (m,) int32 token ids
        (hash-routed layers; else None), out_buf receives (m, H) fp32; residual: (buffer, is fp32) of the
        residual stream (Gemma 4 only). Ends with a barrier. Returns the descriptor sets the commands use (the
        caller frees them with its recording). mode: the routed experts' (Exl3MoeMlp.record: "persistent" needs
        `aborted(m)` checked after the submission). pin: keep this m's scratch for good (a caller's recording).
        Independent dispatches share a phase; one barrier closes each phase (docs/DESIGN.md)."""
        check_recorder(self.device, cmd)  # (None failed at its first dispatch: an AttributeError)
        check_rows(m, minimum=1)
        check_tokens(m)
        with self._lock:
            s = self._scratch_for(m)
            if pin:
                self._pinned.add(m)
        sets = []
        with all_or_nothing(cmd, "the MoE block's record()"):
            for phase in self._phases(x_buf, x_f32, tokens_buf or self._dummy, out_buf, m, mode, residual, s):
                steps = [step for step in phase if step is not None]  # (None: a linear's absent input Hadamard)
                if not steps:  # a phase left empty needs no barrier
                    continue
                for step in steps:
                    sets.append(step(cmd))
                cmd.barrier()
        return [d for d in sets if d is not None]

    def _phases(self, x_buf, x_f32, tokens_buf, out_buf, m, mode, residual, s):
        """Lists of steps (function(cmd) -> descriptor set or None); the steps of a phase are independent."""
        pre, x16 = [], x_buf
        if x_f32:  # the experts read fp16; the router reads the fp32 hidden itself
            pre.append(lambda cmd: self._elem(cmd, layout.ELEM_TO_F16, (x_buf, x_buf, s.x16), m * self.H))
            x16 = s.x16
        router_in, router_f32, experts_in = x_buf, x_f32, x16
        if self.norms is not None:  # Gemma 4: router and routed experts read the normed residual (fp16)
            r_buf, r_f32 = residual
            pre.append(lambda cmd: self._rmsnorm(cmd, "router", r_buf, r_f32, s.z16, False, m, scale=self.H ** -0.5))
            pre.append(lambda cmd: self._rmsnorm(cmd, "routed_in", r_buf, r_f32, s.e16, False, m))
            router_in, router_f32, experts_in = s.z16, False, s.e16
        steps = self.router.steps(router_in, router_f32, tokens_buf, s.logits, s.ids, s.weights, m)
        fused = self._fuses_shared_sum(m, mode)
        # The shared expert's input Hadamards (and gate GEMV) take a phase of their own before the router, so that
        # its gate/up GEMMs (a memory-bound read of its weights) run beside the router (a latency-bound GEMV and
        # selection) rather than beside the short routing pass.
        shared = self._shared_phases(x16, s, m, fused) if self.shared else [[], []]
        add = (s.s, s.gate_logits if self.gate_gemv is not None else None) if fused else None
        early = [shared[0]] if self.shared else []
        # (a shared phase with no step, down's input Hadamard of a direct-mode linear at m = 1, is dropped: it
        # would take a place in the alignment below)
        rest = [phase for phase in shared[2:] if any(step is not None for step in phase)]
        first, routed_out, ahead = steps + shared[1], out_buf, []
        if self.latent is not None:  # fc1 beside the router and the shared expert's first GEMMs
            fc1 = self.latent["in"].stages(experts_in, s.xl, m)
            first.append(fc1[0])
            ahead = [[fc1[1]] + (rest[0] if rest else [])]
            rest, experts_in, routed_out = rest[1:], s.xl, s.rl
        if mode == "split":
            routed = [[st] for st in self.moe.split_stages(experts_in, s.ids, s.weights, routed_out, m,
                                                          self.top_k, shared=add)]
            # The two chains end together: the shared down GEMM beside the routed down (the cheaper neighbour,
            # measured: see _shared_phases), and where one chain is longer its first phases run alone. A shared
            # chain longer than the routed one (direct mode: two dispatches; act, down's Hadamard, down's GEMM)
            # so starts with the short activation alone instead of ending with the shared down GEMM alone.
            # Fused (the routed down adds the shared output): the shared chain ends one phase earlier, beside the
            # routed gate/up, and the routed down runs alone. A token-sum pass (the routed plan's last dispatch, a
            # short one) runs after both chains, so the shared down GEMM stays beside the routed down.
            last_alone = fused or self.moe.moe_plan(m, self.top_k).token_sum_pass
            tail = routed[-1:] if last_alone else []
            routed = routed[:-1] if last_alone else routed
            n = max(len(routed), len(rest))
            pad = lambda chain: [[]] * (n - len(chain)) + chain  # noqa: E731 (empty phases first)
            later = ahead + [r + sh for r, sh in zip(pad(routed), pad(rest))] + tail
        else:  # a persistent launch wants the whole device: nothing runs beside it
            def persistent(cmd):
                self.moe.record(cmd, experts_in, s.ids, s.weights, routed_out, m, self.top_k, mode=mode, shared=add)
            later = ahead + rest + [[persistent]]
        phases = ([pre] if pre else []) + early + [first] + later
        if self.latent is not None:
            phases += self._latent_tail(s, out_buf, m)
        if self.norms is not None:
            phases.append([lambda cmd: self._rmsnorm(cmd, "routed_out", out_buf, True, out_buf, True, m)])
        if self.shared and not fused:
            phases.append([lambda cmd: self._shared_sum(cmd, s, out_buf, m)])
        return phases

    def _fuses_shared_sum(self, m, mode):
        """Whether the routed experts' token sums add the shared output (Exl3MoeMlp's `shared`) instead of a sum
        pass after them: a shared expert whose down runs in the linear's direct mode at m (one row: it activates
        its own input, so its chain ends beside the routed gate/up), no RMSNorms (Gemma 4 adds a normed shared
        output) and no latent projections, and routed experts that zero the rows of tokens with no valid slot in
        their last dispatch (direct mode) or that run as one persistent launch after the shared chain. Saves the
        activation and the sum passes (docs/DESIGN.md, "The device block")."""
        if not self.shared or self.norms is not None or self.latent is not None or not self._fuse_shared_sum:
            return False
        if not self.shared["down"].direct(m):
            return False
        return mode != "split" or self.moe.moe_plan(m, self.top_k).direct

    def _shared_phases(self, x16, s, m, fused=False):
        """The shared expert's phases: [up and gate input Hadamards, gate GEMV] (before the router), [up and
        gate GEMMs] (beside the router), [activation], [down's input Hadamard], [down's GEMM] (beside the routed
        experts' split dispatches). A linear in direct mode (m = 1: ops.plan.gemm_plan) has no input Hadamard
        step: the first phase may be empty (record_buffers skips it) and down's input Hadamard phase holds only None
        (_phases drops it)."""
        ops = self.shared
        # up and gate beside each other and the router: each aims its k-splits at a share of the device
        side = shared_gemm_workgroups(self.device) if "gate" in ops else None
        up = ops["up"].stages(x16, s.u, m, side)
        gate = ops["gate"].stages(x16, s.g, m, side) if "gate" in ops else [None, None]
        first = [up[0]] + ([gate[0]] if gate[0] else [])
        if self.gate_gemv is not None:  # sigmoid gate logits from the fp16 hidden, as the host path
            first.append(lambda cmd: self.gate_gemv.record(cmd, x16, False, s.gate_logits, m))
        second = [up[1]] + ([gate[1]] if gate[1] else [])
        if fused:  # the down GEMM builds its row from the gate and up outputs: no activation pass
            down = ops["down"].stages(s.g if "gate" in ops else s.u, s.s, m,
                                      activated=(s.u, self.activation, self.act_limit))
            return [first, second, [], [down[0]], [down[1]]]
        act = lambda cmd: self._elem(cmd, layout.ELEM_ACTIVATE, (s.g, s.u, s.p), m * self.shared_n)  # noqa: E731
        down = ops["down"].stages(s.p, s.s, m)
        # (down's GEMM stays beside the routed down GEMM even without its input Hadamard step: measured on the
        # H200, DeepSeek-V3 shape m = 1, it cost 3.5 us beside the routed gate/up GEMM and 1.9 beside the down)
        return [first, second, [act], [down[0]], [down[1]]]

    def _latent_tail(self, s, out_buf, m):
        """LatentMoE after the routed experts: the fp32 (m, L) sum rounded to fp16 (exllamav3 hands fc2 an fp16
        input too), fc2_latent_proj's two dispatches, then out = fp32(fc2's fp16 output): one phase each."""
        L, H = self.L, self.H
        to16 = lambda cmd: self._elem(cmd, layout.ELEM_TO_F16, (s.rl, s.rl, s.r16), m * L)  # noqa: E731
        fc2 = self.latent["out"].stages(s.r16, s.y16, m)
        to32 = lambda cmd: self._elem(cmd, layout.ELEM_TO_F32, (s.y16, s.y16, out_buf), m * H)  # noqa: E731
        return [[to16], [fc2[0]], [fc2[1]], [to32]]

    def _shared_sum(self, cmd, s, out_buf, m):
        if self.norms is not None:  # out += RMSNorm(shared), in fp32
            return self._rmsnorm(cmd, "shared_out", s.s, False, out_buf, True, m, accumulate=True)
        return self._elem(cmd, layout.ELEM_ADD_SHARED, (s.s, s.gate_logits, out_buf), m * self.H, cols=self.H,
                          has_gate=self.gate_gemv is not None)

    # ----------------------------------------------------------------------------------------------- call
    def check_hidden(self, hidden, name="hidden"):
        """A DeviceArray hidden must be this device's, (m, H), float16 or float32, open."""
        hidden.check(name, self.device, (None, self.H), hidden.dtype)
        if hidden.dtype not in (np.float16, np.float32):
            raise TypeError(f"{name} must be float16 or float32, got a DeviceArray of {hidden.dtype}")
        return hidden

    def check_tokens_array(self, tokens, m):
        return tokens.check("input_ids", self.device, (m,), np.int32)

    def record(self, cmd, hidden, out, tokens=None, mode="split", residual=None):
        """DeviceArray form of record_buffers: hidden (m, H) float16/float32, out (m, H) float32, tokens (m,)
        int32 or None, residual (m, H) float16/float32 (Gemma 4) or None (checked: device, shape, dtype, open)."""
        self.check_hidden(hidden)
        m = hidden.shape[0]
        out.check("out", self.device, (m, self.H), np.float32)
        refuse_shared_memory(out, (("hidden", hidden), ("residual", residual), ("input_ids", tokens)))
        if tokens is not None:
            self.check_tokens_array(tokens, m)
        self._check_residual(residual, m)
        if m == 0:
            return []
        return self.record_buffers(cmd, hidden.buffer, hidden.dtype == np.float32,
                                   None if tokens is None else tokens.buffer, out.buffer, m, mode,
                                   None if residual is None else (residual.buffer, residual.dtype == np.float32))

    def _check_residual(self, residual, m):
        if (residual is None) != (self.norms is None):
            raise ValueError("residual: " + ("this block's router and routed experts read the residual stream; "
                                             "pass the (m, H) residual" if residual is None else
                                             "only a block with RMSNorms (Gemma 4) takes one"))
        if isinstance(residual, DeviceArray):
            self.check_hidden(residual, "residual")
            if residual.shape[0] != m:
                raise ValueError(f"residual must have shape ({m}, {self.H}), got a DeviceArray of shape "
                                 f"{residual.shape}")

    def aborted(self, m):
        """The abort code of the last persistent routed-expert launch for m tokens (0: none; see Exl3MoeMlp)."""
        return self.moe.aborted(m, self.top_k)

    def __call__(self, hidden, tokens=None, out=None, residual=None):
        """hidden: (m, H) float16/float32 numpy or DeviceArray; tokens: (m,) int32 numpy or DeviceArray (hash
        layers) or None; out: None (numpy), "device" or a DeviceArray; residual: like hidden (Gemma 4) or None.
        ONE submission: inputs, the block and the output's copy are recorded together (CallTransfers)."""
        if out is None and tokens is None and residual is None and type(hidden) is np.ndarray:
            hot_key = (hidden.shape, hidden.dtype)
            hot = self._hot.get(hot_key)
            if hot is not None:
                result = self._run_hot(hot, hidden)
                if result is not None:
                    return result
                self._hot.pop(hot_key, None)  # (stale: the general path below makes it again)
            result = self._general_call(hidden, tokens, out, residual)
            self._keep_hot(hot_key, hidden)
            return result
        return self._general_call(hidden, tokens, out, residual)

    def _general_call(self, hidden, tokens, out, residual):
        if self._closed:
            raise closed_op_error(self)
        if isinstance(hidden, DeviceArray):
            self.check_hidden(hidden)
        m = hidden.shape[0]
        target = resolve_out(out, self.device, (m, self.H), np.float32,
                             (('hidden', hidden), ('residual', residual), ('input_ids', tokens)))
        if isinstance(tokens, DeviceArray):
            self.check_tokens_array(tokens, m)
        self._check_residual(residual, m)
        if m == 0:
            return np.zeros((0, self.H), np.float32) if target is None else target
        inputs = _call_inputs(hidden, tokens, residual)
        # The io buffers are mapped: written and read under one hold of the device (a closed device's memory is
        # unmapped; close() waits for this block instead).
        with self._lock, self.device.use():
            mode = self.moe.decided_mode(m, self.top_k)
            out, abort = self._submit(m, inputs, target, mode)
            if abort:  # a persistent launch's bounded spin ran out: its output is not valid, re-run split
                self.moe.reset_after_abort(m, self.top_k)
                mode = "split"
                out, _ = self._submit(m, inputs, target, mode)
            self.last_mode = mode
            return out if target is None else target

    last_gpu_ms = last_gpu_ms  # device_array.last_gpu_ms: reads last_gpu_time when asked

    def _run_hot(self, hot, hidden):
        """__call__ of a numpy hidden whose shape and dtype ran before (_HotCall): the same submission, checks and
        bookkeeping as the general path, or None, having run nothing, where the entry is stale (the recording or
        the routed experts' split decision gone) or hidden is not C-contiguous."""
        call_key, entry, plan_key, plan, prepared = hot
        with self._lock:
            if self._calls.get(call_key) is not entry or not self.moe.plan_holds(plan_key, plan) \
                    or not fastcall.enabled():
                return None
            self._calls.move_to_end(call_key)
            call = entry[2]
            with self.device.use():  # (the io buffers are mapped: see __call__)
                if self.last_gpu_time is not None:
                    self.last_gpu_time.forget()
                try:
                    out = call.native.run_prepared(prepared, (hidden,), None)
                except ValueError:  # not C-contiguous (nothing was written or submitted)
                    return None
                self.last_gpu_time = call.rec.gpu_time()
            self.last_mode = "split"
            return out

    def _keep_hot(self, key, hidden):
        """After a numpy call that ran split through the native path: keep what _run_hot needs for its next one."""
        m = hidden.shape[0]
        with self._lock:
            call_key = _call_key(m, _call_inputs(hidden, None, None), "split")
            entry = self._calls.get(call_key)
            native = entry[2].native if entry is not None and self.last_mode == "split" else None
            token = self.moe.split_plan(m, self.top_k) if native is not None else None
            prepared = native.prepare((hidden.dtype,)) if token is not None else None
            if prepared is None:
                return
            if len(self._hot) >= HOT_CALLS_MAX:
                self._hot.clear()
            self._hot[key] = (call_key, entry, *token, prepared)

    def _submit(self, m, inputs, target, mode):
        """Inputs, the block recorded for this shape and mode, the output's copy: ONE submission, waited for (the
        caller holds the device). Returns (the numpy output, None for a target; the persistent launch's abort
        code: copied behind the output)."""
        call = self._call_buffers(*_call_key(m, inputs, mode))
        if self.last_gpu_time is not None:  # not read by now: nobody will, the submission need not read it
            self.last_gpu_time.forget()
        out = call.run(self._transfers, [a for a in inputs.values() if a is not None], target, _F32)
        self.last_gpu_time = call.rec.gpu_time()
        return out, call.status_word() if mode == "persistent" else 0

    def _call_buffers(self, m, dtypes, mode):
        """The RecordedCall of (m, the inputs' dtypes, mode), recorded once; its inputs are the present ones, in
        the order of `dtypes`."""
        key = (m, dtypes, mode)
        if key in self._calls:
            self._calls.move_to_end(key)
        else:
            while len(self._calls) >= knobs.get("VKMOE_SHAPE_CACHE"):
                self._evict_call(next(iter(self._calls)))
            mem = self.device.memory
            present = [(name, np.dtype(dt)) for name, dt in dtypes if dt is not None]
            sizes = [m * (1 if name == "tokens" else self.H) * dt.itemsize for name, dt in present]
            *ins, ob = mem.allocate_all(sizes + [m * self.H * 4 + 16],
                                        kinds=["upload"] * len(present) + ["readback"])
            bufs = {name: buf for (name, _), buf in zip(present, ins)}
            f32 = {name: dt == np.float32 for name, dt in present}
            rec = CommandRecorder(self.device, timestamps=2)
            rec.begin()
            rec.fill(ob, POISON_F32)
            rec.barrier()
            rec.timestamp()
            residual = (bufs["residual"], f32["residual"]) if "residual" in bufs else None
            sets = self.record_buffers(rec, bufs["x"], f32["x"], bufs.get("tokens"), ob, m, mode, residual,
                                       pin=False)
            rec.timestamp()
            if mode == "persistent":  # the abort word, read with the output (record_buffers ended with a barrier)
                rec.copy(self.moe.status_buffer(m, self.top_k), ob, 4, src_offset=layout.SYNC_ABORT * 4,
                         dst_offset=m * self.H * 4)
            rec.host_barrier()
            rec.end()
            call = RecordedCall(rec, [(bufs[name], dt, (m,) if name == "tokens" else (m, self.H))
                                      for name, dt in present], (ob, _F32, (m, self.H)))
            self._calls[key] = (bufs, ob, call, sets)
        return self._calls[key][2]

    def _evict_call(self, key):
        """Free one __call__ recording; its m's scratch too when no other recording or record() uses it."""
        bufs, ob, call, sets = self._calls.pop(key)
        close_recording(call.rec, sets, (*bufs.values(), ob))
        m = key[0]
        if m not in self._pinned and all(k[0] != m for k in self._calls):
            self._scratch.pop(m).close()
            self.moe.release_shape(m, self.top_k)
            for op in [*(self.shared or {}).values(), *(self.latent or {}).values()]:
                op.release_shape(m)

    def close(self):
        with self._lock:
            self._closed = True
            self._hot.clear()
            self._transfers.close()
            for bufs, ob, call, sets in self._calls.values():
                close_recording(call.rec, sets, (*bufs.values(), ob))
            self._calls.clear()
            for s in self._scratch.values():
                s.close()
            self._scratch.clear()
            if self.gate_gemv is not None:
                self.gate_gemv.close()
            for b in (self.norms or {}).values():
                b.close()
            self._dummy.close()
            self.router.close()
