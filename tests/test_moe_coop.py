"""The MoE GEMM stages on cooperative matrices (moe_gate_up_coop.comp, moe_down_coop.comp), as far as lavapipe
(which lacks VK_KHR_cooperative_matrix) can test them: the plan's choice and its fallback, the knob's error, the
split-only rule (persistent refused), and the stages' data flow (chunks of COOP_MOE_ROWS rows of one expert, or
COOP_MOE_ROWS_WIDE in the wide builds, with A rows gathered by (token, slot), whole-m-tile partials, k-splits, the
shared band tails) through their `_emulate` builds, which replace only the matrix-unit multiply. The
cooperative-matrix builds themselves are checked on a GPU with `tools/check_coopmat --moe`."""
import functools
from types import SimpleNamespace

import numpy as np
import pytest

import vkmoe
from goldens import rel_rms
from vkmoe import layout
from vkmoe.exl3 import reference
from vkmoe.exl3.synthetic import random_moe_layer
from vkmoe.ops import kernels, plan
from vkmoe.sched.plan import decide

TOL = 3e-3


@pytest.fixture
def emulated(monkeypatch):
    """The coop plan as on a device that has the feature, run by the emulate builds."""
    monkeypatch.setattr(plan, "coop_moe_unavailable", lambda d, rows=None: None)
    monkeypatch.setattr(kernels, "coop_moe_name", functools.partial(kernels.coop_moe_name, flavor="emulate"))
    monkeypatch.setenv("VKMOE_COOPMAT", "on")


# VKMOE_COOPMAT_MOE_WIDE_ROWS that puts a plan on each chunk size: every plan wide from 1 row per expert, none
# from 2^30
WIDE_ROWS_KNOB = {layout.COOP_MOE_ROWS: str(2 ** 30), layout.COOP_MOE_ROWS_WIDE: "1"}


def _routing(m, E, top_k, seed, skip=0):
    rng = np.random.default_rng([seed, m, E])
    # skewed: expert 0 gets most rows (several chunks plus a partial one), others few
    p = np.array([8.0] + [1.0] * (E - 1))
    ids = np.stack([rng.choice(E, top_k, replace=False, p=p / p.sum()) for _ in range(m)]).astype(np.int32)
    w = rng.random((m, top_k)).astype(np.float32)
    for t in range(skip):  # ids outside [0, E): skipped (one slot, and every slot of the last token)
        ids[t, 0] = -1 if t % 2 else E + 3
    if skip:
        ids[m - 1, :] = -1
    return ids, w


# (H, I, E, top_k, m, bits, activation, act_limit, splits, skip)
CASES = [
    pytest.param(256, 256, 3, 2, 120, 4, "silu", 0.0, None, 0, id="silu-chunks"),
    pytest.param(128, 256, 4, 2, 90, (3, 4, 5), "silu", 6.0, None, 3, id="silu-mixed-bits-limit-skips"),
    pytest.param(128, 256, 4, 3, 70, (2, 3, 4), "relu2", 0.0, None, 2, id="relu2-gateless"),
    pytest.param(512, 512, 2, 1, 80, 3, "silu", 0.0, "2,2", 0, id="silu-ksplits"),
    # the other trellis widths: a lane's words 1, 6, 7 or 8 per tile (K = 8: two 16-byte loads)
    pytest.param(128, 256, 3, 2, 40, (6, 7, 8), "silu", 0.0, None, 0, id="silu-bits-6-7-8"),
    pytest.param(128, 256, 3, 2, 40, (1, 2, 1), "silu", 0.0, None, 0, id="silu-bits-1-2"),
]


@pytest.mark.parametrize("rows", [layout.COOP_MOE_ROWS, layout.COOP_MOE_ROWS_WIDE])
@pytest.mark.parametrize("H, I, E, top_k, m, bits, activation, act_limit, splits, skip", CASES)
def test_emulated_stages(monkeypatch, device, emulated, H, I, E, top_k, m, bits, activation, act_limit, splits, skip,
                         rows):
    _check_emulated(monkeypatch, device, H, I, E, top_k, m, bits, activation, act_limit, splits, skip, rows)


