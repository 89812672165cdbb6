"""numpy reference of the EXL3 linear and the fused MoE MLP (spec sections 2, 5, 6, 8).

Two references:
* `moe_forward` / `linear_forward`: the mathematical definition in float64 (or float32) with no fp16 rounding of
  intermediates; this is what the golden `ref_out` arrays hold.
* `moe_forward_fp16`: an emulation of the GPU pipeline (spec 8.6/8.9) with fp16 intermediates, an ideal
  (exact-sum, then RN16) GEMM, and the slot-ordered fp32 output sum the Vulkan op uses.
"""
from __future__ import annotations

import math

import numpy as np

from .. import layout
from .tensor import Exl3Tensor

__all__ = [
    "ACTIVATIONS",
    "HAD_SCALE_F32",
    "hadamard128",
    "had_in",
    "had_out",
    "had_out_f32",
    "linear_forward",
    "moe_forward",
    "moe_forward_fp16",
    "validate_moe_args",
    "validate_moe_layer",
]

ACTIVATIONS = tuple(layout.ACTIVATIONS)
#: fp32(1/sqrt(128)) = 0x3DB504F3, the scale every EXL3 Hadamard applies after the butterflies.
HAD_SCALE_F32 = np.float32(0.088388347648)
_GELU_K = 0.797884560803
_f16 = np.float16
_f32 = np.float32


