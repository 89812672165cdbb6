"""SparseMoeBlock: one decoder layer's whole MoE MLP from an exllamav3-format checkpoint.

    block = SparseMoeBlock.from_checkpoint("model_dir", layer_index=3)      # backend chosen by vkmoe.registry
    y = block(hidden)            # (m, H) fp16/fp32 -> (m, H) float32

router (numpy, fp32) -> routed experts through the registered `exl3_moe_mlp` (+ shared experts through
`exl3_linear`, where the architecture has them). `block.reference(hidden)` is the same block in float64 with
vkmoe.exl3.reference, for tests.
"""
from __future__ import annotations

import math
import re

import numpy as np

from .. import registry
from ..exl3 import load_exl3_tensor
from ..exl3 import reference as ref
from .checkpoint import Checkpoint
from .config import CheckpointError, MissingTensorError, MoeConfig
from .routing import router_logits, sigmoid_group_topk, softmax_topk

__all__ = ["SparseMoeBlock", "block_reference", "load_block_tensors"]

_PROJS = ("gate", "up", "down")


def _activate(g, u, activation):
    """a(g)·u for the shared-expert MLP on the host, in the arrays' dtype."""
    if activation == "relu2":
        return np.square(np.maximum(u, 0))
    if activation == "silu":
        a = g / (1 + np.exp(-g))
    elif activation == "gelu":
        a = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
    elif activation == "gelu_erf":
        a = 0.5 * g * (1 + np.frompyfunc(math.erf, 1, 1)(g / math.sqrt(2)).astype(g.dtype))
    else:
        raise ValueError(f"activation {activation!r} is not supported for shared experts")
    return a * u