# The B-register builds (VKMOE_COOPMAT_B_REGS=on, `_breg`): every trellis width (their lanes read word windows that
# start mid-word for K other than 4 and 8), k-splits, several A blocks per item (H = 512 at 32 rows), both chunk sizes.
B_REGS_CASES = [
    pytest.param(*CASES[0].values, layout.COOP_MOE_ROWS, id="silu-chunks-16"),
    pytest.param(*CASES[0].values, layout.COOP_MOE_ROWS_WIDE, id="silu-chunks-32"),
    pytest.param(*CASES[1].values, layout.COOP_MOE_ROWS, id="mixed-bits-limit-skips-16"),
    pytest.param(*CASES[3].values, layout.COOP_MOE_ROWS_WIDE, id="ksplits-32"),
    pytest.param(*CASES[4].values, layout.COOP_MOE_ROWS, id="bits-6-7-8-16"),
    pytest.param(*CASES[5].values, layout.COOP_MOE_ROWS_WIDE, id="bits-1-2-32"),
]


@pytest.mark.parametrize("H, I, E, top_k, m, bits, activation, act_limit, splits, skip, rows", B_REGS_CASES)
def test_emulated_stages_b_in_registers(monkeypatch, device, emulated, H, I, E, top_k, m, bits, activation,
                                        act_limit, splits, skip, rows):
    monkeypatch.setenv("VKMOE_COOPMAT_B_REGS", "on")
    assert kernels.coop_moe_name(device, "down", rows).endswith("_breg")
    _check_emulated(monkeypatch, device, H, I, E, top_k, m, bits, activation, act_limit, splits, skip, rows)


def test_b_registers_need_the_measured_fragment_order(monkeypatch, device):
    """VKMOE_COOPMAT_B_REGS=on on a device whose B fragment order is not the builds' (lavapipe: no cooperative
    matrices, so the quirk is None) is refused with the knob's name; auto (the default) and off pick the shared-memory
    builds there; auto picks the _breg builds where the order was measured right."""
    from vkmoe.vk import quirks

    assert quirks.cooperative_matrix_b_order(device) in (None, False)
    assert not kernels.coop_moe_name(device, "gate_up").endswith("_breg")
    monkeypatch.setenv("VKMOE_COOPMAT_B_REGS", "off")
    assert not kernels.coop_moe_name(device, "gate_up").endswith("_breg")
    monkeypatch.setenv("VKMOE_COOPMAT_B_REGS", "on")
    with pytest.raises(vkmoe.VkmoeError, match="VKMOE_COOPMAT_B_REGS=on: .*coopmat_b_order_probe: None"):
        kernels.coop_moe_name(device, "gate_up")
    monkeypatch.setenv("VKMOE_COOPMAT_B_REGS", "sideways")
    with pytest.raises(ValueError, match="VKMOE_COOPMAT_B_REGS"):
        kernels.coop_moe_name(device, "gate_up")
    monkeypatch.delenv("VKMOE_COOPMAT_B_REGS")
    right = SimpleNamespace(name="fake")
    monkeypatch.setattr(kernels, "cooperative_matrix_b_order", lambda d: d is right)
    monkeypatch.setattr(kernels, "uses_idot", lambda d: True)
    assert kernels.coop_moe_name(right, "down", layout.COOP_MOE_ROWS_WIDE) == "moe_down_coop_idot_wide_breg"
    assert kernels.coop_moe_name(right, "down", flavor="emulate") == "moe_down_coop_emulate"  # auto: not emulated


def _check_emulated(monkeypatch, device, H, I, E, top_k, m, bits, activation, act_limit, splits, skip, rows):
    monkeypatch.setenv("VKMOE_COOPMAT_MOE_WIDE_ROWS", WIDE_ROWS_KNOB[rows])
    if splits:
        monkeypatch.setenv("VKMOE_MOE_SPLITS", splits)
    gate, up, down = random_moe_layer(H, I, E, bits=bits, activation=activation, seed=H + I + m)
    ids, w = _routing(m, E, top_k, seed=m, skip=skip)
    x = np.random.default_rng(m).standard_normal((m, H)).astype(np.float16)
    p = plan.moe_plan(device, m, top_k, E, H, I, activation != "relu2")
    assert p.coop and p.rows == rows
    assert p.kt_gu % layout.COOP_KSTEP == 0 and p.kt_d % layout.COOP_KSTEP == 0
    if splits:
        assert p.splits_gu == 2 and p.splits_d == 2
    with vkmoe.Exl3MoeMlp(device, gate, up, down, activation=activation, act_limit=act_limit) as moe:
        moe._call_with_skips(x * 4, ids[::-1].copy(), w, "split")  # poison the output, partial and inter buffers
        y = moe._call_with_skips(x, ids, w, "split")
        assert moe.last_run["plan"]["coop"]
    assert np.all(np.isfinite(y))
    ref = reference.moe_forward(x, ids, w, gate, up, down, activation=activation, act_limit=act_limit)
    assert rel_rms(y, ref) < TOL
    if skip:
        assert np.all(y[m - 1] == 0.0)  # a token with no valid slot: a zero row


