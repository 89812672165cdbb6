"""The portable CPU tier: EXL3 decode, linear and fused MoE MLP in native C (fp32 math, GPU-form codebooks).

Same arguments and semantics as `vkmoe.exl3.reference`; results are float32. Build the native module with
`pip install -e .` or `python native/build_native.py` (both need a C compiler).
"""
from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

try:
    from . import _native
except ImportError as exc:  # pragma: no cover - exercised only on unbuilt checkouts
    raise ImportError(
        "vkmoe.cpu needs the compiled native module vkmoe._native, which is not built. Build it with "
        "`pip install -e .` or `python native/build_native.py` from the repository root (a C compiler such as "
        f"gcc or clang is required). Original error: {exc}"
    ) from exc

from . import forksafe
from .exl3 import Exl3Tensor
from .layout import ACTIVATIONS as _ACT
from .layout import CODEBOOKS as _CB_INDEX
from .exl3.decode import CODEBOOKS, as_trellis, codebook_table
from .exl3.reference import F32_MAX, validate_moe_args

__all__ = ["dequantize", "linear", "moe_forward", "isa", "isa_tiers", "set_max_isa"]

_ffi, _lib = _native.ffi, _native.lib
_ISA_NAMES = {0: "scalar", 2: "avx512", 3: "avx512_vnni"}
_LUT32: dict = {}


def isa() -> str:
    """The SIMD tier in use ("avx512_vnni", "avx512" or "scalar")."""
    return _ISA_NAMES.get(_lib.vkn_isa_active(), "scalar")


def isa_tiers() -> list:
    """Every tier this CPU can run, lowest first (tests run each)."""
    best = _lib.vkn_isa_supported()
    return [name for level, name in sorted(_ISA_NAMES.items()) if level <= best]


def set_max_isa(name) -> None:
    """Cap the SIMD tier ("scalar", "avx512", "avx512_vnni" or None for the best available)."""
    table = {None: -1, "scalar": 0, "avx512": 2, "avx512_vnni": 3}
    if name not in table:
        raise ValueError(f"name: expected one of None, 'scalar', 'avx512', 'avx512_vnni', got {name!r}")
    _lib.vkn_set_max_isa(table[name])


def _threads(threads):
    if threads is None:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return max(1, os.cpu_count() or 1)
    t = int(threads)
    if t < 1:
        raise ValueError(f"threads: expected a positive integer or None, got {threads!r}")
    return t


def _lut(codebook: str) -> np.ndarray:
    lut = _LUT32.get(codebook)
    if lut is None:
        lut = np.ascontiguousarray(codebook_table(codebook).astype(np.float32))
        _LUT32[codebook] = lut
    return lut


def _ptr(ctype, arr):
    return _ffi.cast(ctype, arr.ctypes.data) if arr is not None else _ffi.NULL


def _fill(struct, t: Exl3Tensor):
    """Point a vkn_tensor at `t`'s arrays; returns the arrays that must stay alive."""
    def make(tt):
        suh = np.ascontiguousarray(tt.suh, np.float32)
        svh = np.ascontiguousarray(tt.svh, np.float32)
        bias = None if tt.bias is None else np.ascontiguousarray(tt.bias, np.float32)
        return suh, svh, bias

    suh, svh, bias = t.cached("cpu_f32", make)
    lut = _lut(t.codebook)
    struct.trellis = _ptr("const uint16_t *", t.trellis)
    struct.suh = _ptr("const float *", suh)
    struct.svh = _ptr("const float *", svh)
    struct.bias = _ptr("const float *", bias)
    struct.lut = _ptr("const float *", lut)
    struct.k, struct.n, struct.bits, struct.codebook = t.k, t.n, t.bits, _CB_INDEX[t.codebook]
    return (t, suh, svh, bias, lut)


# Struct arrays for expert lists, keyed by the tensors' ids; entries hold the tensors so ids stay valid. One lock:
# calls from several threads (the native work runs without the GIL) look up, refresh and evict entries together,
# and without it a thread's hit could be evicted by another between the lookup and the refresh (a KeyError).
_LIST_CACHE: "OrderedDict" = OrderedDict()
_LIST_CACHE_SIZE = 16
_LIST_LOCK = forksafe.Lock()


