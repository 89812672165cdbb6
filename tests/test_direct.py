"""Direct mode of the MoE stages (VKMOE_MOE_DIRECT): every (token, slot) row its own chunk, no routing pass, each
gate/up workgroup building its own input row. It must give the routed mode's bits for the same k-splits, in
both dispatch modes, on every golden file, and zero the rows of tokens that picked no valid expert. (The golden
calls are small, so auto runs them direct: test_persistent.py's golden test covers direct persistent; this file
covers routed persistent.)"""
import os

import numpy as np
import pytest

from goldens import (calls_on_two_plans, golden_files, golden_moe, ids_with_dead_slots, load_layer, record_run,
                     reference_targets, rel_rms, run_golden_call, same_bits)
from vkmoe import layout
from vkmoe.ops import plan as ops_plan

SPLITS = "2,2"  # both layers of a comparison must share their k-splits (the bits depend on them)
# golden layers whose routed persistent launch is checked too: two calls (m = 3 and 1), mixed bit widths under
# each codebook, gateless relu2
ROUTED_PERSISTENT = {"a_tiny_silu_k4.npz", "b_mixed_bits_g3u4d5.npz", "k_mcg_mixed_g5u3d6.npz", "d_relu2_gateless_k4.npz"}
TINY_PATH = next(p for p in golden_files() if p.endswith("a_tiny_silu_k4.npz"))


def _first_call(monkeypatch, moe, direct, *args):
    """A call that fixes the plan of its shape with VKMOE_MOE_DIRECT=direct (a layer plans a batch shape when it
    first sees it and keeps that plan)."""
    monkeypatch.setenv("VKMOE_MOE_DIRECT", direct)
    monkeypatch.setenv("VKMOE_MOE_SPLITS", SPLITS)
    return moe(*args, dispatch="split")


def _run(moe, call, mode, direct):
    out = run_golden_call(moe, call, mode)
    assert moe.last_run["plan"]["direct"] is (direct == "on"), moe.last_run["plan"]
    return out


@pytest.mark.parametrize("path", golden_files(), ids=lambda p: os.path.basename(p)[:-4])
def test_direct_mode_gives_the_routed_bits(device, monkeypatch, path):
    L = load_layer(path)
    first = lambda moe, setting, *args: _first_call(monkeypatch, moe, setting, *args)  # noqa: E731
    for call, routed, direct in calls_on_two_plans(device, L, ("off", "on"), 7, first):
        want = _run(routed, call, "split", "off")
        # direct persistent == direct split is test_persistent.py's golden test (auto runs these calls direct);
        # here: direct split == routed split, and routed persistent too on a few layers (each is one more
        # compile of the largest shader, slow on lavapipe)
        assert same_bits(_run(direct, call, "split", "on"), want), f"direct{call['suffix']}"
        if os.path.basename(path) in ROUTED_PERSISTENT:
            assert same_bits(_run(routed, call, "persistent", "off"), want), call["suffix"]
        ref = reference_targets(L, call)[0][1]
        assert rel_rms(want, ref) < 3e-3


def test_direct_mode_skips_bad_ids_and_zeroes_tokens_without_a_valid_expert(device, monkeypatch):
    L = load_layer(golden_files()[0])
    call = L.calls[0]
    with golden_moe(device, L) as routed, golden_moe(device, L) as direct:
        ids = ids_with_dead_slots(call, direct.E)
        x, w = call["x"], call["weights"]
        _first_call(monkeypatch, routed, "off", x, call["selected"], w)
        _first_call(monkeypatch, direct, "on", x, call["selected"], w)
        assert direct.last_run["plan"]["direct"] and not routed.last_run["plan"]["direct"]
        want = record_run(device, routed, x, ids, w, "split")
        assert np.all(want[0] == 0.0) and np.isfinite(want).all()
        # twice persistent: the slots without an expert take their next item's ticket without an arrival, and the
        # counters they leave must still be back to 0 for the second launch (and after it)
        for mode in ("split", "persistent", "persistent"):
            got = record_run(device, direct, x, ids, w, mode)
            assert same_bits(got, want), mode
        words = direct._scratch_for(*ids.shape).sync.download(np.uint32)
        assert not words.any(), np.nonzero(words)[0][:24]


