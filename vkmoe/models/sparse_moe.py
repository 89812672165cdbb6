"""SparseMoeBlock: one decoder layer's whole MoE MLP from an exllamav3-format checkpoint.

    block = SparseMoeBlock.from_checkpoint("model_dir", layer_index=3)      # backend chosen by vkmoe.registry
    y = block(hidden)            # (m, H) fp16/fp32 -> (m, H) float32
    y = block(hidden, input_ids=ids)      # DeepSeek-V4 hash layers (experts from tid2eid[token id])
    y = block(hidden, residual=r)         # Gemma 4 (router and routed experts read the residual stream)

Vulkan backend: the whole block on the device, ONE submission per call (vkmoe.ops.block: router shaders, the
routed experts, shared experts, Gemma 4's RMSNorms, the sum); `block.record(rec, hidden, out)` appends it to a
caller's command buffer. CPU backend: router in numpy (fp32; families in vkmoe.models.routing) -> routed experts
through the registered `exl3_moe_mlp` (+ shared experts through `exl3_linear`, where the architecture has them;
NemotronH's LatentMoE: the routed experts between fc1/fc2_latent_proj, two more `exl3_linear`s).
`block.reference(hidden)` is the same block in float64 with vkmoe.exl3.reference, for tests.
"""
from __future__ import annotations

import re

import numpy as np

from .. import registry
from ..exl3 import Exl3Tensor, load_exl3_tensor
from ..exl3 import reference as ref
from ..ops.host_arrays import FP16_MAX, beyond_fp16
from .checkpoint import Checkpoint
from .config import NORM_ROLES, CheckpointError, MissingTensorError, MoeConfig
from .routing import router_logits, sigmoid_group_topk, softmax_topk, sqrtsp_hash, sqrtsp_topk

# Checked on every call: dtype objects compare faster than a dtype with numpy scalar types (no conversion).
_HIDDEN_DTYPES = tuple(map(np.dtype, (np.float16, np.float32, np.float64)))
_DeviceArray = None


def _device_array_class():
    """vkmoe.ops.device_array.DeviceArray, imported on first use: the numpy path (and the CPU backend) must not need
    the Vulkan layer. Kept after that: a function-level import costs ~0.5 us, and the device path asks on every call."""
    global _DeviceArray
    if _DeviceArray is None:
        from ..ops.device_array import DeviceArray
        _DeviceArray = DeviceArray
    return _DeviceArray


__all__ = ["SparseMoeBlock", "block_reference", "load_block_tensors"]

_PROJS = ("gate", "up", "down")


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _divide_output(t, div):
    """A copy of Exl3Tensor `t` whose output is t's / div (div a power of two: svh / div is exact in fp16
    unless it falls below fp16's normal range, which is refused rather than silently rounded)."""
    svh = (t.svh.astype(np.float32) / np.float32(div)).astype(np.float16)
    if not np.array_equal(svh.astype(np.float32) * np.float32(div), t.svh.astype(np.float32)):
        raise CheckpointError(f"interm_div={div:g}: an up projection's svh has values too small to divide exactly "
                              "in fp16")
    return Exl3Tensor(t.trellis, t.suh, svh, codebook=t.codebook, bias=None if t.bias is None else t.bias / div)


def _rms_norm(x, weight, eps, dtype):
    """x / sqrt(mean(x²) + eps) · weight per row, in `dtype` (exllamav3's RMSNorm without a constant bias)."""
    xf = np.asarray(x).astype(dtype)
    return xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + dtype.type(eps)) * weight.astype(dtype)


