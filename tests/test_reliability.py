"""Regression tests for the faults found by using vkmoe as a hostile user would (issue 13): loop-cap safe
zero rows, a closed device, broken or unwritable caches, arrays shared with the caller, leaks, and validation
gaps. Each test compares real outputs (poisoned first) with the float64 reference or exact zeros."""
import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import vkmoe
from vkmoe.exl3 import reference
from goldens import golden_files, load_layer, rel_rms

TOL = 3e-3
TINY = next(p for p in golden_files() if p.endswith("a_tiny_silu_k4.npz"))  # H 256, I 128, E 8, mul1 K4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_layer():
    return load_layer(TINY)


# ------------------------------------------------------------------------------ 1: zero rows vs the loop cap
def test_unrouted_tokens_get_zero_rows_past_the_loop_cap(device, tiny_layer):
    """m * H / 256 = 70,000 > 65,536: the old single-workgroup zero sweep stopped early on Mesa 22.3 and left
    NaN poison in thousands of rows. Only token 0 is routed; every other row must be exactly 0, token 0's row
    must match the reference, and split and persistent must agree bit for bit."""
    L = tiny_layer
    m, H = 70_000, L.hidden_size
    rng = np.random.default_rng(1)
    x = rng.standard_normal((m, H)).astype(np.float16)
    expert_count = np.zeros(L.num_experts, np.int64)
    expert_count[3] = 1
    token_sorted, weight_sorted = np.array([0]), np.array([0.75], np.float32)
    outs = {}
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation="silu") as moe:
        for mode in ("split", "persistent"):
            y = moe.forward_sorted(x, expert_count, token_sorted, weight_sorted, dispatch=mode)
            assert y.shape == (m, H)
            nan_rows = int(np.isnan(y).any(axis=1).sum())
            assert nan_rows == 0, f"{mode}: {nan_rows} rows kept the NaN poison"
            assert not y[1:].any(), f"{mode}: unrouted rows are not zero"
            outs[mode] = y
    ref = reference.moe_forward(x[:1], np.array([[3]]), np.array([[0.75]]), L.gate, L.up, L.down,
                                activation="silu")
    assert rel_rms(outs["split"][:1], ref) < TOL
    assert np.array_equal(outs["split"], outs["persistent"])


# ------------------------------------------------------------------------------------ 2: a closed device
# Defined in every script: `work(outcome, started)` runs forwards in a thread (counting them in outcome["n"],
# setting `started` once one is done) until dev.close(), `delay` seconds after the first, makes it raise.
_RACE_CLOSE = textwrap.dedent("""
    import time
    def race_close(dev, work, delay=None):
        outcome = {"n": 0}
        started = threading.Event()
        def worker():
            try:
                work(outcome, started)
            except vkmoe.VkmoeError as exc:
                outcome["error"] = exc
            except BaseException as exc:
                outcome["other"] = exc
            started.set()
        t = threading.Thread(target=worker)
        t.start()
        started.wait(120)
        if delay is not None:
            time.sleep(delay)
        dev.close()
        t.join(120)
        assert "other" not in outcome, outcome
        assert "is closed" in str(outcome["error"]), outcome
        print("OK", outcome["n"], "forwards before close")
""")


def _run_script(body, env=None, timeout=240):
    """Run `body` in a fresh interpreter (a crash must not take the test run with it); returns the result."""
    script = textwrap.dedent("""
        import sys, threading
        import numpy as np
        sys.path.insert(0, {tests!r})
        import vkmoe
        from goldens import load_layer
        L = load_layer({tiny!r})
    """).format(tests=os.path.join(REPO, "tests"), tiny=TINY) + _RACE_CLOSE + textwrap.dedent(body)
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=REPO)


def _assert_closed_error(result):
    assert result.returncode == 0, f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr[-3000:]}"
    assert "OK" in result.stdout, result.stdout
    assert "validation:" not in result.stderr, result.stderr[-3000:]


CLOSED_CASES = {
    "layer called after close": """
        dev = vkmoe.Device()
        moe = vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, dispatch="split")
        c = L.calls[0]
        moe(c["x"], c["selected"], c["weights"])
        dev.close()
        try:
            moe(c["x"], c["selected"], c["weights"])
        except vkmoe.VkmoeError as exc:
            assert "is closed" in str(exc) and "vkmoe.Device" in str(exc), exc
            print("OK", exc)
        moe.close()  # closing the layer afterwards is harmless
    """,
    "op created on a closed device": """
        dev = vkmoe.Device()
        dev.close()
        for make in (lambda: vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down),
                     lambda: vkmoe.Exl3Linear(dev, L.up[0]),
                     lambda: dev.memory.allocate(64),
                     lambda: vkmoe.CommandRecorder(dev)):
            try:
                make()
                raise SystemExit("no error")
            except vkmoe.VkmoeError as exc:
                assert "is closed" in str(exc), exc
        print("OK")
    """,
    "close while another thread runs forwards": """
        dev = vkmoe.Device()
        moe = vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, dispatch="split")
        c = L.calls[0]
        ref = moe(c["x"], c["selected"], c["weights"])
        def work(outcome, started):
            while True:
                y = moe(c["x"], c["selected"], c["weights"])
                assert np.array_equal(y, ref)
                outcome["n"] += 1
                started.set()
        race_close(dev, work)
    """,
    "close while another thread builds, records and runs layers": """
      for delay in (0.0, 0.001, 0.003, 0.01, 0.03, 0.1):  # close() lands in different phases of the work
        dev = vkmoe.Device()
        c = L.calls[0]
        def work(outcome, started):
            while True:  # a new layer each time: allocation, upload, recording and submission all race close()
                moe = vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, dispatch="split")
                for m in (1, 2, 3):
                    moe(c["x"][:m], c["selected"][:m], c["weights"][:m])
                    outcome["n"] += 1
                    started.set()
                moe.close()
        race_close(dev, work, delay)
    """,
}


@pytest.mark.parametrize("case", sorted(CLOSED_CASES))
def test_closed_device_raises_instead_of_crashing(case):
    _assert_closed_error(_run_script(CLOSED_CASES[case]))


# --------------------------------------------------------------------- 3, 4: malformed or unwritable caches
from vkmoe.sched import residency  # noqa: E402
from vkmoe.vk import quirks  # noqa: E402
from vkmoe.vk.cachefile import CacheWarning  # noqa: E402


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory of the test's own, with nothing remembered from earlier measurements."""
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(quirks, "_measured", {})
    monkeypatch.setattr(residency, "_unsaved", {})
    (tmp_path / "cache").mkdir()
    return tmp_path / "cache"


def _write(path, text):
    path.write_text(text)
    return path


def _forward_ok(dev, L, dispatch):
    c = L.calls[0]
    with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu") as moe:
        y = moe(c["x"], c["selected"], c["weights"], dispatch=dispatch)
    ref = reference.moe_forward(c["x"], c["selected"], c["weights"], L.gate, L.up, L.down, activation="silu")
    assert rel_rms(y, ref) < TOL, dispatch


@pytest.mark.parametrize("content", ["[]", "{not json", "\xff\xfe", '{"KEY": "abc"}',
                                     '{"KEY": {"loop_iteration_cap": "abc", "subgroups_linear": true}}',
                                     '{"KEY": {"loop_iteration_cap": null, "subgroups_linear": 3}}'])
def test_malformed_quirks_cache_is_measured_again_and_repaired(device, fresh_cache, content):
    truth = dict(device.quirks)  # measured (or validly cached) before the cache was broken
    quirks._measured.clear()
    path = _write(fresh_cache / "quirks.json", content.replace("KEY", device.identity.replace('"', '\\"')))
    with pytest.warns(CacheWarning, match="ignoring"):
        got = quirks.detect_quirks(device)
    assert got == truth
    import json

    assert json.loads(path.read_text())[device.identity] == truth  # the file was repaired
    assert quirks.detect_quirks(device) == truth


def test_malformed_residency_cache_leaves_every_mode_working(fresh_cache, tiny_layer, monkeypatch):
    import json

    monkeypatch.delenv("VKMOE_PERSISTENT_GRID", raising=False)
    with vkmoe.Device() as dev:
        key = residency.device_key(dev)
        variant = residency.variant_key((256, 16384))
        for bad in ("abc", {variant: {"format": residency.FORMAT, "persistent": True, "grid": "abc",
                                      "co_resident": {"min": "abc"}}},
                    {residency.CROSSOVER_KEY: {"format": residency.FORMAT, "shapes": {"x": {"max_m": "abc"}}}}):
            _write(fresh_cache / "residency.json", json.dumps({key: bad}))
            residency.forget_checks()  # as another process's store, seen once STAT_INTERVAL_S has passed
            with pytest.warns(CacheWarning):
                for dispatch in ("split", "persistent", "auto"):
                    _forward_ok(dev, tiny_layer, dispatch)
            if isinstance(bad, dict) and variant in bad:
                with pytest.warns(CacheWarning, match="grid='abc'"):
                    assert residency.lookup(dev, variant) is None
        assert not dev.take_validation_messages()


