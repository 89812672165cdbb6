"""Stage 3 in the down items (VKMOE_MOE_STAGE3, SPEC_MOE_STAGE3_IN_DOWN): the gate/up band tails only count their
arrivals and each down item applies stage 3 (output Hadamards, svh, activation, down.suh, input Hadamard) to the
gate/up partials of its own k-range, into shared memory, instead of reading the band tails' `inter`. The same
fp16 values reach the down GEMM in the same order, so the bits must be those of the gate/up tails, for every
golden file, direct and routed, split and persistent; and the plan takes it only where a down item's rows x
blocks fit the GEMM core's shared buffer."""
import os

import numpy as np
import pytest

import vkmoe
from goldens import (calls_on_two_plans, golden_files, golden_moe, load_layer, reference_targets, rel_rms,
                     run_golden_call, same_bits)
from vkmoe import layout
from vkmoe.ops import plan as ops_plan

SPLITS = "2,2"  # both layers of a comparison share their k-splits (the bits depend on them); 2 down splits: a
#                 down item's k-range is part of I, so its stage 3 covers only its own blocks
# golden layers whose persistent launches are compared too (each is one more compile of the largest shader, slow
# on lavapipe): gated and gateless, mixed bit widths, two codebooks
PERSISTENT = {"a_tiny_silu_k4.npz", "d_relu2_gateless_k4.npz", "k_mcg_mixed_g5u3d6.npz"}


def _plan_shape(monkeypatch, moe, stage3, direct, x, ids, w):
    """A first call that fixes the plan of its shape (a layer plans a batch shape when it first sees it), on other
    routing than the checked call, so every buffer holds other numbers before it."""
    monkeypatch.setenv("VKMOE_MOE_STAGE3", stage3)
    monkeypatch.setenv("VKMOE_MOE_DIRECT", direct)
    monkeypatch.setenv("VKMOE_MOE_SPLITS", SPLITS)
    moe(x, ids, w, dispatch="split")
    for path in ("stage3_in_down", "stage3_in_down_persistent"):
        assert moe.last_run["plan"][path] is (stage3 == "down"), moe.last_run["plan"]
    assert moe.last_run["plan"]["direct"] is (direct == "on"), moe.last_run["plan"]


@pytest.mark.parametrize("direct", ["on", "off"])
@pytest.mark.parametrize("path", golden_files(), ids=lambda p: os.path.basename(p)[:-4])
def test_stage3_in_the_down_items_gives_the_band_tails_bits(device, monkeypatch, path, direct):
    L = load_layer(path)
    first = lambda moe, stage3, *args: _plan_shape(monkeypatch, moe, stage3, direct, *args)  # noqa: E731
    for call, tails, in_down in calls_on_two_plans(device, L, ("gate_up", "down"), 11, first):
        want = run_golden_call(tails, call, "split")
        assert rel_rms(want, reference_targets(L, call)[0][1]) < 3e-3
        modes = ("split", "persistent") if os.path.basename(path) in PERSISTENT else ("split",)
        for mode in modes:
            got = run_golden_call(in_down, call, mode)
            assert same_bits(got, want), f"{mode}{call['suffix']}"
        if os.path.basename(path) in PERSISTENT:  # the gate/up tails' persistent launch too
            assert same_bits(run_golden_call(tails, call, "persistent"), want), call["suffix"]


def test_persistent_stage3_in_down_leaves_its_counters_reset(device, monkeypatch):
    """100 persistent launches with stage 3 in the down items and no host-side clearing: the same bits each time
    and every sync word back to 0 (the gate/up band counters now only count, the chunks' progress counters are
    still what the down items wait for)."""
    L = load_layer(golden_files()[0])
    call = L.calls[0]
    moe = golden_moe(device, L)
    try:
        _plan_shape(monkeypatch, moe, "down", "off", -call["x"], call["selected"], call["weights"])
        want = run_golden_call(moe, call, "split")
        for i in range(100):
            got = run_golden_call(moe, call, "persistent")
            assert same_bits(got, want), i
        words = moe._scratch_for(*call["selected"].shape).sync.download(np.uint32)
        assert not words.any(), np.nonzero(words)[0][:24]
    finally:
        moe.close()


def test_plan_takes_stage3_in_down_where_it_fits(device, monkeypatch):
    """auto: the split path of layers of at most STAGE3_IN_DOWN_MAX_BANDS bands of H (the persistent kernel keeps
    the band tails); `down`: both paths; `gate_up`: neither; and only where a down item's rows x blocks fit."""
    for name in ("VKMOE_MOE_DIRECT", "VKMOE_MOE_SPLITS", "VKMOE_MOE_ROWS", "VKMOE_MOE_STAGE3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VKMOE_COOPMAT", "off")
    qwen3, deepseek = (8, 128, 2048, 768, True), (8, 256, 7168, 2048, True)  # top_k, E, H, I, gated

    def plan(m, shape):
        return ops_plan.moe_plan(device, m, *shape, target_workgroups=396)

    def fits(p):
        return p.rows * ops_plan.hadamard_blocks_spanned(p.kt_d) <= layout.STAGE3_IN_DOWN_MAX_UNITS

    assert layout.STAGE3_IN_DOWN_MAX_UNITS == layout.GEMM_RED_WORDS // 64 == 32
    assert ops_plan.STAGE3_IN_DOWN_MAX_BANDS == 2048 // layout.BAND
    for m in (1, 2, 4, 8, 16, 64):
        q, d = plan(m, qwen3), plan(m, deepseek)
        assert fits(q) and q.stage3_in_down and not q.stage3_in_down_persistent, (m, q)
        assert not d.stage3_in_down and not d.stage3_in_down_persistent, (m, d)  # 56 bands
    # m = 1 (direct): the down phase takes one round of 2 workgroups per compute unit with stage 3 in down
    one = plan(1, qwen3)
    assert one.direct and (one.splits_gu, one.splits_d) == (4, 2) and one.kt_d == 24
    monkeypatch.setenv("VKMOE_MOE_STAGE3", "gate_up")
    one = plan(1, qwen3)
    assert not one.stage3_in_down and not one.stage3_in_down_persistent and one.splits_d == 3
    monkeypatch.setenv("VKMOE_MOE_STAGE3", "down")
    for m, shape in ((1, qwen3), (4, qwen3), (1, deepseek), (8, deepseek)):
        p = plan(m, shape)
        assert fits(p) and p.stage3_in_down and p.stage3_in_down_persistent, (m, p)
    big = plan(16, deepseek)  # 4 rows x 16 blocks (one down split): does not fit, whatever the knob says
    assert not fits(big) and not big.stage3_in_down and not big.stage3_in_down_persistent
    monkeypatch.setenv("VKMOE_COOPMAT", "on")  # (a cooperative-matrix plan where the device has them) never
    try:
        p = plan(256, qwen3)
    except vkmoe.VkmoeError:
        p = None
    if p is not None:
        assert p.coop and not p.stage3_in_down and not p.stage3_in_down_persistent


def test_persistent_layers_exist():
    assert PERSISTENT <= {os.path.basename(p) for p in golden_files()}
