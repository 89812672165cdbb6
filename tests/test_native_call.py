"""The native call path (vkmoe.vk.fastcall, native/vkn_call.c): an op call whose forward is recorded writes its
inputs, submits, waits and reads its output in C. It must give the bits of the Python path (VKMOE_NATIVE_CALL=0)
for numpy and DeviceArray inputs and outputs, both dispatch modes and changing shapes; it must really be taken
(native_submission_count) and be left for the Python path when forced or when vkmoe._native lacks it; and its
errors (a closed device, a timeout, bad inputs) must be the Python path's, with the device usable afterwards."""
import numpy as np
import pytest

import vkmoe
from vkmoe import knobs
from goldens import rel_rms
from test_call_path import GOLDEN_TOL, blocks, layer  # noqa: F401 - fixtures: the SparseMoeBlocks, the tiny layer
from test_linear import make_tensor, make_x
from vkmoe.exl3 import reference
from vkmoe.ops.device_array import DeviceArray
from vkmoe.vk import CommandRecorder, DeviceClosedError, commands, fastcall

pytestmark = pytest.mark.skipif(not fastcall.available(), reason="vkmoe._native without the call path")

@pytest.fixture(scope="module")
def moe(device, layer):  # noqa: F811
    L = layer
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation="silu") as op:
        yield op


@pytest.fixture(scope="module")
def linear(device, layer):
    with vkmoe.Exl3Linear(device, make_tensor(layer.hidden_size, 384, 4, "mul1", seed=5)) as op:
        yield op


def _counted(fn):
    """(fn(), how many of its submissions took the native path, how many it made)."""
    native, total = commands.native_submission_count(), commands.submission_count()
    result = fn()
    return result, commands.native_submission_count() - native, commands.submission_count() - total


def _both_paths(monkeypatch, fn, fetch=lambda result: result):
    """fn() on the native path (after a first call, which records and takes the Python path) and forced onto
    the Python path: (fetch(native result), fetch(python result)); checks which path each call took. fetch runs
    outside the count (a DeviceArray's numpy() is a submission of its own where device memory is not mapped)."""
    monkeypatch.setenv("VKMOE_NATIVE_CALL", "1")
    fn()
    native, n_native, n_total = _counted(fn)
    assert n_native == n_total == 1, (n_native, n_total)
    native = fetch(native)
    monkeypatch.setenv("VKMOE_NATIVE_CALL", "0")
    python, n_native, n_total = _counted(fn)
    assert n_native == 0 and n_total == 1
    return native, fetch(python)


def _numpy(result):
    return result.numpy() if isinstance(result, DeviceArray) else result


# ------------------------------------------------------------------------------------ same bits
@pytest.mark.parametrize("dispatch", ["split", "persistent"])
def test_moe_matches_the_python_path(device, moe, layer, monkeypatch, dispatch):
    """Every golden call (several m), numpy and DeviceArray hidden and out, int64 / int32 ids and float16 /
    float32 / float64 weights, against the Python path's bits and the float64 reference."""
    for call in layer.calls:
        x, ids, w = call["x"], call["selected"], call["weights"]
        variants = [(ids, w), (ids.astype(np.int32), w.astype(np.float16)), (ids.astype(np.int64), w.astype(np.float64))]
        for ids_v, w_v in variants:
            native, python = _both_paths(monkeypatch, lambda: moe(x, ids_v, w_v, dispatch=dispatch))
            assert moe.last_run["mode"] == dispatch or moe.last_run["fallback_reason"], moe.last_run
            assert native.dtype == np.float32 and np.array_equal(native, python)
            ref = reference.moe_forward(x, ids_v, w_v, layer.gate, layer.up, layer.down, activation="silu")
            assert rel_rms(native, ref) < GOLDEN_TOL
        with DeviceArray.from_numpy(device, x) as xd:
            for out in (None, "device"):
                # (an array passed again is bound in a recording of its own: device_array.RepeatedArrays; that
                # recording's first submission takes the Python path, as every recording's does)
                moe(xd, ids, w, dispatch=dispatch, out=out)
                native, python = _both_paths(monkeypatch, lambda: moe(xd, ids, w, dispatch=dispatch, out=out), _numpy)
                assert np.array_equal(native, python) and np.array_equal(native, moe(x, ids, w, dispatch=dispatch))
        native, python = _both_paths(monkeypatch, lambda: moe(x, ids, w, dispatch=dispatch, out_dtype=np.float16))
        assert native.dtype == np.float16 and np.array_equal(native, python)


