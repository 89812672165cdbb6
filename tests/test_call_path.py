"""The per-call path of Exl3MoeMlp and Exl3Linear (issue 18 items 1 and 2): ONE submission per call, also where
device memory is not host-visible (a discrete GPU; simulated here on lavapipe), DeviceArrays in and out of the
ops with results bit-identical to the numpy path, clear errors for bad DeviceArrays, the NaN poison of the output
kept, the fence wait that spins before it sleeps, and the residency cache read once into memory."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

import vkmoe
from goldens import golden_files, load_layer, rel_rms
from test_linear import make_tensor, make_x
from vkmoe.ops.device_array import DeviceArray
from vkmoe.sched import residency
from vkmoe.vk import commands

GOLDEN_TOL = 3e-3
TINY = next(p for p in golden_files() if p.endswith("a_tiny_silu_k4.npz"))  # H 256, I 128, 8 experts, top-2


@pytest.fixture(scope="module")
def layer():
    return load_layer(TINY)


@pytest.fixture(scope="module")
def ops(device, layer):
    """(moe, linear H -> H, linear H -> H) on the session device."""
    L = layer
    made = (vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation="silu", dispatch="split"),
            vkmoe.Exl3Linear(device, make_tensor(L.hidden_size, L.hidden_size, 4, "mul1", seed=3)),
            vkmoe.Exl3Linear(device, make_tensor(L.hidden_size, L.hidden_size, 3, "mul1", seed=4)))
    yield made
    for op in made:
        op.close()


@pytest.fixture(scope="module")
def discrete(layer):
    """A device whose device-local memory the host cannot map (as on a discrete GPU): data reaches such
    memory only through staging copies, each a submission of its own before issue 18."""
    dev = vkmoe.Device()
    dev.memory.device_mappable = False  # before anything is allocated: every device block is unmapped
    L = layer
    moe = vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation="silu", dispatch="split")
    lin = vkmoe.Exl3Linear(dev, make_tensor(L.hidden_size, L.hidden_size, 4, "mul1", seed=3))
    yield dev, moe, lin
    moe.close(), lin.close()
    assert not dev.take_validation_messages()
    dev.close()


def _submissions(fn):
    before = commands.submission_count()
    result = fn()
    return commands.submission_count() - before, result


# ------------------------------------------------------------------------------------ one submission
def test_one_submission_per_call_with_unmappable_device_memory(discrete, device, ops, layer):
    dev, moe, lin = discrete
    assert not moe._down.trellis.mapped, "the simulation needs device memory the host cannot map"
    call = layer.calls[0]
    x, ids, w = call["x"], call["selected"], call["weights"]
    moe(x, ids, w), lin(x)  # first calls record the command buffers (and upload nothing else)
    for _ in range(3):
        n, y = _submissions(lambda: moe(x, ids, w))
        assert n == 1, f"Exl3MoeMlp.__call__ made {n} submissions"
        n, z = _submissions(lambda: lin(x))
        assert n == 1, f"Exl3Linear.__call__ made {n} submissions"
    # Same kernels, same inputs: bit-identical to the session device, where device memory is host-visible.
    assert np.array_equal(y, ops[0](x, ids, w)) and np.isfinite(y).all()
    assert np.array_equal(z, ops[1](x)) and np.isfinite(z).all()
    assert rel_rms(y, call["ref_out"]) < GOLDEN_TOL


def test_device_arrays_one_submission_with_unmappable_device_memory(discrete):
    dev, moe, lin = discrete
    x = make_x(3, moe.H, seed=5)
    ids = np.array([[0, 1], [2, 7], [5, 3]], np.int32)
    w = np.full((3, 2), 0.5, np.float32)
    expect = moe(lin(x), ids, w)
    with DeviceArray.from_numpy(dev, x) as xd:
        lin(xd, out="device"), moe(lin(x), ids, w)  # record the copies' buffers once
        n, h = _submissions(lambda: lin(xd, out="device"))
        assert n == 1
        n, y = _submissions(lambda: moe(h, ids, w, out="device"))
        assert n == 1
        assert np.array_equal(y.numpy(), expect)
        h.close(), y.close()


def test_persistent_call_is_one_submission(device, layer):
    """The persistent path reads its abort word back in the same submission as the output."""
    L = layer
    call = L.calls[0]
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation="silu", dispatch="persistent") as moe:
        moe(call["x"], call["selected"], call["weights"])
        if moe.last_run["mode"] != "persistent":
            pytest.skip(f"persistent mode not possible here: {moe.last_run['fallback_reason']}")
        n, y = _submissions(lambda: moe(call["x"], call["selected"], call["weights"]))
        assert moe.last_run["mode"] == "persistent" and moe.last_run["fallback_reason"] is None
    assert n == 1
    assert rel_rms(y, call["ref_out"]) < GOLDEN_TOL


# ------------------------------------------------------------------------------------ device arrays
def test_device_arrays_between_ops_match_numpy(device, ops, layer):
    moe, lin1, lin2 = ops
    for call in layer.calls:
        x, ids, w = call["x"], call["selected"], call["weights"]
        expect_moe = moe(lin2(lin1(x)), ids, w)
        with DeviceArray.from_numpy(device, x) as xd:
            h1 = lin1(xd, out="device")
            h2 = lin2(h1, out="device")
            y = moe(h2, ids, w, out="device")
            assert isinstance(y, DeviceArray) and y.shape == (x.shape[0], moe.H) and y.dtype == np.float32
            assert np.array_equal(h2.numpy(), lin2(lin1(x)))
            got = y.numpy()
            for arr in (h1, h2, y):
                arr.close()
        assert np.isfinite(got).all() and np.array_equal(got, expect_moe)


def test_recorded_copies_follow_the_arrays(device, ops, layer):
    """The DeviceArray copies of a call are recorded once and reused while the same arrays come back: calls
    alternating between two input arrays and two output arrays must each get their own data."""
    moe, lin1, _ = ops
    call = layer.calls[0]
    x = call["x"]
    xs = [x, (x.astype(np.float32) * 0.5).astype(np.float16)]
    expect = [lin1(v) for v in xs]
    assert not np.array_equal(expect[0], expect[1])
    arrays = [DeviceArray.from_numpy(device, v) for v in xs]
    outs = [DeviceArray.empty(device, (x.shape[0], lin1.n), np.float16) for _ in xs]
    try:
        for i in (0, 0, 1, 1, 0, 1):
            outs[i].buffer.upload(np.full((x.shape[0], lin1.n), np.nan, np.float16))
            assert lin1(arrays[i], out=outs[i]) is outs[i]
            assert np.array_equal(outs[i].numpy(), expect[i]), i
    finally:
        for a in arrays + outs:
            a.close()


def test_arrays_passed_again_are_bound_not_copied(device, ops, layer):
    """From a pair of arrays' second call on, the MoE binds them in a recording of their own (no copies): the
    results keep the bits of numpy calls, stale output contents never show, calls alternating between arrays each
    get their own data, and the layer keeps at most BOUND_RECORDINGS such recordings per shape and path."""
    from vkmoe.ops.device_array import BOUND_RECORDINGS

    moe = ops[0]
    call = layer.calls[0]
    x, ids, w = call["x"], call["selected"], call["weights"]
    m, top_k = ids.shape
    xs = [x, (x.astype(np.float32) * 0.5).astype(np.float16)]
    expect = [moe(v, ids, w) for v in xs]
    assert not np.array_equal(expect[0], expect[1])
    n = BOUND_RECORDINGS + 2
    hiddens = [DeviceArray.from_numpy(device, xs[i % 2]) for i in range(n)]
    outs = [DeviceArray.empty(device, (m, moe.H), np.float32) for _ in range(n)]
    bound_keys = lambda: [k for k in moe._recorded if len(k) > 3 and k[:2] == (m, top_k)]
    try:
        for rnd in range(3):
            for i in range(n):
                outs[i].buffer.upload(np.full((m, moe.H), 7.0, np.float32))  # stale contents must be overwritten
                got = moe(hiddens[i], ids, w, out=outs[i])
                assert got is outs[i] and np.array_equal(got.numpy(), expect[i % 2]), (rnd, i)
                y = moe(hiddens[i], ids, w)  # a bound hidden with a numpy output
                assert np.array_equal(y, expect[i % 2]), (rnd, i)
            assert len(bound_keys()) == (BOUND_RECORDINGS if rnd else 0)  # bound from a second call on
        assert any(k[3] is not None and k[4] is not None for k in bound_keys())
        # an output array at the start of a bigger buffer: the bytes past it stay as they were
        big = device.memory.allocate(m * moe.H * 4 + 64)
        big.upload(np.full(m * moe.H + 16, 5.0, np.float32))
        view = DeviceArray(big, (m, moe.H), np.float32)
        for _ in range(2):
            assert np.array_equal(moe(hiddens[0], ids, w, out=view).numpy(), expect[0])
        assert (big.download(np.float32)[m * moe.H:] == 5.0).all()
        big.close()
    finally:
        for a in hiddens + outs:
            a.close()


def test_linear_binds_arrays_passed_again(device, ops, layer, monkeypatch):
    """Exl3Linear binds DeviceArrays passed again as the MoE does: bits of numpy calls over alternating arrays
    (x bound with a numpy output, both bound), stale output never shows, at most BOUND_RECORDINGS recordings per
    m, an output at the start of a bigger buffer keeps the bytes past it, a closed layer frees them all."""
    from vkmoe.ops.device_array import BOUND_RECORDINGS

    _, lin1, _ = ops
    x = layer.calls[0]["x"]
    m = x.shape[0]
    xs = [x, (x.astype(np.float32) * 0.5).astype(np.float16)]
    expect = [lin1(v) for v in xs]
    assert not np.array_equal(expect[0], expect[1])
    n = BOUND_RECORDINGS + 2
    arrays = [DeviceArray.from_numpy(device, xs[i % 2]) for i in range(n)]
    outs = [DeviceArray.empty(device, (m, lin1.n), np.float16) for _ in range(n)]
    mine = {a.buffer for a in arrays + outs}  # (earlier tests of the module's layer bound arrays of their own)
    bound_keys = lambda: [k for k in lin1._bound if k[0] == m and (k[1] in mine or k[2] in mine)]
    try:
        for rnd in range(3):
            for i in range(n):
                outs[i].buffer.upload(np.full((m, lin1.n), 7.0, np.float16))  # stale contents must be overwritten
                assert lin1(arrays[i], out=outs[i]) is outs[i]
                assert np.array_equal(outs[i].numpy(), expect[i % 2]), (rnd, i)
                assert np.array_equal(lin1(arrays[i]), expect[i % 2]), (rnd, i)  # x bound, numpy out
            assert len(bound_keys()) == (BOUND_RECORDINGS if rnd else 0), rnd  # bound from a second call on
        assert any(k[1] is not None and k[2] is not None for k in bound_keys())
        assert np.array_equal(lin1(xs[1]), expect[1])  # the io recording is still there
        big = device.memory.allocate(m * lin1.n * 2 + 64)
        big.upload(np.full(m * lin1.n + 32, 5.0, np.float16))
        view = DeviceArray(big, (m, lin1.n), np.float16)
        for _ in range(2):
            assert np.array_equal(lin1(xs[0], out=view).numpy(), expect[0])
        assert (big.download(np.float16)[m * lin1.n:] == 5.0).all()
        big.close()
        monkeypatch.setenv("VKMOE_SHAPE_CACHE", "1")
        with vkmoe.Exl3Linear(device, lin1.tensor) as other:
            for _ in range(2):
                assert np.array_equal(other(arrays[0], out=outs[0]).numpy(), expect[0])
            assert other._bound
            other(x[:1])  # another m evicts m's io entry, and its bound recordings with it
            assert not other._bound and list(other._io) == [1]
            for _ in range(2):
                assert np.array_equal(other(arrays[1], out=outs[1]).numpy(), expect[1])
            assert other._bound
        assert not other._bound and not other._io  # close() frees them
    finally:
        for a in arrays + outs:
            a.close()


def test_device_array_hidden_matches_golden(device, ops, layer):
    moe = ops[0]
    for call in layer.calls:
        with DeviceArray.from_numpy(device, call["x"]) as xd:
            y = moe(xd, call["selected"], call["weights"])  # numpy out from a device in
        assert rel_rms(y, call["ref_out"]) < GOLDEN_TOL
        assert np.array_equal(y, moe(call["x"], call["selected"], call["weights"]))


def test_out_device_array_is_written_and_returned(device, ops, layer):
    moe, lin1, _ = ops
    call = layer.calls[0]
    x, ids, w = call["x"], call["selected"], call["weights"]
    m = x.shape[0]
    with DeviceArray.empty(device, (m, moe.H), np.float32) as out, \
            DeviceArray.empty(device, (m, lin1.n), np.float16) as yl:
        out.buffer.upload(np.full((m, moe.H), 7.0, np.float32))  # stale contents must be overwritten
        assert moe(x, ids, w, out=out) is out
        assert np.array_equal(out.numpy(), moe(x, ids, w))
        assert lin1(x, out=yl) is yl
        assert np.array_equal(yl.numpy(), lin1(x))


def test_zero_rows_with_device_arrays(device, ops):
    moe, lin1, _ = ops
    empty = DeviceArray.empty(device, (0, moe.H), np.float16)
    y = moe(empty, np.zeros((0, 2), np.int32), np.zeros((0, 2), np.float32), out="device")
    assert isinstance(y, DeviceArray) and y.shape == (0, moe.H) and y.numpy().shape == (0, moe.H)
    z = lin1(empty, out="device")
    assert z.shape == (0, lin1.n) and z.numpy().dtype == np.float16


def test_device_array_arguments_are_named(device, monkeypatch):
    """A shape of 2.5 or "4" was taken as 2 or 4, an object dtype was taken, a non-Buffer failed with an
    AttributeError, a negative size was reported as a buffer size, and a from_numpy whose upload failed left its
    buffer allocated until the device closed."""
    with device.memory.allocate(64) as buf:
        for call, err, msg in (
                (lambda: DeviceArray("abc", (2,), np.float16), TypeError, "buffer: expected a vkmoe Buffer or None"),
                (lambda: DeviceArray(buf, (1.5,), np.float16), TypeError, r"shape: expected a tuple of integers"),
                (lambda: DeviceArray(buf, ("4",), np.float16), TypeError, r"shape: expected a tuple of integers"),
                (lambda: DeviceArray(buf, (True,), np.float16), TypeError, r"shape: expected a tuple of integers"),
                (lambda: DeviceArray(buf, (2,), object), TypeError, "dtype: expected a numeric dtype, got object"),
                (lambda: DeviceArray(buf, (10 ** 30,), np.float16), ValueError, "the buffer holds 64"),
                (lambda: DeviceArray.empty(device, (-1, 2), np.float16), ValueError, "non-negative dimensions"),
                (lambda: DeviceArray.empty(device, (2.5,), np.float16), TypeError, "shape: expected a tuple"),
                (lambda: DeviceArray.empty(device, (2,), "U4"), TypeError, "dtype: expected a numeric dtype"),
                # (named "buffer of N bytes", which the caller never asked for)
                (lambda: DeviceArray.empty(device, (10 ** 12, 128), np.float16), ValueError,
                 r"shape: \(1000000000000, 128\) of float16 would need 256000000000000 bytes, more than this "
                 "device's maxStorageBufferRange")):
            with pytest.raises(err, match=msg):
                call()
        assert DeviceArray(buf, 4, np.float16).shape == (4,)  # (an int is a 1-d shape, as in numpy)
    made = []
    real_allocate = device.memory.allocate
    monkeypatch.setattr(device.memory, "allocate", lambda *a, **k: made.append(real_allocate(*a, **k)) or made[-1])
    def failing_upload(*args, **kwargs):
        raise OSError("upload failed")

    monkeypatch.setattr(vkmoe.Buffer, "upload", failing_upload)
    with pytest.raises(OSError, match="upload failed"):
        DeviceArray.from_numpy(device, np.ones((4, 4), np.float16))
    assert len(made) == 1 and made[0].closed  # (the buffer went back)


def test_dropped_device_arrays_give_their_memory_back(device, ops, layer):
    """An owned DeviceArray (from_numpy / empty, an op's out="device") dropped without close() kept its memory until
    the device closed: 40 dropped 4 MB arrays held 160 MB, and a decode loop taking out="device" results grew
    without bound. A wrapped buffer (not owned) stays the caller's."""
    import gc

    moe = ops[0]
    call = layer.calls[0]
    moe(call["x"], call["selected"], call["weights"], out="device").close()  # (the call's own buffers: once)
    gc.collect()
    before = device.memory.block_count()
    for _ in range(40):
        a = DeviceArray.from_numpy(device, np.ones((1024, 1024), np.float32))
        buf = a.buffer
        del a
        assert buf.closed
    for _ in range(200):
        y = moe(call["x"], call["selected"], call["weights"], out="device")
        buf = y.buffer
        del y
        assert buf.closed
    gc.collect()
    assert device.memory.block_count() == before
    with device.memory.allocate(64) as mine:
        wrapped = DeviceArray(mine, (16,), np.float32)
        del wrapped
        assert not mine.closed


def test_bad_device_arrays(device, ops, layer):
    moe, lin1, _ = ops
    call = layer.calls[0]
    x, ids, w = call["x"], call["selected"], call["weights"]
    m = x.shape[0]
    with DeviceArray.from_numpy(device, x.astype(np.float32)) as x32:
        with pytest.raises(TypeError, match=r"hidden must be float16, got a DeviceArray of float32"):
            moe(x32, ids, w)
        with pytest.raises(TypeError, match=r"x must be float16"):
            lin1(x32)
    with DeviceArray.from_numpy(device, x[:, :128]) as narrow:
        with pytest.raises(ValueError, match=r"hidden must have shape \(m, 256\), got a DeviceArray of shape"):
            moe(narrow, ids, w)
        with pytest.raises(ValueError, match=r"x must have shape \(m, 256\)"):
            lin1(narrow)
    with DeviceArray.from_numpy(device, x[:1]) as short:  # 1 row of hidden, 3 rows of expert_ids
        with pytest.raises(ValueError, match=r"expert_ids: expected shape \(1, top_k\)"):
            moe(short, ids, w)
    closed = DeviceArray.from_numpy(device, x)
    closed.close()
    with pytest.raises(vkmoe.VkmoeError, match=r"hidden is a closed DeviceArray"):
        moe(closed, ids, w)
    with pytest.raises(vkmoe.VkmoeError, match=r"numpy\(\).*closed"):
        closed.numpy()
    buf = device.memory.allocate(x.nbytes)
    wrapped = DeviceArray(buf, x.shape, np.float16)  # not owned: closing the buffer is the caller's business
    buf.close()
    with pytest.raises(vkmoe.VkmoeError, match=r"x is a closed DeviceArray"):
        lin1(wrapped)
    for bad_out, err, msg in (("host", ValueError, r"out must be None, 'device' or a vkmoe DeviceArray, got 'host'"),
                              (np.zeros((m, moe.H), np.float32), TypeError, r"out must be .* got ndarray")):
        with pytest.raises(err, match=msg):
            moe(x, ids, w, out=bad_out)
    with DeviceArray.empty(device, (m, moe.H), np.float16) as wrong_dtype:
        with pytest.raises(TypeError, match=r"out must be float32, got a DeviceArray of float16"):
            moe(x, ids, w, out=wrong_dtype)
    with DeviceArray.empty(device, (m + 1, moe.H), np.float32) as wrong_rows:
        with pytest.raises(ValueError, match=r"out must have shape \(3, 256\)"):
            moe(x, ids, w, out=wrong_rows)
    with device.memory.allocate(16) as small, pytest.raises(ValueError, match=r"needs 2048 bytes; the buffer holds 16"):
        DeviceArray(small, (4, 256), np.float16)
    with pytest.raises(TypeError, match=r"array must be a numpy array"):
        DeviceArray.from_numpy(device, [1, 2])


def test_device_array_of_another_device(discrete, ops, layer):
    other, _, _ = discrete
    moe, lin1, _ = ops
    call = layer.calls[0]
    with DeviceArray.from_numpy(other, call["x"]) as foreign:
        with pytest.raises(ValueError, match=r"hidden is a DeviceArray of another vkmoe.Device .*; this op runs on"):
            moe(foreign, call["selected"], call["weights"])
        with pytest.raises(ValueError, match=r"x is a DeviceArray of another vkmoe.Device"):
            lin1(foreign)
    with DeviceArray.empty(other, (call["x"].shape[0], moe.H), np.float32) as foreign_out:
        with pytest.raises(ValueError, match=r"out is a DeviceArray of another vkmoe.Device"):
            moe(call["x"], call["selected"], call["weights"], out=foreign_out)


def test_device_array_after_its_device_closed(layer):
    dev = vkmoe.Device()
    arr = DeviceArray.from_numpy(dev, layer.calls[0]["x"])
    dev.close()
    assert arr.closed
    with pytest.raises(vkmoe.VkmoeError, match=r"closed"):
        arr.numpy()
    arr.close()  # nothing left to free; must not touch the destroyed device


# ------------------------------------------------------------------------------------ poison kept
@pytest.mark.parametrize("to_device, bind", [(False, False), (True, False), (True, True)],
                         ids=["numpy-out", "device-out", "bound-device-out"])
def test_unwritten_output_is_nan(device, ops, layer, to_device, bind):
    """A forward that writes nothing leaves the output NaN, also after a real call filled the buffer; so does
    one whose recording binds the caller's DeviceArrays in place of the io buffers (device_array.RepeatedArrays)."""
    moe = ops[0]
    call = layer.calls[0]
    x, ids, w = call["x"], call["selected"].astype(np.int32), call["weights"].astype(np.float32)
    m, top_k = ids.shape
    assert np.isfinite(moe(x, ids, w)).all()  # the output buffer now holds real values
    target = DeviceArray.empty(device, (m, moe.H), np.float32) if to_device else None
    if bind:
        assert moe(x, ids, w, out=target) is target and np.isfinite(target.numpy()).all()
    writes_nothing = SimpleNamespace(key="writes-nothing", reads_status=False, check=lambda scratch: 0,
                                     record=lambda rec, scratch, buffers: rec.barrier())
    with moe._call_lock:
        out = moe._run_path(writes_nothing, x, ids, w, m, top_k, target=target,
                            bound=(None, target.buffer) if bind else None).out
    if to_device:
        assert out is None
        out = target.numpy()
        target.close()
    assert out.shape == (m, moe.H) and np.isnan(out).all()


@pytest.mark.parametrize("direct", ["on", "off"])
def test_poison_beside_the_first_dispatch(device, layer, monkeypatch, direct):
    """In direct mode the output's poison fill rides beside the first split dispatch (gate/up writes no output)
    instead of taking a barrier of its own: a forward that runs only that dispatch still leaves the output NaN
    after a real call filled the buffer. In routed mode the routing pass may zero rows, so the fill keeps its own
    barrier before it."""
    monkeypatch.setenv("VKMOE_MOE_DIRECT", direct)  # (read when the layer first plans the shape)
    call = layer.calls[0]
    x, ids, w = call["x"], call["selected"].astype(np.int32), call["weights"].astype(np.float32)
    m, top_k = ids.shape
    L = layer
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation="silu", dispatch="split") as moe:
        expect = moe(x, ids, w)
        assert np.isfinite(expect).all()
        scratch = moe._scratch_for(m, top_k)
        assert scratch.plan.direct == (direct == "on")
        assert moe._split_path.first_dispatch_writes_output(scratch) == (direct == "off")
        assert np.array_equal(moe(x, ids, w), expect)
        if direct == "off":
            return

        def first_only(cmd, scratch, buffers, beside_first=None):
            dset = moe._split_stages(scratch, buffers)[0](cmd)
            beside_first(cmd)
            cmd.barrier()
            return [dset]

        gate_up_only = SimpleNamespace(key="gate-up-only", reads_status=False, check=lambda scratch: 0,
                                       first_dispatch_writes_output=lambda scratch: False, record=first_only)
        with moe._call_lock:
            out = moe._run_path(gate_up_only, x, ids, w, m, top_k).out
        assert out.shape == (m, moe.H) and np.isnan(out).all()