def test_unwritable_cache_dir_keeps_measurements_in_memory(tmp_path, monkeypatch, tiny_layer):
    blocker = _write(tmp_path / "a-file", "not a directory")
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(blocker / "vkmoe"))
    monkeypatch.setattr(quirks, "_measured", {})
    monkeypatch.setattr(residency, "_unsaved", {})
    with vkmoe.Device() as dev:
        with pytest.warns(CacheWarning, match="cannot write"):
            info = dev.info()
        assert set(quirks.MEASUREMENTS) <= set(info["quirks"])
        assert dev.identity in quirks._measured  # a second device in this process does not measure again
        calls = []
        monkeypatch.setattr(quirks, "MEASUREMENTS", {k: (lambda d, k=k: calls.append(k)) for k in quirks.MEASUREMENTS})
        assert quirks.detect_quirks(dev) == info["quirks"] and not calls
        for dispatch in ("split", "auto"):
            _forward_ok(dev, tiny_layer, dispatch)
        report_entry = {"workgroup_size": 256, "shared_bytes": 16384, "verdict": {"persistent": True, "grid": 2,
                        "reason": "test"}, "co_resident": {"min": 2, "median": 2, "samples": [2], "launched": 4}}
        with pytest.warns(CacheWarning, match="cannot write"):
            residency.store(dev, {"variants": [report_entry], "quirks": {}, "device": {}})
        assert residency.lookup(dev, (256, 16384))["grid"] == 2  # kept in memory for this process
        assert not dev.take_validation_messages()


# ------------------------------------------------------------------------------------------------ 8: leaks
def _bytes_in_use(dev):
    blocks = [b for kind in dev.memory._blocks.values() for b in kind]
    return sum(b.size - sum(size for _, size in b.free) for b in blocks)


def test_layer_dropped_without_close_frees_its_memory(dev, tiny_layer):
    import gc

    L, c = tiny_layer, tiny_layer.calls[0]
    with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu", dispatch="split"):
        pass  # (on a discrete GPU the first upload makes the memory manager's staging buffer, which it keeps)
    gc.collect()
    before = _bytes_in_use(dev)
    for _ in range(5):
        moe = vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu", dispatch="split")
        y = moe(c["x"], c["selected"], c["weights"])
        assert np.isfinite(y).all()
        assert _bytes_in_use(dev) > before
        del moe, y
        gc.collect()
        assert _bytes_in_use(dev) == before
    layer = vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu", dispatch="split")
    layer.close()  # close() and then the finalizer: nothing is freed twice
    del layer
    gc.collect()
    assert _bytes_in_use(dev) == before


def test_oversized_batch_is_rejected_without_allocating(dev, tiny_layer):
    L = tiny_layer
    m = 70_000  # top_k 2: the stage buffers need 2 * m * 2 * H * 2 bytes, more than lavapipe's 128 MiB range
    limit = dev.limits.maxStorageBufferRange
    if 4 * m * 2 * L.hidden_size <= limit:  # (a GPU's 4 GB range: the batch would need host arrays of gigabytes)
        pytest.skip(f"this device's maxStorageBufferRange ({limit}) holds the test's batch")
    x = np.ones((m, L.hidden_size), np.float16)
    ids = np.tile(np.array([[1, 2]]), (m, 1))
    w = np.full((m, 2), 0.5, np.float16)
    with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu", dispatch="split") as moe:
        before = _bytes_in_use(dev)
        for _ in range(3):
            with pytest.raises(ValueError, match=rf"hidden: {m} rows x top_k 2: the routed op's .* would need \d+ "
                                                 r"bytes, more than this device's maxStorageBufferRange"):
                moe(x, ids, w)
            assert _bytes_in_use(dev) == before
        y = moe(x[:2], ids[:2], w[:2])  # the layer still works
        ref = reference.moe_forward(x[:2], ids[:2], w[:2], L.gate, L.up, L.down, activation="silu")
        assert rel_rms(y, ref) < TOL


# ------------------------------------------------------------------------- 7: arrays shared with the caller
def test_oversized_linear_batch_names_x_without_allocating(dev):
    """An Exl3Linear call whose x, output or k-split partials would pass maxStorageBufferRange: a ValueError naming
    x and its rows, before anything is allocated or any cached shape evicted; the layer still works."""
    from test_linear import make_tensor, make_x

    k = n = 2048
    limit = dev.limits.maxStorageBufferRange
    big_x, big_partial = limit // (2 * k) + 1, limit // (4 * n) + 1  # (lavapipe: 32769 and 16385 rows)
    assert big_partial * k * 2 <= limit, "x itself would be too large: pick another k"
    tensor = make_tensor(k, n, 4, "mul1", seed=5)
    with vkmoe.Exl3Linear(dev, tensor) as lin:
        x = make_x(2, k)
        want = lin(x)
        before = _bytes_in_use(dev)
        for m, what in ((big_x, "its fp16 copy"), (big_partial, "the GEMM's k-split partials")):
            with pytest.raises(ValueError, match=rf"x: {m} rows: {what} would need \d+ bytes, more than this "
                                                 r"device's maxStorageBufferRange"):
                lin(np.zeros((m, k), np.float16))
            assert _bytes_in_use(dev) == before
        assert np.array_equal(lin(x).view(np.uint16), want.view(np.uint16))
        assert rel_rms(want.astype(np.float32), reference.linear_forward(x, tensor).astype(np.float32)) < TOL


def test_exl3_tensor_keeps_its_own_read_only_arrays(tiny_layer):
    t0 = tiny_layer.up[0]
    trellis, suh, svh = t0.trellis.copy(), t0.suh.copy(), t0.svh.copy()
    t = vkmoe.Exl3Tensor(trellis, suh, svh, codebook=t0.codebook)
    w = t.dequantize().copy()
    svh[:] = np.nan
    suh[:] = np.nan
    trellis[:] = 0
    assert np.isfinite(t.svh).all() and np.isfinite(t.suh).all()
    assert np.array_equal(t.dequantize(), w)
    assert np.array_equal(vkmoe.Exl3Tensor(t.trellis, t.suh, t.svh, codebook=t.codebook).dequantize(), w)
    for name in ("trellis", "suh", "svh"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(t, name)[0] = 0


# -------------------------------------------------------------------------------------- 9: validation gaps
def test_float64_weight_beyond_float32_is_rejected(device, tiny_layer):
    L, c = tiny_layer, tiny_layer.calls[0]
    w = c["weights"].astype(np.float64)
    w[0, 0] = 1e300  # finite in float64, Inf once cast to the float32 the kernels use
    from vkmoe import cpu, registry

    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, dispatch="split") as moe:
        with pytest.raises(ValueError, match="expert_weights.*float32"):
            moe(c["x"], c["selected"], w)
        y = moe(c["x"], c["selected"], c["weights"])  # still fine afterwards
    with pytest.raises(ValueError, match="expert_weights.*float32"):
        cpu.moe_forward(c["x"], c["selected"], w, L.gate, L.up, L.down)
    with pytest.raises(ValueError, match="expert_weights.*float32"):
        registry.create("exl3_moe_mlp", L.gate, L.up, L.down, backend="cpu")(c["x"], c["selected"], w)
    ref = reference.moe_forward(c["x"], c["selected"], c["weights"], L.gate, L.up, L.down, activation="silu")
    assert rel_rms(y, ref) < TOL


def test_forward_sorted_rejects_float_indices(device, tiny_layer):
    L = tiny_layer
    x = np.ones((2, L.hidden_size), np.float16)
    count = np.zeros(L.num_experts, np.int64)
    count[1] = 2
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, dispatch="split") as moe:
        with pytest.raises(TypeError, match="token_sorted must be an integer array, got dtype float64"):
            moe.forward_sorted(x, count, np.array([0.0, 1.7]), np.array([0.5, 0.5], np.float32))
        with pytest.raises(TypeError, match="expert_count must be an integer array"):
            moe.forward_sorted(x, count.astype(np.float32), np.array([0, 1]), np.array([0.5, 0.5], np.float32))