def test_moe_alternating_shapes_and_layouts(moe, layer, monkeypatch):
    """Calls alternating between shapes, each shape's recording resubmitted; non-contiguous and read-only
    inputs, which the native path converts first."""
    calls = layer.calls
    expect = [moe(c["x"], c["selected"], c["weights"]) for c in calls]
    monkeypatch.setenv("VKMOE_NATIVE_CALL", "1")
    for _ in range(3):
        for c, want in zip(calls, expect):
            got, n_native, _ = _counted(lambda: moe(c["x"], c["selected"], c["weights"]))
            assert n_native == 1 and np.array_equal(got, want)
    c, want = calls[0], expect[0]
    wide_ids = np.repeat(c["selected"], 2, axis=1)[:, ::2]          # a strided view
    fortran = np.asfortranarray(c["x"])
    frozen = c["weights"].copy()
    frozen.flags.writeable = False
    assert not wide_ids.flags.c_contiguous and not fortran.flags.c_contiguous
    got, n_native, _ = _counted(lambda: moe(fortran, wide_ids, frozen))
    assert n_native == 1 and np.array_equal(got, want)
    got, n_native, _ = _counted(lambda: moe(c["x"], c["selected"].astype(np.uint8), c["weights"]))
    assert n_native == 1 and np.array_equal(got, want)


def _hot_spy(moe, monkeypatch):
    """A list that gets one entry (the outcome: an array, or None where it fell back) per call of moe's hot path."""
    taken, real = [], type(moe)._run_hot

    def spy(self, *args):
        out = real(self, *args)
        taken.append(out)
        return out

    monkeypatch.setattr(type(moe), "_run_hot", spy)
    return taken


def test_hot_calls_give_the_general_path_s_bits(moe, layer, monkeypatch):
    """A numpy signature called again takes the hot path (Exl3MoeMlp._run_hot): the bits of the general native
    path and of the Python path, the float64 reference's values, one native submission, a last_run as the
    general path's; a non-contiguous input of the same signature leaves it for the general path, bits unchanged."""
    monkeypatch.setenv("VKMOE_NATIVE_CALL", "1")
    taken = _hot_spy(moe, monkeypatch)
    for call in layer.calls:
        x, ids, w = call["x"], call["selected"], call["weights"].astype(np.float16)
        moe._hot.clear()
        general = moe(x, ids, w, dispatch="split")  # (records, or takes the native path and keeps the signature)
        general = moe(x, ids, w, dispatch="split")
        report = dict(moe.last_run)
        del taken[:]
        hot, n_native, n_total = _counted(lambda: moe(x, ids, w, dispatch="split"))
        assert len(taken) == 1 and taken[0] is not None and n_native == n_total == 1
        assert np.array_equal(hot, general) and hot.dtype == np.float32
        ref = reference.moe_forward(x, ids, w, layer.gate, layer.up, layer.down, activation="silu")
        assert rel_rms(hot, ref) < GOLDEN_TOL
        assert {k: v for k, v in moe.last_run.items() if k not in ("gpu_ms", "wall_ms")} == \
            {k: v for k, v in report.items() if k not in ("gpu_ms", "wall_ms")}
        assert moe.last_run["gpu_ms"] > 0
        monkeypatch.setenv("VKMOE_NATIVE_CALL", "0")
        python, n_native, _ = _counted(lambda: moe(x, ids, w, dispatch="split"))
        monkeypatch.setenv("VKMOE_NATIVE_CALL", "1")
        assert n_native == 0 and np.array_equal(python, hot)
    c = layer.calls[-1]
    x, ids, w = c["x"], c["selected"], c["weights"]
    want = moe(x, ids, w, dispatch="split")
    strided = np.repeat(x, 2, axis=1)[:, ::2]
    assert strided.shape == x.shape and not strided.flags.c_contiguous
    del taken[:]
    assert np.array_equal(moe(strided, ids, w, dispatch="split"), want)
    assert len(taken) == 1 and taken[0] is None  # (the hot path declined it; the general one converted it)
    assert np.array_equal(moe(x, ids, w, dispatch="split"), want)