# ------------------------------------------------------------------------------------ GPU time when asked
def test_gpu_time_is_read_only_when_asked(device, ops, layer, monkeypatch):
    """A runtime's calls read no timestamps (a driver call each) unless it asks for last_run["gpu_ms"] or
    last_gpu_ms; what it then reads is the last call's own, also once the layer is closed."""
    moe, lin, _ = ops
    call = layer.calls[0]
    x, ids, w = call["x"], call["selected"], call["weights"]
    reads = []
    real = commands.CommandRecorder._ticks
    monkeypatch.setattr(commands.CommandRecorder, "_ticks", lambda rec: reads.append(rec) or real(rec))
    for _ in range(3):
        moe(x, ids, w), lin(x)
    assert reads == []
    assert moe.last_run["gpu_ms"] > 0 and lin.last_gpu_ms > 0 and len(reads) == 2
    assert moe.last_run is moe.last_run and lin.last_gpu_ms > 0 and len(reads) == 2  # each read once
    L = layer
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation="silu", dispatch="split") as own:
        own(x, ids, w)
    assert own.last_run["gpu_ms"] > 0 and own.last_run["mode"] == "split"  # read when the layer closed


# ------------------------------------------------------------------------------------ fence wait
@pytest.mark.parametrize("spin_s", [1.0, 1e-6], ids=["spin-catches-it", "spin-then-sleep"])
def test_wait_spins_then_sleeps(device, ops, spin_s):
    """Both ends of the wait: the fence seen signalled while spinning, and a spin too short for the work."""
    lin = ops[1]
    x = make_x(16, lin.k, seed=8)
    expect = lin(x)
    rec = lin._call_buffers(16)[2].rec
    old = rec.spin_s
    rec.spin_s = spin_s
    try:
        for _ in range(2):
            assert np.array_equal(lin(x), expect)
            assert not rec.pending
    finally:
        rec.spin_s = old


