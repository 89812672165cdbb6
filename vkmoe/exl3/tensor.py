"""Exl3Tensor: one EXL3-quantized linear (trellis + scales), validated once at construction."""
from __future__ import annotations

import numpy as np

from .decode import CODEBOOKS, dequantize

__all__ = ["Exl3Tensor"]


def _frozen_copy(arr: np.ndarray) -> np.ndarray:
    """A read-only C-contiguous copy: the caller's array stays theirs, and nothing can change the tensor after
    it was validated (or after its decoded weights were cached)."""
    out = np.array(arr, order="C", copy=True)
    out.setflags(write=False)
    return out


def _fp16_vector(name: str, value, length: int, expected: str) -> np.ndarray:
    arr = _frozen_copy(np.asarray(value))  # copied before the check: a later write by the caller changes nothing
    if arr.dtype != np.float16:
        raise TypeError(f"{name}: expected float16, got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] != length:
        raise ValueError(f"{name}: expected shape ({length},) ({expected}), got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: expected finite values, found NaN/Inf")
    return arr


class Exl3Tensor:
    """An EXL3 linear `y = x·W + bias` with W = diag(suh)·Hk·Ŵ·Hn·diag(svh) (spec section 2).

    trellis: uint16 or int16 (k/16, n/16, 16*K), K = bits in 1..8, k and n multiples of 128 (stored as a
    C-contiguous uint16 view); suh: float16 (k,); svh: float16 (n,); codebook: "mul1", "mcg" or "3inst";
    bias: None or (n,) float16/float32 (stored float16, as exllamav3 does at load). The arrays are stored as
    read-only copies: changing the caller's arrays afterwards does not change the tensor, and its attributes cannot
    be rebound (the ops and the CPU tier cache what they derived from them: device copies, struct pointers).
    """

    __slots__ = ("trellis", "suh", "svh", "bias", "codebook", "k", "n", "bits", "_cache", "__weakref__")

    def __init__(self, trellis, suh, svh, codebook="mul1", bias=None):
        if not isinstance(codebook, str) or codebook not in CODEBOOKS:
            raise ValueError(f"codebook: expected one of {', '.join(repr(c) for c in CODEBOOKS)}, got {codebook!r}")
        tr = np.asarray(trellis)
        if tr.dtype not in (np.uint16, np.int16):
            raise TypeError(f"trellis: expected uint16 or int16, got dtype {tr.dtype}")
        if tr.ndim != 3:
            raise ValueError(f"trellis: expected 3 dimensions (k/16, n/16, 16*K), got shape {tr.shape}")
        if tr.shape[2] % 16 == 8:  # exllamav3 writes these (K + 0.5 bits per weight); no decoder here has them
            raise ValueError(f"trellis: last dimension {tr.shape[2]} = 16*K+8 is the half-integer EXL3 bit width "
                             f"({tr.shape[2] / 16:g} bits per weight), which vkmoe does not support")
        if tr.shape[2] % 16 != 0 or not 1 <= tr.shape[2] // 16 <= 8:
            raise ValueError(f"trellis: expected last dimension 16*K with K (bits) in 1..8, got {tr.shape[2]}")
        k, n = tr.shape[0] * 16, tr.shape[1] * 16
        if k == 0 or k % 128 != 0:
            raise ValueError(f"trellis: expected k = 16*shape[0] to be a positive multiple of 128, got k={k}")
        if n == 0 or n % 128 != 0:
            raise ValueError(f"trellis: expected n = 16*shape[1] to be a positive multiple of 128, got n={n}")
        self.trellis = _frozen_copy(tr.view(np.uint16))
        self.k, self.n, self.bits = k, n, tr.shape[2] // 16
        self.codebook = codebook
        self.suh = _fp16_vector("suh", suh, k, "k = input features")
        self.svh = _fp16_vector("svh", svh, n, "n = output features")
        if bias is None:
            self.bias = None
        else:
            b = np.asarray(bias)
            if b.dtype not in (np.float16, np.float32):
                raise TypeError(f"bias: expected float16 or float32, got dtype {b.dtype}")
            if b.ndim != 1 or b.shape[0] != n:
                raise ValueError(f"bias: expected shape ({n},) (n = output features), got {b.shape}")
            with np.errstate(over="ignore"):  # (refused below, with a message of ours)
                b16 = b.astype(np.float16)
            if not np.all(np.isfinite(b16)):  # (as suh and svh; float32 beyond float16's range rounds to Inf)
                raise ValueError("bias: expected finite values within float16's range (|b| <= 65504), found "
                                 + ("NaN/Inf" if not np.all(np.isfinite(b)) else "values beyond it"))
            self.bias = _frozen_copy(b16)
        self._cache = {}

    def __setattr__(self, name, value):
        if hasattr(self, "_cache"):  # set last in __init__: from then on the tensor is what was validated
            raise AttributeError(f"Exl3Tensor is read-only: {name!r} cannot be set after construction "
                                 "(make a new Exl3Tensor)")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise AttributeError(f"Exl3Tensor is read-only: {name!r} cannot be deleted")

    def __reduce__(self):  # pickling and copy rebuild (and re-validate) from the arrays, without the caches
        return (Exl3Tensor, (self.trellis, self.suh, self.svh, self.codebook, self.bias))

    @property
    def nbytes(self) -> int:
        extra = self.bias.nbytes if self.bias is not None else 0
        return self.trellis.nbytes + self.suh.nbytes + self.svh.nbytes + extra

    def dequantize(self) -> np.ndarray:
        """Ŵ (k, n) float16, decoded once and cached (the cache is read-only)."""
        w = self._cache.get("w")
        if w is None:
            w = dequantize(self.trellis, self.codebook)
            w.setflags(write=False)
            self._cache["w"] = w
        return w

    def cached(self, key, make):
        """Per-tensor memo for derived data (e.g. float32 scales for the CPU tier)."""
        v = self._cache.get(key)
        if v is None:
            v = make(self)
            self._cache[key] = v
        return v

    def __repr__(self):
        b = "" if self.bias is None else ", bias"
        return f"Exl3Tensor(k={self.k}, n={self.n}, bits={self.bits}, codebook={self.codebook!r}{b})"