def test_hot_calls_follow_the_decision_and_the_knobs(moe, layer, monkeypatch):
    """A hot signature of a call without dispatch= follows VKMOE_DISPATCH (a persistent launch is never hot),
    VKMOE_NATIVE_CALL=0 (the Python path) and evictions (VKMOE_SHAPE_CACHE=1 with alternating shapes): every
    output as the general path's."""
    monkeypatch.setenv("VKMOE_NATIVE_CALL", "1")
    calls = layer.calls[:2]
    assert calls[0]["x"].shape[0] != calls[1]["x"].shape[0]
    for mode in ("split", "persistent", "split"):
        monkeypatch.setenv("VKMOE_DISPATCH", mode)
        for c in calls:
            x, ids, w = c["x"], c["selected"], c["weights"]
            want = moe(x, ids, w, dispatch=mode)
            for _ in range(3):
                got = moe(x, ids, w)
                assert np.array_equal(got, want)
                assert moe.last_run["mode"] == mode or moe.last_run["fallback_reason"], moe.last_run
    monkeypatch.setenv("VKMOE_NATIVE_CALL", "0")
    c = calls[0]
    got, n_native, n_total = _counted(lambda: moe(c["x"], c["selected"], c["weights"]))
    assert n_native == 0 and n_total == 1
    monkeypatch.setenv("VKMOE_NATIVE_CALL", "1")
    monkeypatch.setenv("VKMOE_SHAPE_CACHE", "2")  # three shapes in turn: each new one evicts the oldest (a
    L = layer  # layer of its own: the fixture's has shapes that record() pinned)
    c = max(calls, key=lambda c: c["x"].shape[0])
    assert c["x"].shape[0] > 2 and 2 not in [c["x"].shape[0] for c in calls]
    shapes = calls + [{"x": c["x"][:2], "selected": c["selected"][:2], "weights": c["weights"][:2]}]
    want = [moe(c["x"], c["selected"], c["weights"], dispatch="split") for c in shapes]
    with vkmoe.Exl3MoeMlp(moe.device, L.gate, L.up, L.down, activation="silu") as op:
        taken = _hot_spy(op, monkeypatch)
        for _ in range(2):
            for c, expect in zip(shapes, want):
                for _ in range(3):  # (records; native, keeps the signature; hot)
                    assert np.array_equal(op(c["x"], c["selected"], c["weights"], dispatch="split"), expect)
                assert len(op._scratch) <= 2
    assert sum(t is None for t in taken) == 3  # (an entry whose shape went was declined, not run: the second round)
    assert sum(t is not None for t in taken) == 6


@pytest.mark.parametrize("out_dtype", [np.float16, np.float32])
def test_linear_matches_the_python_path(device, linear, monkeypatch, out_dtype):
    for m in (1, 3, 16):
        x = make_x(m, linear.k, seed=m)
        native, python = _both_paths(monkeypatch, lambda: linear(x, out_dtype=out_dtype))
        assert native.dtype == out_dtype and np.array_equal(native, python)
        native, python = _both_paths(monkeypatch, lambda: linear(x.astype(np.float32), out_dtype=out_dtype))
        assert np.array_equal(native, python)
        native, python = _both_paths(monkeypatch, lambda: linear(np.asfortranarray(x), out_dtype=out_dtype))
        assert np.array_equal(native, python) and np.array_equal(native, linear(x, out_dtype=out_dtype))
        with DeviceArray.from_numpy(device, x) as xd:
            for out in (None, "device"):
                linear(xd, out=out)  # (xd is bound from its second call on, in a recording of its own: see above)
                native, python = _both_paths(monkeypatch, lambda: linear(xd, out=out), _numpy)
                assert np.array_equal(native, python) and np.array_equal(native, linear(x))


def test_device_block_matches_the_python_path(device, blocks, monkeypatch):  # noqa: F811
    for block in blocks:
        for m in (1, 4):
            hidden = make_x(m, block.config.hidden_size, seed=20 + m)
            for h in (hidden, hidden.astype(np.float32)):
                native, python = _both_paths(monkeypatch, lambda: block(h))
                assert np.isfinite(native).all() and np.array_equal(native, python)
            with DeviceArray.from_numpy(device, hidden) as xd:
                native, python = _both_paths(monkeypatch, lambda: block(xd, out="device"), _numpy)
                assert np.array_equal(native, python)