def test_submit_riders_must_be_recorded(device):
    with vkmoe.CommandRecorder(device) as rec, vkmoe.CommandRecorder(device) as unrecorded:
        rec.begin()
        rec.end()
        with pytest.raises(vkmoe.VkmoeError, match=r"recorded CommandRecorders of the same device"):
            rec.submit(before=[unrecorded])


# ------------------------------------------------------------------------------------ no file reads per call
def test_residency_cache_read_once(device, tmp_path, monkeypatch):
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path))
    reads = []
    real_read = residency.read_json
    monkeypatch.setattr(residency, "read_json", lambda name: reads.append(1) or real_read(name))
    assert residency.lookup_crossover(device) == {}
    residency.store_crossover(device, "tiny", 4, "test")
    reads.clear()
    for _ in range(5):
        assert residency.lookup_crossover(device)["tiny"]["max_m"] == 4
    assert len(reads) == 1, f"the cache file was read {len(reads)} times for 5 lookups"
    residency.lookup_crossover(device)["tiny"]["max_m"] = 99  # a caller's copy: the cache is unchanged
    assert residency.lookup_crossover(device)["tiny"]["max_m"] == 4
    # Within STAT_INTERVAL_S the file is not even looked at; after it, a rewrite by another process is seen.
    monkeypatch.setattr(residency, "STAT_INTERVAL_S", 60.0)  # a slow CI machine must not reach the interval
    residency.crossover_entries(device)
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(residency.os, "stat", lambda p, *a, **k: stats.append(p) or real_stat(p, *a, **k))
    for _ in range(5):
        residency.crossover_entries(device)
    assert stats == [], "the cache file was stat'ed on every lookup"
    monkeypatch.setattr(residency, "STAT_INTERVAL_S", 0.0)
    path = residency.cache_path()
    with open(path) as f:
        data = json.load(f)
    data[residency.device_key(device)][residency.CROSSOVER_KEY]["shapes"]["tiny"]["max_m"] = 16
    with open(path + ".new", "w") as f:
        json.dump(data, f)
    os.replace(path + ".new", path)
    assert residency.lookup_crossover(device)["tiny"]["max_m"] == 16