def test_cpu_backend_rejects_the_ids_the_vulkan_backend_rejects(tiny_layer):
    from vkmoe import registry

    L, c = tiny_layer, tiny_layer.calls[0]
    op = registry.create("exl3_moe_mlp", L.gate, L.up, L.down, backend="cpu")
    ids = c["selected"].copy()
    ids[0, 0] = L.num_experts
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, %d\)" % L.num_experts):
        op(c["x"], ids, c["weights"])
    ids = c["selected"].copy()
    ids[0, 1] = ids[0, 0]
    with pytest.raises(ValueError, match="expert_ids row 0 names an expert twice"):
        op(c["x"], ids, c["weights"])
    y = op(c["x"], c["selected"], c["weights"])
    ref = reference.moe_forward(c["x"], c["selected"], c["weights"], L.gate, L.up, L.down, activation="silu")
    assert rel_rms(y, ref) < TOL


def _checkpoint_files(tiny_layer, tmp_path, drop_last=False):
    from safetensors.numpy import save_file
    from vkmoe.exl3 import save_exl3_tensor

    L, prefix, tensors = tiny_layer, "model.layers.0.mlp", {}
    for e in range(L.num_experts - (1 if drop_last else 0)):
        for proj, lst in (("gate", L.gate), ("up", L.up), ("down", L.down)):
            save_exl3_tensor(tensors, f"{prefix}.experts.{e}.{proj}_proj", lst[e])
    path = tmp_path / "layer.safetensors"
    save_file(tensors, str(path))
    return path, prefix


def test_from_safetensors_with_num_experts_detects_a_missing_last_expert(device, tiny_layer, tmp_path):
    from vkmoe.exl3 import MissingTensorError, load_moe_experts

    path, prefix = _checkpoint_files(tiny_layer, tmp_path, drop_last=True)
    E = tiny_layer.num_experts
    assert load_moe_experts(str(path), prefix)["num_experts"] == E - 1  # the file alone cannot tell
    with pytest.raises(MissingTensorError, match=f"experts 0..{E - 2}; expected {E} experts"):
        vkmoe.Exl3MoeMlp.from_safetensors(device, str(path), prefix, num_experts=E)
    (tmp_path / "full").mkdir()
    full, _ = _checkpoint_files(tiny_layer, tmp_path / "full")
    with vkmoe.Exl3MoeMlp.from_safetensors(device, str(full), prefix, num_experts=E, dispatch="split") as moe:
        c = tiny_layer.calls[0]
        y = moe(c["x"], c["selected"], c["weights"])
    ref = reference.moe_forward(c["x"], c["selected"], c["weights"], tiny_layer.gate, tiny_layer.up,
                                tiny_layer.down, activation="silu")
    assert rel_rms(y, ref) < TOL


def test_unreadable_checkpoints_raise_checkpoint_error(tmp_path):
    from vkmoe.exl3 import CheckpointError, load_exl3_tensor, load_moe_experts
    from vkmoe.models import MoeConfig

    garbage = _write(tmp_path / "garbage.safetensors", "garbage" * 4)
    for path in (garbage, tmp_path / "missing.safetensors"):
        with pytest.raises(CheckpointError, match="cannot read it as a safetensors file"):
            load_moe_experts(str(path), "model.layers.0.mlp")
        with pytest.raises(CheckpointError):
            load_exl3_tensor(str(path), "x")
    # a directory is read as a model directory: its garbage file is named
    with pytest.raises(CheckpointError, match="garbage.safetensors: not a safetensors file"):
        load_moe_experts(str(tmp_path), "model.layers.0.mlp")
    with pytest.raises(CheckpointError):
        load_exl3_tensor(str(tmp_path), "x")
    (tmp_path / "bad-utf8").mkdir()
    (tmp_path / "bad-utf8" / "config.json").write_bytes(b"{\"hidden_size\": \"\xff\xfe\"}")
    (tmp_path / "dir-config").mkdir()
    (tmp_path / "dir-config" / "config.json").mkdir()
    _write(tmp_path / "list.json", "[1, 2]")
    _write(tmp_path / "types.json", '{"model_type": "qwen3_moe", "hidden_size": "abc", "num_experts": 8, '
                                    '"num_experts_per_tok": 2, "moe_intermediate_size": 128}')
    _write(tmp_path / "types2.json", '{"model_type": "qwen3_moe", "hidden_size": 256, "num_experts": [8], '
                                     '"num_experts_per_tok": 2, "moe_intermediate_size": 128}')
    for path in ("bad-utf8", "dir-config", "list.json", "types.json", "types2.json"):
        with pytest.raises(CheckpointError, match=str(tmp_path / path)):
            MoeConfig.from_file(tmp_path / path)
    bad = {"model.layers.0.mlp.experts.0.up_proj.trellis": np.zeros((8, 8, 64), np.uint16),
           "model.layers.0.mlp.experts.0.up_proj.suh": np.array(["a"] * 128),
           "model.layers.0.mlp.experts.0.up_proj.svh": np.ones(128, np.float16)}
    with pytest.raises(CheckpointError, match="suh"):
        load_exl3_tensor(bad, "model.layers.0.mlp.experts.0.up_proj")
    bad["model.layers.0.mlp.experts.0.up_proj.suh"] = np.ones(128, np.float32)
    bad["model.layers.0.mlp.experts.0.up_proj.trellis"] = np.zeros((8, 8, 64), np.float32)
    with pytest.raises(CheckpointError, match="trellis: expected uint16"):
        load_exl3_tensor(bad, "model.layers.0.mlp.experts.0.up_proj")


CLI_USAGE_ERRORS = [
    ("bench_moe", "--small", "--device", "7"),
    ("bench_moe", "--small", "--json", "/nonexistent-dir/x.json"),  # refused before the run, not after it
    ("probe_residency", "--repeats", "1e20"),
    ("probe_residency", "--repeats", "100000000000000000000"),
    ("check_decode", "--k", "100"),
    ("bench_cpu", "--m", "-1"),
    ("profile_moe", "--m", "0"),
    ("pipeline_stats", "--m", "0"),
    ("pipeline_stats", "--coopmat", "maybe"),
    ("pipeline_stats", "--device", "7"),
    ("pipeline_stats", "--json", "/nonexistent-dir/x.json"),
    ("make_exl3_moe_checkpoint", "--out", "UNDER_A_FILE/ckpt"),
    # negative seeds were a numpy traceback after the tool had started
    ("bench_moe", "--small", "--seed", "-1"),
    ("bench_linear", "--k", "128", "--n", "128", "--seed", "-1"),
    ("bench_linear", "--k", "128", "--n", "128", "--warmup", "-1"),
    ("make_exl3_moe_checkpoint", "--seed", "-1", "--out", "UNDER_A_FILE/ckpt"),
    ("vkmoe", "demo", "--seed", "-1"),
    ("vkmoe", "demo", "--experts", "4"),
    ("vkmoe", "demo", "--experts", "100000"),  # (past the op's 1024: it built the layer first)
    ("vkmoe", "demo", "--tokens", "0"),
    ("bench_sharded", "--devices", "0,99"),  # (a DeviceSelectionError traceback)
    ("bench_sharded", "--m", "0"),
    ("profile_host", "--m", "0"),  # (ran, timing nothing)
]


@pytest.mark.parametrize("argv", CLI_USAGE_ERRORS, ids=[" ".join(a) for a in CLI_USAGE_ERRORS])
def test_tool_argument_errors_are_usage_errors(argv, tmp_path):
    blocker = _write(tmp_path / "a-file", "x")
    args = [a.replace("UNDER_A_FILE", str(blocker)) for a in argv]
    command = ["-m", "vkmoe"] if args[0] == "vkmoe" else [os.path.join(REPO, "tools", args[0])]
    result = subprocess.run([sys.executable, *command, *args[1:]], capture_output=True,
                            text=True, timeout=120, cwd=REPO, env=dict(os.environ, VKMOE_CACHE_DIR=str(tmp_path)))
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "error:" in result.stderr, result.stderr[-2000:]
    assert not os.path.exists(tmp_path / "ckpt")


def test_a_command_whose_batch_the_device_refuses_says_so_and_exits_2(device, tmp_path):
    """`vkmoe demo --tokens N` past the device's buffers was a traceback and exit 1, which the demo's contract
    reserves for FAIL (a wrong result); the library's named refusal is now the command's one-line error, exit 2."""
    need_per_token = 8 * 2048 * 2  # top-8 rows of the demo's hidden 2048 in fp16: the op's stage-1 buffer
    tokens = device.limits.maxStorageBufferRange // need_per_token + 1
    if tokens > 20000:
        pytest.skip(f"this device's buffers hold {tokens - 1} tokens: the demo's host arrays would be the test")
    result = subprocess.run([sys.executable, "-m", "vkmoe", "demo", "--tokens", str(tokens)], capture_output=True,
                            text=True, timeout=300, cwd=REPO, env=dict(os.environ, VKMOE_CACHE_DIR=str(tmp_path)))
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "vkmoe demo: error: hidden:" in result.stderr, result.stderr[-2000:]
    assert "maxStorageBufferRange" in result.stderr


