"""vkmoe.registry: registration, availability, backend choice (auto, VKMOE_BACKEND, simulated no-Vulkan)."""
import importlib

import numpy as np
import pytest

from vkmoe import registry
from vkmoe.exl3 import Exl3Tensor
from vkmoe.exl3 import reference as ref
from vkmoe.registry import RegistryError


def _importable(modname, cls):
    try:
        getattr(importlib.import_module(modname), cls)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not landed yet"
        return pytest.mark.skipif(True, reason=f"{modname}.{cls} not importable yet ({type(exc).__name__}: {exc})")
    return pytest.mark.skipif(False, reason="")


needs_vulkan_linear = _importable("vkmoe.ops.linear", "Exl3Linear")
needs_vulkan_moe = _importable("vkmoe.ops.moe", "Exl3MoeMlp")


@pytest.fixture
def fake_vulkan(monkeypatch):
    """A Vulkan backend that looks usable without touching a device; counts probes."""
    calls = []

    def probe():
        calls.append(1)
        return True, "fake device"

    registry.reset()
    monkeypatch.setattr(registry, "_probe_vulkan", probe)
    monkeypatch.setattr(registry, "_op_importable", lambda op: (True, ""))
    monkeypatch.delenv("VKMOE_BACKEND", raising=False)
    yield calls
    registry.reset()


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv("VKMOE_BACKEND", raising=False)


def _tensor(rng, k, n):
    tr = rng.integers(0, 1 << 16, size=(k // 16, n // 16, 64), dtype=np.uint16)
    suh = (rng.choice([-1.0, 1.0], k) / np.sqrt(k)).astype(np.float16)
    svh = rng.choice([-1.0, 1.0], n).astype(np.float16)
    return Exl3Tensor(tr, suh, svh, codebook="mul1")


def _rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2))


def test_registered_lists_every_op_backend_pair():
    pairs = set(registry.registered())
    assert {("exl3_linear", "vulkan"), ("exl3_linear", "cpu"), ("exl3_moe_mlp", "vulkan"),
            ("exl3_moe_mlp", "cpu")} <= pairs


def test_cpu_pairs_available():
    assert ("exl3_linear", "cpu") in registry.available()
    assert ("exl3_moe_mlp", "cpu") in registry.available()


def test_unknown_op_lists_what_exists():
    with pytest.raises(RegistryError) as exc:
        registry.create("exl3_conv")
    msg = str(exc.value)
    assert "exl3_conv" in msg and "exl3_linear" in msg and "exl3_moe_mlp" in msg


def test_unknown_backend_lists_backends():
    with pytest.raises(RegistryError) as exc:
        registry.create("exl3_linear", None, backend="metal")
    assert "metal" in str(exc.value) and "vulkan" in str(exc.value) and "cpu" in str(exc.value)


def test_register_and_unregister_custom_backend():
    registry.register("exl3_linear", "test_backend", lambda t, device=None: ("made", t))
    try:
        assert ("exl3_linear", "test_backend") in registry.registered()
        assert registry.create("exl3_linear", 7, backend="test_backend") == ("made", 7)
        with pytest.raises(RegistryError, match="already registered"):
            registry.register("exl3_linear", "test_backend", lambda t, device=None: None)
    finally:
        registry.unregister("exl3_linear", "test_backend")
    assert ("exl3_linear", "test_backend") not in registry.registered()


def test_no_vulkan_device_selects_cpu(fake_vulkan):
    with registry.simulate_no_vulkan():
        assert registry.select_backend() == "cpu"
        assert registry.select_backend(ops=("exl3_moe_mlp", "exl3_linear")) == "cpu"
        assert ("exl3_moe_mlp", "vulkan") not in registry.available()
        op = registry.create("exl3_linear", _tensor(np.random.default_rng(0), 128, 128))
        assert isinstance(op, registry.CpuExl3Linear)


def test_failed_probe_selects_cpu(monkeypatch):
    registry.reset()
    monkeypatch.setattr(registry, "_probe_vulkan", lambda: (False, "no usable Vulkan device (test)"))
    try:
        assert registry.select_backend() == "cpu"
        assert registry.vulkan_status() == (False, "no usable Vulkan device (test)")
        with pytest.raises(RegistryError, match="vulkan"):
            registry.default_device()
    finally:
        registry.reset()