def hadamard128(x, scale: bool = True) -> np.ndarray:
    """Unnormalised Sylvester H128 per 128-block of the last axis, then × r (if `scale`).

    float32 input: the exact fp32 butterfly order of spec 5 (w = 1, 2, ..., 64; pairs (i, i+w)), then one fp32
    multiply by fp32(1/sqrt(128)) — bit-exact with the GPU. float64 input: same order in float64 and the float64
    1/sqrt(128). Other dtypes are computed in float64.
    """
    v = np.asarray(x)
    if v.dtype not in (np.float32, np.float64):
        v = v.astype(np.float64)
    if v.shape[-1] % 128 != 0:
        raise ValueError(f"x: last dimension must be a multiple of 128, got {v.shape[-1]}")
    lead = v.shape[:-1]
    nb = v.shape[-1] // 128
    v = v.reshape(-1, nb, 128)
    w = 1
    while w < 128:
        blocks = v.reshape(v.shape[0], nb, 128 // (2 * w), 2, w)
        a, b = blocks[:, :, :, 0, :], blocks[:, :, :, 1, :]
        v = np.stack((a + b, a - b), axis=3).reshape(v.shape[0], nb, 128)
        w *= 2
    if scale:
        r = HAD_SCALE_F32 if v.dtype == np.float32 else np.float64(1.0 / math.sqrt(128.0))
        v = v * r
    return v.reshape(*lead, nb * 128)


def had_in(x16, s16) -> np.ndarray:
    """GPU input transform: RN16(x·s) -> FWHT in fp32 -> RN16(q·r). float16 out."""
    p = (np.asarray(x16, _f16).astype(_f32) * np.asarray(s16, _f16).astype(_f32)).astype(_f16)
    return hadamard128(p.astype(_f32)).astype(_f16)


def had_out(x16, s16) -> np.ndarray:
    """GPU output transform from fp16: FWHT in fp32 -> RN16(RN16(q·r)·s). float16 out."""
    q = hadamard128(np.asarray(x16, _f16).astype(_f32)).astype(_f16)
    return (q.astype(_f32) * np.asarray(s16, _f16).astype(_f32)).astype(_f16)


def had_out_f32(acc32, s16) -> np.ndarray:
    """GPU output transform from fp32 accumulators to fp32: fp32(fp32(q·r)·s)."""
    return hadamard128(np.asarray(acc32, _f32)) * np.asarray(s16, _f16).astype(_f32)


def _decoded(tensor: Exl3Tensor, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    return tensor.cached(("w", dt.str), lambda t: t.dequantize().astype(dt))


def linear_forward(x, tensor: Exl3Tensor, dtype=np.float64) -> np.ndarray:
    """y = ((x ⊙ suh)·Hk·Ŵ)·Hn ⊙ svh + bias, computed in `dtype` (spec 2/6); x (m, k) -> (m, n)."""
    if not isinstance(tensor, Exl3Tensor):
        raise TypeError(f"tensor: expected Exl3Tensor, got {type(tensor).__name__}")
    dt = np.dtype(dtype)
    xa = np.asarray(x)
    if xa.ndim != 2 or xa.shape[1] != tensor.k:
        raise ValueError(f"x: expected shape (m, {tensor.k}), got {xa.shape}")
    xs = xa.astype(dt) * tensor.suh.astype(dt)
    acc = hadamard128(xs) @ _decoded(tensor, dt)
    y = hadamard128(acc.astype(dt, copy=False)) * tensor.svh.astype(dt)
    if tensor.bias is not None:
        y = y + tensor.bias.astype(dt)
    return y


def _erf(x: np.ndarray) -> np.ndarray:
    return np.frompyfunc(math.erf, 1, 1)(x).astype(x.dtype)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _activate(g, u, activation: str, limit: float):
    """Gated product a(g)·u in the array's dtype; `limit` 0 = no clamp (spec 8.6 / golden README)."""
    one = u.dtype.type(1)
    if activation == "swiglu_oai":
        if limit:
            g = np.minimum(g, limit)
            u = np.clip(u, -limit, limit)
        return (u + one) * g * _sigmoid(u.dtype.type(1.702) * g)
    if activation == "silu":
        a = g * _sigmoid(g)
    elif activation == "gelu":
        a = u.dtype.type(0.5) * g * (one + np.tanh(u.dtype.type(_GELU_K) * (g + u.dtype.type(0.044715) * g * g * g)))
    elif activation == "gelu_erf":
        a = u.dtype.type(0.5) * g * (one + _erf(g / u.dtype.type(math.sqrt(2.0))))
    else:  # relu2, gateless
        a = np.maximum(u, 0)
    if limit:
        a = np.minimum(a, limit)
        u = np.clip(u, -limit, limit)
    return a * u


def validate_moe_layer(gate, up, down, activation, act_limit):
    """The layer's checks of every MoE implementation (expert lists, activation, act_limit); returns (E, H, I)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if (activation == "relu2") != (gate is None):
        raise ValueError("gate: must be None exactly when activation is 'relu2' (gateless); "
                         f"got activation={activation!r} with gate={'None' if gate is None else 'a list'}")
    for name, lst in (("up", up), ("down", down)) + ((("gate", gate),) if gate is not None else ()):
        if not isinstance(lst, (list, tuple)) or not lst:
            raise TypeError(f"{name}: expected a non-empty list of Exl3Tensor")
        for i, t in enumerate(lst):
            if not isinstance(t, Exl3Tensor):
                raise TypeError(f"{name}[{i}]: expected Exl3Tensor, got {type(t).__name__}")
    E = len(up)
    if len(down) != E or (gate is not None and len(gate) != E):
        raise ValueError(f"gate/up/down: expected the same number of experts, got "
                         f"{None if gate is None else len(gate)}/{len(up)}/{len(down)}")
    H, I = up[0].k, up[0].n
    for name, lst, kk, nn in (("gate", gate, H, I), ("up", up, H, I), ("down", down, I, H)):
        for i, t in enumerate(lst or ()):
            if (t.k, t.n) != (kk, nn):
                raise ValueError(f"{name}[{i}]: expected shape {kk}x{nn} (k x n), got {t.k}x{t.n}")
    try:
        lim = float(act_limit)
    except (TypeError, ValueError):
        raise TypeError(f"act_limit: expected a number, got {act_limit!r}") from None
    if not math.isfinite(lim) or lim < 0:
        raise ValueError(f"act_limit: expected a finite value >= 0, got {act_limit!r}")
    return E, H, I


def validate_moe_args(hidden, expert_ids, expert_weights, gate, up, down, activation, act_limit):
    """Shared argument checks for every MoE implementation; returns (hidden, ids int64, weights, E, H, I)."""
    E, H, I = validate_moe_layer(gate, up, down, activation, act_limit)
    h = np.asarray(hidden)
    if h.ndim != 2 or h.shape[1] != H:
        raise ValueError(f"hidden: expected shape (m, {H}), got {h.shape}")
    if h.dtype not in (np.float16, np.float32, np.float64):
        raise TypeError(f"hidden: expected float16/float32, got dtype {h.dtype}")
    ids = np.asarray(expert_ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"expert_ids: expected an integer array, got dtype {ids.dtype}")
    if ids.ndim != 2 or ids.shape[0] != h.shape[0]:
        raise ValueError(f"expert_ids: expected shape (m={h.shape[0]}, top_k), got {ids.shape}")
    w = np.asarray(expert_weights)
    if w.dtype not in (np.float16, np.float32, np.float64):
        raise TypeError(f"expert_weights: expected float16/float32, got dtype {w.dtype}")
    if w.shape != ids.shape:
        raise ValueError(f"expert_weights: expected the shape of expert_ids {ids.shape} (top_k mismatch), got {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError("expert_weights: contains NaN or Inf")
    return h, ids.astype(np.int64), w, E, H, I


F32_MAX = float(np.finfo(np.float32).max)


_SMALL_ROUTING = 128  # routing arrays up to this many ids are checked in plain Python first


def _small_routing_ok(expert_ids, expert_weights, E):
    """True when a small routing passes check_op_routing's rules (else the numpy checks below name the problem).
    Whole-list builtins rather than a Python loop per value: this runs on every decode call."""
    rows = expert_ids.tolist()
    for row in rows:
        if len(set(row)) != len(row):
            return False
    if rows and rows[0] and (min(map(min, rows)) < 0 or max(map(max, rows)) >= E):
        return False
    ws = expert_weights.ravel().tolist()
    # A finite sum means no NaN or Inf among the weights (a sum that overflows only sends them to the numpy checks).
    return math.isfinite(sum(ws)) and (not ws or max(map(abs, ws)) <= F32_MAX)


def check_op_routing(expert_ids: np.ndarray, expert_weights: np.ndarray, E: int) -> None:
    """The routing rules of the ops' __call__ (Vulkan and cpu backends alike; the reference and `record()`
    skip ids outside [0, E) instead): every id in [0, E), no expert twice in one row, and weights that stay
    finite in the float32 the kernels compute in."""
    m, top_k = expert_ids.shape
    if expert_ids.size <= _SMALL_ROUTING and _small_routing_ok(expert_ids, expert_weights, E):
        return  # a decode batch: plain Python is ~5x cheaper than numpy's reductions on a handful of values
    if m and (expert_ids.min() < 0 or expert_ids.max() >= E):
        bad = expert_ids[(expert_ids < 0) | (expert_ids >= E)][0]
        raise ValueError(f"expert_ids must lie in [0, {E}); found {bad}")
    if m and top_k > 1:
        s = np.sort(expert_ids, axis=1)
        if (s[:, 1:] == s[:, :-1]).any():
            row = int(np.nonzero((s[:, 1:] == s[:, :-1]).any(axis=1))[0][0])
            raise ValueError(f"expert_ids row {row} names an expert twice: {expert_ids[row].tolist()}")
    if not np.isfinite(expert_weights).all():
        raise ValueError("expert_weights contains NaN or Inf")
    largest = float(np.abs(expert_weights).max()) if m else 0.0
    if largest > F32_MAX:
        raise ValueError(f"expert_weights holds {largest:g}, beyond float32's range "
                         f"(|w| <= {F32_MAX:g}): it would become Inf on the device")


def _expert_rows(ids: np.ndarray, E: int):
    """Yield (e, token index array, slot index array) for every expert that has rows."""
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    order = np.argsort(np.where(valid, flat, E), kind="stable")
    order = order[valid[order]]
    counts = np.bincount(flat[order], minlength=E)
    start = 0
    topk = ids.shape[1]
    for e in range(E):
        c = counts[e]
        if c:
            sel = order[start:start + c]
            yield e, sel // topk, sel % topk
            start += c


def moe_forward(hidden, expert_ids, expert_weights, gate, up, down, activation="silu", act_limit=0.0,
                dtype=np.float64) -> np.ndarray:
    """out[t] = Σ_slots w[t,s]·down_e(act(gate_e(x_t), up_e(x_t))) in `dtype` (float64 default), no fp16 rounding.

    Expert ids outside [0, E) are skipped. Returns (m, H) in `dtype`.
    """
    h, ids, w, E, H, I = validate_moe_args(hidden, expert_ids, expert_weights, gate, up, down, activation, act_limit)
    dt = np.dtype(dtype)
    lim = float(act_limit)
    m, topk = ids.shape
    contrib = np.zeros((m, topk, H), dtype=dt)
    x = h.astype(dt)
    for e, tok, slot in _expert_rows(ids, E):
        xe = x[tok]
        u = linear_forward(xe, up[e], dt)
        g = linear_forward(xe, gate[e], dt) if gate is not None else None
        p = _activate(g, u, activation, lim)
        d = linear_forward(p, down[e], dt)
        contrib[tok, slot] = d * w[tok, slot].astype(dt)[:, None]
    out = np.zeros((m, H), dtype=dt)
    for s in range(topk):  # slot order, as the op sums
        out += contrib[:, s]
    return out


def _round_gemm(a16, tensor: Exl3Tensor) -> np.ndarray:
    # Ideal GEMM: fp16 products summed without rounding error (float64 is exact enough), one RN16.
    return (a16.astype(np.float64) @ _decoded(tensor, np.float64)).astype(_f16)


def _activate_fp16(g16, u16, activation: str, limit: float) -> np.ndarray:
    """Stage 3 in fp16 (spec 8.6): returns p = RN16(a·u) (swiglu_oai: the fp32 formula rounded once)."""
    if activation == "swiglu_oai":
        g, u = g16.astype(_f32), u16.astype(_f32)
        if limit:
            L = _f32(limit)
            g = np.minimum(g, L)
            u = np.clip(u, -L, L)
        return ((u + _f32(1)) * g * (_f32(1) / (_f32(1) + np.exp(_f32(-1.702) * g)))).astype(_f16)
    if activation == "silu":
        with np.errstate(over="ignore"):
            e = np.exp(-g16.astype(np.float64)).astype(_f16)
            s = (e.astype(_f32) + _f32(1)).astype(_f16)
            r = (1.0 / s.astype(np.float64)).astype(_f16)
        a = (g16.astype(_f32) * r.astype(_f32)).astype(_f16)
    elif activation in ("gelu", "gelu_erf"):
        x = g16.astype(_f32)
        if activation == "gelu":
            t = np.tanh(_f32(_GELU_K) * (x + _f32(0.044715) * x * x * x))
        else:
            t = _erf(x / _f32(math.sqrt(2.0)))
        a = (_f32(0.5) * x * (_f32(1) + t)).astype(_f16)
    else:
        a = np.maximum(u16, _f16(0))
    if limit:
        L16 = _f16(limit)
        u16 = np.clip(u16, -L16, L16)
        a = np.minimum(a, L16)
    return (a.astype(_f32) * u16.astype(_f32)).astype(_f16)


def moe_forward_fp16(hidden, expert_ids, expert_weights, gate, up, down, activation="silu", act_limit=0.0,
                     dtype=np.float32) -> np.ndarray:
    """Emulation of the GPU pipeline (spec 8.6/8.9) with fp16 intermediates; (m, H) float32.

    had_in in fp16, ideal GEMM then RN16, stage 3 in fp16, down GEMM RN16, output Hadamard in fp32 scaled by
    fp32(r·w) and svh, summed over slots in slot order in fp32. Routing weights are used as given (fp16 weights
    are exact in fp32). Biases (not in the fused CUDA kernel): gate/up RN16(y + b) after the output transform;
    down adds fp32(w·b). `dtype` is accepted for signature symmetry; the result is always float32.
    """
    h, ids, w, E, H, I = validate_moe_args(hidden, expert_ids, expert_weights, gate, up, down, activation, act_limit)
    lim = float(act_limit)
    m, topk = ids.shape
    x16 = h.astype(_f16)
    contrib = np.zeros((m, topk, H), dtype=_f32)
    for e, tok, slot in _expert_rows(ids, E):
        xe = x16[tok]

        def proj(t):
            y = had_out(_round_gemm(had_in(xe, t.suh), t), t.svh)
            if t.bias is not None:
                y = (y.astype(_f32) + t.bias.astype(_f32)).astype(_f16)
            return y

        u = proj(up[e])
        g = proj(gate[e]) if gate is not None else None
        p = _activate_fp16(g, u, activation, lim)
        dn = down[e]
        d = _round_gemm(had_in(p, dn.suh), dn)
        we = w[tok, slot].astype(_f32)[:, None]
        scale = HAD_SCALE_F32 * we  # fp32(r·w)
        y = (hadamard128(d.astype(_f32), scale=False) * scale) * dn.svh.astype(_f32)
        if dn.bias is not None:
            y = y + we * dn.bias.astype(_f32)
        contrib[tok, slot] = y
    out = np.zeros((m, H), dtype=_f32)
    for s in range(topk):
        out += contrib[:, s]
    return out