def test_linear_dropped_without_close_frees_its_memory(dev, tiny_layer):
    import gc

    t = tiny_layer.up[0]
    x = np.random.default_rng(3).standard_normal((3, t.k)).astype(np.float16)
    gc.collect()
    before = _bytes_in_use(dev)
    for _ in range(3):
        lin = vkmoe.Exl3Linear(dev, t)
        y = lin(x)
        assert _bytes_in_use(dev) > before
        del lin
        gc.collect()
        assert _bytes_in_use(dev) == before
    assert rel_rms(y.astype(np.float32), reference.linear_forward(x, t)) < TOL


def _safetensors_bytes(header):
    import json
    import struct

    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * 64


def test_malformed_model_directories_raise_checkpoint_error(tmp_path):
    import json

    from vkmoe.exl3 import CheckpointError
    from vkmoe.models.checkpoint import Checkpoint

    def entry(dtype, shape, offsets):
        return _safetensors_bytes({"w": {"dtype": dtype, "shape": shape, "data_offsets": offsets}})

    cases = {
        "header-list": {"model.safetensors": _safetensors_bytes([1, 2])},
        "bad-entry": {"model.safetensors": _safetensors_bytes({"w": {"dtype": "F32", "shape": "ab",
                                                                       "data_offsets": [0, 8]}})},
        "bad-index-utf8": {"model.safetensors.index.json": b"{\"weight_map\": \"\xff\"}"},
        "index-not-map": {"model.safetensors.index.json": b"{\"weight_map\": 3}"},
        "shard-is-dir": {"model.safetensors/": None},
        # header entries that were taken: numpy asked for 3.6 TiB (a MemoryError), a negative begin read the
        # header's own bytes as the tensor, "0", 4.5 and true read as integers, a huge offset overflowed the seek
        "huge-shape": {"model.safetensors": entry("F32", [10 ** 12], [0, 4])},
        "negative-begin": {"model.safetensors": entry("U8", [4], [-4, 0])},
        "string-offsets": {"model.safetensors": entry("U8", [4], ["0", "4"])},
        "float-shape": {"model.safetensors": entry("U8", [4.5], [0, 4])},
        "bool-shape": {"model.safetensors": entry("U8", [True], [0, 1])},
        "huge-offsets": {"model.safetensors": entry("U8", [4], [2 ** 70, 2 ** 70 + 4])},
        "three-offsets": {"model.safetensors": entry("U8", [4], [0, 4, 8])},
        # index shards that are not file names of the directory: a TypeError, or a file read outside it
        "shard-not-a-name": {"model.safetensors.index.json": json.dumps({"weight_map": {"w": 5}}).encode()},
        "shard-outside": {"model.safetensors.index.json":
                          json.dumps({"weight_map": {"w": "../outside.safetensors"}}).encode()},
    }
    (tmp_path / "outside.safetensors").write_bytes(entry("U8", [4], [0, 4]))  # (readable: must still be refused)
    for name, files in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        for fname, data in files.items():
            if fname.endswith("/"):
                (folder / fname).mkdir()
            else:
                (folder / fname).write_bytes(data)
        with pytest.raises(CheckpointError, match=str(folder)):
            ckpt = Checkpoint(folder)
            for key in ckpt.keys():
                ckpt[key]


# --------------------------------------------------------------------------- 5: varying batch sizes
def _routing(m, H, E, top_k=2, seed=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, H)).astype(np.float16)
    ids = np.stack([rng.choice(E, top_k, replace=False) for _ in range(m)])
    w = rng.uniform(0.1, 1.0, (m, top_k)).astype(np.float32)
    return x, ids, w


def _recorders(dev):
    return sum(isinstance(o, vkmoe.CommandRecorder) for o in dev._children)


def test_varying_batch_sizes_keep_the_caches_bounded(dev, tiny_layer, monkeypatch):
    """50 different m: the layer keeps VKMOE_SHAPE_CACHE shapes (default 8) and exactly the device memory of the
    last 8 shapes; an evicted shape records again and is still correct; a shape passed to record() stays."""
    monkeypatch.delenv("VKMOE_SHAPE_CACHE", raising=False)
    from vkmoe import knobs

    limit = knobs.get("VKMOE_SHAPE_CACHE")
    assert limit == 8
    L = tiny_layer
    x, ids, w = _routing(50, L.hidden_size, L.num_experts)
    ref = reference.moe_forward(x, ids, w, L.gate, L.up, L.down, activation="silu")  # row-wise: ref[:m] is m's

    def forward(moe, m):
        y = moe(x[:m], ids[:m], w[:m])
        assert rel_rms(y, ref[:m]) < TOL, m

    recorders = _recorders(dev)
    base = _bytes_in_use(dev)
    with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu", dispatch="split") as moe:
        for m in range(1, 51):
            forward(moe, m)
            assert len(moe._scratch) == len(moe._io) == len(moe._recorded) == min(m, limit)
            assert _recorders(dev) - recorders == min(m, limit)
        assert sorted(moe._scratch) == [(m, 2) for m in range(43, 51)]
        used = _bytes_in_use(dev) - base
        forward(moe, 1)  # evicted long ago: recorded again, still correct
        forward(moe, 50)
    with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu", dispatch="split") as fresh:
        for m in range(43, 51):
            forward(fresh, m)
        assert _bytes_in_use(dev) - base == used  # the same 8 shapes: the same memory, nothing left of the rest
    assert _bytes_in_use(dev) == base and _recorders(dev) == recorders

    monkeypatch.setenv("VKMOE_SHAPE_CACHE", "2")
    with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu", dispatch="split") as moe:
        hb, ib, wb, ob = dev.memory.allocate_all([3 * L.hidden_size * 2, 24, 24, 3 * L.hidden_size * 4])
        try:
            with vkmoe.CommandRecorder(dev) as rec:
                rec.begin()
                rec.fill(ob, 0x7FC00000)  # NaN poison: a row the forward misses shows up
                rec.barrier()
                moe.record(rec, hb, ib, wb, ob, 3, 2)
                rec.end()
                pinned = moe._scratch[(3, 2)]
                for m in (4, 5, 6, 7):
                    forward(moe, m)
                assert moe._scratch[(3, 2)] is pinned and len(moe._scratch) == 3  # 2 by calls + the pinned one
                hb.upload(x[:3])
                ib.upload(ids[:3].astype(np.int32))
                wb.upload(w[:3])
                rec.submit(wait=True)
            assert rel_rms(ob.download(np.float32, (3, L.hidden_size)), ref[:3]) < TOL
        finally:
            for b in (hb, ib, wb, ob):
                b.close()


def test_linear_with_varying_batch_sizes_keeps_its_caches_bounded(dev, tiny_layer, monkeypatch):
    monkeypatch.setenv("VKMOE_SHAPE_CACHE", "3")
    t = tiny_layer.up[0]
    x = np.random.default_rng(7).standard_normal((12, t.k)).astype(np.float16)
    ref = reference.linear_forward(x, t)
    recorders, base = _recorders(dev), _bytes_in_use(dev)
    with vkmoe.Exl3Linear(dev, t) as lin:
        for m in list(range(1, 13)) + [1]:
            y = lin(x[:m])
            assert rel_rms(y.astype(np.float32), ref[:m]) < TOL, m
            assert len(lin._io) <= 3 and len(lin._scratch) <= 3 and _recorders(dev) - recorders <= 3
        assert sorted(lin._io) == [1, 11, 12]
    assert _bytes_in_use(dev) == base and _recorders(dev) == recorders


