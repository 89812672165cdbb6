"""numpy reference: Hadamard examples (spec 5), linear vs dense weights, every golden call."""
import numpy as np
import pytest

from goldens import golden_files, load_layer, moe_call_args, reference_targets, rel_rms
from vkmoe.exl3 import Exl3Tensor
from vkmoe.exl3 import reference as R

LAYERS = [load_layer(p) for p in golden_files()]
CALLS = [(L, c) for L in LAYERS for c in L.calls]
IDS = [f"{L.name}{c['suffix'] or '_main'}" for L, c in CALLS]


def test_hadamard_matrix_and_examples():
    eye = np.eye(128)
    Hm = R.hadamard128(eye, scale=False)
    a, b = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    popc = np.vectorize(lambda v: bin(v).count("1"))(a & b)
    np.testing.assert_array_equal(Hm, (-1.0) ** popc)
    e0 = np.zeros(128, np.float16)
    e0[0] = 1
    assert np.all(R.had_in(e0, np.ones(128, np.float16)).view(np.uint16) == 0x2DA8)
    x = np.zeros(128, np.float16)
    x[1], x[2] = 1, 2
    got = R.had_in(x, np.ones(128, np.float16)).astype(np.float64)
    np.testing.assert_allclose(got[:8], [0.265137, 0.088379, -0.088379, -0.265137] * 2, atol=1e-5)
    i = np.arange(128)
    x = (((i % 7) - 3) / 4).astype(np.float16)
    s = np.where(i % 3 == 0, -1.5, 0.5).astype(np.float16)
    assert [f"{v:04X}" for v in R.had_in(x, s).view(np.uint16)[:6]] == "2CF3 2FC7 35D5 AFC7 B14E AFC7".split()


def test_hadamard_fp32_butterfly_order():
    """Bit-exact fp32 evaluation order: compare with a plain loop over pairs."""
    v = np.random.default_rng(5).standard_normal(128).astype(np.float32)
    ref = v.copy()
    w = 1
    while w < 128:
        for i in range(128):
            if i & w == 0:
                ref[i], ref[i + w] = ref[i] + ref[i + w], ref[i] - ref[i + w]
        w *= 2
    ref = ref * np.float32(0.088388347648)
    got = R.hadamard128(v)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, ref)
    assert R.HAD_SCALE_F32.view(np.uint32) == 0x3DB504F3
    v64 = R.hadamard128(v.astype(np.float64))
    np.testing.assert_allclose(R.hadamard128(v64), v, rtol=1e-12, atol=1e-12)  # orthonormal: H·H = I


def test_linear_forward_matches_dense():
    rng = np.random.default_rng(7)
    k, n = 256, 128
    tr = rng.integers(0, 65536, (k // 16, n // 16, 48), dtype=np.uint16)
    t = Exl3Tensor(tr, rng.uniform(-1, 1, k).astype(np.float16), rng.uniform(-1, 1, n).astype(np.float16),
                   codebook="3inst", bias=rng.standard_normal(n).astype(np.float16))
    Hk = R.hadamard128(np.eye(k))  # rows: e_i · Hk (normalised)
    Hn = R.hadamard128(np.eye(n))
    W = np.diag(t.suh.astype(np.float64)) @ Hk @ t.dequantize().astype(np.float64) @ Hn @ np.diag(t.svh.astype(np.float64))
    x = rng.standard_normal((3, k)).astype(np.float16)
    want = x.astype(np.float64) @ W + t.bias.astype(np.float64)
    np.testing.assert_allclose(R.linear_forward(x, t), want, rtol=1e-10, atol=1e-10)
    y32 = R.linear_forward(x, t, dtype=np.float32)
    assert y32.dtype == np.float32 and rel_rms(y32, want) < 1e-5


@pytest.mark.parametrize("layer, call", CALLS, ids=IDS)
def test_golden_reference(layer, call):
    for act, ref in reference_targets(layer, call):
        out = R.moe_forward(call["x"], call["selected"], call["weights"], layer.gate, layer.up, layer.down,
                            act, layer.act_limit)
        assert out.dtype == np.float64 and out.shape == ref.shape
        assert rel_rms(out, ref) < 1e-9, act
        if call["exl3_out"] is not None:
            assert rel_rms(out, call["exl3_out"]) < 3e-2
        o16 = R.moe_forward_fp16(call["x"], call["selected"], call["weights"], layer.gate, layer.up, layer.down,
                                 act, layer.act_limit)
        assert o16.dtype == np.float32 and np.all(np.isfinite(o16))
        assert rel_rms(o16, ref) < 3e-3, act
        if call["exl3_out"] is not None:
            assert rel_rms(o16, call["exl3_out"]) < 3e-2


def test_gelu_forms_differ():
    L = [l for l in LAYERS if l.name.startswith("c_gelu")][0]
    c = L.calls[0]
    tanh = R.moe_forward(c["x"], c["selected"], c["weights"], L.gate, L.up, L.down, "gelu")
    assert rel_rms(tanh, c["ref_out"]) > 1e-7  # erf reference is a different function


def test_float32_dtype_and_skipped_ids():
    L = LAYERS[0]
    c = L.calls[0]
    out32 = R.moe_forward(c["x"], c["selected"], c["weights"], L.gate, L.up, L.down, L.activation, dtype=np.float32)
    assert out32.dtype == np.float32 and rel_rms(out32, c["ref_out"]) < 1e-5
    sel = c["selected"].copy()
    sel[0, 1] = L.num_experts  # sentinel: skipped
    sel[1, 0] = -1
    out = R.moe_forward(c["x"], sel, c["weights"], L.gate, L.up, L.down, L.activation)
    w = c["weights"].copy()
    w[0, 1] = 0
    w[1, 0] = 0
    want = R.moe_forward(c["x"], c["selected"], w, L.gate, L.up, L.down, L.activation)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_act_limit_clamps():
    L = LAYERS[0]
    c = L.calls[0]
    args = (c["x"], c["selected"], c["weights"], L.gate, L.up, L.down, "silu")
    free = R.moe_forward(*args)
    lim = R.moe_forward(*args, act_limit=0.05)
    assert rel_rms(lim, free) > 1e-3
    lim16 = R.moe_forward_fp16(*args, act_limit=0.05)
    assert rel_rms(lim16, lim) < 3e-3


@pytest.mark.parametrize("bad, exc, match", [
    (dict(activation="tanh"), ValueError, "activation"),
    (dict(gate=None), ValueError, "gate"),
    (dict(expert_weights=np.full((3, 2), np.nan, np.float16)), ValueError, "expert_weights"),
    (dict(expert_weights=np.ones((3, 3), np.float16)), ValueError, "top_k"),
    (dict(hidden=np.ones((3, 100), np.float16)), ValueError, "hidden"),
    (dict(expert_ids=np.ones((3, 2), np.float32)), TypeError, "expert_ids"),
    (dict(act_limit=-1.0), ValueError, "act_limit"),
])
def test_reference_argument_errors(bad, exc, match):
    with pytest.raises(exc, match=match):
        R.moe_forward(**moe_call_args(LAYERS[0], **bad))
