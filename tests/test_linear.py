"""Exl3Linear on the Vulkan device: GPU decode bit-exact, the op within 3e-3 relative RMS of the float64
reference, argument checking, determinism, the lavapipe loop cap, and record() into a caller's command buffer.

Pipelines compile slowly on lavapipe, and each (bits, codebook, rows-per-pass, bias) specialization is a new
pipeline: the case lists below reuse specializations on purpose (m=1 -> rows 1, m=3 -> rows 4, m=16 and
m=100 -> rows 16; see vkmoe.ops.plan.rows_for)."""
import numpy as np
import pytest

import vkmoe
from goldens import GOLDEN_DIR, rel_rms
from vkmoe.exl3 import dequantize, reference
from vkmoe.layout import DIRECT_MAX_KT
from vkmoe.ops.plan import compute_units, gemm_plan

CODEBOOKS = ("mul1", "mcg", "3inst")
BITS = tuple(range(1, 9))
TOL = 3e-3


def make_tensor(k, n, bits, codebook, seed=0, bias=False):
    """A random EXL3 tensor (any bit pattern is a valid trellis) with realistic scales."""
    rng = np.random.default_rng([seed, k, n, bits, CODEBOOKS.index(codebook)])
    trellis = rng.integers(0, 1 << 16, size=(k // 16, n // 16, 16 * bits), dtype=np.uint16)
    suh = (rng.choice([-1.0, 1.0], size=k) * rng.uniform(0.5, 1.5, size=k)).astype(np.float16)
    svh = (rng.choice([-1.0, 1.0], size=n) * rng.uniform(0.005, 0.02, size=n)).astype(np.float16)
    b = rng.normal(0.0, 0.5, size=n).astype(np.float16) if bias else None
    return vkmoe.Exl3Tensor(trellis, suh, svh, codebook=codebook, bias=b)


def make_x(m, k, seed=1, scale=1.0):
    rng = np.random.default_rng([seed, m, k])
    return (rng.standard_normal((m, k)) * scale).astype(np.float16)


def check_close(y, x, tensor, what=""):
    assert y.dtype == np.float16 and y.shape == (x.shape[0], tensor.n), (y.dtype, y.shape)
    assert np.all(np.isfinite(y)), f"{what}: non-finite outputs at {np.argwhere(~np.isfinite(y))[:5].tolist()}"
    ref = reference.linear_forward(x, tensor)
    err = rel_rms(y, ref)
    assert err < TOL, f"{what}: relative RMS {err:.3g} >= {TOL}"
    return err


def run_poisoned(layer, x):
    """Call once with other data (so the output buffer holds stale non-zero values), then with x."""
    stale = layer(make_x(x.shape[0], layer.k, seed=99, scale=3.0))
    assert np.any(stale != 0)
    return layer(x)


# ------------------------------------------------------------------------------------------ GPU dequantize
DEQUANT_SHAPES = [(128, 128), (256, 384), (384, 128)]


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_bit_exact(device, bits, codebook):
    for k, n in DEQUANT_SHAPES:
        t = make_tensor(k, n, bits, codebook, seed=7)
        with vkmoe.Exl3Linear(device, t) as layer:
            got = layer.dequantize()
        want = dequantize(t.trellis, codebook)
        assert got.shape == (k, n) and got.dtype == np.float16
        gu, wu = got.view(np.uint16), want.view(np.uint16)
        bad = np.argwhere(gu != wu)
        assert bad.size == 0, (f"K={bits} {codebook} ({k},{n}): {len(bad)} mismatches, first at {bad[0].tolist()}: "
                               f"got {gu[tuple(bad[0])]:#06x} want {wu[tuple(bad[0])]:#06x}")


def test_dequantize_golden(device):
    z = np.load(f"{GOLDEN_DIR}/a_tiny_silu_k4.npz")
    codebook = str(z["codebook"])
    checked = 0
    for proj in ("gate", "up", "down"):
        if f"w_{proj}_e0" not in z.files:
            continue
        t = vkmoe.Exl3Tensor(z[f"{proj}_trellis"][0], z[f"{proj}_suh"][0], z[f"{proj}_svh"][0], codebook=codebook)
        with vkmoe.Exl3Linear(device, t) as layer:
            got = layer.dequantize()
        want = z[f"w_{proj}_e0"]
        assert got.shape == want.shape
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), f"{proj} e0 differs from the golden"
        checked += 1
    assert checked == 3


# ------------------------------------------------------------------------------------------ forward
M16_SPECS = [(1, "mcg"), (3, "3inst"), (4, "mul1"), (6, "mcg"), (8, "3inst")]


def _cases():
    cases = []
    # m = 1 (rows 1): every (bits, codebook) pair; k != n, 3 bands.
    cases += [(1, b, cb, 256, 384) for b in BITS for cb in CODEBOOKS]
    # m = 3 (rows 4, a partial pass): bits 1..8, codebooks cycling; n = 128 (one band).
    cases += [(3, b, CODEBOOKS[b % 3], 384, 128) for b in BITS]
    # m = 16 (rows 16; these pipelines are the slowest to compile, ~5 s each on Mesa 25): a spread of bits,
    # every codebook.
    cases += [(16, b, cb, 256, 384) for b, cb in M16_SPECS]
    # m = 100 (rows 16, 7 row chunks, the last partial): reuses m = 16 pipelines; all codebooks.
    cases += [(100, b, cb, 512, 256) for b, cb in M16_SPECS[1:4]]
    return cases


@pytest.mark.parametrize("m,bits,codebook,k,n", _cases(),
                         ids=[f"m{c[0]}-K{c[1]}-{c[2]}-{c[3]}x{c[4]}" for c in _cases()])
def test_forward(device, m, bits, codebook, k, n):
    t = make_tensor(k, n, bits, codebook)
    x = make_x(m, k)
    with vkmoe.Exl3Linear(device, t) as layer:
        y = run_poisoned(layer, x)
        check_close(y, x, t, f"m={m} K={bits} {codebook} ({k},{n})")
        assert layer.last_gpu_ms is not None and layer.last_gpu_ms >= 0


def test_bias(device):
    k, n, m = 256, 384, 3
    t = make_tensor(k, n, 4, "mul1", seed=3, bias=True)
    t0 = vkmoe.Exl3Tensor(t.trellis, t.suh, t.svh, codebook="mul1")
    x = make_x(m, k)
    with vkmoe.Exl3Linear(device, t) as layer, vkmoe.Exl3Linear(device, t0) as plain:
        y = run_poisoned(layer, x)
        check_close(y, x, t, "bias")
        y0 = plain(x)
    # The bias really arrives: the difference is the bias (up to fp16 rounding of the sum).
    d = y.astype(np.float64) - y0.astype(np.float64)
    assert rel_rms(d, np.broadcast_to(t.bias.astype(np.float64), d.shape)) < 5e-3


def test_float32_bias_accepted(device):
    k, n = 128, 128
    t = make_tensor(k, n, 4, "mul1", seed=4)
    bias = np.random.default_rng(5).normal(0, 0.5, n).astype(np.float32)
    t = vkmoe.Exl3Tensor(t.trellis, t.suh, t.svh, codebook="mul1", bias=bias)
    x = make_x(3, k)
    with vkmoe.Exl3Linear(device, t) as layer:
        check_close(layer(x), x, t, "float32 bias")


# ------------------------------------------------------------------------------------------ bad inputs
@pytest.fixture(scope="module")
def small():
    """(tensor, x) with a pipeline that other tests already compiled (m=3, K=4, mul1 -> rows 4)."""
    t = make_tensor(256, 384, 4, "mul1", seed=11)
    return t, make_x(3, 256, seed=12)


def _still_usable(layer, t, x):
    check_close(layer(x), x, t, "after an error")


def test_bad_inputs(device, small):
    t, x = small
    with vkmoe.Exl3Linear(device, t) as layer:
        with pytest.raises(TypeError, match=r"\bx\b.*float64"):
            layer(x.astype(np.float64))
        _still_usable(layer, t, x)
        with pytest.raises(ValueError, match=r"\bx\b.*float16's range"):
            layer(np.full(x.shape, 1e5, np.float32))
        _still_usable(layer, t, x)
        with pytest.raises(ValueError):
            layer(make_x(3, 128))                  # wrong k
        _still_usable(layer, t, x)
        with pytest.raises(ValueError):
            layer(x[0])                            # 1-D
        _still_usable(layer, t, x)
        with pytest.raises((TypeError, ValueError)):
            layer(x[None])                         # 3-D
        _still_usable(layer, t, x)
        with pytest.raises(TypeError):
            layer(x.tolist())                      # not an ndarray
        _still_usable(layer, t, x)


def test_not_a_tensor(device, small):
    t, x = small
    with pytest.raises(TypeError):
        vkmoe.Exl3Linear(device, t.trellis)
    with pytest.raises(TypeError):
        vkmoe.Exl3Linear(device, None)
    with vkmoe.Exl3Linear(device, t) as layer:
        _still_usable(layer, t, x)


def test_non_contiguous_x(device, small):
    t, x = small
    with vkmoe.Exl3Linear(device, t) as layer:
        want = layer(x)
        fortran = np.asfortranarray(x)
        assert not fortran.flags.c_contiguous
        y_f = layer(fortran[:, ::1])
        transposed = x.T.copy().T
        y_t = layer(transposed)
        wide = np.zeros((x.shape[0], 2 * x.shape[1]), np.float16)
        wide[:, ::2] = x
        y_s = layer(wide[:, ::2])
    for y in (y_f, y_t, y_s):
        assert np.array_equal(y.view(np.uint16), want.view(np.uint16))
    check_close(want, x, t, "contiguous")


def test_m_zero(device, small):
    t, x = small
    with vkmoe.Exl3Linear(device, t) as layer:
        y = layer(np.zeros((0, t.k), np.float16))
        assert isinstance(y, np.ndarray) and y.shape == (0, t.n) and y.dtype == np.float16
        _still_usable(layer, t, x)


# ------------------------------------------------------------------------------------------ determinism
def test_deterministic(device):
    t = make_tensor(512, 256, 4, "mul1", seed=21)   # an m=100 specialization (rows 16, in M16_SPECS)
    x = make_x(100, 512, seed=22)
    with vkmoe.Exl3Linear(device, t) as layer:
        a = layer(x)
        layer(make_x(100, 512, seed=23))
        b = layer(x)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


# ------------------------------------------------------------------------------------------ loop cap
@pytest.mark.parametrize("k,n,bits,codebook,bias,wg_per_cu", [
    (256, 384, 4, "mul1", False, 3), (2048, 128, 3, "3inst", True, 1), (2048, 256, 5, "mcg", False, 7),
    (4096, 128, 2, "mul1", False, 40)], ids=lambda v: str(v))
def test_direct_mode_matches_the_two_dispatches(device, monkeypatch, k, n, bits, codebook, bias, wg_per_cu):
    """m = 1 runs in direct mode (one dispatch: each workgroup builds the input Hadamard of the 128-blocks its
    k-range touches, ops.plan.gemm_plan): the same bits as VKMOE_LINEAR_DIRECT=off (input Hadamard dispatch, barrier,
    GEMM) with the same k-splits, for k-ranges that start and end inside a block (VKMOE_GEMM_WG_PER_CU moves them)."""
    monkeypatch.setenv("VKMOE_GEMM_WG_PER_CU", str(wg_per_cu))
    t = make_tensor(k, n, bits, codebook, seed=41, bias=bias)
    x = make_x(1, k, seed=42)
    outs = {}
    for choice in ("auto", "off"):
        monkeypatch.setenv("VKMOE_LINEAR_DIRECT", choice)  # read when a shape is recorded: a layer of its own
        plan = gemm_plan(device, 1, k, n)
        assert plan.direct == (choice == "auto") and plan.rows == 1
        with vkmoe.Exl3Linear(device, t) as layer:
            outs[choice] = run_poisoned(layer, x)
            xb, yb = device.memory.allocate(k * 2), device.memory.allocate(n * 2)
            try:  # direct mode: no input Hadamard step at all
                assert (layer.stages(xb, yb, 1)[0] is None) == (choice == "auto")
                layer.release_shape(1)
            finally:
                xb.close()
                yb.close()
        outs[choice + "_plan"] = plan
    assert outs["auto_plan"].splits == outs["off_plan"].splits or k // 16 > DIRECT_MAX_KT
    if device.quirks.get("loop_iteration_cap"):  # Mesa 22.3: whole 4-tile k-ranges (ops.plan.gemm_plan says why)
        assert outs["auto_plan"].kt_per_split % 4 == 0
    assert np.array_equal(outs["auto"], outs["off"])
    check_close(outs["auto"], x, t, f"direct ({k},{n}) K={bits} {codebook}")
    # m > 1 is never direct (one row's room in shared memory)
    assert not gemm_plan(device, 2, k, n).direct


@pytest.mark.parametrize("m", [1, 2])
def test_split_sums_shared_by_idle_rows(device, monkeypatch, m):
    """A one-row band with 16 or more k-splits has its split sum shared by the lane groups of the pass rows it
    leaves idle (linear_tail.glsl: 4 groups, each a quarter of the splits): right against the float64 reference
    with 22 k-splits (not a multiple of the groups), the bias added once; m = 2 (the plain split order) beside it."""
    n, k = 768, 2048  # 6 bands x 22 splits: the GEMM aims at >= 132 workgroups on any device
    monkeypatch.setenv("VKMOE_GEMM_WG_PER_CU", str(-(-132 // compute_units(device))))
    plan = gemm_plan(device, m, k, n)
    assert plan.splits >= 16, plan  # (22 where the plan fills the grid; direct mode keeps as many or more)
    t = make_tensor(k, n, 4, "mul1", seed=51, bias=True)
    x = make_x(m, k, seed=52)
    with vkmoe.Exl3Linear(device, t) as layer:
        y = run_poisoned(layer, x)
    check_close(y, x, t, f"m={m} ({k},{n}) {plan.splits} k-splits")


def test_long_k_past_loop_cap(device):
    """k = 69,632 > 65,535: a kernel looping over k in one invocation would be cut short on Mesa 22.3."""
    k, n, m = 69632, 128, 1
    t = make_tensor(k, n, 2, "mul1", seed=31)
    x = make_x(m, k, seed=32)
    with vkmoe.Exl3Linear(device, t) as layer:
        y = run_poisoned(layer, x)
    check_close(y, x, t, f"m={m} K=2 mul1 ({k},{n})")


# ------------------------------------------------------------------------------------------ record()
def test_record_caller_buffers(device, small):
    t, x = small
    m = x.shape[0]
    mem = device.memory
    with vkmoe.Exl3Linear(device, t) as layer:
        want = layer(x)
        xb, yb = mem.allocate(m * t.k * 2), mem.allocate(m * t.n * 2)
        try:
            xb.upload(x)
            yb.upload(np.full(m * t.n, 0x7E00, np.uint16))     # poison: fp16 NaN
            rec = vkmoe.CommandRecorder(device)
            try:
                rec.begin()
                layer.record(rec, xb, yb, m)
                rec.end()
                rec.submit(wait=True)
                got = yb.download(np.float16, (m, t.n))
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
                # Resubmitting the same recording gives the same bits (self-resetting counters).
                yb.upload(np.full(m * t.n, 0x7E00, np.uint16))
                rec.submit(wait=True)
                again = yb.download(np.float16, (m, t.n))
                assert np.array_equal(again.view(np.uint16), want.view(np.uint16))
            finally:
                rec.close()
        finally:
            xb.close()
            yb.close()


def test_record_chained(device):
    """Two layers recorded back to back in one command buffer: y2 = L2(L1(x)); record() ends with a barrier."""
    m = 3
    t1 = make_tensor(256, 384, 4, "mul1", seed=41)
    t2 = make_tensor(384, 128, 4, "mul1", seed=42)
    x = make_x(m, 256, seed=43)
    mem = device.memory
    with vkmoe.Exl3Linear(device, t1) as l1, vkmoe.Exl3Linear(device, t2) as l2:
        want1 = l1(x)
        want2 = l2(want1)
        bufs = [mem.allocate(m * 256 * 2), mem.allocate(m * 384 * 2), mem.allocate(m * 128 * 2)]
        try:
            bufs[0].upload(x)
            for b in bufs[1:]:
                b.upload(np.full(b.size // 2, 0x7E00, np.uint16))
            rec = vkmoe.CommandRecorder(device, timestamps=3)
            try:
                rec.begin()
                rec.timestamp()
                l1.record(rec, bufs[0], bufs[1], m)
                rec.timestamp()
                l2.record(rec, bufs[1], bufs[2], m)
                rec.timestamp()
                rec.end()
                rec.submit(wait=True)
                stamps = rec.timestamps_ms()
                assert len(stamps) == 3 and stamps[0] <= stamps[1] <= stamps[2]
                got = bufs[2].download(np.float16, (m, 128))
            finally:
                rec.close()
        finally:
            for b in bufs:
                b.close()
    assert np.array_equal(got.view(np.uint16), want2.view(np.uint16))


def test_input_hadamard_grid_folds_past_the_workgroup_count_limit(device):
    """exl3_had_in's workgroups fold into (x, y) within maxComputeWorkGroupCount[0] >= 65535 (layout.fold_grid): a
    k = 256 linear at m = 131074 needs 65537 of them (was 'exl3_had_in: 65537 workgroups on axis 0 exceeds the
    device limit 65535'; k = 2048 reached it at m = 16384). Rows on both sides of the fold match the reference."""
    from vkmoe import layout

    k, n, m = 256, 128, 131074
    assert layout.had_in_grid(m, k)[1] == 2, "pick an m whose input Hadamard needs a second row of workgroups"
    tensor = make_tensor(k, n, 4, "mul1", seed=11)
    x = make_x(m, k, seed=12)
    with vkmoe.Exl3Linear(device, tensor) as lin:
        y = lin(x)
    assert y.shape == (m, n) and np.isfinite(y).all()
    for rows in (slice(0, 64), slice(131008, m)):  # the first workgroups, and those of the folded second row
        ref = reference.linear_forward(x[rows], tensor)
        assert rel_rms(y[rows].astype(np.float32), ref.astype(np.float32)) < TOL


# ------------------------------------------------------------------ direct mode with the activation fused in
def _stage_run(device, layer, x_dev, m, activated=None):
    """The linear's GEMM stage alone (direct mode: no input Hadamard stage) into a poisoned output; fp16 bits."""
    from vkmoe.ops.device_array import DeviceArray
    from vkmoe.vk import CommandRecorder

    with DeviceArray.from_numpy(device, np.full((m, layer.n), np.nan, np.float16)) as y, \
            CommandRecorder(device) as rec:
        had_in, gemm = layer.stages(x_dev.buffer, y.buffer, m, activated=activated)
        assert had_in is None
        rec.begin()
        dset = gemm(rec)
        rec.barrier()
        rec.end()
        rec.submit(wait=True)
        dset.free()
        return y.numpy().view(np.uint16).copy()


@pytest.mark.parametrize("activation,limit", [("silu", 0.0), ("gelu", 0.0), ("gelu_erf", 0.0), ("relu2", 0.0),
                                              ("swiglu_oai", 7.0), ("silu", 0.75)])
def test_direct_mode_activates_its_row_as_the_block_pass_does(device, activation, limit):
    """stages(activated=(up, activation, limit)) at m = 1 (a device block's shared down): the GEMM builds its row
    as fp16(act(gate, up)) itself; the output has the bits of the block's activation pass (moe_block_elem
    ELEM_ACTIVATE) followed by the plain direct-mode GEMM. Gate and up values large enough that the activation's
    fp16 rounding matters (on an H100 the driver dropped it until linear_x_word hid the round trip)."""
    from vkmoe import layout
    from vkmoe.ops import kernels
    from vkmoe.ops.block import ElemPush
    from vkmoe.ops.device_array import DeviceArray
    from vkmoe.vk import CommandRecorder

    k, n = 512, 256
    t = make_tensor(k, n, 4, "mul1", seed=11)
    g, u = make_x(1, k, seed=12, scale=2.0), make_x(1, k, seed=13, scale=2.0)
    with vkmoe.Exl3Linear(device, t) as layer, DeviceArray.from_numpy(device, g) as gd, \
            DeviceArray.from_numpy(device, u) as ud, DeviceArray.from_numpy(device, np.zeros_like(g)) as pd:
        assert layer.direct(1)
        pipe = kernels.pipeline(device, "moe_block_elem", ElemPush)
        with CommandRecorder(device) as rec:
            rec.begin()
            dset = pipe.bind(gd.buffer, ud.buffer, pd.buffer)
            rec.dispatch(pipe, dset, (layout.ceil_div(k // 2, layout.WORKGROUP_SIZE), 1),
                         ElemPush(pairs=k // 2, cols=1, mode=layout.ELEM_ACTIVATE, act=layout.ACTIVATIONS[activation],
                                  limit=limit, has_gate=0))
            rec.end()
            rec.submit(wait=True)
            dset.free()
        plain = _stage_run(device, layer, pd, 1)
        fused = _stage_run(device, layer, gd, 1, activated=(ud.buffer, activation, limit))
        assert np.array_equal(fused, plain) and np.all(np.isfinite(plain.view(np.float16)))
        check_close(plain.view(np.float16), pd.numpy(), t, "the activated row")


def test_activated_stages_refuse_what_they_cannot_run(device):
    t = make_tensor(256, 128, 4, "mul1", seed=14)
    from vkmoe.ops.device_array import DeviceArray

    with vkmoe.Exl3Linear(device, t) as layer, DeviceArray.from_numpy(device, make_x(2, 256)) as x, \
            DeviceArray.from_numpy(device, np.zeros((2, 128), np.float16)) as y:
        with pytest.raises(ValueError, match="activation must be one of"):
            layer.stages(x.buffer, y.buffer, 1, activated=(x.buffer, "swish", 0.0))
        assert not layer.direct(2)
        with pytest.raises(ValueError, match="direct mode only"):
            layer.stages(x.buffer, y.buffer, 2, activated=(x.buffer, "silu", 0.0))
        small = device.memory.allocate(16)
        try:
            with pytest.raises(ValueError, match="activated up_buf"):  # (k = 256 fp16 values: 512 bytes)
                layer.stages(x.buffer, y.buffer, 1, activated=(small, "silu", 0.0))
        finally:
            small.close()
