"""The token-sum pass (VKMOE_MOE_TOKEN_SUM, MoePlan.token_sum_pass, SPEC_MOE_TOKEN_SUM_PASS): the split path's down
tails write the (token, slot) rows only, and a fourth dispatch (moe_token_sum.comp) sums each token's rows in slot
order, instead of each tail counting its rows' arrivals and summing the tokens it completed. The same values are
added in the same order, so the bits must be the tails' sums, for every golden file; the plan takes it for routed
split plans only (auto: the cooperative-matrix ones), never in direct mode or in the persistent kernel."""
import os

import numpy as np

import pytest

from goldens import (calls_on_two_plans, golden_files, golden_moe, ids_with_dead_slots, load_layer, poison_scratch,
                     record_run, reference_targets, rel_rms, run_golden_call, same_bits)
from vkmoe import layout
from vkmoe.ops import moe as ops_moe
from vkmoe.ops import plan as ops_plan


def _plan_shape(monkeypatch, moe, token_sum, x, ids, w):
    """A first call that fixes the plan of its shape (a layer plans a batch shape when it first sees it), routed, on
    other routing than the checked call, so every buffer holds other numbers before it."""
    monkeypatch.setenv("VKMOE_MOE_TOKEN_SUM", token_sum)
    monkeypatch.setenv("VKMOE_MOE_DIRECT", "off")
    monkeypatch.setenv("VKMOE_COOPMAT", "off")
    moe(x, ids, w, dispatch="split")
    plan = moe.last_run["plan"]
    assert plan["token_sum_pass"] is (token_sum == "on") and not plan["direct"], plan


# The pass sums rows whatever the layer: golden layers with gated and gateless activations, an act limit, mixed bit
# widths under both codebooks, one and two calls (each file is several more pipelines to compile, slow on Mesa 25)
LAYERS = ("a_tiny_silu_k4.npz", "b_mixed_bits_g3u4d5.npz", "d_relu2_gateless_k4.npz", "e_swiglu_oai_lim7_k4.npz",
          "k_mcg_mixed_g5u3d6.npz")


@pytest.mark.parametrize("path", [p for p in golden_files() if os.path.basename(p) in LAYERS],
                         ids=lambda p: os.path.basename(p)[:-4])
def test_token_sum_pass_gives_the_tails_bits(device, monkeypatch, path):
    L = load_layer(path)
    first = lambda moe, token_sum, *args: _plan_shape(monkeypatch, moe, token_sum, *args)  # noqa: E731
    for call, tails, passed in calls_on_two_plans(device, L, ("off", "on"), 13, first):
        want = run_golden_call(tails, call, "split")
        assert rel_rms(want, reference_targets(L, call)[0][1]) < 3e-3
        got = run_golden_call(passed, call, "split")
        assert same_bits(got, want), call["suffix"]
        # the persistent kernel of a plan with the pass sums in its tails (one dispatch): the same bits
        if os.path.basename(path) == "a_tiny_silu_k4.npz":
            assert same_bits(run_golden_call(passed, call, "persistent"), want), call["suffix"]


def test_token_sum_pass_skips_dead_slots(device, monkeypatch):
    """Slots without a valid expert (an id below 0 or past E): their (token, slot) rows are never written, and the
    scratch holds NaN (poisoned) there; the pass must drop them as the tails do, and give a token with no valid
    slot a zero row."""
    L = load_layer(golden_files()[0])
    call = L.calls[0]
    with golden_moe(device, L) as tails, golden_moe(device, L) as passed:
        ids = ids_with_dead_slots(call, tails.E)
        x, w = call["x"], call["weights"]
        outs = []
        for moe, token_sum in ((tails, "off"), (passed, "on")):
            _plan_shape(monkeypatch, moe, token_sum, -x, call["selected"], w)
            poison_scratch(moe)
            outs.append(record_run(device, moe, x, ids, w, "split"))
        want, got = outs
        assert np.all(want[0] == 0.0) and np.isfinite(want).all()
        assert same_bits(got, want)


