"""EXL3 trellis decoding (spec sections 3 and 4), vectorised numpy.

Codebook values are produced through 65536-entry lookup tables built once per codebook: every state maps to
one fp16 value, so a table lookup is both the fastest numpy form and trivially bit-exact with the per-state
formulas (which are kept in `_codebook_formula` and checked against independent code in the tests).
"""
from __future__ import annotations

import numpy as np

from .. import layout

__all__ = [
    "CODEBOOKS",
    "TENSOR_CORE_PERM",
    "MUL1_C1",
    "MUL1_C0",
    "as_trellis",
    "codebook_values",
    "codebook_table",
    "decode_states",
    "dequantize",
    "state_index_table",
]

#: GPU-form codebooks accepted by Exl3Tensor; "mul1_exact" is only a decode option (CPU affine form).
CODEBOOKS = tuple(layout.CODEBOOKS)

MUL1_C1 = np.array(0x1EEE, dtype=np.uint16).view(np.float16)[()]
MUL1_C0 = np.array(0xC931, dtype=np.uint16).view(np.float16)[()]


def _make_perm() -> np.ndarray:
    t = np.arange(256)
    lane, q = t >> 3, t & 7
    row = 2 * (lane & 3) + (q & 1) + 8 * ((q >> 1) & 1)
    col = (lane >> 2) + 8 * (q >> 2)
    perm = (16 * row + col).astype(np.int64)
    perm.setflags(write=False)
    return perm


#: perm(t): position t of a tile's code stream -> row-major index (16*row + col) inside the 16x16 tile.
TENSOR_CORE_PERM = _make_perm()


def _codebook_formula(states: np.ndarray, codebook: str) -> np.ndarray:
    s = np.asarray(states).astype(np.uint32)
    if codebook in ("3inst", "mcg"):
        if codebook == "3inst":
            x = s * np.uint32(89226354) + np.uint32(64248484)
        else:
            x = s * np.uint32(0xCBAC1FED)
        y = (x & np.uint32(0x8FFF8FFF)) ^ np.uint32(0x3B603B60)
        a = (y & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float32)
        b = (y >> np.uint32(16)).astype(np.uint16).view(np.float16).astype(np.float32)
        # |a|,|b| in [0.125, 2): their fp32 sum is exact, so one cast gives the single fp16 rounding.
        return (a + b).astype(np.float16)
    x = s * np.uint32(0x83DCD12D)
    bsum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
    if codebook == "mul1":
        # (1024 + B) * c1 + c0 is exact in float64, so rounding it once equals the fused fp16 fma.
        v = (1024.0 + bsum.astype(np.float64)) * float(MUL1_C1) + float(MUL1_C0)
        return v.astype(np.float16)
    if codebook == "mul1_exact":
        return ((bsum.astype(np.float32) - np.float32(510.0)) * np.float32(MUL1_C1)).astype(np.float32)
    raise ValueError(f"codebook: expected one of 'mul1', 'mcg', '3inst', 'mul1_exact', got {codebook!r}")


_TABLES: dict = {}


def codebook_table(codebook: str) -> np.ndarray:
    """All 65536 decoded values of `codebook` (read-only; float16, float32 for "mul1_exact")."""
    tab = _TABLES.get(codebook)
    if tab is None:
        with np.errstate(over="ignore"):
            tab = _codebook_formula(np.arange(65536, dtype=np.uint32), codebook)
        tab.setflags(write=False)
        _TABLES[codebook] = tab
    return tab


def codebook_values(states, codebook: str) -> np.ndarray:
    """Decode 16-bit trellis states with `codebook` (same shape as `states`).

    "mul1", "mcg", "3inst" give the GPU form as float16 (bit-exact); "mul1_exact" gives exllamav3's CPU affine
    form (bytesum - 510) * fp16(0x1eee) as float32 (it is not representable in fp16 in general).
    """
    s = np.asarray(states)
    if s.dtype.kind not in "iu":
        raise TypeError(f"states: expected an integer array, got dtype {s.dtype}")
    return codebook_table(codebook)[s.astype(np.uint16, copy=False)]


_INDEX: dict = {}


def state_index_table(bits: int):
    """(word_a, word_c, shift) int arrays of length 256: s_t = ((U[a]<<32 | U[c]) >> shift) & 0xFFFF."""
    tab = _INDEX.get(bits)
    if tab is None:
        K = bits
        t = np.arange(256, dtype=np.int64)
        e = (t + 1) * K + 256 * K
        b = e - 16
        nw = 8 * K
        wa = (b // 32) % nw
        wc = ((e - 1) // 32) % nw
        sh = 32 * ((e - 1) // 32 + 1) - e
        tab = (wa, wc, sh)
        _INDEX[bits] = tab
    return tab


def as_trellis(trellis) -> np.ndarray:
    """`trellis` checked as a (k/16, n/16, 16*K) uint16 (or int16) array, viewed as uint16."""
    t = np.asarray(trellis)
    if t.dtype not in (np.uint16, np.int16):
        raise TypeError(f"trellis: expected uint16 or int16, got dtype {t.dtype}")
    if t.ndim != 3 or t.shape[2] % 16 != 0 or not 1 <= t.shape[2] // 16 <= 8:
        raise ValueError(f"trellis: expected shape (k/16, n/16, 16*K) with K in 1..8, got {t.shape}")
    return t.view(np.uint16)


def decode_states(trellis) -> np.ndarray:
    """16-bit states of every tile, in encoded order t: uint16 (k/16, n/16, 256)."""
    t = as_trellis(trellis)
    K = t.shape[2] // 16
    # Little-endian reinterpretation of word pairs: U[m] = T[2m] | T[2m+1] << 16.
    u = np.ascontiguousarray(t).view("<u4").astype(np.uint64)
    wa, wc, sh = state_index_table(K)
    window = (u[..., wa] << np.uint64(32)) | u[..., wc]
    return ((window >> sh.astype(np.uint64)) & np.uint64(0xFFFF)).astype(np.uint16)


def dequantize(trellis, codebook: str = "mul1") -> np.ndarray:
    """Dequantized Ŵ (k, n), row = input channel. float16 (bit-exact GPU form); float32 for "mul1_exact"."""
    states = decode_states(trellis)
    kt, nt = states.shape[:2]
    vals = codebook_values(states, codebook)
    tiles = np.empty_like(vals)
    tiles[..., TENSOR_CORE_PERM] = vals
    return tiles.reshape(kt, nt, 16, 16).transpose(0, 2, 1, 3).reshape(kt * 16, nt * 16)