@pytest.mark.parametrize("rows", [layout.COOP_MOE_ROWS, layout.COOP_MOE_ROWS_WIDE])
def test_coop_stages_count_their_co_residency(monkeypatch, tmp_path, device, emulated, rows):
    """Exl3MoeMlp.co_resident_coop: each coop stage's discovery build (`_discover`: the stage's own source and
    specialization, the plan's chunk size) counts its co-resident workgroups, at most lavapipe's worker threads,
    and the count is cached per pipeline like the persistent kernel's."""
    import json

    from vkmoe.sched import occupancy

    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VKMOE_COOPMAT_MOE_WIDE_ROWS", WIDE_ROWS_KNOB[rows])
    occupancy._measured.clear()
    gate, up, down = random_moe_layer(256, 256, 3, seed=8)
    with vkmoe.Exl3MoeMlp(device, gate, up, down) as moe:
        p = moe._scratch_for(120, 2).plan
        assert p.coop and p.rows == rows
        counts = {stage: moe.co_resident_coop(p, stage) for stage in ("gate_up", "down")}
        for c in counts.values():
            assert c["launched"] == occupancy.launch_size(device) > c["min"] >= 1, c
            if device.is_lavapipe:
                assert max(c["samples"]) <= device.compute_units, c
        entries = json.load(open(tmp_path / "residency.json"))
        (pipelines,) = [v["pipelines"]["entries"] for v in entries.values() if "pipelines" in v]
        for stage in ("gate_up", "down"):
            build = "emulate_wide" if rows == layout.COOP_MOE_ROWS_WIDE else "emulate"
            (key,) = [k for k in pipelines if k.startswith(f"moe_{stage}_coop_{build}_discover@")]
            assert pipelines[key]["min"] == counts[stage]["min"]
        with pytest.raises(ValueError, match="stage must be 'gate_up' or 'down'"):
            moe.co_resident_coop(p, "route")
        monkeypatch.setenv("VKMOE_COOPMAT", "off")
        fma = plan.moe_plan(device, 2, 2, 3, 256, 256, True)
        assert not fma.coop
        with pytest.raises(ValueError, match="runs the FMA stages"):
            moe.co_resident_coop(fma, "gate_up")


# ------------------------------------------------------------------------------------------ the choice
def test_plan_choice(monkeypatch, device):
    monkeypatch.setattr(plan, "coop_moe_unavailable", lambda d, rows=None: None)
    monkeypatch.setattr(plan, "coop_probe_failure", lambda d: None)
    monkeypatch.setenv("VKMOE_COOPMAT", "auto")
    monkeypatch.setenv("VKMOE_COOPMAT_MOE_MIN_ROWS", "4")  # (token, slot) rows per expert: m * 8 / 128 >= 4
    assert not plan.moe_plan(device, 63, 8, 128, 2048, 768, True).coop
    p = plan.moe_plan(device, 64, 8, 128, 2048, 768, True)
    assert p.coop and p.rows == layout.COOP_MOE_ROWS and p.max_chunks == 128 + 64 * 8 // layout.COOP_MOE_ROWS
    assert p.splits_gu * p.kt_gu >= 2048 // 16 and p.kt_gu % layout.COOP_KSTEP == 0
    monkeypatch.setenv("VKMOE_COOPMAT", "off")
    assert not plan.moe_plan(device, 1024, 8, 128, 2048, 768, True).coop


def test_default_switch_point(monkeypatch, device):
    """Auto takes the coop stages from 3 (token, slot) rows per expert (VKMOE_COOPMAT_MOE_MIN_ROWS' default, the
    H100's measured switch point): m = 48 on the Qwen3 shape (top-8 of 128), 96 on DeepSeek-V3's (top-8 of 256)."""
    monkeypatch.setattr(plan, "coop_moe_unavailable", lambda d, rows=None: None)
    monkeypatch.setattr(plan, "coop_probe_failure", lambda d: None)
    monkeypatch.setenv("VKMOE_COOPMAT", "auto")
    monkeypatch.delenv("VKMOE_COOPMAT_MOE_MIN_ROWS", raising=False)
    for m, E, H, I, coop in ((47, 128, 2048, 768, False), (48, 128, 2048, 768, True),
                             (95, 256, 7168, 2048, False), (96, 256, 7168, 2048, True)):
        assert plan.moe_plan(device, m, 8, E, H, I, True).coop == coop, (m, E)