class SparseMoeBlock:
    """Router + routed experts (+ shared experts). Construct with from_checkpoint(), or directly from arrays.

    router_weight: (E, H) float array (HF `gate.weight`); e_score_correction_bias: (E,) or None (the selection
    bias of dots/sqrtsp routers); gate/up/down: lists of E Exl3Tensor (gate None for gateless relu2 experts);
    shared: None or {"gate", "up", "down"} Exl3Tensor (one dense MLP; "gate" None when relu2);
    shared_gate_weight: None or (1, H) (Qwen3-Next: the shared output is scaled by sigmoid(x · w));
    tid2eid: None or (vocab, top_k) int table (DeepSeek-V4 hash layers: expert ids by token id);
    per_expert_scale: None or (E,) (Gemma 4); norms: None or {role: (H,) RMSNorm weight} for every role in
    config.NORM_ROLES (Gemma 4); latent: None or {"in": (H x L), "out": (L x H)} Exl3Tensor, NemotronH's LatentMoE
    fc1/fc2_latent_proj (required exactly when config.moe_latent_size is set): the routed experts then run at
    width L on fc1(x) and fc2 brings their routing-weighted sum back to H.
    The router family is config.router_for(layer_index); a hash layer needs `input_ids` at call time. With
    `norms` (Gemma 4) `hidden` is the dense MLP's input and the router and routed experts read the residual
    stream, so the call needs `residual` (m, H) too: out = post_norm(routed(pre_norm(residual))) +
    post_norm(shared(hidden)).
    """

    def __init__(self, config: MoeConfig, router_weight, gate, up, down, e_score_correction_bias=None,
                 shared=None, shared_gate_weight=None, tid2eid=None, per_expert_scale=None, norms=None,
                 latent=None, layer_index=None, device=None, backend=None, dispatch=None):
        self.config = config
        self.layer_index = layer_index
        self.router = config.router_for(layer_index)
        E, H = config.num_experts, config.hidden_size
        w = np.asarray(router_weight)
        if w.shape != (E, H):
            raise CheckpointError(f"router weight: expected shape ({E}, {H}) (num_experts, hidden_size), got {w.shape}")
        self.router_weight = np.ascontiguousarray(w, dtype=np.float32)
        self._router_weight_src = w
        self.e_bias = None
        if e_score_correction_bias is not None and self.router != "sqrtsp_hash":
            b = np.asarray(e_score_correction_bias)
            if b.shape != (E,):
                raise CheckpointError(f"e_score_correction_bias: expected shape ({E},), got {b.shape}")
            self.e_bias = b
        elif config.spec.bias_required:
            raise CheckpointError(f"{config.arch} routing needs e_score_correction_bias")
        self.tid2eid = None
        if self.router == "sqrtsp_hash":
            self.tid2eid = _check_tid2eid(tid2eid, config)
        self.shared_gate_weight = None
        if shared_gate_weight is not None:
            sg = np.asarray(shared_gate_weight)
            if sg.shape != (1, H):
                raise CheckpointError(f"shared_expert_gate: expected shape (1, {H}), got {sg.shape}")
            self.shared_gate_weight = sg
        self.per_expert_scale = None
        if per_expert_scale is not None:
            pes = np.asarray(per_expert_scale)
            if pes.shape != (E,):
                raise CheckpointError(f"per_expert_scale: expected shape ({E},), got {pes.shape}")
            self.per_expert_scale = pes
        self.norms = None
        if norms is not None:
            if set(norms) != set(NORM_ROLES):
                raise CheckpointError(f"norms: expected the roles {', '.join(NORM_ROLES)}, got {', '.join(norms)}")
            for role, wt in norms.items():
                if np.shape(wt) != (H,):
                    raise CheckpointError(f"norms[{role!r}]: expected shape ({H},), got {np.shape(wt)}")
            self.norms = {role: np.asarray(wt) for role, wt in norms.items()}
        # interm_div (Laguna): the routed experts compute u/div (their fp16 products would overflow) and the
        # routing weights carry div back; exact since the down projection is linear and div a power of two.
        self.interm_div = config.interm_div
        if self.interm_div:
            up = [_divide_output(t, self.interm_div) for t in up]
        self.gate, self.up, self.down = gate, up, down
        self.shared = shared
        self.latent = _check_latent(latent, config)
        self.activation = config.activation
        self.act_limit, self.shared_act_limit = config.act_limits_for(layer_index)
        ops = ("exl3_moe_mlp", "exl3_linear") if shared or self.latent else ("exl3_moe_mlp",)
        self.backend = backend or registry.select_backend(device=device, ops=ops)
        kw = {} if dispatch is None else {"dispatch": dispatch}
        self.moe = registry.create("exl3_moe_mlp", gate, up, down, activation=self.activation,
                                   act_limit=self.act_limit, backend=self.backend, device=device, **kw)
        self.shared_ops = None
        if shared:
            self.shared_ops = {p: registry.create("exl3_linear", shared[p], backend=self.backend, device=device)
                               for p in _PROJS if shared.get(p) is not None}
        self.latent_ops = None
        if self.latent:
            self.latent_ops = {r: registry.create("exl3_linear", t, backend=self.backend, device=device)
                               for r, t in self.latent.items()}
        self.device_block = self._device_block() if self.backend == "vulkan" else None
        self._last_run = None
        self._closed = False  # (the device path raises once set: its memory is freed)

    def _device_block(self):
        """The whole block on the routed-expert op's Vulkan device (vkmoe.ops.block): router, routed and shared
        experts, Gemma 4's RMSNorms and the sum in one command buffer."""
        from ..ops.block import DeviceMoeBlock  # the numpy path and the CPU backend must not need the Vulkan layer
        from ..ops.router import DeviceRouter

        c, device = self.config, self.moe.device
        router = DeviceRouter(device, self.router, self._router_weight_src, c.top_k, bias=self.e_bias,
                              per_expert_scale=self.per_expert_scale, tid2eid=self.tid2eid, n_group=c.n_group,
                              topk_group=c.topk_group, norm=c.norm_topk_prob,
                              routed_scaling_factor=c.routed_scaling_factor, op_scale=self.interm_div or 1.0)
        return DeviceMoeBlock(device, router, self.moe, c.top_k, shared=self.shared_ops,
                              shared_gate_weight=self.shared_gate_weight, activation=self.activation,
                              shared_act_limit=self.shared_act_limit, norms=self.norms, eps=c.rms_norm_eps,
                              latent=self.latent_ops)

    # -------------------------------------------------------------------------------------- loading
    @classmethod
    def from_checkpoint(cls, path, layer_index: int, device=None, backend=None, dispatch=None) -> "SparseMoeBlock":
        """Load layer `layer_index`'s MoE block from an exllamav3 model directory (config.json + safetensors)."""
        config = MoeConfig.from_file(path)
        ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
        tensors = load_block_tensors(ckpt, config, layer_index)
        return cls(config, layer_index=layer_index, device=device, backend=backend, dispatch=dispatch, **tensors)

    # -------------------------------------------------------------------------------------- forward
    def _check_hidden(self, hidden):
        h = np.asarray(hidden)
        H = self.config.hidden_size
        if h.ndim != 2 or h.shape[1] != H:
            raise ValueError(f"hidden: expected shape (m, {H}), got {h.shape}")
        if h.dtype not in _HIDDEN_DTYPES:
            raise TypeError(f"hidden: expected float16, float32 or float64, got dtype {h.dtype}")
        return h

    def _check_fp16_range(self, h):
        """hidden where experts take it in float16 (the routed ones, unless Gemma 4's norms feed them; the shared
        ones): float32 / float64 values beyond float16's range became Inf there and the row NaN, without a word.
        Refused, as Exl3Linear refuses such an x. NaN passes (each backend's own rule for it)."""
        takers = [w for w, takes in (("routed", self.norms is None), ("shared", bool(self.shared))) if takes]
        if h.dtype == np.float16 or not takers:
            return
        if beyond_fp16(h):
            raise ValueError(f"hidden: {h.dtype} values beyond float16's range (|hidden| <= {FP16_MAX:g}): the "
                             f"{' and '.join(takers)} experts take hidden in float16")

    def _hash_ids(self, input_ids, m):
        if input_ids is None:
            raise ValueError(f"input_ids: layer {self.layer_index} of {self.config.arch} is a hash-routed layer "
                             f"(layer < num_hash_layers={self.config.num_hash_layers}); call block(hidden, "
                             "input_ids=...) with the (m,) token ids")
        t = np.asarray(input_ids)
        if t.dtype.kind not in "iu":
            raise TypeError(f"input_ids: expected an integer array, got dtype {t.dtype}")
        if t.shape != (m,):
            raise ValueError(f"input_ids: expected shape ({m},) (one token id per hidden row), got {t.shape}")
        V = self.tid2eid.shape[0]
        if m and (t.min() < 0 or t.max() >= V):
            raise ValueError(f"input_ids: expected token ids in [0, {V}) (rows of tid2eid), got "
                             f"[{t.min()}, {t.max()}]")
        return self.tid2eid[t]

    def _residual(self, residual, hidden):
        if residual is None:
            raise ValueError(f"residual: {self.config.arch} routes and feeds its routed experts from the residual "
                             "stream; call block(hidden, residual=...) with the (m, H) pre-norm residual")
        r = np.asarray(residual)
        if r.shape != hidden.shape or r.dtype.kind != "f":
            raise ValueError(f"residual: expected a float array of the hidden's shape {hidden.shape}, got "
                             f"{r.dtype} {r.shape}")
        return r

    def _norm(self, role, x, dtype):
        return _rms_norm(x, self.norms[role], self.config.rms_norm_eps, np.dtype(dtype))

    def _router_input(self, hidden, residual, dt):
        if self.norms is None:
            return hidden
        z = self._norm("router", self._residual(residual, hidden), dt) * dt.type(self.config.hidden_size ** -0.5)
        # exllamav3 hands the router an fp16 input; the float64 reference keeps it exact.
        return z.astype(np.float16) if dt == np.float32 else z

    def _expert_input(self, hidden, residual):
        """fp16 input of the routed experts: hidden, or (Gemma 4) the normed residual."""
        if self.norms is None:
            return np.ascontiguousarray(hidden, dtype=np.float16)
        return self._norm("routed_in", self._residual(residual, hidden), np.float32).astype(np.float16)

    def route(self, hidden, input_ids=None, dtype=np.float32, residual=None):
        """(expert ids int64 (m, top_k), routing weights (m, top_k) in `dtype`), router math in `dtype`."""
        if self._closed:
            raise registry.closed_error(self)
        hidden = self._check_hidden(hidden)  # (a 1-d hidden failed deep in the router: "not enough values to unpack")
        c = self.config
        dt = np.dtype(dtype)
        if dt not in (np.float32, np.float64):
            raise ValueError(f"dtype: the router computes in float32 or float64, got {dt}")
        w = self.router_weight if dt == np.float32 else self._router_weight_src
        logits = router_logits(self._router_input(hidden, residual, dt), w, dt)
        if self.router == "std":
            ids, wts = softmax_topk(logits, c.top_k, c.norm_topk_prob, self.per_expert_scale)
        elif self.router == "dots":
            ids, wts = sigmoid_group_topk(logits, self.e_bias, c.top_k, c.n_group, c.topk_group, c.norm_topk_prob,
                                          c.routed_scaling_factor)
        elif self.router == "sqrtsp":
            ids, wts = sqrtsp_topk(logits, self.e_bias, c.top_k, c.routed_scaling_factor)
        else:
            ids, wts = sqrtsp_hash(logits, self._hash_ids(input_ids, logits.shape[0]), c.routed_scaling_factor)
        return ids, wts.astype(dt)

    def __call__(self, hidden, input_ids=None, residual=None, out=None):
        """hidden (m, H) float16/float32 -> (m, H) float32. input_ids: the token ids (hash-routed layers);
        residual: Gemma 4's residual stream. With the vulkan backend hidden (and input_ids, residual) may be
        DeviceArrays, and out "device" (return a new DeviceArray) or a DeviceArray to fill; the whole block runs
        on the device in ONE submission (vkmoe.ops.block). The CPU backend: numpy in and out."""
        if self.device_block is not None:
            return self._device_call(hidden, input_ids, out, residual)
        if self._closed:  # (the CPU backend's ops hold no device memory, but a closed block is closed everywhere)
            raise registry.closed_error(self)
        self._refuse_device_arrays(hidden, out)
        h = self._check_hidden(hidden)
        m = h.shape[0]
        if m == 0:
            return np.zeros((0, self.config.hidden_size), np.float32)
        self._check_fp16_range(h)
        ids, wts = self.route(h, input_ids, residual=residual)
        finite = np.isfinite(wts).all(axis=1)
        if not finite.all():  # (else the routed op would name expert_weights, which the caller never passed)
            raise ValueError(f"hidden: token {int(np.flatnonzero(~finite)[0])}'s routing weights are not finite (a "
                             f"NaN or Inf in its hidden values or the router's weights); the {self.backend} backend "
                             "refuses them (the vulkan backend returns that token's row as NaN)")
        x16 = np.ascontiguousarray(h, dtype=np.float16)
        xe = self._expert_input(h, residual)
        if self.latent_ops:  # LatentMoE: fc1's fp16 output feeds the experts, as exllamav3's latent_in hands on
            xe = self.latent_ops["in"](xe)
        out = np.asarray(self.moe(xe, ids, self._op_weights(wts).astype(np.float32)), dtype=np.float32)
        if self.latent_ops:
            # exllamav3 rounds the fp32 routed sum to fp16 for fc2 (latent_out), which writes fp32; vkmoe's
            # linear writes fp16: one more rounding (2^-11 relative), well inside the block's tolerance.
            out = self.latent_ops["out"](out.astype(np.float16)).astype(np.float32)
        if self.norms is not None:
            out = self._norm("routed_out", out, np.float32)
        if self.shared_ops:
            ops = self.shared_ops
            u = ops["up"](x16).astype(np.float32)
            g = ops["gate"](x16).astype(np.float32) if "gate" in ops else None
            # fp16 between the linears, as exllamav3's GatedMLP hands its intermediate on; the reference's
            # activation (act_limit convention of spec 8.6 included) so block and reference cannot drift apart.
            p = ref._activate(g, u, self.activation, self.shared_act_limit).astype(np.float16)
            s = ops["down"](p).astype(np.float32)
            if self.shared_gate_weight is not None:
                s = s * _sigmoid(router_logits(x16, self.shared_gate_weight, np.float32))
            if self.norms is not None:
                s = self._norm("shared_out", s, np.float32)
            out = out + s
        return out

    def _refuse_device_arrays(self, hidden, out):
        """The host path (CPU backend) takes and returns numpy only."""
        what = "out" if out is not None else None
        if what is None and not isinstance(hidden, np.ndarray):
            what = "a DeviceArray hidden" if isinstance(hidden, _device_array_class()) else None
        if what is not None:
            raise ValueError(f"{what} needs the vulkan backend; this block runs on {self.backend!r}")

    def _device_call(self, hidden, input_ids, out, residual):
        if self._closed:
            raise registry.closed_error(self)
        DeviceArray = _device_array_class()
        if not isinstance(hidden, DeviceArray):
            hidden = self._check_hidden(hidden)
            self._check_fp16_range(hidden)
            if hidden.dtype == np.float64:
                hidden = hidden.astype(np.float32)  # the host router's precision
        tokens = self._device_tokens(input_ids, hidden.shape[0])
        if self.norms is not None and not isinstance(residual, DeviceArray):
            residual = self._residual(residual, hidden)
            if residual.dtype not in (np.float16, np.float32):
                residual = residual.astype(np.float32)  # the host norms' precision
        block = self.device_block
        result = block(hidden, tokens, out, residual if self.norms is not None else None)
        # made when last_run is read: its GPU time is a driver call a runtime rarely wants (vkmoe.vk.GpuTime)
        mode, gpu_time = block.last_mode, block.last_gpu_time
        self._last_run = lambda: {"mode": mode, "where": "device (router, experts, sum)", "gpu_ms": gpu_time.ms}
        return result

    def _device_tokens(self, input_ids, m):
        """input_ids as the device router takes them: None (not a hash layer), a DeviceArray (m,) int32 (ids
        outside the table route nowhere: ids -1, weight 0) or checked numpy int32."""
        if self.router != "sqrtsp_hash":
            return None
        if isinstance(input_ids, _device_array_class()):
            return input_ids
        self._hash_ids(input_ids, m)  # the checks, with their messages
        return np.ascontiguousarray(input_ids, dtype=np.int32)

    def record(self, rec, hidden, out, input_ids=None, residual=None):
        """Append the whole block to a recording vkmoe CommandRecorder: hidden (m, H) float16/float32 and out
        (m, H) float32 DeviceArrays of this block's device, input_ids an (m,) int32 DeviceArray for a hash
        layer, residual an (m, H) float16/float32 DeviceArray for Gemma 4. Ends with a barrier, so the next block
        may read `out`. Returns the descriptor sets the commands use (free them when the recording is dropped)."""
        DeviceArray = _device_array_class()
        if self._closed:
            raise registry.closed_error(self)
        if self.device_block is None:
            raise ValueError(f"record() needs the whole block on a Vulkan device; it runs on {self.backend!r}")
        from ..ops.record_args import check_recorder
        check_recorder(self.device_block.device, rec, "rec")
        named = [("hidden", hidden), ("out", out)] + ([("residual", residual)] if self.norms is not None else [])
        for name, arr in named:
            if not isinstance(arr, DeviceArray):
                raise TypeError(f"{name}: expected a vkmoe DeviceArray, got {type(arr).__name__}")
        if self.router == "sqrtsp_hash" and not isinstance(input_ids, DeviceArray):
            raise TypeError(f"input_ids: layer {self.layer_index} is hash-routed; record() needs the (m,) int32 "
                            f"token ids as a DeviceArray, got {type(input_ids).__name__}")
        return self.device_block.record(rec, hidden, out, input_ids if self.router == "sqrtsp_hash" else None,
                                        residual=residual if self.norms is not None else None)

    def close(self):
        """Free the block's device objects (the routed and shared expert ops included)."""
        self._closed = True
        if self.device_block is not None:
            self.device_block.close()
        for op in [self.moe, *(self.shared_ops or {}).values(), *(self.latent_ops or {}).values()]:
            if hasattr(op, "close"):
                op.close()

    def _op_weights(self, wts):
        """Routing weights as the routed-expert op takes them (times interm_div where the ups are divided)."""
        return wts * wts.dtype.type(self.interm_div) if self.interm_div else wts

    @property
    def last_run(self):
        """How the last call ran: the routed-expert op's report (CPU backend), or for the device block {"mode": the
        routed experts' split / persistent, "where", "gpu_ms": the whole block's GPU time}."""
        if self.device_block is None:
            return getattr(self.moe, "last_run", None)
        report = self._last_run
        if callable(report):
            report = self._last_run = report()
        return report

    def reference(self, hidden, routing=None, input_ids=None, residual=None) -> np.ndarray:
        """The whole block in float64 (router included) with vkmoe.exl3.reference; (m, H) float64."""
        return block_reference(self, hidden, routing, input_ids, residual)

    def __repr__(self):
        c = self.config
        latent = f", latent={c.moe_latent_size}" if self.latent else ""
        return (f"SparseMoeBlock({c.arch}, layer={self.layer_index}, router={self.router}, H={c.hidden_size}{latent}, "
                f"I={c.moe_intermediate_size}, E={c.num_experts}, top_k={c.top_k}, "
                f"shared={c.shared_intermediate_size if self.shared else 0}, backend={self.backend!r})")