def test_usable_vulkan_selects_vulkan_and_probe_is_cached(fake_vulkan):
    assert registry.select_backend() == "vulkan"
    assert registry.select_backend(ops="exl3_moe_mlp") == "vulkan"
    assert ("exl3_moe_mlp", "vulkan") in registry.available()
    assert len(fake_vulkan) == 1


def test_vulkan_not_selected_when_op_module_missing(fake_vulkan, monkeypatch):
    monkeypatch.setattr(registry, "_op_importable", lambda op: (False, "vkmoe.ops.moe missing"))
    assert registry.select_backend(ops="exl3_moe_mlp") == "cpu"


def test_env_override(fake_vulkan, monkeypatch):
    monkeypatch.setenv("VKMOE_BACKEND", "cpu")
    assert registry.select_backend() == "cpu"
    monkeypatch.setenv("VKMOE_BACKEND", "vulkan")
    assert registry.select_backend() == "vulkan"
    with registry.simulate_no_vulkan():
        with pytest.raises(RegistryError, match="VKMOE_BACKEND=vulkan"):
            registry.select_backend()


def test_env_override_invalid_value(monkeypatch):
    monkeypatch.setenv("VKMOE_BACKEND", "cuda")
    with pytest.raises(RegistryError) as exc:
        registry.select_backend()
    assert "cuda" in str(exc.value) and "vulkan" in str(exc.value) and "cpu" in str(exc.value)


def test_explicit_backend_beats_env(monkeypatch):
    monkeypatch.setenv("VKMOE_BACKEND", "vulkan")
    op = registry.create("exl3_linear", _tensor(np.random.default_rng(0), 128, 128), backend="cpu")
    assert isinstance(op, registry.CpuExl3Linear)


def test_cpu_linear_matches_reference():
    rng = np.random.default_rng(1)
    t = _tensor(rng, 256, 128)
    x = rng.standard_normal((5, 256)).astype(np.float16)
    y = registry.create("exl3_linear", t, backend="cpu")(x)
    assert y.dtype == np.float16 and y.shape == (5, 128)
    assert _rel_rms(y, ref.linear_forward(x, t)) < 3e-3


def _moe_args(rng, E=4, H=128, I=128, m=6, topk=2):
    gate = [_tensor(rng, H, I) for _ in range(E)]
    up = [_tensor(rng, H, I) for _ in range(E)]
    down = [_tensor(rng, I, H) for _ in range(E)]
    x = rng.standard_normal((m, H)).astype(np.float16)
    ids = np.stack([rng.permutation(E)[:topk] for _ in range(m)])
    w = rng.random((m, topk)).astype(np.float32)
    return gate, up, down, x, ids, w


def test_cpu_moe_matches_reference():
    rng = np.random.default_rng(2)
    gate, up, down, x, ids, w = _moe_args(rng)
    op = registry.create("exl3_moe_mlp", gate, up, down, activation="silu", backend="cpu")
    y = op(x, ids, w)
    assert y.dtype == np.float32 and op.last_run["mode"] == "cpu"
    assert _rel_rms(y, ref.moe_forward(x, ids, w, gate, up, down, "silu")) < 3e-3


@needs_vulkan_linear
def test_vulkan_linear_factory(device):
    import vkmoe

    rng = np.random.default_rng(3)
    t = _tensor(rng, 128, 128)
    lin = registry.create("exl3_linear", t, backend="vulkan", device=device)
    assert isinstance(lin, vkmoe.Exl3Linear)
    x = rng.standard_normal((3, 128)).astype(np.float16)
    assert _rel_rms(lin(x), ref.linear_forward(x, t)) < 3e-3


@needs_vulkan_moe
def test_vulkan_moe_factory(device):
    import vkmoe

    rng = np.random.default_rng(4)
    gate, up, down, x, ids, w = _moe_args(rng, E=2, m=3)
    moe = registry.create("exl3_moe_mlp", gate, up, down, activation="silu", backend="vulkan", device=device)
    assert isinstance(moe, vkmoe.Exl3MoeMlp)
    assert _rel_rms(moe(x, ids, w), ref.moe_forward(x, ids, w, gate, up, down, "silu")) < 3e-3
    assert "mode" in moe.last_run


