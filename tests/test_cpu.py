"""The native CPU tier against the numpy reference and the golden vectors (every ISA tier available)."""
import numpy as np
import pytest

from goldens import golden_files, load_layer, moe_call_args, reference_targets, rel_rms
from vkmoe import cpu
from vkmoe.exl3 import Exl3Tensor, dequantize
from vkmoe.exl3 import reference as R

LAYERS = [load_layer(p) for p in golden_files()]
CALLS = [(L, c) for L in LAYERS for c in L.calls]
IDS = [f"{L.name}{c['suffix'] or '_main'}" for L, c in CALLS]
ISAS = cpu.isa_tiers()


@pytest.fixture(params=ISAS)
def isa(request):
    cpu.set_max_isa(request.param)
    yield request.param
    cpu.set_max_isa(None)


@pytest.mark.parametrize("K", range(1, 9))
def test_dequantize_bit_exact(isa, K):
    rng = np.random.default_rng(K)
    for cb in ("3inst", "mcg", "mul1"):
        tr = rng.integers(0, 65536, (8, 16, 16 * K), dtype=np.uint16)
        got = cpu.dequantize(tr, cb)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, dequantize(tr, cb).astype(np.float32), err_msg=f"{cb} K={K}")


@pytest.mark.parametrize("layer, call", CALLS, ids=IDS)
def test_golden_moe(isa, layer, call):
    for act, ref in reference_targets(layer, call):
        out = cpu.moe_forward(call["x"], call["selected"], call["weights"], layer.gate, layer.up, layer.down,
                              act, layer.act_limit, threads=2)
        assert out.dtype == np.float32 and out.shape == ref.shape and np.all(np.isfinite(out))
        assert rel_rms(out, ref) < 3e-3, act
        if call["exl3_out"] is not None:
            assert rel_rms(out, call["exl3_out"]) < 3e-2


def test_deterministic_across_threads():
    L = LAYERS[1]
    c = L.calls[0]
    args = (c["x"], c["selected"], c["weights"], L.gate, L.up, L.down, L.activation)
    a = cpu.moe_forward(*args, threads=1)
    b = cpu.moe_forward(*args, threads=2)
    d = cpu.moe_forward(*args, threads=5)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, d)


def test_skipped_ids_and_limit(isa):
    L = LAYERS[0]
    c = L.calls[0]
    sel = c["selected"].copy()
    sel[0, 1] = L.num_experts
    sel[2, 0] = -1
    for lim in (0.0, 0.05):
        ref = R.moe_forward(c["x"], sel, c["weights"], L.gate, L.up, L.down, "silu", lim)
        out = cpu.moe_forward(c["x"], sel, c["weights"].astype(np.float32), L.gate, L.up, L.down, "silu", lim)
        assert rel_rms(out, ref) < 1e-5