def _check_tid2eid(tid2eid, config):
    if tid2eid is None:
        raise CheckpointError(f"{config.arch} hash layer needs the tid2eid table (token id -> expert ids)")
    t = np.asarray(tid2eid)
    if t.dtype.kind not in "iu" or t.ndim != 2 or t.shape[1] != config.top_k:
        raise CheckpointError(f"tid2eid: expected an integer table (vocab_size, num_experts_per_tok="
                              f"{config.top_k}), got {t.dtype} {t.shape}")
    if t.size and (t.min() < 0 or t.max() >= config.num_experts):
        raise CheckpointError(f"tid2eid: expert ids must be in [0, {config.num_experts}), got "
                              f"[{t.min()}, {t.max()}]")
    return t.astype(np.int64)


def _check_latent(latent, config):
    """{"in", "out"} Exl3Tensors of a LatentMoE block (shapes H x L and L x H), or None; present exactly when
    the config has moe_latent_size."""
    H, L = config.hidden_size, config.moe_latent_size
    if not L:
        if latent is not None:
            raise CheckpointError(f"latent: {config.arch} config has no moe_latent_size, so the block takes no "
                                  "latent projections")
        return None
    if not isinstance(latent, dict) or set(latent) != {"in", "out"}:
        raise CheckpointError(f"latent: moe_latent_size={L} needs {{'in': fc1_latent_proj, 'out': "
                              f"fc2_latent_proj}} Exl3Tensors, got {latent!r:.80}")
    for role, (k, n) in (("in", (H, L)), ("out", (L, H))):
        t = latent[role]
        if not isinstance(t, Exl3Tensor) or (t.k, t.n) != (k, n):
            got = f"{t.k}x{t.n}" if isinstance(t, Exl3Tensor) else type(t).__name__
            raise CheckpointError(f"latent[{role!r}]: expected an Exl3Tensor of {k}x{n} (in x out: hidden_size={H}, "
                                  f"moe_latent_size={L}), got {got}")
    return dict(latent)