# ----------------------------------------------------------------- 6: persistent launches that cannot run
def test_grid_beyond_the_dispatch_limit_runs_split(dev):
    """A forced grid above maxComputeWorkGroupCount[0]: the plan refuses it, the call runs split (correct, with
    the reason in last_run) and no recorder of the failed attempt is left on the device."""
    if dev.limits.maxComputeWorkGroupCount[0] >= 70000:  # (lavapipe: 65535; NVIDIA: 2^31 - 1)
        pytest.skip("the forced grid of 70000 is within this device's maxComputeWorkGroupCount[0]")
    result = _run_script("""
        from goldens import rel_rms
        from vkmoe.exl3 import reference
        dev = vkmoe.Device()
        limit = dev.limits.maxComputeWorkGroupCount[0]
        assert limit < 70000, limit
        c = L.calls[0]
        ref = reference.moe_forward(c["x"], c["selected"], c["weights"], L.gate, L.up, L.down, activation="silu")
        with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu") as moe:
            for _ in range(2):
                y = moe(c["x"], c["selected"], c["weights"])
                assert rel_rms(y, ref) < 3e-3
                run = moe.last_run
                assert run["requested"] == "persistent" and run["mode"] == "split", run
                assert "maxComputeWorkGroupCount" in run["fallback_reason"], run
                recorders = [o for o in dev._children if isinstance(o, vkmoe.CommandRecorder)]
                assert len(recorders) == len(moe._recorded) == 1, (recorders, moe._recorded)
        assert not dev.take_validation_messages()
        print("OK", run["fallback_reason"])
    """, env={"VKMOE_PERSISTENT_GRID": "70000", "VKMOE_DISPATCH": "persistent"})
    _assert_closed_error(result)


def test_cached_grid_beyond_the_dispatch_limit_is_refused(device, fresh_cache, monkeypatch):
    from vkmoe.ops.plan import moe_plan
    from vkmoe.sched.plan import decide, persistent_plan

    monkeypatch.delenv("VKMOE_PERSISTENT_GRID", raising=False)
    monkeypatch.delenv("VKMOE_PERSISTENT_WG_PER_CU", raising=False)
    plan = moe_plan(device, 4, 2, 8, 256, 128, True)
    big = device.limits.maxComputeWorkGroupCount[0] + 1  # (lavapipe 65535, NVIDIA 2^31 - 1)
    measured = {"min": big, "median": big, "samples": [big], "launched": big}
    p = persistent_plan(device, plan, 8, 256, 128, True, measured)
    assert not p.allowed and not p.trusted and "maxComputeWorkGroupCount" in p.reason
    d = decide(device, plan, "persistent", 8, 256, 128, True, lambda: measured)
    assert d.mode == "split" and "maxComputeWorkGroupCount" in d.reason


def test_first_run_may_include_the_drivers_shader_compile(dev):
    """lavapipe compiles a pipeline at its first dispatch (seconds with a cold shader cache); that must not count
    against VKMOE_TIMEOUT, which later calls still get. A first process measures the persistent pipeline's
    co-residency (cached), a second one with Mesa's shader cache off and a 0.25 s timeout runs both paths."""
    if not dev.is_lavapipe:
        pytest.skip("this driver compiles at pipeline creation, not at the first dispatch")
    _assert_closed_error(_run_script("""
        dev = vkmoe.Device()
        with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu") as moe:
            c = L.calls[0]
            moe.co_resident(moe._scratch_for(*c["selected"].shape).plan)
        print("OK")
    """))
    result = _run_script("""
        import time
        from goldens import rel_rms
        from vkmoe.exl3 import reference
        dev = vkmoe.Device()
        c = L.calls[0]
        ref = reference.moe_forward(c["x"], c["selected"], c["weights"], L.gate, L.up, L.down, activation="silu")
        with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu") as moe:
            for mode in ("split", "persistent"):
                times = []
                for _ in range(2):
                    start = time.monotonic()
                    y = moe(c["x"], c["selected"], c["weights"], dispatch=mode)
                    times.append(time.monotonic() - start)
                    assert moe.last_run["mode"] == mode, moe.last_run
                    assert rel_rms(y, ref) < 3e-3
                # else this test shows nothing: the first call must have compiled past the timeout
                assert times[0] > 0.25, (mode, times)
                print(mode, times)
        x = c["x"].astype(np.float16)  # Exl3Linear (and every op submitting through CallTransfers) too
        ref = reference.linear_forward(x, L.gate[0])
        with vkmoe.Exl3Linear(dev, L.gate[0]) as lin:
            times = []
            for _ in range(2):
                start = time.monotonic()
                y = lin(x)
                times.append(time.monotonic() - start)
                assert rel_rms(y, ref) < 3e-3
            print("linear", times)
        # A caller's own recording (moe.record into a CommandRecorder): its first submission gets the same bound.
        # gelu: pipelines this process has not compiled yet.
        ref = reference.moe_forward(c["x"], c["selected"], c["weights"], L.gate, L.up, L.down, activation="gelu")
        m, top_k = c["selected"].shape
        with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="gelu") as moe:
            inputs = (c["x"].astype(np.float16), c["selected"].astype(np.int32), c["weights"].astype(np.float32))
            bufs = [dev.memory.allocate(a.nbytes) for a in inputs]
            for buf, a in zip(bufs, inputs):
                buf.upload(np.ascontiguousarray(a))
            out = dev.memory.allocate(m * moe.H * 4)
            out.upload(np.full((m, moe.H), np.nan, np.float32))
            with vkmoe.CommandRecorder(dev) as rec:
                rec.begin()
                moe.record(rec, *bufs, out, m, top_k, mode="split")
                rec.end()
                start = time.monotonic()
                rec.submit(wait=True)
                first = time.monotonic() - start
                assert first > 0.25, first  # else this shows nothing
                assert rel_rms(out.download(np.float32, (m, moe.H)), ref) < 3e-3
                start = time.monotonic()
                rec.submit(wait=True)  # not fresh: VKMOE_TIMEOUT again (a split forward of the tiny layer: ms)
                print("recorded", first, time.monotonic() - start)
            for b in (*bufs, out):
                b.close()
        assert not dev.take_validation_messages()
        print("OK")
    """, env={"VKMOE_TIMEOUT": "0.25", "MESA_SHADER_CACHE_DISABLE": "true"})
    _assert_closed_error(result)


# ------------------------------------------------------------------- 10: ops after close(); record()'s arguments
def test_ops_used_after_close_raise_a_clear_error(dev, tiny_layer, tmp_path):
    from test_linear import make_tensor
    from test_models import DEEPSEEK
    from vkmoe.models import SparseMoeBlock, write_checkpoint

    L, c = tiny_layer, tiny_layer.calls[0]
    x, ids, w = c["x"], c["selected"], c["weights"]
    m, top_k = ids.shape
    moe = vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu", dispatch="split")
    for _ in range(3):  # (the third call takes the hot path: close() must end that one too)
        moe(x, ids, w)
    moe.close()
    bufs = [dev.memory.allocate(n) for n in (m * L.hidden_size * 2, m * top_k * 4, m * top_k * 4,
                                             m * L.hidden_size * 4)]
    with vkmoe.CommandRecorder(dev) as rec:
        rec.begin()
        for run in (lambda: moe(x, ids, w), lambda: moe(x, ids, w, dispatch="persistent"),
                    lambda: moe.record(rec, *bufs, m, top_k), lambda: moe.split_stages(*bufs, m, top_k)):
            with pytest.raises(vkmoe.VkmoeError, match="this Exl3MoeMlp is closed"):
                run()
        lin = vkmoe.Exl3Linear(dev, make_tensor(L.hidden_size, L.hidden_size, 4, "mul1", seed=3))
        xl = x.astype(np.float16)
        want = lin(xl)
        lin.close()
        for run in (lambda: lin(xl), lambda: lin.record(rec, bufs[0], bufs[0], m), lambda: lin.dequantize()):
            with pytest.raises(vkmoe.VkmoeError, match="this Exl3Linear is closed"):
                run()
    for b in bufs:
        b.close()
    block = SparseMoeBlock.from_checkpoint(write_checkpoint(str(tmp_path), **DEEPSEEK), 0, backend="vulkan",
                                           device=dev)
    hidden = x.astype(np.float32)
    for _ in range(3):
        block(hidden)
    block.close()
    with pytest.raises(vkmoe.VkmoeError, match="this SparseMoeBlock is closed"):
        block(hidden)
    # The device stays usable: the same layers made again give the reference's answers.
    with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu") as again:
        ref = reference.moe_forward(x, ids, w, L.gate, L.up, L.down, activation="silu")
        assert rel_rms(again(x, ids, w), ref) < TOL
    with vkmoe.Exl3Linear(dev, make_tensor(L.hidden_size, L.hidden_size, 4, "mul1", seed=3)) as lin2:
        assert np.array_equal(lin2(xl).view(np.uint16), want.view(np.uint16))
    assert not dev.take_validation_messages()