class SparseMoeBlock:
    """Router + routed experts (+ shared experts). Construct with from_checkpoint(), or directly from arrays.

    router_weight: (E, H) float array (HF `mlp.gate.weight`); e_score_correction_bias: (E,) or None;
    gate/up/down: lists of E Exl3Tensor; shared: None or {"gate", "up", "down"} Exl3Tensor (one dense MLP).
    """

    def __init__(self, config: MoeConfig, router_weight, gate, up, down, e_score_correction_bias=None,
                 shared=None, layer_index=None, device=None, backend=None, dispatch=None):
        self.config = config
        self.layer_index = layer_index
        E, H = config.num_experts, config.hidden_size
        w = np.asarray(router_weight)
        if w.shape != (E, H):
            raise CheckpointError(f"router weight: expected shape ({E}, {H}) (num_experts, hidden_size), got {w.shape}")
        self.router_weight = np.ascontiguousarray(w, dtype=np.float32)
        self._router_weight_src = w
        if config.arch == "deepseek_v3":
            if e_score_correction_bias is None:
                raise CheckpointError("deepseek_v3 routing needs e_score_correction_bias")
            b = np.asarray(e_score_correction_bias)
            if b.shape != (E,):
                raise CheckpointError(f"e_score_correction_bias: expected shape ({E},), got {b.shape}")
            self.e_bias = b
        else:
            self.e_bias = None
        self.gate, self.up, self.down = gate, up, down
        self.shared = shared
        self.activation = config.activation
        ops = ("exl3_moe_mlp", "exl3_linear") if shared else ("exl3_moe_mlp",)
        self.backend = backend or registry.select_backend(device=device, ops=ops)
        kw = {} if dispatch is None else {"dispatch": dispatch}
        self.moe = registry.create("exl3_moe_mlp", gate, up, down, activation=self.activation, act_limit=0.0,
                                   backend=self.backend, device=device, **kw)
        self.shared_ops = None
        if shared:
            self.shared_ops = {p: registry.create("exl3_linear", shared[p], backend=self.backend, device=device)
                               for p in _PROJS if shared.get(p) is not None}

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
        if h.dtype not in (np.float16, np.float32):
            raise TypeError(f"hidden: expected float16 or float32, got dtype {h.dtype}")
        return h

    def route(self, hidden, dtype=np.float32):
        """(expert ids int64 (m, top_k), routing weights (m, top_k) in `dtype`), router math in `dtype`."""
        c = self.config
        dt = np.dtype(dtype)
        w = self.router_weight if dt == np.float32 else self._router_weight_src
        logits = router_logits(hidden, w, dt)
        if c.arch == "qwen3_moe":
            ids, wts = softmax_topk(logits, c.top_k, c.norm_topk_prob)
        else:
            ids, wts = sigmoid_group_topk(logits, self.e_bias, c.top_k, c.n_group, c.topk_group, c.norm_topk_prob,
                                          c.routed_scaling_factor)
        return ids, wts.astype(dt)

    def __call__(self, hidden, out=None):
        """hidden (m, H) float16/float32 -> (m, H) float32. With the vulkan backend hidden may be a DeviceArray,
        and out "device" (return a new DeviceArray) or a DeviceArray to fill. The router and the shared experts'
        activation still run on the host (issue 18 item 3 moves them): a DeviceArray hidden is fetched for them
        (the routed experts read a float16 one on the device), and with shared experts the sum is uploaded."""
        x_dev = target = None
        if out is not None or not isinstance(hidden, np.ndarray):
            # Imported only here: the numpy path (and the CPU backend) must not need the Vulkan layer.
            from ..ops.device_array import DeviceArray, resolve_out
        if not isinstance(hidden, np.ndarray) and isinstance(hidden, DeviceArray):
            hidden.check("hidden", self._vulkan_device("a DeviceArray hidden"), (None, self.config.hidden_size),
                         hidden.dtype)
            x_dev = hidden if hidden.dtype == np.float16 else None
            hidden = hidden.numpy()
        h = self._check_hidden(hidden)
        m = h.shape[0]
        if out is not None:
            target = resolve_out(out, self._vulkan_device("out"), (m, self.config.hidden_size), np.float32)
        if m == 0:
            return np.zeros((0, self.config.hidden_size), np.float32) if target is None else target
        ids, wts = self.route(h)
        x16 = np.ascontiguousarray(h, dtype=np.float16)
        experts_in = x16 if x_dev is None else x_dev
        if target is not None and not self.shared_ops:
            return self.moe(experts_in, ids, wts.astype(np.float32), out=target)
        out = np.asarray(self.moe(experts_in, ids, wts.astype(np.float32)), dtype=np.float32)
        if self.shared_ops:
            ops = self.shared_ops
            u = ops["up"](x16).astype(np.float32)
            g = ops["gate"](x16).astype(np.float32) if "gate" in ops else None
            # fp16 between the linears, as exllamav3's GatedMLP hands its intermediate on.
            p = _activate(g, u, self.activation).astype(np.float16)
            out = out + ops["down"](p).astype(np.float32)
        if target is not None:
            target.buffer.upload(out)
            return target
        return out

    def _vulkan_device(self, what):
        """The device of the routed-expert op, which DeviceArrays must live on."""
        device = getattr(self.moe, "device", None)
        if self.backend != "vulkan" or device is None:
            raise ValueError(f"{what} needs the vulkan backend; this block runs on {self.backend!r}")
        return device

    @property
    def last_run(self):
        return getattr(self.moe, "last_run", None)

    def reference(self, hidden, routing=None) -> np.ndarray:
        """The whole block in float64 (router included) with vkmoe.exl3.reference; (m, H) float64."""
        return block_reference(self, hidden, routing)

    def __repr__(self):
        c = self.config
        return (f"SparseMoeBlock({c.arch}, layer={self.layer_index}, H={c.hidden_size}, I={c.moe_intermediate_size}, "
                f"E={c.num_experts}, top_k={c.top_k}, shared={c.n_shared_experts if self.shared else 0}, "
                f"backend={self.backend!r})")