def block_reference(block: SparseMoeBlock, hidden, routing=None, input_ids=None, residual=None) -> np.ndarray:
    """float64 version of `block(hidden, input_ids)`: float64 router (unless `routing` = (ids, weights) is
    given), experts on the fp16-rounded hidden (what the block feeds its experts) through
    vkmoe.exl3.reference, no fp16 intermediates."""
    h = block._check_hidden(hidden)
    f64 = np.dtype(np.float64)
    if routing is None:
        r64 = None if residual is None else np.asarray(residual, np.float64)
        routing = block.route(h.astype(np.float64), input_ids, dtype=f64, residual=r64)
    ids, wts = routing
    x = h.astype(np.float16).astype(np.float64)
    xe = block._expert_input(h, residual).astype(np.float64)  # the experts' fp16 input, as the block feeds them
    if block.latent:
        xe = ref.linear_forward(xe, block.latent["in"], np.float64)
    out = ref.moe_forward(xe, ids, block._op_weights(np.asarray(wts, np.float64)), block.gate, block.up, block.down,
                          activation=block.activation, act_limit=block.act_limit, dtype=np.float64)
    if block.latent:
        out = ref.linear_forward(out, block.latent["out"], np.float64)
    if block.norms is not None:
        out = block._norm("routed_out", out, f64)
    if block.shared:
        s = block.shared
        u = ref.linear_forward(x, s["up"], np.float64)
        g = ref.linear_forward(x, s["gate"], np.float64) if s.get("gate") is not None else None
        a = ref._activate(g, u, block.activation, block.shared_act_limit)
        y = ref.linear_forward(a, s["down"], np.float64)
        if block.shared_gate_weight is not None:
            y = y * _sigmoid(router_logits(x, block.shared_gate_weight, np.float64))
        if block.norms is not None:
            y = block._norm("shared_out", y, f64)
        out = out + y
    return out