# ------------------------------------------------------------------------------------ SparseMoeBlock
@pytest.fixture(scope="module")
def blocks(device, tmp_path_factory):
    """(qwen3 block without shared experts, deepseek block with one) on the session device."""
    from test_models import DEEPSEEK, QWEN
    from vkmoe.models import SparseMoeBlock, write_checkpoint

    made = []
    for name, spec in (("qwen3_moe", QWEN), ("deepseek_v3", DEEPSEEK)):
        path = write_checkpoint(str(tmp_path_factory.mktemp(name)), **spec)
        made.append(SparseMoeBlock.from_checkpoint(path, 0, backend="vulkan", device=device))
    yield made
    for block in made:
        block.moe.close()
        for op in (block.shared_ops or {}).values():
            op.close()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_block_takes_and_returns_device_arrays(device, blocks, dtype):
    for block in blocks:
        hidden = make_x(4, block.config.hidden_size, seed=12).astype(dtype)
        expect = block(hidden)
        assert np.isfinite(expect).all()
        with DeviceArray.from_numpy(device, hidden) as xd:
            assert np.array_equal(block(xd), expect)
            y = block(xd, out="device")
            assert isinstance(y, DeviceArray) and y.dtype == np.float32
            assert np.array_equal(y.numpy(), expect), block
            y.close()
        with DeviceArray.empty(device, hidden.shape, np.float32) as out:
            assert block(hidden, out=out) is out and np.array_equal(out.numpy(), expect)