@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_linear(isa, m):
    rng = np.random.default_rng(m)
    k, n = 256, 384
    for bits, cb in ((2, "mul1"), (5, "mcg"), (8, "3inst")):
        tr = rng.integers(0, 65536, (k // 16, n // 16, 16 * bits), dtype=np.uint16)
        t = Exl3Tensor(tr, rng.uniform(-1, 1, k).astype(np.float16), rng.uniform(-1, 1, n).astype(np.float16),
                       codebook=cb, bias=rng.standard_normal(n).astype(np.float32))
        x = rng.standard_normal((m, k)).astype(np.float16)
        y = cpu.linear(x, t)
        assert y.dtype == np.float32 and y.shape == (m, n)
        assert rel_rms(y, R.linear_forward(x, t)) < 1e-5


def test_empty_routing():
    L = LAYERS[0]
    c = L.calls[0]
    sel = np.full_like(c["selected"], -1)
    out = cpu.moe_forward(c["x"], sel, c["weights"], L.gate, L.up, L.down, "silu")
    assert np.all(out == 0)


@pytest.mark.parametrize("bad, exc, match", [
    (dict(activation="swish"), ValueError, "activation"),
    (dict(activation="relu2"), ValueError, "gate"),
    (dict(expert_weights=np.array([[np.nan, 1], [1, 1], [1, 1]], np.float32)), ValueError, "expert_weights"),
    (dict(expert_weights=np.ones((3, 1), np.float32)), ValueError, "top_k"),
    (dict(expert_ids=np.zeros((2, 2), np.int64)), ValueError, "expert_ids"),
    (dict(hidden=np.ones((3, 256), np.int32)), TypeError, "hidden"),
    (dict(hidden=np.ones((3, 256), np.float64)), TypeError, "hidden"),
    (dict(up=[]), TypeError, "up"),
    (dict(threads=0), ValueError, "threads"),
])
def test_argument_errors(bad, exc, match):
    with pytest.raises(exc, match=match):
        cpu.moe_forward(**moe_call_args(LAYERS[0], **bad))


def test_linear_and_dequantize_errors():
    t = LAYERS[0].up[0]
    with pytest.raises(ValueError, match="x"):
        cpu.linear(np.ones((2, 100), np.float16), t)
    with pytest.raises(TypeError, match="tensor"):
        cpu.linear(np.ones((2, 256), np.float16), "nope")
    with pytest.raises(ValueError, match="codebook"):
        cpu.dequantize(t.trellis, "mul1_exact")


def test_missing_native_module_message():
    import subprocess
    import sys

    code = ("import sys; sys.modules['vkmoe._native'] = None\n"
            "try:\n    import vkmoe.cpu\nexcept ImportError as e:\n    print('MSG', e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install -e ." in res.stdout and "C compiler" in res.stdout, res.stdout + res.stderr


def test_exl3_package_has_no_vulkan_or_native_imports():
    import pathlib
    import re

    import vkmoe.exl3

    for f in pathlib.Path(vkmoe.exl3.__file__).parent.glob("*.py"):
        src = f.read_text()
        assert not re.search(r"^\s*(import|from)\s+(vulkan|vkmoe\.vk|vkmoe\.cpu|\.\.cpu|\.\._native)", src, re.M), f


def test_expert_list_cache_is_safe_across_threads(monkeypatch):
    """A thread's cache hit must not be evicted by another thread before it is refreshed (it was: a KeyError).

    Deterministic: the cache pauses the first thread between its lookup and its refresh until a second thread's
    call, which evicts the oldest entry, has returned (or 0.5 s). With the lock the second call waits instead.
    """
    import threading
    from collections import OrderedDict
    from vkmoe.exl3 import synthetic

    per_layer = 3  # lists of a call: gate, up, down
    fill = cpu._LIST_CACHE_SIZE // per_layer  # layers whose lists fit the cache; one more evicts layers[0]'s
    layers = [synthetic.random_moe_layer(128, 128, 2, bits=1, seed=s) for s in range(fill + 1)]
    h = np.random.default_rng(0).standard_normal((1, 128)).astype(np.float16)
    ids, w = np.array([[0, 1]]), np.array([[0.5, 0.5]], np.float32)
    paused, second_done = threading.Event(), threading.Event()
    first = threading.current_thread()

    class PausingCache(OrderedDict):
        def move_to_end(self, key, last=True):
            if threading.current_thread() is first and not paused.is_set():
                paused.set()
                second_done.wait(0.5)
            super().move_to_end(key, last)

    monkeypatch.setattr(cpu, "_LIST_CACHE", PausingCache())
    want = [R.moe_forward(h, ids, w, *L).astype(np.float32) for L in layers]
    for L in layers[:fill]:  # layers[0]'s lists are the oldest entries
        cpu.moe_forward(h, ids, w, *L, threads=1)
    got = {}

    def second():
        paused.wait(5)
        got["second"] = cpu.moe_forward(h, ids, w, *layers[-1], threads=1)  # a new list: evicts the oldest
        second_done.set()

    t = threading.Thread(target=second)
    t.start()
    got["first"] = cpu.moe_forward(h, ids, w, *layers[0], threads=1)  # hits, then pauses before the refresh
    t.join(10)
    assert paused.is_set() and not t.is_alive()
    assert rel_rms(got["first"], want[0]) < 3e-3 and rel_rms(got["second"], want[-1]) < 3e-3