def test_plan_takes_the_token_sum_pass_for_routed_split_plans(device, monkeypatch):
    """auto: cooperative-matrix plans only; on: every routed plan; off: none; never direct mode; the persistent
    kernel's specialization never has it; the split path gets a fourth dispatch exactly when the plan has it."""
    for name in ("VKMOE_MOE_DIRECT", "VKMOE_MOE_SPLITS", "VKMOE_MOE_ROWS", "VKMOE_MOE_TOKEN_SUM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VKMOE_COOPMAT", "off")
    qwen3 = (8, 128, 2048, 768, True)  # top_k, E, H, I, gated

    def plan(m):
        return ops_plan.moe_plan(device, m, *qwen3, target_workgroups=396)

    assert not plan(64).token_sum_pass and not plan(1).token_sum_pass  # auto, FMA
    monkeypatch.setenv("VKMOE_MOE_TOKEN_SUM", "on")
    routed, direct = plan(64), plan(1)
    assert routed.token_sum_pass and not routed.direct
    assert direct.direct and not direct.token_sum_pass
    bits = {"gate": 4, "up": 4, "down": 4}
    for p, persistent, want in ((routed, False, True), (routed, True, False), (direct, False, False)):
        spec = ops_moe.moe_spec(p, bits, "mul1", "silu", persistent=persistent)
        assert spec[layout.SPEC_MOE_TOKEN_SUM_PASS] is want, (p, persistent)
    grids = layout.split_grids(routed, 2048, 768, True)
    assert len(grids) == 4 and grids[3] == layout.fold_grid(64 * 2048 // 256)
    assert layout.split_grids(plan(16), 2048, 768, True)[3] is not None
    monkeypatch.setenv("VKMOE_MOE_TOKEN_SUM", "off")
    assert layout.split_grids(plan(64), 2048, 768, True)[3] is None
    monkeypatch.setenv("VKMOE_MOE_TOKEN_SUM", "auto")
    monkeypatch.setenv("VKMOE_COOPMAT", "on")  # a cooperative-matrix plan where the device has them
    if ops_plan.coop_moe_unavailable(device) is None:
        assert plan(256).coop and plan(256).token_sum_pass


@pytest.mark.parametrize("m", [3, 9])
def test_block_runs_the_token_sum_pass_after_both_chains(device, tmp_path, monkeypatch, m):
    """A device block whose routed plan has the token-sum pass: the shared down GEMM still runs beside the routed
    down, the token sums take the phase after it, then the block's sum pass; the output has the bits of the block
    whose down tails sum the tokens."""
    from test_device_block import ARCHS, H, _has, _hidden, _recorded_phases
    from vkmoe.models import SparseMoeBlock, write_checkpoint

    monkeypatch.setenv("VKMOE_MOE_DIRECT", "off")
    path = write_checkpoint(str(tmp_path / "ds"), arch="deepseek_v3", hidden=H, intermediate=128, seed=43,
                            **ARCHS["deepseek_v3"])
    x = _hidden(m, seed=m)
    outs = {}
    for token_sum in ("off", "on"):
        monkeypatch.setenv("VKMOE_MOE_TOKEN_SUM", token_sum)  # (read when the block's routed op first plans m)
        block = SparseMoeBlock.from_checkpoint(path, 0, backend="vulkan", device=device)
        try:
            plan = block.device_block.moe.moe_plan(m, ARCHS["deepseek_v3"]["top_k"])
            assert plan.token_sum_pass is (token_sum == "on")
            phases, outs[token_sum] = _recorded_phases(device, block, x, m)
            assert np.array_equal(block(x), outs[token_sum])
        finally:
            block.close()
        down = [i for i, p in enumerate(phases) if _has(p, "moe_down")]
        assert len(down) == 1 and sum(n.startswith("exl3_linear") for n in phases[down[0]]) == 1, phases
        after = phases[down[0] + 1:]
        want = ([["moe_token_sum"]] if token_sum == "on" else []) + [["moe_block_elem"]]
        assert after == want, phases
    assert np.array_equal(outs["on"].view(np.uint32), outs["off"].view(np.uint32))


def test_token_sum_layers_exist():
    assert set(LAYERS) <= {os.path.basename(p) for p in golden_files()}