def test_default_wide_switch_point(monkeypatch, device):
    """The 32-row chunks from 13 (token, slot) rows per expert (VKMOE_COOPMAT_MOE_WIDE_ROWS' default, the H100's
    measured switch point): m = 208 on the Qwen3 shape (top-8 of 128), 416 on DeepSeek-V3's (top-8 of 256)."""
    monkeypatch.setattr(plan, "coop_moe_unavailable", lambda d, rows=None: None)
    monkeypatch.setattr(plan, "coop_probe_failure", lambda d: None)
    monkeypatch.setenv("VKMOE_COOPMAT", "auto")
    monkeypatch.delenv("VKMOE_COOPMAT_MOE_WIDE_ROWS", raising=False)
    narrow, wide = layout.COOP_MOE_ROWS, layout.COOP_MOE_ROWS_WIDE
    for m, E, H, I, rows in ((207, 128, 2048, 768, narrow), (208, 128, 2048, 768, wide),
                             (415, 256, 7168, 2048, narrow), (416, 256, 7168, 2048, wide)):
        p = plan.moe_plan(device, m, 8, E, H, I, True)
        assert p.coop and p.rows == rows, (m, E)


def test_plan_takes_the_wide_chunks_from_its_rows_per_expert(monkeypatch, device):
    """COOP_MOE_ROWS_WIDE from VKMOE_COOPMAT_MOE_WIDE_ROWS (token, slot) rows per expert on average, where the
    device can run the wide builds; the chunk table is sized for the plan's rows."""
    unavailable = {layout.COOP_MOE_ROWS: None, layout.COOP_MOE_ROWS_WIDE: None}
    monkeypatch.setattr(plan, "coop_moe_unavailable", lambda d, rows=layout.COOP_MOE_ROWS: unavailable[rows])
    monkeypatch.setattr(plan, "coop_probe_failure", lambda d: None)
    monkeypatch.setenv("VKMOE_COOPMAT", "auto")
    monkeypatch.setenv("VKMOE_COOPMAT_MOE_WIDE_ROWS", "32")
    qwen3 = (8, 128, 2048, 768, True)
    narrow, wide = plan.moe_plan(device, 511, *qwen3), plan.moe_plan(device, 512, *qwen3)  # 31.9 / 32 rows
    assert narrow.coop and narrow.rows == layout.COOP_MOE_ROWS
    assert wide.coop and wide.rows == layout.COOP_MOE_ROWS_WIDE
    assert wide.max_chunks == 128 + 512 * 8 // layout.COOP_MOE_ROWS_WIDE
    monkeypatch.setenv("VKMOE_COOPMAT_MOE_WIDE_ROWS", "33")
    assert plan.moe_plan(device, 512, *qwen3).rows == layout.COOP_MOE_ROWS
    monkeypatch.setenv("VKMOE_COOPMAT_MOE_WIDE_ROWS", "32")
    unavailable[layout.COOP_MOE_ROWS_WIDE] = "the wide builds' SPIR-V was not built"
    assert plan.moe_plan(device, 1024, *qwen3).rows == layout.COOP_MOE_ROWS
    monkeypatch.setenv("VKMOE_COOPMAT_MOE_WIDE_ROWS", "0")
    with pytest.raises(ValueError, match="VKMOE_COOPMAT_MOE_WIDE_ROWS"):  # knobs.KnobError
        plan.moe_plan(device, 1024, *qwen3)


def test_build_names():
    """The plan's rows pick the wide build; the emulate flavor replaces the device's."""
    name = functools.partial(kernels.coop_moe_name, None, flavor="emulate")  # the flavor given: no device needed
    assert name("down", layout.COOP_MOE_ROWS) == "moe_down_coop_emulate"
    assert name("gate_up", layout.COOP_MOE_ROWS_WIDE) == "moe_gate_up_coop_emulate_wide"


def _skip_with_the_feature(device):
    if plan.coop_moe_unavailable(device) is None:
        pytest.skip(f"{device.name} has VK_KHR_cooperative_matrix: this test is about a device without it")