def test_plan_chooses_direct_mode_for_small_batches_with_short_items(device, monkeypatch):
    monkeypatch.delenv("VKMOE_MOE_DIRECT", raising=False)
    monkeypatch.delenv("VKMOE_MOE_SPLITS", raising=False)
    qwen3, deepseek = (8, 128, 2048, 768, True), (8, 256, 7168, 2048, True)  # top_k, E, H, I, gated

    def plan(m, shape):
        return ops_plan.moe_plan(device, m, *shape, target_workgroups=396)  # the H200's 3 per SM

    one = plan(1, qwen3)
    assert one.direct and one.rows == 1 and one.max_chunks == one.R
    # at most 396 items per phase (one round), not at least 396; the down phase at most 264 (2 per SM) with stage 3
    # in the down items (test_stage3_in_down.py)
    assert (one.splits_gu, one.splits_d) == (4, 2)
    assert ops_plan.hadamard_blocks_spanned(one.kt_gu) <= ops_plan.DIRECT_AUTO_MAX_BLOCKS
    two = plan(2, qwen3)
    assert two.direct and (two.splits_gu, two.splits_d) == (2, 1)
    four = plan(4, qwen3)  # H200: 67.8 us direct vs 76.2 routed (BENCHMARKS.md, fourteenth session)
    assert four.direct and (four.splits_gu, four.splits_d) == (2, 1)
    ds = plan(1, deepseek)  # more than one round of items, each at most 8 blocks (test below): 132.2 vs 143.3 us
    assert ds.direct and (ds.splits_gu, ds.splits_d) == (7, 2)
    assert not plan(ops_plan.DIRECT_AUTO_MAX_M + 1, (8, 128, 512, 256, True)).direct
    monkeypatch.setenv("VKMOE_MOE_DIRECT", "off")
    assert not plan(1, qwen3).direct
    # forced on: a gate/up item's input row must fit the GEMM core's reduction buffer, so k-splits grow
    monkeypatch.setenv("VKMOE_MOE_DIRECT", "on")
    monkeypatch.setenv("VKMOE_MOE_SPLITS", "1,1")
    big = plan(64, deepseek)
    assert big.direct and big.kt_gu <= layout.DIRECT_MAX_KT and big.splits_gu * big.kt_gu >= 7168 // 16
    assert big.splits_gu == 2


def test_routed_chunks_hold_four_rows_from_sixteen_tokens(device, monkeypatch):
    """ops.plan.routed_rows: below ROUTED_ROWS4_MIN_M tokens a batch with no more rows than experts takes one row
    per chunk (the split path was faster there), from it at least 4 (rows that pick one expert share a decode);
    with more rows than experts the average rows per expert decides, as before."""
    for name in ("VKMOE_MOE_DIRECT", "VKMOE_MOE_SPLITS", "VKMOE_MOE_ROWS", "VKMOE_COOPMAT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VKMOE_COOPMAT", "off")  # the FMA path's chunks (the coop stages have their own tile)
    qwen3, deepseek = (8, 128, 2048, 768, True), (8, 256, 7168, 2048, True)  # top_k, E, H, I, gated

    def rows(m, shape):
        p = ops_plan.moe_plan(device, m, *shape, target_workgroups=396)
        assert not p.direct and p.max_chunks == min(shape[1], p.R) + layout.ceil_div(p.R, p.rows)
        return p.rows

    assert ops_plan.ROUTED_ROWS4_MIN_M == 16
    assert [rows(m, qwen3) for m in (5, 8, 15, 16, 17, 32, 128)] == [1, 1, 1, 4, 4, 4, 8]  # m <= 4: direct
    assert [rows(m, deepseek) for m in (5, 8, 15, 16, 32, 64)] == [1, 1, 1, 4, 4, 4]