@needs_vulkan_moe
@needs_vulkan_linear
def test_real_probe_selects_vulkan_here():
    registry.reset()
    try:
        ok, why = registry.vulkan_status()
        if not ok:
            pytest.skip(f"no Vulkan device on this machine: {why}")
        assert registry.select_backend(ops=("exl3_moe_mlp", "exl3_linear")) == "vulkan"
    finally:
        registry.reset()


@needs_vulkan_moe
@needs_vulkan_linear
@pytest.mark.parametrize("backend", ["vulkan", "cpu"])
def test_both_backends_take_and_refuse_the_same_calls(device, backend):
    """"Callers never branch on the backend": the CPU ops took no dispatch / out_dtype / out argument, had no
    close() or `with`, rounded float32 or int hidden silently, and checked the layer only at its first call."""
    rng = np.random.default_rng(5)
    gate, up, down, x, ids, w = _moe_args(rng, E=4, m=3)
    dev = device if backend == "vulkan" else None
    want = ref.moe_forward(x, ids, w, gate, up, down, "silu")
    with registry.create("exl3_moe_mlp", gate, up, down, backend=backend, device=dev) as moe:
        assert _rel_rms(moe(x, ids, w, dispatch="split"), want) < 3e-3
        y16 = moe(x, ids.tolist(), w, out_dtype=np.float16)
        assert y16.dtype == np.float16 and _rel_rms(y16, want) < 3e-3
        for bad, exc, match in [((x.astype(np.float32), ids, w), TypeError, "hidden must be float16"),
                                ((x[:, :64], ids, w), ValueError, r"hidden: expected shape \(m, 128\)"),
                                ((x, ids + 4, w), ValueError, r"expert_ids must lie in \[0, 4\)"),
                                ((x, ids, w[:, :1]), ValueError, "expert_weights")]:
            with pytest.raises(exc, match=match):
                moe(*bad)
        with pytest.raises(ValueError, match="dispatch argument='fast'"):
            moe(x, ids, w, dispatch="fast")
        with pytest.raises(ValueError, match="out_dtype"):
            moe(x, ids, w, out_dtype=np.int32)
        if backend == "cpu":
            with pytest.raises(ValueError, match="out: the cpu backend returns numpy arrays"):
                moe(x, ids, w, out="device")
    with pytest.raises(Exception, match="this .*MoeMlp is closed"):
        moe(x, ids, w)
    for args, kw, exc, match in [((gate, up, down), dict(activation="nope"), ValueError, "activation"),
                                 ((gate, up, down[:2]), {}, ValueError, "experts"),
                                 ((gate, up, down), dict(act_limit=-1.0), ValueError, "act_limit"),
                                 ((gate, up, down), dict(dispatch="fast"), ValueError, "dispatch"),
                                 ((gate, up, ["x"] * 4), {}, TypeError, "down")]:
        with pytest.raises(exc, match=match):
            registry.create("exl3_moe_mlp", *args, backend=backend, device=dev, **kw)

    t = up[0]
    xl = rng.standard_normal((2, 128)).astype(np.float16)
    with registry.create("exl3_linear", t, backend=backend, device=dev) as lin:
        want = ref.linear_forward(xl, t)
        assert lin(xl).dtype == np.float16 and _rel_rms(lin(xl), want) < 3e-3
        y32 = lin(xl.astype(np.float32), out_dtype=np.float32)
        assert y32.dtype == np.float32 and np.array_equal(y32, lin(xl).astype(np.float32))
        with pytest.raises(TypeError, match="x: expected float16 or float32"):
            lin(np.ones((2, 128), np.int32))
        with pytest.raises(ValueError, match="x: float32 values beyond float16's range"):
            lin(np.full((2, 128), 1e6, np.float32))
    with pytest.raises(Exception, match="this .*Linear is closed"):
        lin(xl)
    with pytest.raises(TypeError, match="tensor must be a vkmoe.Exl3Tensor"):
        registry.create("exl3_linear", "x", backend=backend, device=dev)