def test_device_block_hot_calls(device, blocks, monkeypatch):  # noqa: F811
    """A numpy hidden called again takes the block's hot path (DeviceMoeBlock._run_hot): the bits of the general
    path (native and Python) and of the float64 reference's block within tolerance; VKMOE_DISPATCH=persistent
    (a routed decision that changed) and a strided hidden leave it for the general path, same bits."""
    from vkmoe.ops.block import DeviceMoeBlock

    taken, real = [], DeviceMoeBlock._run_hot

    def spy(self, *args):
        out = real(self, *args)
        taken.append(out)
        return out

    monkeypatch.setattr(DeviceMoeBlock, "_run_hot", spy)
    monkeypatch.setenv("VKMOE_NATIVE_CALL", "1")
    for block in blocks:
        for m in (1, 3):
            for h in (make_x(m, block.config.hidden_size, seed=40 + m),
                      make_x(m, block.config.hidden_size, seed=50 + m).astype(np.float32)):
                monkeypatch.delenv("VKMOE_DISPATCH", raising=False)
                block(h)
                want = block(h)  # (the general native path: keeps the signature)
                del taken[:]
                hot, n_native, n_total = _counted(lambda: block(h))
                assert len(taken) == 1 and taken[0] is not None and n_native == n_total == 1
                assert np.array_equal(hot, want) and block.last_run["mode"] == "split"
                assert rel_rms(hot, block.reference(h)) < GOLDEN_TOL
                monkeypatch.setenv("VKMOE_NATIVE_CALL", "0")
                assert np.array_equal(block(h), want)
                monkeypatch.setenv("VKMOE_NATIVE_CALL", "1")
                monkeypatch.setenv("VKMOE_DISPATCH", "persistent")
                del taken[:]
                for _ in range(3):
                    assert np.array_equal(block(h), want)
                    assert block.last_run["mode"] == "persistent"
                assert all(t is None for t in taken)
                monkeypatch.delenv("VKMOE_DISPATCH")
                assert np.array_equal(block(h), want)  # (split again: the general path keeps the signature)
                wide = np.repeat(h, 2, axis=1)[:, ::2]
                assert not wide.flags.c_contiguous
                del taken[:]
                assert np.array_equal(block(wide), want) and len(taken) == 1 and taken[0] is None


def test_c_conversions_are_numpy_s(device):
    """Every fp16 bit pattern to fp32 (subnormals, infinities, NaN payloads), fp64 to fp32 rounding (halfway
    cases, subnormals, overflow) and int64 to int32 wrapping, on both ends of a call."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    doubles = np.concatenate([np.random.default_rng(0).standard_normal(4096) * 10.0 ** np.arange(-40, 40, 80 / 4096),
                              [1 + 2.0 ** -24, 1 + 3 * 2.0 ** -24, 2.0 ** -149, 2.0 ** -150, 1e39, -1e39, 3.4028235e38]])
    ints = np.array([0, 1, -1, 2 ** 31 - 1, -2 ** 31, 2 ** 31, 2 ** 40 + 5, -2 ** 40 - 5], np.int64)
    mem = device.memory
    with CommandRecorder(device) as rec:
        rec.begin()
        rec.end()
        rec.submit(wait=True)
        for src, dst in ((halves, np.float32), (doubles, np.float32), (ints, np.int32)):
            n = src.size
            with mem.allocate(n * 4, kind="upload") as inp, mem.allocate(n * 2, kind="readback") as out:
                call = fastcall.NativeCall(rec, [(inp, dst, (n,))], (out, np.float16, (n,)))
                out.host_view(np.float16, (n,))[...] = halves[:n]
                back = call.run([src], np.dtype(np.float32))
                with np.errstate(over="ignore"):  # (1e39 becomes inf in numpy's cast too)
                    assert inp.host_view(dst, (n,)).tobytes() == src.astype(dst).tobytes()
                assert back.tobytes() == halves[:n].astype(np.float32).tobytes()
                assert call.run([None]) is None


# ------------------------------------------------------------------------------------ which path
def test_without_the_native_module_the_python_path_runs(moe, linear, layer, monkeypatch):
    c = layer.calls[0]
    want, want_lin = moe(c["x"], c["selected"], c["weights"]), linear(c["x"])
    monkeypatch.setattr(fastcall, "_lib", None)
    assert not fastcall.available() and not fastcall.enabled()
    got, n_native, n_total = _counted(lambda: (moe(c["x"], c["selected"], c["weights"]), linear(c["x"])))
    assert n_native == 0 and n_total == 2
    assert np.array_equal(got[0], want) and np.array_equal(got[1], want_lin)


def test_first_submission_of_a_recording_takes_the_python_path(device, layer):
    """It may include the driver's lazy compile, which gets the compile bound (CallTransfers.submit)."""
    L = layer
    c = L.calls[0]
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation="silu", dispatch="split") as fresh:
        counts = [_counted(lambda: fresh(c["x"], c["selected"], c["weights"]))[1:] for _ in range(3)]
    # (the first call may also submit one-time uploads of its own, e.g. a scratch buffer's zeros into device
    # memory that the host cannot map: a discrete GPU's)
    assert counts[0][0] == 0 and counts[0][1] >= 1 and counts[1:] == [(1, 1), (1, 1)], counts


