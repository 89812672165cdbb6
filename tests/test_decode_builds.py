"""Every build of the decoding shaders runs here, whichever one the device would pick: the portable build (shifts
and masks), the integer-dot-product build and the packed-fp16 build, through the linear op and the MoE op, plus
the measured quirks that choose between them."""
import os

import numpy as np
import pytest

import vkmoe
from goldens import golden_files, load_layer, rel_rms
from vkmoe.exl3 import dequantize, reference
from vkmoe.ops import kernels

BUILDS = ["", "idot", "f16"]


@pytest.fixture
def force_build(monkeypatch, device):
    def force(build):
        if build == "idot" and not device.features.get("shaderIntegerDotProduct"):
            pytest.skip("the device has no integer dot product")
        if build == "f16" and not (device.features.get("shaderIntegerDotProduct")
                                   and device.features.get("shaderFloat16")):
            pytest.skip("the device has no fp16 arithmetic")
        monkeypatch.setattr(kernels, "decode_variant", lambda dev: build)
    return force


def test_quirks_are_measured(device):
    q = device.quirks
    assert set(q) >= {"loop_iteration_cap", "subgroups_linear"}
    assert q["subgroups_linear"] in (True, False)
    fused = kernels.f16_fma_fused(device)  # measured by the ops layer with the mul1 constants
    assert fused in (True, False)
    if device.is_lavapipe:
        assert q["subgroups_linear"] is True
        # lavapipe splits fp16 fma into multiply + add: the exact fp32 mul1 form must be used there
        assert fused is False


def test_f16_build_needs_linear_subgroups(device, monkeypatch):
    monkeypatch.setenv("VKMOE_DECODE", "auto")
    monkeypatch.setattr(type(device), "quirks", property(lambda self: dict(self._quirks or {}, subgroups_linear=False)),
                        raising=False)
    assert kernels.decode_variant(device) in ("", "idot")
    monkeypatch.setenv("VKMOE_DECODE", "sometimes")
    with pytest.raises(ValueError, match="VKMOE_DECODE"):
        kernels.decode_variant(device)


@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b or "portable")
def test_linear_in_every_build(device, force_build, build):
    force_build(build)
    rng = np.random.default_rng(11)
    for bits, codebook in ((4, "mul1"), (3, "mcg"), (2, "3inst")):
        k, n = 256, 256
        tr = rng.integers(0, 1 << 16, size=(k // 16, n // 16, 16 * bits), dtype=np.uint16)
        t = vkmoe.Exl3Tensor(tr, (rng.standard_normal(k) * 0.1).astype(np.float16),
                             rng.standard_normal(n).astype(np.float16), codebook=codebook)
        x = rng.standard_normal((3, k)).astype(np.float16)
        with vkmoe.Exl3Linear(device, t) as lin:
            y = lin(x)
            if build != "f16":  # the dequantizer has no fp16 build; it checks the portable and idot decoders
                assert np.array_equal(lin.dequantize().view(np.uint16), dequantize(tr, codebook).view(np.uint16))
        assert np.isfinite(y).all()
        assert rel_rms(y.astype(np.float64), reference.linear_forward(x, t)) < 3e-3, (bits, codebook)


@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b or "portable")
def test_moe_in_every_build(device, force_build, build):
    force_build(build)
    path = next(p for p in golden_files() if os.path.basename(p).startswith("a_tiny"))
    L = load_layer(path)
    call = L.calls[0]
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation=L.activation) as moe:
        out = moe(call["x"], call["selected"], call["weights"], dispatch="split")
    assert np.isfinite(out).all()
    assert rel_rms(out, call["ref_out"]) < 3e-3


def test_fma_probe_reports_single_rounding_where_it_is_exact(device):
    """The probe's other answer: with c1 = 1 and c0 = 0 every fma is exact, so any driver rounds it once."""
    from vkmoe.vk.quirks import measure_f16_fma_rounds_once

    if not device.features.get("shaderFloat16"):
        pytest.skip("the device has no fp16 arithmetic")
    assert measure_f16_fma_rounds_once(device, kernels.FP16_1024, kernels.MUL1_BYTE_SUMS, 1.0, 0.0) is True