def _tensor_array(lst):
    if lst is None:
        return _ffi.NULL, None
    key = tuple(id(t) for t in lst)
    with _LIST_LOCK:
        hit = _LIST_CACHE.get(key)
        if hit is not None:
            _LIST_CACHE.move_to_end(key)
            return hit[0], hit
        arr = _ffi.new("vkn_tensor[]", len(lst))
        keep = [_fill(arr[i], t) for i, t in enumerate(lst)]
        entry = (arr, keep)
        _LIST_CACHE[key] = entry
        while len(_LIST_CACHE) > _LIST_CACHE_SIZE:
            _LIST_CACHE.popitem(last=False)
        return arr, entry


def dequantize(trellis, codebook: str = "mul1") -> np.ndarray:
    """Ŵ (k, n) as float32 through the native decoder (every value is exactly an fp16 of the GPU form)."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook: expected one of {', '.join(CODEBOOKS)}, got {codebook!r}")
    tr = np.ascontiguousarray(as_trellis(trellis))
    k, n, bits = tr.shape[0] * 16, tr.shape[1] * 16, tr.shape[2] // 16
    out = np.empty((k, n), dtype=np.float32)
    st = _ffi.new("vkn_tensor *")
    lut = _lut(codebook)
    st.trellis = _ptr("const uint16_t *", tr)
    st.lut = _ptr("const float *", lut)
    st.suh = st.svh = st.bias = _ffi.NULL
    st.k, st.n, st.bits, st.codebook = k, n, bits, _CB_INDEX[codebook]
    _lib.vkn_dequant(st, _ptr("float *", out))
    return out


def linear(x: np.ndarray, tensor: Exl3Tensor, threads: "int | None" = None) -> np.ndarray:
    """y = x·W + bias (fp32 math), x (m, k) float16/float32 -> (m, n) float32."""
    if not isinstance(tensor, Exl3Tensor):
        raise TypeError(f"tensor: expected Exl3Tensor, got {type(tensor).__name__}")
    xa = np.asarray(x)
    if xa.dtype not in (np.float16, np.float32):
        raise TypeError(f"x: expected float16 or float32, got dtype {xa.dtype}")
    if xa.ndim != 2 or xa.shape[1] != tensor.k:
        raise ValueError(f"x: expected shape (m, {tensor.k}), got {xa.shape}")
    nthreads = _threads(threads)
    x32 = np.ascontiguousarray(xa, np.float32)
    y = np.empty((x32.shape[0], tensor.n), dtype=np.float32)
    st = _ffi.new("vkn_tensor *")
    keep = _fill(st, tensor)
    rc = _lib.vkn_linear(st, _ptr("const float *", x32), x32.shape[0], _ptr("float *", y), nthreads)
    del keep
    if rc != 0:
        raise MemoryError("vkn_linear: out of memory")
    return y


def moe_forward(hidden: np.ndarray, expert_ids: np.ndarray, expert_weights: np.ndarray,
                gate: "list[Exl3Tensor] | None", up: "list[Exl3Tensor]", down: "list[Exl3Tensor]",
                activation: str = "silu", act_limit: float = 0.0, threads: "int | None" = None) -> np.ndarray:
    """Fused MoE MLP, same arguments and semantics as `vkmoe.exl3.reference.moe_forward`; (m, H) float32.

    hidden (m, H) float16/float32; expert_ids (m, top_k) integers (ids outside [0, E) are skipped, as the
    reference and exllamav3's sentinel do); expert_weights (m, top_k) float16/float32, finite.
    """
    h, ids, w, E, H, I = validate_moe_args(hidden, expert_ids, expert_weights, gate, up, down, activation, act_limit)
    if h.dtype == np.float64:
        raise TypeError("hidden: expected float16 or float32, got dtype float64")
    if w.size and float(np.abs(w).max()) > F32_MAX:
        raise ValueError(f"expert_weights: holds {float(np.abs(w).max()):g}, beyond float32's range (computed in float32)")
    nthreads = _threads(threads)
    m, topk = ids.shape
    x32 = np.ascontiguousarray(h, np.float32)
    ids64 = np.ascontiguousarray(ids, np.int64)
    w32 = np.ascontiguousarray(w, np.float32)
    out = np.empty((m, H), dtype=np.float32)
    g_arr, g_keep = _tensor_array(gate)
    u_arr, u_keep = _tensor_array(up)
    d_arr, d_keep = _tensor_array(down)
    rc = _lib.vkn_moe(g_arr, u_arr, d_arr, E, m, topk, _ptr("const float *", x32), _ptr("const int64_t *", ids64),
                      _ptr("const float *", w32), _ACT[activation], float(act_limit), _ptr("float *", out), nthreads)
    del g_keep, u_keep, d_keep
    if rc != 0:
        raise MemoryError("vkn_moe: out of memory")
    return out