# ------------------------------------------------------------------------------------ errors
def test_bad_inputs_raise_as_before(moe, linear, layer):
    c = layer.calls[0]
    x, ids, w = c["x"], c["selected"], c["weights"]
    moe(x, ids, w)  # the shape's recording exists: the next calls would take the native path
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 8\); found 9"):
        moe(x, np.full_like(ids, 9), w)
    with pytest.raises(ValueError, match=r"expert_weights contains NaN or Inf"):
        moe(x, ids, np.full_like(w, np.nan))
    with pytest.raises(TypeError, match=r"hidden must be float16"):
        moe(x.astype(np.float32), ids, w)
    with pytest.raises(ValueError, match=r"x: expected shape \(m, 256\)"):
        linear(x[:, :128])
    assert np.array_equal(moe(x, ids, w), moe(x, ids, w))


def test_hot_signature_still_checks_every_input_shape(moe, layer, monkeypatch):
    """A signature on the hot path (Exl3MoeMlp._run_hot) with routing weights of another shape: the general
    path's error, never a copy of the slot's size out of a smaller array (it was read past its end and ran)."""
    monkeypatch.setenv("VKMOE_NATIVE_CALL", "1")
    taken = _hot_spy(moe, monkeypatch)
    c = max(layer.calls, key=lambda call: call["selected"].shape[0])  # (m > 1: w[:1] is another shape)
    x, ids, w = c["x"], c["selected"], c["weights"]
    m, top_k = ids.shape
    assert m > 1
    want = moe(x, ids, w, dispatch="split")
    moe(x, ids, w, dispatch="split")
    del taken[:]
    assert np.array_equal(moe(x, ids, w, dispatch="split"), want) and taken and taken[0] is not None  # (hot)
    for bad in (w[:1], np.ascontiguousarray(w[:, :1]), w.reshape(-1), np.repeat(w, 2, axis=1), w[..., None]):
        with pytest.raises(ValueError, match=rf"expert_weights: expected shape \({m}, {top_k}\)"):
            moe(x, ids, bad, dispatch="split")
    assert np.array_equal(moe(x, ids, w, dispatch="split"), want)


def _outcome(fn):
    """fn()'s result, or its exception's type and message."""
    try:
        return fn()
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)


def test_routing_checked_in_c_as_check_op_routing_does(moe, layer, monkeypatch):
    """The native path checks a call's routing in C (fastcall.IndexRule, BoundedRule) instead of
    check_op_routing: every case, valid or not, in every dtype C reads itself, must end as on the Python path (the
    same output, or the same error)."""
    c = layer.calls[0]
    x, ids, w = c["x"][:2], c["selected"][:2], c["weights"][:2]
    E, k = moe.E, ids.shape[1]
    f32_max = float(np.finfo(np.float32).max)
    id_cases = [ids, np.full_like(ids, E), np.where(ids == ids[0, 0], -1, ids), ids + (1 << 32),
                np.repeat(ids[:, :1], k, axis=1), np.array([[E - 1] + list(range(k - 1))] * 2)]
    w = w.astype(np.float64)
    w_cases = [w, -w, np.where(w == w[0, 0], np.nan, w), np.where(w == w[1, 0], np.inf, w),
               np.full_like(w, f32_max), np.full_like(w, np.nextafter(f32_max, np.inf)), np.full_like(w, 1e39)]
    checked = 0
    for id_dt in (np.int32, np.int64):
        for w_dt in (np.float16, np.float32, np.float64):
            for ids_v in id_cases:
                for w_v in w_cases:
                    with np.errstate(over="ignore", invalid="ignore"):
                        ids_c, w_c = ids_v.astype(id_dt), w_v.astype(w_dt)
                    if id_dt is np.int32 and (ids_v >= 1 << 31).any():
                        continue  # (the wrap of astype, not a case)
                    monkeypatch.setenv("VKMOE_NATIVE_CALL", "0")
                    python = _outcome(lambda: moe(x, ids_c, w_c))
                    monkeypatch.setenv("VKMOE_NATIVE_CALL", "1")
                    native, n_native, _ = _counted(lambda: _outcome(lambda: moe(x, ids_c, w_c)))
                    if isinstance(python, np.ndarray):
                        assert n_native == 1 and np.array_equal(native, python, equal_nan=True)
                    else:
                        assert native == python, (id_dt, w_dt, ids_v, w_v)
                        assert n_native == 0  # rejected before the submission
                    checked += 1
    assert checked > 200


