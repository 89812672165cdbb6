"""Exl3Tensor validation and the safetensors loaders (exllamav3 key names)."""
import numpy as np
import pytest
from safetensors.numpy import save_file

from vkmoe.exl3 import Exl3Tensor, dequantize, load_exl3_tensor, load_moe_experts, save_exl3_tensor
from vkmoe.exl3.loaders import MCG_FLAG, MUL1_FLAG


def _parts(k=128, n=256, bits=4, seed=0):
    rng = np.random.default_rng(seed)
    tr = rng.integers(0, 65536, (k // 16, n // 16, 16 * bits), dtype=np.uint16)
    suh = rng.uniform(-2, 2, k).astype(np.float16)
    svh = rng.uniform(-2, 2, n).astype(np.float16)
    return tr, suh, svh


def test_valid_tensor_attributes():
    tr, suh, svh = _parts()
    t = Exl3Tensor(tr.view(np.int16), suh, svh, codebook="mcg", bias=np.ones(256, np.float32))
    assert (t.k, t.n, t.bits, t.codebook) == (128, 256, 4, "mcg")
    assert t.trellis.dtype == np.uint16 and t.trellis.flags.c_contiguous
    assert t.bias.dtype == np.float16
    assert t.nbytes == tr.nbytes + suh.nbytes + svh.nbytes + 512
    np.testing.assert_array_equal(t.dequantize(), dequantize(tr, "mcg"))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(trellis=np.zeros((8, 16, 64), np.float32)), TypeError, "trellis"),
    (dict(trellis=np.zeros((8, 16), np.uint16)), ValueError, "trellis"),
    (dict(trellis=np.zeros((8, 16, 40), np.uint16)), ValueError, "trellis"),
    (dict(trellis=np.zeros((8, 16, 144), np.uint16)), ValueError, "trellis"),
    (dict(trellis=np.zeros((4, 16, 64), np.uint16), suh=np.ones(64, np.float16)), ValueError, "trellis"),
    (dict(trellis=np.zeros((8, 4, 64), np.uint16), svh=np.ones(64, np.float16)), ValueError, "trellis"),
    (dict(suh=np.ones(128, np.float32)), TypeError, "suh"),
    (dict(suh=np.ones(64, np.float16)), ValueError, "suh"),
    (dict(svh=np.ones(255, np.float16)), ValueError, "svh"),
    (dict(svh=np.ones(256, np.int16)), TypeError, "svh"),
    (dict(svh=np.full(256, np.nan, np.float16)), ValueError, "svh"),
    (dict(codebook="mul2"), ValueError, "codebook"),
    (dict(codebook=None), ValueError, "codebook"),
    (dict(bias=np.ones(128, np.float16)), ValueError, "bias"),
    (dict(bias=np.ones(256, np.int32)), TypeError, "bias"),
    # a NaN bias, or a float32 one beyond float16's range (Inf once stored), was taken
    (dict(bias=np.full(256, np.nan, np.float16)), ValueError, "bias: expected finite values.*NaN/Inf"),
    (dict(bias=np.full(256, 1e6, np.float32)), ValueError, "bias: expected finite values.*beyond it"),
])
def test_validation_errors(kwargs, exc, match):
    tr, suh, svh = _parts()
    args = dict(trellis=tr, suh=suh, svh=svh, codebook="mul1", bias=None)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        Exl3Tensor(**args)


def _assert_same(a, b):
    np.testing.assert_array_equal(a.trellis, b.trellis)
    np.testing.assert_array_equal(a.suh, b.suh)
    np.testing.assert_array_equal(a.svh, b.svh)
    assert a.codebook == b.codebook and a.bits == b.bits
    assert (a.bias is None) == (b.bias is None)
    if a.bias is not None:
        np.testing.assert_array_equal(a.bias, b.bias)


def test_round_trip_file(tmp_path):
    tr, suh, svh = _parts()
    tensors = {
        "a": Exl3Tensor(tr, suh, svh, codebook="mul1"),
        "b": Exl3Tensor(tr, suh, svh, codebook="mcg", bias=np.linspace(-1, 1, 256).astype(np.float32)),
        "c": Exl3Tensor(tr, suh, svh, codebook="3inst"),
    }
    d = {}
    for k, t in tensors.items():
        save_exl3_tensor(d, f"model.layers.0.{k}", t)
    assert d["model.layers.0.a.mul1"] == MUL1_FLAG and d["model.layers.0.a.mul1"].dtype == np.int32
    assert d["model.layers.0.b.mcg"] == MCG_FLAG
    assert d["model.layers.0.a.trellis"].dtype == np.int16
    path = tmp_path / "t.safetensors"
    save_file(d, str(path))
    for k, t in tensors.items():
        _assert_same(load_exl3_tensor(str(path), f"model.layers.0.{k}"), t)
        _assert_same(load_exl3_tensor(d, f"model.layers.0.{k}"), t)


