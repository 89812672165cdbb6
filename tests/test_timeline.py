"""The persistent kernel's timing build (VKMOE_PERSISTENT_CLOCK=1, vkmoe.ops.timeline): the same bits as split and
as the plain kernel, and clock marks in the order the kernel reaches them."""
import numpy as np
import pytest

import vkmoe
from goldens import golden_files, load_layer
from vkmoe import layout
from vkmoe.ops.timeline import Timeline


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.fixture(scope="module")
def golden():
    return load_layer(golden_files()[0])


def _layer(device, L):
    return vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation=L.activation, act_limit=L.act_limit)


def test_timing_build_gives_the_same_bits_and_ordered_marks(device, golden, monkeypatch):
    L = golden
    plain = _layer(device, L)
    monkeypatch.setenv("VKMOE_PERSISTENT_CLOCK", "1")
    timed = _layer(device, L)  # read when the layer is made
    monkeypatch.delenv("VKMOE_PERSISTENT_CLOCK")
    try:
        assert timed.clock and not plain.clock
        call = L.calls[0]
        args = (call["x"], call["selected"], call["weights"])
        m, top_k = call["selected"].shape
        with pytest.raises(vkmoe.VkmoeError, match="no persistent launch"):
            timed.persistent_timeline(m, top_k)
        split = plain(*args, dispatch="split")
        expected = plain(*args, dispatch="persistent")
        assert plain.last_run["mode"] == "persistent"
        for _ in range(2):  # a second launch overwrites every mark of the first
            got = timed(*args, dispatch="persistent")
            assert timed.last_run["mode"] == "persistent" and timed.last_run["fallback_reason"] is None
            assert np.array_equal(_bits(got), _bits(split)) and np.array_equal(_bits(got), _bits(expected))
        t = timed.persistent_timeline(m, top_k)
        assert t.workgroups == timed.last_run["workgroups"]
        us = t.us
        assert np.nanmin(us["start"]) == 0.0 and np.isfinite(us["start"]).all()
        # every workgroup ends both phases and then itself, in that order
        for earlier, later in (("start", "gate_up_done"), ("gate_up_done", "down_done"), ("down_done", "end")):
            assert np.isfinite(us[later]).all(), later
            assert (us[earlier] <= us[later]).all(), (earlier, later)
        # a first item's GEMM ends before its arrival, and its tail, where it was its band's last arrival, after it
        for gemm, arrival, tail in (("first_gate_up_gemm", "first_gate_up_arrival", "first_stage3_end"),
                                    ("first_down_gemm", "first_down_arrival", "first_stage5_end")):
            ran = np.isfinite(us[gemm])
            assert ran.any(), gemm
            assert (us[gemm][ran] <= us[arrival][ran]).all()
            tails = np.isfinite(us[tail])
            assert (us[arrival][tails] <= us[tail][tails]).all(), tail
            assert not (tails & ~ran).any(), tail
        summary = t.summary()
        assert set(summary) == set(layout.CLOCK_MARKS) | {"waits"}
        assert summary["end"]["reached"] == t.workgroups
        assert summary["end"]["last"] >= summary["down_done"]["median"] >= summary["start"]["median"]
    finally:
        plain.close()
        timed.close()


def test_timeline_errors_name_what_is_missing(device, golden):
    moe = _layer(device, golden)
    try:
        with pytest.raises(vkmoe.VkmoeError, match="VKMOE_PERSISTENT_CLOCK=1"):
            moe.persistent_timeline(1, 2)
    finally:
        moe.close()
    with pytest.raises(ValueError, match="workgroups"):
        Timeline(np.zeros((3, 5), np.uint32))
    with pytest.raises(ValueError, match="no start mark"):
        Timeline(np.zeros((3, layout.CLOCK_WORDS_PER_WG), np.uint32))


def test_clock_layer_on_a_device_without_the_clock_is_refused(device, golden, monkeypatch):
    monkeypatch.setitem(device.features, "shaderDeviceClock", False)
    monkeypatch.setenv("VKMOE_PERSISTENT_CLOCK", "1")
    with pytest.raises(vkmoe.VkmoeError, match="shaderDeviceClock"):
        _layer(device, golden)


def test_clock_words_fit_their_area():
    assert layout.CLOCK_WAITS + 2 <= layout.CLOCK_WORDS_PER_WG


def _words(ticks):
    """Timing words of workgroups whose marks are `ticks` (rows: workgroups; columns: the first marks; 64-bit)."""
    ticks = np.asarray(ticks, np.uint64)
    w = np.zeros((len(ticks), layout.CLOCK_WORDS_PER_WG), np.uint32)
    for i in range(ticks.shape[1]):
        w[:, 2 * i] = (ticks[:, i] & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        w[:, 2 * i + 1] = (ticks[:, i] >> np.uint64(32)).astype(np.uint32)
    return w


def test_timeline_reads_a_32_bit_clock_across_its_wrap():
    # Both lavapipes store 0 as the clock's high word: a launch straddling the low word's wrap (every 2^32 ns)
    # once read its gate/up mark 4.288 s before its start (a CI failure of the test above).
    wrap = 1 << 32
    starts = [wrap - 7_000, wrap - 2_000]                    # ns; workgroup 1 starts 5 us after workgroup 0
    marks = [[s, s + 3_000, s + 12_000] for s in starts]     # the second and third marks past the wrap
    t = Timeline(_words([[v % wrap for v in row] for row in marks]))
    np.testing.assert_allclose(t.us["start"], [0.0, 5.0])
    np.testing.assert_allclose(t.us[layout.CLOCK_MARKS[1]], [3.0, 8.0])
    np.testing.assert_allclose(t.us[layout.CLOCK_MARKS[2]], [12.0, 17.0])
    assert np.isnan(t.us[layout.CLOCK_MARKS[3]]).all()    # never reached: 0
    # workgroup 1 may start first; the earliest start is 0 either way
    t = Timeline(_words([[wrap - 1_000, 500], [wrap - 3_000, wrap - 1_500]]))
    np.testing.assert_allclose(t.us["start"], [2.0, 0.0])
    np.testing.assert_allclose(t.us[layout.CLOCK_MARKS[1]], [3.5, 1.5])


def test_timeline_keeps_a_64_bit_clock_whole():
    # A real 64-bit clock: the high words count, no modulo (a mark 5 s after the start stays 5 s after it)
    base = (7 << 32) + 123
    t = Timeline(_words([[base, base + 5_000_000_000], [base + 1_000, base + 2_000]]))
    np.testing.assert_allclose(t.us["start"], [0.0, 1.0])
    np.testing.assert_allclose(t.us[layout.CLOCK_MARKS[1]], [5e6, 2.0])