def test_block_bad_device_arrays(device, blocks, discrete, layer):
    block = blocks[0]
    other = discrete[0]
    x = make_x(2, block.config.hidden_size, seed=13)
    with DeviceArray.from_numpy(other, x) as foreign:
        with pytest.raises(ValueError, match=r"hidden is a DeviceArray of another vkmoe.Device"):
            block(foreign)
    with DeviceArray.from_numpy(device, x[:, :128]) as narrow:
        with pytest.raises(ValueError, match=r"hidden must have shape \(m, 256\)"):
            block(narrow)
    with pytest.raises(ValueError, match=r"out must be None, 'device' or a vkmoe DeviceArray"):
        block(x, out="gpu")
    with DeviceArray.empty(device, (3, block.config.hidden_size), np.float32) as wrong_rows:
        with pytest.raises(ValueError, match=r"out must have shape \(2, 256\)"):
            block(x, out=wrong_rows)


def test_block_on_cpu_backend_refuses_device_arrays(device, tmp_path):
    from test_models import QWEN
    from vkmoe.models import SparseMoeBlock, write_checkpoint

    block = SparseMoeBlock.from_checkpoint(write_checkpoint(str(tmp_path), **QWEN), 0, backend="cpu")
    x = make_x(2, block.config.hidden_size, seed=14)
    assert np.isfinite(block(x)).all()  # numpy in and out needs no Vulkan layer
    with DeviceArray.from_numpy(device, x) as xd:
        with pytest.raises(ValueError, match=r"a DeviceArray hidden needs the vulkan backend; this block runs on 'cpu'"):
            block(xd)
    with pytest.raises(ValueError, match=r"out needs the vulkan backend"):
        block(x, out="device")