def block_reference(block: SparseMoeBlock, hidden, routing=None) -> np.ndarray:
    """float64 version of `block(hidden)`: float64 router (unless `routing` = (ids, weights) is given), experts
    on the fp16-rounded hidden (what the block feeds its experts) through vkmoe.exl3.reference, no fp16
    intermediates."""
    h = block._check_hidden(hidden)
    ids, wts = routing if routing is not None else block.route(h.astype(np.float64), dtype=np.float64)
    x = h.astype(np.float16).astype(np.float64)
    out = ref.moe_forward(x, ids, np.asarray(wts, np.float64), block.gate, block.up, block.down,
                          activation=block.activation, act_limit=0.0, dtype=np.float64)
    if block.shared:
        s = block.shared
        u = ref.linear_forward(x, s["up"], np.float64)
        g = ref.linear_forward(x, s["gate"], np.float64) if s.get("gate") is not None else None
        out = out + ref.linear_forward(_activate(g, u, block.activation), s["down"], np.float64)
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
    path = ckpt.path
    L = config.num_hidden_layers
    if layer_index < 0 or (L and layer_index >= L):
        raise CheckpointError(f"{path}: layer_index={layer_index} out of range (num_hidden_layers={L})")
    if not config.is_moe_layer(layer_index):
        raise CheckpointError(f"{path}: layer {layer_index} is a dense MLP layer in {config.arch} "
                              f"(first_k_dense_replace / mlp_only_layers / sparse step), not a MoE block")
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    p = f"model.layers.{layer_index}.mlp"
    src = ckpt.subset(p + ".")

    def plain(key, shape, why):
        if key not in src:
            raise MissingTensorError(f"{path}: tensor {key} not found ({why})")
        arr = src[key]
        if arr.shape != shape:
            raise CheckpointError(f"{path}: {key}: shape {arr.shape} does not match config.json, which implies "
                                  f"{shape} ({why})")
        if arr.dtype.kind != "f":
            raise CheckpointError(f"{path}: {key}: expected a float tensor, got {arr.dtype}")
        return arr

    # Expert count first: a wrong num_experts also breaks the router's shape, but this names the real cause.
    pat = re.compile(re.escape(p) + r"\.experts\.(\d+)\.")
    stored = {int(mt.group(1)) for k in src.keys() for mt in [pat.match(k)] if mt}
    extra = sorted(e for e in stored if e >= E)
    if extra:
        raise CheckpointError(f"{path}: {p}.experts.{extra[0]}.* exists but config.json says num_experts={E} "
                              f"(the checkpoint holds {max(stored) + 1} experts in layer {layer_index})")
    if stored and max(stored) + 1 < E:
        raise MissingTensorError(f"{path}: {p}.experts.{max(stored) + 1}.gate_proj.trellis not found: config.json "
                                 f"says num_experts={E} but layer {layer_index} holds experts 0..{max(stored)}")
    out = {"router_weight": plain(f"{p}.gate.weight", (E, H), f"router, num_experts={E}, hidden_size={H}")}
    if config.arch == "deepseek_v3":
        out["e_score_correction_bias"] = plain(f"{p}.gate.e_score_correction_bias", (E,),
                                               f"deepseek_v3 selection bias, n_routed_experts={E}")
    shapes = {"gate": (H, I), "up": (H, I), "down": (I, H)}
    for proj in _PROJS:
        out[proj] = [_load_linear(src, f"{p}.experts.{e}.{proj}_proj", *shapes[proj], path,
                                  f"expert {e} of num_experts={E}") for e in range(E)]
    if config.n_shared_experts:
        Is = config.shared_intermediate_size
        sshape = {"gate": (H, Is), "up": (H, Is), "down": (Is, H)}
        out["shared"] = {proj: _load_linear(src, f"{p}.shared_experts.{proj}_proj", *sshape[proj], path,
                                            f"shared experts, n_shared_experts={config.n_shared_experts} x "
                                            f"moe_intermediate_size={I}") for proj in _PROJS}
    return out