def test_default_keeps_fma_without_the_feature(monkeypatch, device):
    _skip_with_the_feature(device)
    monkeypatch.delenv("VKMOE_COOPMAT", raising=False)
    monkeypatch.setenv("VKMOE_COOPMAT_MOE_MIN_ROWS", "1")
    assert "VK_KHR_cooperative_matrix" in plan.coop_moe_unavailable(device)
    assert not plan.moe_plan(device, 256, 8, 128, 2048, 768, True).coop


def test_forcing_coop_without_the_feature_raises(monkeypatch, device):
    _skip_with_the_feature(device)
    monkeypatch.setenv("VKMOE_COOPMAT", "on")
    gate, up, down = random_moe_layer(128, 128, 2, seed=1)
    with vkmoe.Exl3MoeMlp(device, gate, up, down) as moe:
        x = np.ones((4, 128), np.float16)
        ids, w = np.array([[0], [1], [0], [1]], np.int32), np.ones((4, 1), np.float32)
        with pytest.raises(vkmoe.VkmoeError, match=r"VKMOE_COOPMAT=on.*MoE stages.*VK_KHR_cooperative_matrix"):
            moe(x, ids, w)


def test_missing_spirv_is_a_reason(monkeypatch, device):
    monkeypatch.setattr(plan, "coop_unavailable", lambda d: None)
    monkeypatch.setattr(plan, "SPV_DIR", "/nonexistent")
    assert "SPIR-V" in plan.coop_moe_unavailable(device)
    assert "SPIR-V" in plan.coop_moe_unavailable(device, layout.COOP_MOE_ROWS_WIDE)


# ------------------------------------------------------------------------------------------ split only
def test_persistent_refused_when_coop_applies(monkeypatch, device, emulated):
    p = plan.moe_plan(device, 64, 2, 2, 128, 128, True)
    assert p.coop
    never = lambda: pytest.fail("no co-residency is measured for a coop plan")  # noqa: E731
    for requested in ("auto", "persistent"):
        d = decide(device, p, requested, 2, 128, 128, True, never)
        assert d.mode == "split" and "cooperative matrices" in d.reason, d
    gate, up, down = random_moe_layer(128, 128, 2, seed=2)
    ids, w = _routing(64, 2, 2, seed=3)
    x = np.random.default_rng(4).standard_normal((64, 128)).astype(np.float16)
    with vkmoe.Exl3MoeMlp(device, gate, up, down) as moe:
        y = moe(x, ids, w, dispatch="persistent")
        run = moe.last_run
        assert run["mode"] == "split" and "cooperative matrices" in run["fallback_reason"], run
        assert rel_rms(y, reference.moe_forward(x, ids, w, gate, up, down)) < TOL
        hb, ib, wb, ob = moe._io_for(64, 2)
        with vkmoe.CommandRecorder(device) as cmd, pytest.raises(ValueError, match="cooperative matrices"):
            moe.record(cmd, hb, ib, wb, ob, 64, 2, mode="persistent")


# ------------------------------------------------------------------------------------------ partial rows
def test_partial_tiles_do_not_overlap():
    """The chunk tables the routing writes (chunks of <= COOP_MOE_ROWS rows per expert, sorted rows contiguous) with the
    partial row of chunk c at p0 + COOP_MOE_ROW_SLACK * c (partial_row0 in moe_stages.glsl): the whole m-tiles the
    matrix unit stores never reach the next chunk's rows nor past layout.moe_partial_rows."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        E, top_k, m = int(rng.integers(1, 20)), int(rng.integers(1, 4)), int(rng.integers(1, 300))
        counts = np.bincount(rng.integers(0, E, m * top_k), minlength=E)
        rows = layout.COOP_MOE_ROWS
        p = plan.MoePlan(m, top_k, rows, min(E, m * top_k) + -(-m * top_k // rows), 1, 4, 1, 4, True)
        chunks, p0 = [], 0
        for n in counts:
            for first in range(0, n, rows):
                chunks.append((p0 + first, min(rows, n - first)))
            p0 += n
        assert len(chunks) <= p.max_chunks
        end = 0
        for c, (first, nr) in enumerate(chunks):
            q0 = first + layout.COOP_MOE_ROW_SLACK * c
            assert q0 >= end
            end = q0 + -(-nr // layout.TILE) * layout.TILE
        assert end <= layout.moe_partial_rows(p)
        sizes = layout.scratch_bytes(p, 128, 128)
        assert sizes["partial_split"] == 4 * layout.moe_partial_rows(p) * 128 * 2