def test_record_checks_the_recorder_and_buffers_it_is_given(dev, tiny_layer):
    from test_linear import make_tensor

    L, c = tiny_layer, tiny_layer.calls[0]
    x, ids, w = c["x"], c["selected"], c["weights"]
    m, top_k = ids.shape
    H = L.hidden_size
    sizes = {"hidden_buf": m * H * 2, "ids_buf": m * top_k * 4, "weights_buf": m * top_k * 4, "out_buf": m * H * 4}
    other_dev = vkmoe.Device()
    with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu") as moe, \
            vkmoe.Exl3Linear(dev, make_tensor(H, H, 4, "mul1", seed=3)) as lin, \
            vkmoe.CommandRecorder(dev) as rec, vkmoe.CommandRecorder(other_dev) as foreign_rec:
        bufs = {name: dev.memory.allocate(n) for name, n in sizes.items()}
        small, closed, foreign = dev.memory.allocate(16), dev.memory.allocate(m * H * 2), \
            other_dev.memory.allocate(m * H * 2)
        closed.close()
        rec.begin()
        moe_args = list(bufs.values())
        for name, bad, error, match in (
                ("cmd", None, TypeError, "cmd: expected a vkmoe CommandRecorder, got NoneType"),
                ("cmd", foreign_rec, ValueError, "cmd is a CommandRecorder of another vkmoe.Device"),
                ("hidden_buf", np.zeros(m * H, np.float16), TypeError, "hidden_buf: expected a vkmoe Buffer"),
                ("ids_buf", small, ValueError, f"ids_buf holds 16 bytes; this call needs {sizes['ids_buf']}"),
                ("out_buf", small, ValueError, f"out_buf holds 16 bytes; this call needs {sizes['out_buf']}"),
                ("weights_buf", closed, vkmoe.VkmoeError, "weights_buf is a closed Buffer"),
                ("hidden_buf", foreign, ValueError, "hidden_buf is a Buffer of another vkmoe.Device")):
            args = [rec, *moe_args]
            args[0 if name == "cmd" else 1 + list(sizes).index(name)] = bad
            with pytest.raises(error, match=match):
                moe.record(*args, m, top_k)
        # m: an integer; 0 records nothing; a negative m recorded nothing silently, a float one failed in the plan
        for bad_m, error, match in ((-1, ValueError, "m: expected an integer >= 0, got -1"),
                                    (1.5, TypeError, "m: expected an integer number of rows, got float 1.5"),
                                    ("2", TypeError, "m: expected an integer number of rows, got str '2'"),
                                    (True, TypeError, "m: expected an integer number of rows, got bool True")):
            with pytest.raises(error, match=match):
                moe.record(rec, *moe_args, bad_m, top_k)
            with pytest.raises(error, match=match):
                lin.record(rec, bufs["hidden_buf"], bufs["hidden_buf"], bad_m)
        for stages in (lambda: moe.split_stages(*moe_args, 0, top_k),
                       lambda: lin.stages(bufs["hidden_buf"], bufs["hidden_buf"], 0)):
            with pytest.raises(ValueError, match="m: expected an integer >= 1, got 0"):
                stages()
        assert moe.record(rec, *moe_args, 0, top_k) is None and lin.record(rec, small, small, 0) is None
        for args, error, match in (
                ((None, bufs["hidden_buf"], bufs["hidden_buf"]), TypeError, "cmd: expected a vkmoe CommandRecorder"),
                ((rec, small, bufs["hidden_buf"]), ValueError, f"x_buf holds 16 bytes; this call needs {m * H * 2}"),
                ((rec, bufs["hidden_buf"], None), TypeError, "y_buf: expected a vkmoe Buffer, got NoneType")):
            with pytest.raises(error, match=match):
                lin.record(*args, m)
        # The same recorder, given good arguments, still records the right forward (output poisoned first).
        bufs["hidden_buf"].upload(np.ascontiguousarray(x, np.float16))
        bufs["ids_buf"].upload(np.ascontiguousarray(ids, np.int32))
        bufs["weights_buf"].upload(np.ascontiguousarray(w, np.float32))
        bufs["out_buf"].upload(np.full((m, H), np.nan, np.float32))
        moe.record(rec, *moe_args, m, top_k)
        rec.end()
        rec.submit(wait=True)
        ref = reference.moe_forward(x, ids, w, L.gate, L.up, L.down, activation="silu")
        assert rel_rms(bufs["out_buf"].download(np.float32, (m, H)), ref) < TOL
        for b in (*bufs.values(), small, foreign):
            b.close()
    other_dev.close()
    assert not dev.take_validation_messages()


# ------------------------------------------------------------ 11: NaN through the activations' act_limit clamp
NAN_ACTIVATIONS = [("silu", 1.5), ("gelu", 2.0), ("gelu_erf", 2.0), ("relu2", 0.0), ("relu2", 1.5),
                   ("swiglu_oai", 1.5)]


@pytest.mark.parametrize("activation,limit", NAN_ACTIVATIONS)
def test_a_nan_row_stays_nan_through_the_activation(dev, activation, limit):
    """A NaN hidden value makes its row's gate and up NaN: the output row is NaN, as the float64 reference's
    (np.minimum / np.clip keep NaN). GLSL's min / clamp leave NaN undefined, and lavapipe's returned the limit:
    under an act_limit the row came out finite (silent garbage). Split for every activation, persistent for one
    (its compile is the slowest); the CPU tier too; the other row keeps the reference's values."""
    from vkmoe import cpu
    from vkmoe.exl3 import synthetic

    gate, up, down = synthetic.random_moe_layer(256, 128, 8, activation=activation, seed=2)
    x = (np.random.default_rng(3).standard_normal((2, 256)) * 0.5).astype(np.float16)
    x[1, 9] = np.nan
    ids, w = np.array([[0, 5], [2, 7]], np.int32), np.array([[0.75, 0.25], [0.5, 0.5]], np.float32)
    with np.errstate(invalid="ignore"):
        ref = reference.moe_forward(x, ids, w, gate, up, down, activation=activation, act_limit=limit)
    assert np.isnan(ref[1]).all() and np.isfinite(ref[0]).all()
    modes = ("split", "persistent") if (activation, limit) == ("swiglu_oai", 1.5) else ("split",)
    with vkmoe.Exl3MoeMlp(dev, gate, up, down, activation=activation, act_limit=limit) as moe:
        for mode in modes:
            y = moe(x, ids, w, dispatch=mode)
            assert moe.last_run["mode"] == mode
            assert np.isnan(y[1]).all(), (mode, y[1][:8])
            assert rel_rms(y[:1], ref[:1]) < TOL
    y = cpu.moe_forward(x, ids, w, gate, up, down, activation=activation, act_limit=limit)
    assert np.isnan(y[1]).all() and rel_rms(y[:1], ref[:1]) < TOL
    assert not dev.take_validation_messages()


