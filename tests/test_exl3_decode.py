"""Trellis decode: golden matrices, an independent slow decoder, and the spec's worked examples."""
from fractions import Fraction

import numpy as np
import pytest

from goldens import golden_files, load_layer
from vkmoe.exl3 import TENSOR_CORE_PERM, codebook_values, decode_states, dequantize

CODEBOOKS = ("3inst", "mcg", "mul1")


def _half(bits):
    return float(np.array(bits, dtype=np.uint16).view(np.float16))


def _slow_value(s, cb):
    """Spec section 3, one state at a time with Python integers and exact fractions."""
    if cb == "mul1":
        x = (s * 0x83DCD12D) & 0xFFFFFFFF
        B = sum((x >> (8 * i)) & 0xFF for i in range(4))
        exact = (1024 + B) * Fraction(_half(0x1EEE)) + Fraction(_half(0xC931))
        return np.float16(float(exact))  # float(exact) is exact here; one rounding to fp16
    x = (s * 89226354 + 64248484) & 0xFFFFFFFF if cb == "3inst" else (s * 0xCBAC1FED) & 0xFFFFFFFF
    y = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return np.float16(_half(y & 0xFFFF) + _half(y >> 16))


def _slow_tile_states(words, K):
    """States by reading the MSB-first stream bit by bit (spec section 4, not the closed form)."""
    U = [int(words[2 * m]) | (int(words[2 * m + 1]) << 16) for m in range(8 * K)]
    nbits = 256 * K

    def bit(p):
        p %= nbits
        return (U[p // 32] >> (31 - p % 32)) & 1

    states = []
    for t in range(256):
        s = 0
        for i in range(16):
            s = (s << 1) | bit((t + 1) * K - 16 + i)
        states.append(s)
    return states


def _slow_dequant(trellis, cb):
    kt, nt, w16 = trellis.shape
    K = w16 // 16
    out = np.zeros((kt * 16, nt * 16), dtype=np.float16)
    cache = {}
    for i in range(kt):
        for j in range(nt):
            for t, s in enumerate(_slow_tile_states(trellis[i, j], K)):
                lane, q = t >> 3, t & 7
                row = 2 * (lane & 3) + (q & 1) + 8 * ((q >> 1) & 1)
                col = (lane >> 2) + 8 * (q >> 2)
                if s not in cache:
                    cache[s] = _slow_value(s, cb)
                out[16 * i + row, 16 * j + col] = cache[s]
    return out


@pytest.mark.parametrize("K", range(1, 9))
@pytest.mark.parametrize("cb", CODEBOOKS)
def test_random_trellis_matches_slow_decoder(K, cb):
    rng = np.random.default_rng(1000 * K + CODEBOOKS.index(cb))
    tr = rng.integers(0, 65536, size=(2, 1, 16 * K), dtype=np.uint16)
    got = dequantize(tr, cb)
    assert got.dtype == np.float16 and got.shape == (32, 16)
    np.testing.assert_array_equal(got.view(np.uint16), _slow_dequant(tr, cb).view(np.uint16))
    # int16 input is the same bits
    np.testing.assert_array_equal(dequantize(tr.view(np.int16), cb).view(np.uint16), got.view(np.uint16))


def test_golden_expert0_bit_exact():
    path = [p for p in golden_files() if p.endswith("a_tiny_silu_k4.npz")][0]
    layer = load_layer(path)
    z = layer.npz
    for proj in ("gate", "up", "down"):
        tr = z[f"{proj}_trellis"][0]
        np.testing.assert_array_equal(decode_states(tr), z[f"states_{proj}_e0"], err_msg=proj)
        np.testing.assert_array_equal(dequantize(tr, "mul1").view(np.uint16), z[f"w_{proj}_e0"].view(np.uint16),
                                      err_msg=proj)


# spec section 3 table: state -> (3inst, mcg, mul1) fp16 bits
SPEC_TABLE = {
    0x0000: (0x3A25, 0x3F60, 0xC2E8),
    0x0001: (0xBB5B, 0x304E, 0x3921),
    0x1234: (0xC066, 0x3E0F, 0xB89E),
    0x8000: (0xB7F8, 0xB915, 0xBAF2),
    0xABCD: (0xB98E, 0x35E7, 0xBD42),
    0xFFFF: (0xB110, 0x3ACD, 0xB936),
}


def test_spec_codebook_table():
    states = np.array(list(SPEC_TABLE), dtype=np.uint16)
    for c, cb in enumerate(CODEBOOKS):
        got = codebook_values(states, cb).view(np.uint16)
        assert [hex(v) for v in got] == [hex(v[c]) for v in SPEC_TABLE.values()], cb
    assert float(codebook_values(np.array([1]), "mul1")[0]) == pytest.approx(0.64111328)


def test_mul1_exact_form():
    s = np.arange(65536, dtype=np.uint32)
    x = (s * np.uint32(0x83DCD12D)).astype(np.uint32)
    B = sum(((x >> (8 * i)) & 0xFF).astype(np.int64) for i in range(4))
    v = codebook_values(s, "mul1_exact")
    assert v.dtype == np.float32
    np.testing.assert_array_equal(v, (B - 510).astype(np.float32) * np.float32(0.00676727294921875))
    # the GPU form sits about -0.0018 from it
    off = codebook_values(s, "mul1").astype(np.float64) - v
    assert abs(off.mean() + 0.0018) < 3e-4


def _encode_k3_example():
    K = 3
    v = [(3 * t + (t >> 3)) % 8 for t in range(256)]
    bits = [(sym >> (K - 1 - b)) & 1 for sym in v for b in range(K)]
    natural = [int("".join(map(str, bits[16 * q:16 * q + 16])), 2) for q in range(16 * K)]
    stored = np.array(natural, dtype=np.uint16).reshape(-1, 2)[:, ::-1].reshape(-1)  # pair swap (pack.cu)
    return stored.reshape(1, 1, 16 * K)


def test_spec_k3_worked_example():
    tr = _encode_k3_example()
    assert [f"{w:04X}" for w in tr[0, 0, :8]] == "D533 0F19 543C AA1E CEA8 6778 F1A1 9D50".split()
    s = decode_states(tr)[0, 0]
    assert (s[0], s[1], s[2], s[5], s[32], s[255]) == (0x3C60, 0xE303, 0x181E, 0x3C67, 0x7544, 0x878C)
    want = {"3inst": [0xB31B, 0xAD90, 0x31D8, 0x3E0B], "mcg": [0xC036, 0xBB1B, 0xBB03, 0xC07D],
            "mul1": [0x3E31, 0xBCDA, 0xB8E3, 0x3B83]}
    for cb, bits in want.items():
        assert list(codebook_values(s[:4], cb).view(np.uint16)) == bits, cb
    w = dequantize(tr, "mul1").astype(np.float64)
    np.testing.assert_allclose(w[0, :4], [1.54785, 0.49219, 1.54785, 0.49219], atol=1e-5)
    assert w[1, 0] == pytest.approx(-1.21289, abs=1e-5)
    assert w[0, 8] == pytest.approx(-0.23865, abs=1e-5)


def test_perm_table():
    first = "0 16 128 144 8 24 136 152 32 48 160 176 40 56 168 184 64 80 192 208 72 88 200 216 96 112 224 240 104 120 232 248"
    assert list(TENSOR_CORE_PERM[:32]) == [int(v) for v in first.split()]
    assert list(TENSOR_CORE_PERM[224:228]) == [7, 23, 135, 151]
    assert sorted(TENSOR_CORE_PERM) == list(range(256))


def test_decode_rejects_bad_input():
    with pytest.raises(TypeError, match="trellis"):
        dequantize(np.zeros((1, 1, 64), np.float32))
    with pytest.raises(ValueError, match="trellis"):
        dequantize(np.zeros((1, 1, 65), np.uint16))
    with pytest.raises(ValueError, match="codebook"):
        dequantize(np.zeros((1, 1, 64), np.uint16), "bogus")