def test_legacy_sign_bitfields(tmp_path):
    rng = np.random.default_rng(3)
    tr = rng.integers(0, 65536, (8, 8, 32), dtype=np.uint16)
    suh = rng.choice([-1.0, 1.0], 128).astype(np.float16)
    svh = rng.choice([-1.0, 1.0], 128).astype(np.float16)
    t = Exl3Tensor(tr, suh, svh, codebook="mul1")
    d = save_exl3_tensor({}, "x", t, legacy_signs=True)
    assert "x.suh" not in d and d["x.su"].dtype == np.int16 and d["x.su"].shape == (8,)
    # bit i of word j <-> channel 16j + i, set => -1
    assert ((int(d["x.su"].view(np.uint16)[1]) >> 3) & 1) == (suh[19] < 0)
    save_file(d, str(tmp_path / "l.safetensors"))
    _assert_same(load_exl3_tensor(str(tmp_path / "l.safetensors"), "x"), t)
    # hand-made words: word 0 = 0x0001 -> channel 0 negative only
    d2 = dict(d)
    d2["x.su"] = np.zeros(8, np.int16)
    d2["x.su"][0] = 1
    su = load_exl3_tensor(d2, "x").suh
    assert su[0] == -1 and np.all(su[1:] == 1)


def _moe_dict(E=3, gated=True, codebook="mcg", prefix="model.layers.3.mlp"):
    d = {}
    for e in range(E):
        for p, (k, n) in (("gate", (128, 256)), ("up", (128, 256)), ("down", (256, 128))):
            if p == "gate" and not gated:
                continue
            tr, suh, svh = _parts(k, n, bits=3, seed=10 * e + len(p))
            save_exl3_tensor(d, f"{prefix}.experts.{e}.{p}_proj", Exl3Tensor(tr, suh, svh, codebook=codebook))
    return d


def test_moe_round_trip(tmp_path):
    d = _moe_dict()
    d["model.layers.3.mlp.gate.weight"] = np.zeros((3, 128), np.float16)  # router, not an expert
    save_file(d, str(tmp_path / "moe.safetensors"))
    res = load_moe_experts(str(tmp_path / "moe.safetensors"), "model.layers.3.mlp")
    assert res["num_experts"] == 3 and res["codebook"] == "mcg"
    assert res["bits"] == {"gate": 3, "up": 3, "down": 3}
    assert len(res["gate"]) == len(res["up"]) == len(res["down"]) == 3
    assert (res["down"][2].k, res["down"][2].n) == (256, 128)
    np.testing.assert_array_equal(res["up"][1].trellis, d["model.layers.3.mlp.experts.1.up_proj.trellis"].view(np.uint16))


def test_moe_gateless():
    res = load_moe_experts(_moe_dict(E=2, gated=False, codebook="mul1"), "model.layers.3.mlp")
    assert res["gate"] is None and len(res["up"]) == 2


def test_moe_missing_key():
    d = _moe_dict()
    del d["model.layers.3.mlp.experts.1.down_proj.trellis"]
    with pytest.raises(KeyError, match=r"experts\.1\.down_proj"):
        load_moe_experts(d, "model.layers.3.mlp")
    with pytest.raises(KeyError, match="nothere"):
        load_moe_experts(d, "nothere")
    d = _moe_dict()
    del d["model.layers.3.mlp.experts.2.up_proj.suh"]
    with pytest.raises(KeyError, match=r"experts\.2\.up_proj\.suh"):
        load_moe_experts(d, "model.layers.3.mlp")


def test_moe_mixed_codebook_and_bits():
    d = _moe_dict()
    del d["model.layers.3.mlp.experts.2.gate_proj.mcg"]
    d["model.layers.3.mlp.experts.2.gate_proj.mul1"] = np.array(MUL1_FLAG, np.int32)
    with pytest.raises(ValueError, match=r"experts\.2\.gate_proj: codebook"):
        load_moe_experts(d, "model.layers.3.mlp")
    d = _moe_dict()
    tr, suh, svh = _parts(128, 256, bits=5)
    save_exl3_tensor(d, "model.layers.3.mlp.experts.1.up_proj", Exl3Tensor(tr, suh, svh, codebook="mcg"))
    with pytest.raises(ValueError, match=r"experts\.1\.up_proj: 5 bits"):
        load_moe_experts(d, "model.layers.3.mlp")


def test_both_flags_error():
    d = _moe_dict(E=1)
    d["model.layers.3.mlp.experts.0.up_proj.mul1"] = np.array(MUL1_FLAG, np.int32)
    with pytest.raises(ValueError, match="both"):
        load_exl3_tensor(d, "model.layers.3.mlp.experts.0.up_proj")
    with pytest.raises(KeyError, match="trellis"):
        load_exl3_tensor(d, "model.layers.3.mlp.experts.0.nope")


def test_tensor_attributes_cannot_be_rebound():
    """The ops and the CPU tier cache what they derived from a tensor (device copies, pointers into its arrays),
    so rebinding `t.trellis` after a call used to leave them reading the old array (freed once unreferenced)."""
    import copy
    import pickle

    tr, suh, svh = _parts()
    t = Exl3Tensor(tr, suh, svh, bias=np.ones(256, np.float16))
    for name in ("trellis", "suh", "svh", "bias", "codebook", "k", "n", "bits", "_cache"):
        with pytest.raises(AttributeError, match=f"read-only: '{name}' cannot be set"):
            setattr(t, name, getattr(t, name))
        with pytest.raises(AttributeError, match="read-only"):
            delattr(t, name)
    with pytest.raises(AttributeError):
        t.extra = 1  # no such slot either
    w = t.dequantize()
    for clone in (pickle.loads(pickle.dumps(t)), copy.deepcopy(t), copy.copy(t)):
        assert clone is not t and (clone.k, clone.n, clone.bits, clone.codebook) == (t.k, t.n, t.bits, t.codebook)
        for name in ("trellis", "suh", "svh", "bias"):
            np.testing.assert_array_equal(getattr(clone, name), getattr(t, name))
            assert not getattr(clone, name).flags.writeable
        np.testing.assert_array_equal(clone.dequantize(), w)