@pytest.mark.parametrize("bound", [16, 5000])  # the bitmap's and the pairwise scan's repeat search
def test_index_and_bounded_rules(device, bound):
    """NativeCall's rules, on the values as given: a call whose check C cannot clear runs the caller's check
    (which here lets it through), one that C clears does not."""
    rng = np.random.default_rng(bound)
    mem = device.memory
    with CommandRecorder(device) as rec, mem.allocate(64 * 4, kind="upload") as ib, \
            mem.allocate(64 * 4, kind="upload") as wb, mem.allocate(16, kind="readback") as out:
        rec.begin()
        rec.end()
        rec.submit(wait=True)
        call = fastcall.NativeCall(rec, [(ib, np.int32, (8, 8), fastcall.IndexRule(bound, 8)),
                                         (wb, np.float32, (64,), fastcall.BoundedRule(2.5))], (out, np.float32, (4,)))
        for _ in range(200):
            ids = np.stack([rng.choice(bound, 8, replace=False) for _ in range(8)]).astype(np.int64)
            if rng.random() < 0.5:
                r, a, b = rng.integers(8), *rng.choice(8, 2, replace=False)
                ids[r, a] = ids[r, b]
            if rng.random() < 0.2:
                ids[rng.integers(8), rng.integers(8)] = rng.choice([-1, bound, bound + (1 << 32), -(1 << 32)])
            w = rng.uniform(-2.5, 2.5, 64)
            if rng.random() < 0.3:
                w[rng.integers(64)] = rng.choice([np.nan, np.inf, -np.inf, 2.5000001, -2.6])
            for ids_v, w_v in ((ids, w), (ids.astype(np.int32), w.astype(np.float32)), (ids, w.astype(np.float16))):
                if ids_v.dtype == np.int32 and not np.array_equal(ids_v, ids):
                    continue  # (the wrap of astype, not a case)
                valid = (all(len(set(row)) == 8 for row in ids_v.tolist()) and ids_v.min() >= 0
                         and ids_v.max() < bound and bool(np.all(np.abs(w_v.astype(np.float64)) <= 2.5)))
                asked = []
                call.run([ids_v, w_v], check=asked.append)
                assert (not asked) == valid, (ids_v, w_v)
                assert np.array_equal(ib.host_view(np.int32, (8, 8)), ids_v.astype(np.int32))


def test_native_call_checks_the_shapes_it_copies(device):
    with CommandRecorder(device) as rec, device.memory.allocate(64, kind="upload") as inp, \
            device.memory.allocate(64, kind="readback") as out:
        rec.begin()
        rec.end()
        call = fastcall.NativeCall(rec, [(inp, np.float32, (4, 4))], (out, np.float32, (16,)))
        with pytest.raises(ValueError, match=r"expected an array of shape \(4, 4\), got \(2, 4\)"):
            call.run([np.zeros((2, 4), np.float32)])
        prepared = call.prepare((np.dtype(np.float32),))
        with device.use(), pytest.raises(ValueError, match=r"expected arrays of shapes \[\(4, 4\)\], got \[\(2, 4\)\]"):
            call.run_prepared(prepared, (np.zeros((2, 4), np.float32),), None)
        with pytest.raises(ValueError, match=r"does not fit"):
            fastcall.NativeCall(rec, [(inp, np.float32, (32,))], (out, np.float32, (16,)))