# ----------------------------------------------------------------------------------------- checkpoint
def _load_linear(src, key, k, n, path, why):
    try:
        t = load_exl3_tensor(src, key)
    except KeyError as exc:
        msg = exc.args[0] if exc.args else str(exc)
        raise MissingTensorError(f"{path}: {msg} ({why})") from None
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: {key}: {exc}") from None
    if (t.k, t.n) != (k, n):
        raise CheckpointError(f"{path}: {key}: shape {t.k}x{t.n} (in x out) does not match config.json, "
                              f"which implies {k}x{n} ({why})")
    return t


def load_block_tensors(ckpt: Checkpoint, config: MoeConfig, layer_index: int) -> dict:
    """The arrays and Exl3Tensors of layer `layer_index`'s MoE block, checked against `config`."""
    if isinstance(layer_index, bool) or not isinstance(layer_index, (int, np.integer)):
        raise TypeError(f"layer_index: expected an integer, got {type(layer_index).__name__} {layer_index!r}")
    path, spec = ckpt.path, config.spec
    L = config.num_hidden_layers
    if layer_index < 0 or (L and layer_index >= L):
        raise CheckpointError(f"{path}: layer_index={layer_index} out of range (num_hidden_layers={L})")
    if not config.is_moe_layer(layer_index):
        raise CheckpointError(f"{path}: layer {layer_index} is a dense MLP layer in {config.arch} "
                              f"(first_k_dense_replace / mlp_only_layers / sparse step / pattern), not a MoE block")
    E, H, I, W = config.num_experts, config.hidden_size, config.moe_intermediate_size, config.expert_size
    p = spec.prefix.format(layer=layer_index)
    if spec.alt_prefix and f"{p}.{spec.router_key}" not in ckpt:  # an older key style of the same tensors
        alt = spec.alt_prefix.format(layer=layer_index)
        p = alt if f"{alt}.{spec.router_key}" in ckpt else p
    src = ckpt.subset(p + ".")

    def plain(key, shape, why, kind="f"):
        if key not in src:
            raise MissingTensorError(f"{path}: tensor {key} not found ({why})")
        arr = src[key]
        if arr.shape != shape:
            raise CheckpointError(f"{path}: {key}: shape {arr.shape} does not match config.json, which implies "
                                  f"{shape} ({why})")
        if arr.dtype.kind not in kind:
            raise CheckpointError(f"{path}: {key}: expected a {'float' if kind == 'f' else 'integer'} tensor, "
                                  f"got {arr.dtype}")
        return arr

    # Expert count first: a wrong num_experts also breaks the router's shape, but this names the real cause.
    pat = re.compile(re.escape(p) + r"\.experts\.(\d+)\.")
    stored = {int(mt.group(1)) for k in src.keys() for mt in [pat.match(k)] if mt}
    extra = sorted(e for e in stored if e >= E)
    ek = spec.experts_key
    stacked = sorted(k for k in src.keys() if k.startswith(f"{p}.experts.gate_up_proj"))
    if stacked and not stored:  # exllamav3 quantizes each expert's slice of it under experts.<e>.*
        raise CheckpointError(f"{path}: {stacked[0]} is a stacked expert tensor, the unquantized Hugging Face "
                              f"layout; an EXL3 checkpoint holds {p}.experts.<e>.{spec.expert_keys[1]}.trellis etc.")
    if extra:
        raise CheckpointError(f"{path}: {p}.experts.{extra[0]}.* exists but config.json says {ek}={E} "
                              f"(the checkpoint holds {max(stored) + 1} experts in layer {layer_index})")
    if stored and max(stored) + 1 < E:
        first = next(k for k in spec.expert_keys if k)
        raise MissingTensorError(f"{path}: {p}.experts.{max(stored) + 1}.{first}.trellis not found: config.json "
                                 f"says {ek}={E} but layer {layer_index} holds experts 0..{max(stored)}")
    out = {"router_weight": plain(f"{p}.{spec.router_key}", (E, H), f"router, {ek}={E}, hidden_size={H}")}
    if spec.per_expert_scale_key:
        out["per_expert_scale"] = plain(f"{p}.{spec.per_expert_scale_key}", (E,), f"router, {ek}={E}")
    if spec.norm_keys:
        out["norms"] = {role: plain(f"{p}.{key}", (H,), f"{role} RMSNorm weight, hidden_size={H}")
                        for role, key in spec.norm_keys}
    router = config.router_for(layer_index)
    if router == "sqrtsp_hash":
        V = config.vocab_size
        out["tid2eid"] = plain(f"{p}.gate.tid2eid", (V, config.top_k), f"hash layer {layer_index} < num_hash_layers="
                               f"{config.num_hash_layers}: vocab_size={V} x num_experts_per_tok={config.top_k}",
                               kind="iu")
    elif spec.bias_keys and (config.use_bias is not False or spec.bias_required):
        found = [k for k in spec.bias_keys if f"{p}.{k}" in src]
        if found:
            out["e_score_correction_bias"] = plain(f"{p}.{found[0]}", (E,), f"{router} selection bias, {ek}={E}")
        elif spec.bias_required or config.use_bias:
            raise MissingTensorError(f"{path}: tensor {p}.{spec.bias_keys[0]} not found ({config.arch} "
                                     f"{router} selection bias, {ek}={E}"
                                     + (f", {spec.bias_flag}=true)" if config.use_bias else ")"))
    shapes = {"gate": (W, I), "up": (W, I), "down": (I, W)}  # W: the latent width in a LatentMoE
    if config.moe_latent_size:
        out["latent"] = _load_latent(src, p, config, path)
    for proj, name in zip(_PROJS, spec.expert_keys):
        out[proj] = None if name is None else [
            _load_linear(src, f"{p}.experts.{e}.{name}", *shapes[proj], path, f"expert {e} of {ek}={E}")
            for e in range(E)]
    if config.shared_intermediate_size:
        out["shared"] = _load_shared(ckpt, src, p, config, layer_index)
        if spec.shared_gate:
            out["shared_gate_weight"] = plain(f"{p}.shared_expert_gate.weight", (1, H),
                                              f"sigmoid gate of the shared expert, hidden_size={H}")
    return out