@pytest.mark.parametrize("activation,limit", NAN_ACTIVATIONS)
def test_the_shared_expert_activation_keeps_nan(dev, activation, limit):
    """The device block's shared-expert activation (moe_block_elem ELEM_ACTIVATE) against reference._activate:
    numbers within one fp16 rounding, and a NaN gate or up value gives NaN (under act_limit too), never the
    limit. Output poisoned first."""
    from vkmoe import layout
    from vkmoe.ops import kernels
    from vkmoe.ops.block import ElemPush

    rng = np.random.default_rng(4)
    n = 512
    g = (rng.standard_normal(n) * 2.0).astype(np.float16)
    u = (rng.standard_normal(n) * 2.0).astype(np.float16)
    g[[3, 100]] = np.nan
    u[[7, 100, 300]] = np.nan
    want = reference._activate(g.astype(np.float32), u.astype(np.float32), activation, limit).astype(np.float16)
    nan_at = np.isnan(want)
    assert nan_at[[7, 100, 300]].all() and (activation == "relu2" or nan_at[3])
    pipe = kernels.pipeline(dev, "moe_block_elem", ElemPush)
    bufs = [dev.memory.allocate(n * 2) for _ in range(3)]
    try:
        bufs[0].upload(g)
        bufs[1].upload(u)
        bufs[2].upload(np.full(n, 0x7E01, np.uint16))  # poison: a NaN that no activation writes
        with vkmoe.CommandRecorder(dev) as rec:
            rec.begin()
            dset = pipe.bind(*bufs)
            rec.dispatch(pipe, dset, layout.fold_grid(layout.ceil_div(n // 2, layout.WORKGROUP_SIZE)),
                         ElemPush(pairs=n // 2, cols=1, mode=layout.ELEM_ACTIVATE,
                                  act=layout.ACTIVATIONS[activation], limit=limit, has_gate=0))
            rec.end()
            rec.submit(wait=True)
            dset.free()
        got = bufs[2].download(np.uint16, (n,))
    finally:
        for b in bufs:
            b.close()
    assert not (got == 0x7E01).any()
    got = got.view(np.float16)
    assert np.array_equal(np.isnan(got), nan_at), np.flatnonzero(np.isnan(got) != nan_at)
    np.testing.assert_allclose(got[~nan_at].astype(np.float32), want[~nan_at].astype(np.float32), rtol=2e-3,
                               atol=2e-3)
    assert not dev.take_validation_messages()


def test_constructors_name_a_device_argument_that_is_not_a_device(tiny_layer):
    """Every constructor that takes a device says so when given something else (was an AttributeError such as
    "'NoneType' object has no attribute 'limits'"); nothing is allocated before the check."""
    from vkmoe.ops.block import DeviceMoeBlock
    from vkmoe.ops.device_array import DeviceArray
    from vkmoe.ops.router import DeviceRouter, RouterGemv
    from test_linear import make_tensor

    L = tiny_layer
    x = np.zeros((2, L.hidden_size), np.float16)
    router_w = np.zeros((8, L.hidden_size), np.float16)
    for bad in (None, "gpu", 0):
        for make in (lambda: vkmoe.Exl3MoeMlp(bad, L.gate, L.up, L.down, activation="silu"),
                     lambda: vkmoe.Exl3Linear(bad, make_tensor(256, 128, 4, "mul1", seed=1)),
                     lambda: vkmoe.CommandRecorder(bad),
                     lambda: DeviceArray.from_numpy(bad, x),
                     lambda: DeviceArray.empty(bad, (2, 3), np.float32),
                     lambda: RouterGemv(bad, router_w),
                     lambda: DeviceRouter(bad, "std", router_w, 2),
                     lambda: DeviceMoeBlock(bad, None, None, 2)):
            with pytest.raises(TypeError, match=f"device: expected a vkmoe.Device, got {type(bad).__name__}"):
                make()


def test_an_argument_of_a_second_device_object_of_the_same_gpu_says_so(dev, tiny_layer):
    """Two Device objects of one GPU print alike, so "x is a DeviceArray on <Device 0 ...>; this op runs on
    <Device 0 ...>" read as a contradiction: the message now says that the arrays belong to the other object."""
    from vkmoe.ops.device_array import DeviceArray
    from vkmoe.vk.errors import foreign_device_error

    L, c = tiny_layer, tiny_layer.calls[0]
    other = vkmoe.Device()
    try:
        with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu") as moe, \
                DeviceArray.from_numpy(other, c["x"]) as foreign:
            with pytest.raises(ValueError, match=r"hidden is a DeviceArray of another vkmoe\.Device \(.*\) \(a second "
                                                 r"Device object of the same GPU: .*\); this op runs on"):
                moe(foreign, c["selected"], c["weights"])
            assert np.isfinite(moe(c["x"], c["selected"], c["weights"])).all()  # the op is still usable
    finally:
        other.close()
    # Devices that print differently get no such remark.
    err = foreign_device_error("x", "Buffer", "<vkmoe.Device 1: B>", "<vkmoe.Device 0: A>")
    assert str(err) == "x is a Buffer of another vkmoe.Device ('<vkmoe.Device 1: B>'); this op runs on '<vkmoe.Device 0: A>'"
    assert not dev.take_validation_messages()


# ------------------------------------------------------------------------------------------- fork()
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def _in_fork_child(work, timeout):
    """fork(); the child runs work(report) (a dict it fills), sends the report through a pipe and exits without
    returning into pytest. Returns (report, wait status); a child that hangs past `timeout` s is killed and
    reported as such."""
    import json
    import select
    import signal

    read, write = os.pipe()
    progress_read, progress_write = os.pipe()  # the report's keys as the child sets them: where a hang was
    pid = os.fork()
    if pid == 0:
        report = _ProgressReport(progress_write)
        try:
            work(report)
        except BaseException as exc:
            report["unexpected"] = repr(exc)
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    os.close(progress_write)
    ready, _, _ = select.select([read], [], [], timeout)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    with os.fdopen(read) as f, os.fdopen(progress_read) as p:
        if ready:
            report = json.loads(f.read() or "{}")
        else:
            done = p.read().split()
            report = {"unexpected": f"the child hung for {timeout} s, after setting {done[-3:] or 'nothing'}"}
    _, status = os.waitpid(pid, 0)
    return report, status


class _ProgressReport(dict):
    """A fork child's report that also writes each key it is given to a pipe, as it is given."""

    def __init__(self, fd):
        super().__init__()
        self._fd = fd

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        os.write(self._fd, f"{key} ".encode())


def test_a_forked_child_gets_a_clear_error_and_can_open_its_own_device(tiny_layer):
    """Vulkan objects do not survive fork(). A child's call on the parent's device waited VKMOE_TIMEOUT (60 s) for a
    submission lavapipe never ran, then blamed the GPU, and a new Device in the child hung the same way (it reused
    the parent's VkInstance). Now the parent's objects raise DeviceClosedError at once saying why, closing them
    touches no handle of the parent's, a new Device in the child works (lavapipe) or says why it cannot (where the
    parent loaded a GPU's driver: the next tests), and the parent carries on unharmed."""
    from vkmoe.ops.device_array import DeviceArray
    from vkmoe.vk import CommandRecorder, DeviceClosedError

    L, c = tiny_layer, tiny_layer.calls[0]
    x, ids, w = c["x"], c["selected"], c["weights"]
    d = vkmoe.Device()
    moe = vkmoe.Exl3MoeMlp(d, L.gate, L.up, L.down, activation="silu", dispatch="split")
    expect = moe(x, ids, w)
    xd = DeviceArray.from_numpy(d, x)
    rec = CommandRecorder(d)
    rec.begin()
    rec.fill(xd.buffer, 0, nbytes=4)
    rec.end()
    rec.submit(wait=False)  # (still noted as unwaited at the fork)

    def child(report):
        t0 = time.monotonic()
        try:
            moe(x, ids, w)
        except DeviceClosedError as exc:
            report["error"] = str(exc)
        report["seconds"] = time.monotonic() - t0
        for thing in (rec, xd, moe, d):  # the parent's: closing them must not touch its handles
            thing.close()
        report["closed"] = True
        try:
            d2 = vkmoe.Device()
        except vkmoe.VkmoeError as exc:  # (after a GPU's driver in the parent: refused at once, the error says why)
            report["own_device"] = str(exc)
        else:
            with d2, vkmoe.Exl3MoeMlp(d2, L.gate, L.up, L.down, activation="silu", dispatch="split") as moe2:
                report["own_device"] = bool(np.array_equal(moe2(x, ids, w), expect))

    report, status = _in_fork_child(child, 120)  # (a child that hangs, as before the fix, is killed)
    assert "unexpected" not in report, report
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert "forked from" in report.get("error", "") and "fork()" in report["error"], report
    assert report["seconds"] < 5, report
    # a new Device works there (lavapipe), or its error says why and what to do instead
    assert report["own_device"] is True or ("forked from" in report["own_device"]
                                            and "'spawn'" in report["own_device"]), report
    # the parent's device, layer, array and recorder are untouched by the child's closes
    rec.wait()
    assert np.array_equal(moe(xd, ids, w), moe(x * np.float16(0) + xd.numpy(), ids, w))
    assert np.array_equal(moe(x, ids, w), expect)
    rec.close(), xd.close(), moe.close()
    assert not d.take_validation_messages()
    d.close()


def test_a_fork_child_of_a_process_that_opened_a_gpu_makes_no_vulkan_call(tiny_layer, monkeypatch):
    """A GPU driver does not survive fork(): NVIDIA's refused vkCreateDevice in such a child, and once a child that
    opened a new Device there hung until it was killed. So where the parent loaded a GPU's driver, Device() and
    list_devices() in a fork child raise at once, saying why and what to do, and never reach the driver; the CPU
    tier still runs there, and the parent's device is unharmed. (lavapipe: the parent pretends to have loaded a
    GPU's driver, the mark that enumerating one leaves.)"""
    from vkmoe import registry
    from vkmoe.vk import device as device_module

    L, c = tiny_layer, tiny_layer.calls[0]
    d = vkmoe.Device()
    monkeypatch.setattr(device_module, "_gpu_driver", "a GPU (pretend)")

    def child(report):
        made = []

        def no_instance(*args, **kwargs):
            made.append(True)
            raise AssertionError("a Vulkan instance was made")

        device_module._Instance.__init__ = no_instance
        t0 = time.monotonic()
        for name, call in (("device", vkmoe.Device), ("list", vkmoe.list_devices)):
            try:
                call()
            except vkmoe.VkmoeError as exc:
                report[name] = str(exc)
        report["seconds"] = time.monotonic() - t0
        report["instance_made"] = bool(made)
        y = registry.create("exl3_moe_mlp", L.gate, L.up, L.down, backend="cpu")(c["x"], c["selected"], c["weights"])
        report["cpu"] = bool(np.isfinite(y).all())

    report, status = _in_fork_child(child, 60)
    assert "unexpected" not in report, report
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    for name in ("device", "list"):
        said = report.get(name, "")
        assert "forked from" in said and "a GPU (pretend)" in said and "'spawn'" in said, report
    assert report["seconds"] < 5 and not report["instance_made"] and report["cpu"], report
    with vkmoe.Exl3MoeMlp(d, L.gate, L.up, L.down, activation="silu", dispatch="split") as moe:  # the parent's
        assert rel_rms(moe(c["x"], c["selected"], c["weights"]), c["ref_out"]) < TOL
    assert not d.take_validation_messages()
    d.close()


def test_a_gpu_among_the_enumerated_devices_marks_the_process(monkeypatch):
    """The loader loads every driver when devices are enumerated, so a GPU's driver (and its threads) is in the
    process as soon as an instance lists it, whichever device is opened: the first non-CPU device enumerated is
    what a fork child's refusal names; CPU drivers leave no mark."""
    from types import SimpleNamespace

    import vulkan as vk
    from vkmoe.vk import device as device_module

    monkeypatch.setattr(device_module, "_gpu_driver", None)
    cpu = SimpleNamespace(deviceType=vk.VK_PHYSICAL_DEVICE_TYPE_CPU, deviceName="llvmpipe")
    device_module._note_gpu_driver([cpu])
    assert device_module._gpu_driver is None
    device_module._note_gpu_driver([cpu, SimpleNamespace(deviceType=vk.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU,
                                                         deviceName="Big GPU")])
    device_module._note_gpu_driver([SimpleNamespace(deviceType=vk.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU,
                                                    deviceName="Small GPU")])
    assert device_module._gpu_driver == "Big GPU"
    # this machine's own devices: marked exactly when one of them is not a CPU driver
    monkeypatch.setattr(device_module, "_gpu_driver", None)
    listed = vkmoe.list_devices()
    assert (device_module._gpu_driver is None) == all(kind == "cpu" for _, _, kind in listed), listed


def test_a_fork_while_other_threads_hold_vkmoes_locks_does_not_hang_the_child(tiny_layer):
    """fork() copies every lock as the parent's threads held it: a child whose parent had a thread inside an op call
    (its call lock), a cache lookup or a recorder's close hung forever on its first call instead of raising the
    forked-device error; a sharded layer's pool had no threads there, so its call never ran. Here a parent thread
    holds those locks across the fork, deterministically; the child must raise at once, close everything, run the
    CPU tier and ask the registry."""
    import threading

    from vkmoe import cpu, registry
    from vkmoe.ops import kernels
    from vkmoe.ops.sharded import ShardedMoeMlp
    from vkmoe.sched import residency
    from vkmoe.vk import CommandRecorder, DeviceClosedError
    from vkmoe.vk.device import _Instance

    L, c = tiny_layer, tiny_layer.calls[0]
    x, ids, w = c["x"], c["selected"], c["weights"]
    d = vkmoe.Device()
    moe = vkmoe.Exl3MoeMlp(d, L.gate, L.up, L.down, activation="silu", dispatch="split")
    lin = vkmoe.Exl3Linear(d, L.up[0])
    sharded = ShardedMoeMlp([d, d], L.gate, L.up, L.down, activation="silu")
    rec = CommandRecorder(d)
    expect = moe(x, ids, w)
    assert np.array_equal(sharded(x, ids, w), expect)
    cpu_expect = cpu.moe_forward(x, ids, w, L.gate, L.up, L.down, "silu")
    locks = [moe._call_lock, lin._call_lock, rec._close_lock, cpu._LIST_LOCK, registry._lock, residency._lock,
             kernels._lock, _Instance._lock] + [sh._call_lock for sh in sharded.shards]
    held, done = threading.Event(), threading.Event()

    def holder():
        for lock in locks:
            lock.acquire()
        held.set()
        done.wait(60)
        for lock in reversed(locks):
            lock.release()

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10)

    def child(report):
        report["errors"] = []
        t0 = time.monotonic()
        for name, call in (("moe", lambda: moe(x, ids, w)), ("linear", lambda: lin(x)),
                           ("sharded", lambda: sharded(x, ids, w))):
            try:
                call()
            except DeviceClosedError:
                report["errors"].append(name)
        for thing in (rec, sharded, lin, moe, d):
            thing.close()
        report["cpu"] = bool(np.array_equal(cpu.moe_forward(x, ids, w, L.gate, L.up, L.down, "silu"), cpu_expect))
        report["registry"] = ("exl3_moe_mlp", "cpu") in registry.available()
        try:
            report["devices"] = len(vkmoe.list_devices())  # (takes the instance lock)
        except vkmoe.VkmoeError as exc:  # (after a GPU's driver in the parent: refused under that lock, at once)
            report["devices"] = str(exc)
        report["seconds"] = time.monotonic() - t0

    report, _ = _in_fork_child(child, 60)  # (a child that hangs, as before the fix, is killed)
    done.set()
    t.join(10)
    assert "unexpected" not in report, report
    assert report["errors"] == ["moe", "linear", "sharded"] and report["cpu"] and report["registry"], report
    from vkmoe.vk import device as device_module

    gpu_parent = device_module._gpu_driver is not None
    assert ("'spawn'" in report["devices"]) if gpu_parent else report["devices"] >= 1, report
    assert report["seconds"] < 20, report
    # the parent's objects carry on once its thread let go of the locks
    assert np.array_equal(moe(x, ids, w), expect) and np.array_equal(sharded(x, ids, w), expect)
    for thing in (rec, sharded, lin, moe):
        thing.close()
    assert not d.take_validation_messages()
    d.close()


@pytest.mark.parametrize("op", ["moe", "linear"])
def test_a_record_that_fails_partway_spoils_the_recording(dev, tiny_layer, monkeypatch, op):
    """An op's record() that failed after appending some of its commands (here its second dispatch raises) left
    them in the caller's command buffer, which then ran half an op without a word. Now its submit() raises, naming
    the op and the error, until begin() again; a full recording after that runs and gives the op's numbers."""
    from test_linear import make_tensor

    from vkmoe.vk import CommandRecorder

    L, c = tiny_layer, tiny_layer.calls[0]
    x, ids, w = c["x"], c["selected"], c["weights"]
    m, top_k = ids.shape
    H = L.hidden_size
    with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu", dispatch="split") as moe, \
            vkmoe.Exl3Linear(dev, make_tensor(H, H, 4, "mul1", seed=3)) as lin, CommandRecorder(dev) as rec:
        if op == "moe":
            expect, name = moe(x, ids, w), "Exl3MoeMlp.record()"
            arrays = (x, ids.astype(np.int32), w.astype(np.float32))
            ins = [dev.memory.allocate(a.nbytes) for a in arrays]
            for b, a in zip(ins, arrays):
                b.upload(a)
            out = dev.memory.allocate(m * H * 4)
            record = lambda: moe.record(rec, *ins, out, m, top_k)  # noqa: E731
            result = lambda: out.download(np.float32, (m, H))  # noqa: E731
        else:
            expect, name = lin(x), "Exl3Linear.record()"
            ins = [dev.memory.allocate(x.nbytes)]
            ins[0].upload(x)
            out = dev.memory.allocate(m * H * 2)
            record = lambda: lin.record(rec, ins[0], out, m)  # noqa: E731
            result = lambda: out.download(np.float16, (m, H))  # noqa: E731
        dispatch, calls = CommandRecorder.dispatch, []

        def failing(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise vkmoe.VkmoeError("injected: out of device memory")
            return dispatch(self, *args, **kwargs)

        rec.begin()
        rec.fill(out, 0)
        rec.barrier()
        monkeypatch.setattr(CommandRecorder, "dispatch", failing)
        if op == "linear":
            monkeypatch.setenv("VKMOE_LINEAR_DIRECT", "off")  # (two dispatches: the input Hadamard, the GEMM)
        with pytest.raises(vkmoe.VkmoeError, match="injected"):
            record()
        monkeypatch.setattr(CommandRecorder, "dispatch", dispatch)
        assert len(calls) == 2
        rec.end()
        with pytest.raises(vkmoe.VkmoeError, match=rf"cannot run again: {re.escape(name)} failed partway through "
                                                   r"its commands \(VkmoeError: injected"):
            rec.submit()
        rec.begin()
        record()
        rec.end()
        rec.submit()
        assert np.array_equal(result(), expect)
        for b in ins + [out]:
            b.close()