def test_linear_plans_keep_to_one_round(device, monkeypatch):
    """ops.plan.gemm_plan takes the most k-splits whose grid stays within the target workgroups (one round of
    resident workgroups), never a grid just past it (7168 x 2048 at m = 1: 16 bands x 24 splits = 384, where the
    fewest splits reaching 396 gave 400), and always covers k. On Mesa 22.3 (the loop cap) the k-ranges are then
    rounded up to whole 4-tile steps, which can take a split away (ops.plan.gemm_plan says why)."""
    monkeypatch.setenv("VKMOE_COOPMAT", "off")
    monkeypatch.delenv("VKMOE_LINEAR_DIRECT", raising=False)
    whole_steps = bool(device.quirks.get("loop_iteration_cap"))
    for m, k, n in [(1, 7168, 2048), (1, 8192, 8192), (1, 2048, 7168), (2, 7168, 2048), (4, 8192, 8192),
                    (16, 2048, 768), (1, 2048, 768), (3, 4096, 128)]:
        p = ops_plan.gemm_plan(device, m, k, n, target_workgroups=396)
        grid = (n // layout.BAND) * p.row_chunks * p.splits
        assert p.splits * p.kt_per_split >= k // 16 > (p.splits - 1) * p.kt_per_split, (m, k, n, p)
        assert grid <= 396 or p.splits == 1 or p.kt_per_split == 4, (m, k, n, p)  # 4: the shortest k-split
        if whole_steps:
            assert p.kt_per_split % 4 == 0, (m, k, n, p)
        elif p.splits > 1 and p.kt_per_split > 4 and not p.direct:
            more = ops_plan._splits(device, k // 16, (n // layout.BAND) * p.row_chunks, 396, forced=p.splits + 1)
            assert (n // layout.BAND) * p.row_chunks * more[0] > 396, (m, k, n, p)  # the most that fit
    # 24 splits of 19 tiles; on Mesa 22.3 23 of 20
    assert ops_plan.gemm_plan(device, 1, 7168, 2048, target_workgroups=396).splits == (23 if whole_steps else 24)


def test_routed_k_ranges_are_whole_steps_where_the_driver_has_the_loop_cap(device, monkeypatch):
    """ops.plan._slot_uniform: on Mesa 22.3 (the driver with the loop cap) routed MoE k-ranges are whole 4-tile steps,
    as direct ones everywhere (a routed down range of 6 tiles gave NaN there: test_persistent.py's odd-step test);
    elsewhere they keep their tiles. Forced splits and the plan's own both."""
    for name in ("VKMOE_MOE_SPLITS", "VKMOE_MOE_ROWS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VKMOE_COOPMAT", "off")
    monkeypatch.setenv("VKMOE_MOE_DIRECT", "off")

    def kts(m, top_k, H, I, splits=None):
        if splits:
            monkeypatch.setenv("VKMOE_MOE_SPLITS", splits)
        else:
            monkeypatch.delenv("VKMOE_MOE_SPLITS", raising=False)
        p = ops_plan.moe_plan(device, m, top_k, 8, H, I, True, target_workgroups=6)
        assert not p.direct and p.splits_gu * p.kt_gu >= H // 16 and p.splits_d * p.kt_d >= I // 16, p
        return p.kt_gu, p.kt_d

    monkeypatch.setitem(device.quirks, "loop_iteration_cap", 65536)
    # 3 down splits of I = 256 (16 tiles) would be 6 tiles; the plan's own for one chunk of 2 bands too
    assert kts(40, 4, 384, 256, "3,3") == (8, 8)
    assert kts(40, 4, 384, 256, "4,4") == (8, 4)
    assert kts(1, 1, 256, 256) == (8, 8)
    monkeypatch.delitem(device.quirks, "loop_iteration_cap")
    assert kts(40, 4, 384, 256, "3,3") == (8, 6)
    assert kts(40, 4, 384, 256, "4,4") == (6, 4)
    assert kts(1, 1, 256, 256) == (8, 6)


def test_routed_persistent_layers_exist():
    assert ROUTED_PERSISTENT <= {os.path.basename(p) for p in golden_files()}


@pytest.mark.parametrize("name", sorted(ROUTED_PERSISTENT))
def test_direct_mode_with_one_down_split(device, monkeypatch, name):
    """One down k-split in direct mode (the plan's at m = 2 on the H200): a token's band counts one arrival per
    valid slot, a single-split arrival takes no counter round trip (wg_last_arrival) but the token's counter still
    does; the routed bits in both dispatch modes, and the counters back to 0 after each launch."""
    L = load_layer(os.path.join(os.path.dirname(golden_files()[0]), name))
    with golden_moe(device, L) as routed, golden_moe(device, L) as direct:
        for call in L.calls:
            for moe, setting in ((routed, "off"), (direct, "on")):
                monkeypatch.setenv("VKMOE_MOE_DIRECT", setting)
                monkeypatch.setenv("VKMOE_MOE_SPLITS", "2,1")
                moe(-call["x"], call["selected"], call["weights"], dispatch="split")
                assert moe.last_run["plan"]["splits_d"] == 1, moe.last_run["plan"]
            want = _run(routed, call, "split", "off")
            assert rel_rms(want, reference_targets(L, call)[0][1]) < 3e-3
            for mode in ("split", "persistent", "persistent"):
                assert same_bits(_run(direct, call, mode, "on"), want), f"{mode}{call['suffix']}"
            words = direct._scratch_for(*call["selected"].shape).sync.download(np.uint32)
            assert not words.any(), np.nonzero(words)[0][:24]


def test_direct_splits_weigh_rounds_against_item_cost(device, monkeypatch):
    """ops.plan._direct_splits: where one round of the target holds enough k-splits it takes the most that fit (the
    one-round rule); where even one split needs more than a round it takes a few more splits (the DeepSeek-V3
    shape at m = 1: 448 down items per split on 396 workgroups, 2 splits); a gate/up item spans at most
    DIRECT_AUTO_MAX_BLOCKS Hadamard blocks; every k-range is whole 4-tile steps."""
    monkeypatch.delenv("VKMOE_MOE_DIRECT", raising=False)
    monkeypatch.delenv("VKMOE_MOE_SPLITS", raising=False)
    qwen3, deepseek = (8, 128, 2048, 768, True), (8, 256, 7168, 2048, True)
    one = ops_plan.moe_plan(device, 1, *deepseek, target_workgroups=396)
    assert one.direct and (one.splits_gu, one.kt_gu, one.splits_d, one.kt_d) == (7, 64, 2, 64)
    assert ops_plan.direct_max_kt_gu() == 64
    assert ops_plan._direct_splits(device, 128, 96, 396, 64) == (4, 32)  # one round: the most splits that fit
    assert ops_plan._direct_splits(device, 128, 448, 396, 128) == (2, 64)  # past one round unsplit: 2
    assert ops_plan._direct_splits(device, 16, 4, 6, 64) == (1, 16)  # a round of 6 holds 1 split of 4 items
    for m in (1, 2, 3, 4):
        for shape in (qwen3, deepseek, (2, 8, 256, 128, True), (4, 16, 512, 384, False)):
            p = ops_plan.moe_plan(device, m, *shape, target_workgroups=396)
            if p.direct:
                assert p.kt_gu % 4 == 0 and p.kt_d % 4 == 0, (m, shape, p)
                assert p.splits_gu * p.kt_gu >= shape[2] // 16 > (p.splits_gu - 1) * p.kt_gu, (m, shape, p)
                assert p.splits_d * p.kt_d >= shape[3] // 16 > (p.splits_d - 1) * p.kt_d, (m, shape, p)
                assert ops_plan.hadamard_blocks_spanned(p.kt_gu) <= ops_plan.DIRECT_AUTO_MAX_BLOCKS, (m, shape, p)


def test_forced_direct_splits_keep_whole_k_steps(device, monkeypatch):
    """VKMOE_MOE_SPLITS in direct mode rounds each k-range up to whole 4-tile steps (ops.plan.direct_kt): forced
    3 gate/up splits of the tiny layer's 16 k-tiles run as 2 of 8. Mesa 22.3's lavapipe left every persistent
    output NaN with 3 splits of 6 tiles; here the persistent bits must equal split's, which equal routed mode's."""
    L = load_layer(TINY_PATH)
    with golden_moe(device, L) as direct, golden_moe(device, L) as routed:
        call = next(c for c in L.calls if c["suffix"] == "_m1")
        monkeypatch.setenv("VKMOE_MOE_SPLITS", "3,1")
        for moe, setting in ((direct, "on"), (routed, "off")):
            monkeypatch.setenv("VKMOE_MOE_DIRECT", setting)
            moe(-call["x"], call["selected"], call["weights"], dispatch="split")
        assert (direct.last_run["plan"]["splits_gu"], direct.last_run["plan"]["kt_gu"]) == (2, 8), direct.last_run
        monkeypatch.setenv("VKMOE_MOE_SPLITS", "2,1")  # the routed layer planned 3 splits of 6: give it direct's
        routed2 = golden_moe(device, L)
        try:
            monkeypatch.setenv("VKMOE_MOE_DIRECT", "off")
            want = _run(routed2, call, "split", "off")
        finally:
            routed2.close()
        assert rel_rms(want, reference_targets(L, call)[0][1]) < 3e-3
        for mode in ("split", "persistent"):
            got = _run(direct, call, mode, "on")
            assert np.all(np.isfinite(got)) and same_bits(got, want), mode