def test_timeout_raises_then_the_device_recovers(dev, layer, monkeypatch):
    """A tiny VKMOE_TIMEOUT against a forward that runs longer: vkmoe.TimeoutError with the Python path's
    message, from the native path; with the timeout back, the same op gives the right answer."""
    L = layer
    c = L.calls[-1]
    x, ids, w = (np.tile(c[k], (64 // c[k].shape[0] + 1, 1))[:64] for k in ("x", "selected", "weights"))
    with vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu", dispatch="split") as op:
        want = op(x, ids, w)
        for recording in op._recorded.values():  # no spin (as on a CPU device): on a GPU it would catch the end
            recording.rec.spin_s = 0.0
        monkeypatch.setenv("VKMOE_TIMEOUT", "0.000001")
        native = commands.native_submission_count()
        with pytest.raises(vkmoe.TimeoutError, match=r"the GPU did not finish within 1e-06 s"):
            for _ in range(20):  # (a forward of milliseconds on lavapipe, tens of us on a GPU: never within 1 us)
                op(x, ids, w)
        assert commands.native_submission_count() > native
        monkeypatch.delenv("VKMOE_TIMEOUT")
        assert np.array_equal(op(x, ids, w), want)


def test_closed_device_raises_device_closed_error(layer):
    L = layer
    c = L.calls[0]
    d = vkmoe.Device()
    moe = vkmoe.Exl3MoeMlp(d, L.gate, L.up, L.down, activation="silu", dispatch="split")
    lin = vkmoe.Exl3Linear(d, make_tensor(L.hidden_size, 256, 4, "mul1", seed=6))
    for _ in range(2):
        moe(c["x"], c["selected"], c["weights"]), lin(c["x"])
    assert not d.take_validation_messages()
    d.close()
    with pytest.raises(DeviceClosedError, match="is closed"):
        moe(c["x"], c["selected"], c["weights"])
    with pytest.raises(DeviceClosedError, match="is closed"):
        lin(c["x"])
    moe.close(), lin.close()


def test_spin_setting_reaches_the_native_wait(device, linear):
    """CommandRecorder.spin_s, changed on a live recorder, is the C spin's too (both ends of the wait)."""
    x = make_x(16, linear.k, seed=8)
    expect = linear(x)
    rec = linear._call_buffers(16)[2].rec
    old = rec.spin_s
    try:
        for spin_s in (1.0, 1e-6):
            rec.spin_s = spin_s
            for _ in range(2):
                got, n_native, _ = _counted(lambda: linear(x))
                assert n_native == 1 and np.array_equal(got, expect) and not rec.pending
    finally:
        rec.spin_s = old


def test_a_gpu_wait_spins_about_as_long_as_the_last_run(device, linear):
    """On a GPU a wait spins about as long as the recorder's last run took (RUN_SPIN_FACTOR x, in SPIN_STEP_S steps,
    between spin_s and MAX_SPIN_S) before sleeping, on both call paths: sleeping in vkWaitForFences cost an H100 host
    0.2-0.35 ms per chained submission. Lavapipe (a CPU device) never spins unless told to; here the recorder is
    made to behave as on a GPU."""
    from vkmoe.vk import commands

    x = make_x(16, linear.k, seed=8)
    expect = linear(x)
    rec = linear._call_buffers(16)[2].rec
    old = rec.spin_s, rec._adaptive_spin
    try:
        rec._adaptive_spin, rec.spin_s = True, 0.0005
        for run_s, want in ((0.0001, 0.0005), (0.002, 0.0025), (0.00201, 0.00255), (1.0, commands.MAX_SPIN_S)):
            rec._run_s = run_s
            rec.spin_s = 0.0005  # (recomputes the next spin)
            assert rec._spin_next == pytest.approx(want)
        for native in ("1", "0"):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("VKMOE_NATIVE_CALL", native)
                rec._run_s = 0.0
                got = linear(x)
                assert np.array_equal(got, expect) and not rec.pending and rec._run_s > 0
                asked = rec._spin_next
                assert 0.0005 <= asked <= commands.MAX_SPIN_S
                got = linear(x)  # (the native struct takes the spin the last run asked for at the next call)
                assert np.array_equal(got, expect)
                if native == "1":
                    assert linear._call_buffers(16)[2].native._spin_s == asked
    finally:
        rec._adaptive_spin = old[1]
        rec.spin_s = old[0]
        rec._run_s = 0.0


def test_knob_defaults_to_the_native_path():
    assert knobs.get("VKMOE_NATIVE_CALL", {}) is True
    assert knobs.get("VKMOE_NATIVE_CALL", {"VKMOE_NATIVE_CALL": "off"}) is False