def test_out_that_shares_memory_with_an_input_is_refused(device, ops, blocks, layer):
    """An out DeviceArray over the input's memory: a call that binds both (the second call with the same pair)
    would read the input while its tails write the output (the linear's direct mode at m = 1 reads x in every GEMM
    workgroup), a race on a GPU that lavapipe's order hides. Refused, naming the input; arrays that merely share a
    VkBuffer (separate allocations) still work, and the ops stay usable."""
    moe, lin, _ = ops
    call = layer.calls[0]
    x, ids, w = call["x"], call["selected"], call["weights"]
    m, H = x.shape
    with DeviceArray.from_numpy(device, x) as xd:
        with pytest.raises(ValueError, match="out shares device memory with x: the op reads x while it writes out"):
            lin(xd, out=xd)
        with device.memory.allocate(m * H * 4) as shared:
            hidden_view = DeviceArray(shared, (m, H), np.float16)  # the buffer's first half
            hidden_view.buffer.upload(np.ascontiguousarray(x))
            out_view = DeviceArray(shared, (m, H), np.float32)     # all of it: overlaps hidden_view
            with pytest.raises(ValueError, match="out shares device memory with hidden"):
                moe(hidden_view, ids, w, out=out_view)
            block = blocks[0]
            bx = make_x(m, block.config.hidden_size, seed=14).astype(np.float16)
            hidden_view.buffer.upload(bx)
            with pytest.raises(ValueError, match="out shares device memory with hidden"):
                block(hidden_view, out=out_view)
            rec = vkmoe.CommandRecorder(device)
            try:
                rec.begin()
                with pytest.raises(ValueError, match="out shares device memory with hidden"):
                    block.device_block.record(rec, hidden_view, out_view)
            finally:
                rec.close()
        # separate arrays (they may share a VkBuffer): the same answers as numpy in and out, twice (bound)
        want = lin(x)
        for _ in range(2):
            with DeviceArray.empty(device, (m, lin.n), np.float16) as yd:
                assert np.array_equal(lin(xd, out=yd).numpy().view(np.uint16), want.view(np.uint16))
        want_moe = moe(x, ids, w)
        with DeviceArray.empty(device, (m, H), np.float32) as od:
            for _ in range(2):
                assert np.array_equal(moe(xd, ids, w, out=od).numpy(), want_moe)