def _load_shared(ckpt, src, p, config, layer_index):
    """The shared expert's {"gate", "up", "down"} Exl3Tensors ("gate" None when gateless), at the hidden size."""
    spec, H, Is = config.spec, config.hidden_size, config.shared_intermediate_size
    sshape = {"gate": (H, Is), "up": (H, Is), "down": (Is, H)}
    why = f"shared expert, intermediate {Is} from {spec.shared}"
    sp = spec.shared_key_prefix(layer_index, p)
    ssrc = src if sp.startswith(p + ".") else ckpt.subset(sp + ".")
    return {proj: None if name is None else _load_linear(ssrc, f"{sp}.{name}", *sshape[proj], ckpt.path, why)
            for proj, name in zip(_PROJS, spec.shared_keys)}


def _load_latent(src, p, config, path):
    """NemotronH LatentMoE's projections: EXL3 linears in exllamav3 checkpoints (its BlockSparseMLP builds them
    as quantized Linear layers, like the experts), fc1 H -> L before the routed experts, fc2 L -> H after."""
    H, L = config.hidden_size, config.moe_latent_size
    why = f"LatentMoE projection, hidden_size={H}, {config.spec.latent_key}={L}"
    return {"in": _load_linear(src, f"{p}.fc1_latent_proj", H, L, path, why),
            "out": _load_linear(src, f"{p}.fc2_latent_proj", L, H, path, why)}