# ------------------------------------------------------------------- the caller's own unwaited runs
@pytest.mark.parametrize("case", ["moe input", "moe input bound", "moe output", "linear output bound"])
def test_an_op_waits_for_the_callers_unwaited_run_on_its_arrays(device, ops, layer, monkeypatch, case):
    """An op called with a DeviceArray that the caller's own submit(wait=False) still writes (its input) or reads
    (the op's output) did not wait for that run: the op's submission has no barrier ahead of it, so a GPU may run
    it beside the caller's. Now the op waits for such a run first. Here the caller's run is a spin and then a copy
    (into the input, or out of the output); the op's submission must find that run over, its result must be that
    of the input's new contents, and the caller's copy must hold the output's contents from before the op."""
    from spin import SpinRun, fence_signalled, skip_if_over
    from vkmoe.vk import CommandRecorder

    moe, lin1, _ = ops
    op = moe if case.startswith("moe") else lin1
    call = layer.calls[0]
    x, ids, w = call["x"], call["selected"], call["weights"]
    x_new = (x.astype(np.float32) * 0.5).astype(np.float16)
    run = (lambda h, **kw: op(h, ids, w, **kw)) if op is moe else op
    expect_old, expect_new = run(x), run(x_new)
    assert not np.array_equal(expect_old, expect_new)
    out_shape, out_dtype = expect_old.shape, expect_old.dtype
    # (a CPU driver runs the spin for a while; a GPU needs far more of it to be still running at the op's call)
    groups, iterations = (64, 5000) if device.device_type == "cpu" else (1024, 400000)
    with SpinRun(device, groups, iterations) as spin, DeviceArray.from_numpy(device, x) as xd, \
            DeviceArray.from_numpy(device, x_new) as fresh, DeviceArray.empty(device, out_shape, out_dtype) as outd, \
            DeviceArray.empty(device, out_shape, out_dtype) as seen_out, CommandRecorder(device) as caller:
        if case.endswith("bound"):  # a second call with the same arrays: bound in the recording, no copies
            for _ in range(2):
                run(xd, out=outd)
        outd.buffer.upload(np.full(out_shape, 3.0, out_dtype))
        caller.begin()
        caller.barrier()  # (after the spin riding ahead of it in the same submission)
        if case.endswith(("input", "input bound")):
            caller.copy(fresh.buffer, xd.buffer, xd.nbytes)
        else:
            caller.copy(outd.buffer, seen_out.buffer, outd.nbytes)
        caller.end()
        at_submit = []
        prepare = CommandRecorder._prepare_submit

        def noting(self, *args):
            if self is not caller and self is not spin.rec:
                at_submit.append(fence_signalled(caller))
            return prepare(self, *args)

        monkeypatch.setattr(CommandRecorder, "_prepare_submit", noting)
        caller.submit(wait=False, before=[spin.rec])
        skip_if_over(caller, "the op's call")
        if "input" in case:
            got = run(xd)
            assert np.array_equal(got, expect_new)
        else:
            assert run(xd, out=outd) is outd
            assert np.array_equal(outd.numpy(), expect_old)
            assert (seen_out.numpy() == 3.0).all()
        assert at_submit and all(at_submit), at_submit
        # the op's wait saw the caller's run end: later calls no longer look for it (the caller never waited)
        assert not device.in_flight.has_unwaited
        monkeypatch.undo()
        caller.wait()
