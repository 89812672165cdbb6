"""sched decides, ops run: decide() returns a Decision and nothing else; Exl3MoeMlp runs one path object per
mode, checks it after submission, re-runs split after an abort and reports every outcome in one shape."""
import json
import os

import numpy as np
import pytest

import vkmoe
from goldens import golden_files, load_layer, rel_rms
from vkmoe import layout
from vkmoe.ops import moe as moe_module
from vkmoe.sched import plan as sched_plan
from vkmoe.sched import residency

TINY = next(p for p in golden_files() if os.path.basename(p).startswith("a_tiny"))
GOLDEN_TOL = 3e-3


@pytest.fixture(scope="module")
def tiny(device):
    L = load_layer(TINY)
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation=L.activation) as moe:
        yield L, moe


def _inputs(L):
    c = L.calls[0]
    return (np.ascontiguousarray(c["x"]), np.ascontiguousarray(c["selected"], np.int32),
            np.ascontiguousarray(c["weights"], np.float32), c["ref_out"])


def test_decide_returns_only_a_decision(tiny):
    L, moe = tiny
    x, ids, w, _ = _inputs(L)
    plan = moe._scratch_for(*ids.shape).plan
    split = sched_plan.decide(moe.device, plan, "split", moe.E, moe.H, moe.I, moe.gated)
    assert split == sched_plan.Decision("split", None, "split requested")
    forced = sched_plan.decide(moe.device, plan, "persistent", moe.E, moe.H, moe.I, moe.gated)
    assert forced.mode in ("split", "persistent") and isinstance(forced.plan, sched_plan.PersistentPlan)
    assert forced.reason.startswith("persistent requested")


def test_run_split_and_run_persistent_return_the_same_shape(tiny):
    L, moe = tiny
    x, ids, w, ref = _inputs(L)
    m, top_k = ids.shape
    pplan = sched_plan.persistent_plan(moe.device, moe._scratch_for(m, top_k).plan, moe.E, moe.H, moe.I, moe.gated)
    if not pplan.allowed:
        pytest.skip(pplan.reason)
    split = moe.run_split(x, ids, w, m, top_k)
    persistent = moe.run_persistent(x, ids, w, m, top_k, pplan)
    for result in (split, persistent):
        assert isinstance(result, moe_module.RunResult) and result.abort_code == 0
        assert result.gpu_ms > 0 and rel_rms(result.out, ref) < GOLDEN_TOL
    assert np.array_equal(split.out.view(np.uint32), persistent.out.view(np.uint32))


def test_last_run_has_one_shape(tiny):
    L, moe = tiny
    x, ids, w, _ = _inputs(L)
    shapes = []
    for dispatch in ("split", "persistent"):
        moe(x, ids, w, dispatch=dispatch)
        shapes.append(set(moe.last_run))
    moe(x[:0], ids[:0], w[:0], dispatch="split")
    assert moe.last_run["mode"] == "none"
    shapes.append(set(moe.last_run))
    assert shapes[0] == shapes[1] == shapes[2]


def test_an_aborted_launch_reruns_split(tiny, monkeypatch):
    """The post-submission check, not sched, sees the abort: ops resets the sync area and re-runs split."""
    L, moe = tiny
    x, ids, w, ref = _inputs(L)
    pplan = sched_plan.persistent_plan(moe.device, moe._scratch_for(*ids.shape).plan, moe.E, moe.H, moe.I,
                                       moe.gated)
    if not pplan.allowed:
        pytest.skip(pplan.reason)
    resets = []
    monkeypatch.setattr(moe_module._PersistentPath, "check", lambda self, scratch: layout.ABORT_BARRIER)
    monkeypatch.setattr(moe_module._Scratch, "reset_sync", lambda self: resets.append(self.plan.m))
    out = moe(x, ids, w, dispatch="persistent")
    run = moe.last_run
    assert run["mode"] == "split" and run["requested"] == "persistent" and run["workgroups"] is None
    assert layout.ABORT_REASONS[layout.ABORT_BARRIER] in run["fallback_reason"]
    assert resets == [ids.shape[0]]
    assert rel_rms(out, ref) < GOLDEN_TOL


# ---------------------------------------------------------------- the call plans: kept, and planned again on a change
def _mode_of(moe, L, **kwargs):
    """(mode, requested) of one call, after checking its output."""
    x, ids, w, ref = _inputs(L)
    assert rel_rms(moe(x, ids, w, **kwargs), ref) < GOLDEN_TOL
    return moe.last_run["mode"], moe.last_run["requested"]


def test_a_planned_call_sees_what_changes_its_decision(tiny, tmp_path, monkeypatch):
    """A call's plan is kept per (shape, dispatch argument), and the next call of the same shape still runs in
    the mode decided now: after a change of VKMOE_DISPATCH, of a knob the decision reads (VKMOE_PERSISTENT_MAX_M),
    of the residency cache's measurements (this process's store at once, another process's within
    STAT_INTERVAL_S), and a bad VKMOE_DISPATCH still raises."""
    L, moe = tiny
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path))  # no measured crossover: auto keeps to split
    for name in ("VKMOE_DISPATCH", "VKMOE_PERSISTENT_MAX_M", "VKMOE_PERSISTENT_GRID"):
        monkeypatch.delenv(name, raising=False)
    m = L.calls[0]["selected"].shape[0]
    plan = moe._scratch_for(*L.calls[0]["selected"].shape).plan
    pplan = sched_plan.persistent_plan(moe.device, plan, moe.E, moe.H, moe.I, moe.gated, moe.co_resident(plan))
    if not pplan.trusted:
        pytest.skip(pplan.reason)
    assert _mode_of(moe, L) == ("split", "auto")
    monkeypatch.setenv("VKMOE_DISPATCH", "persistent")
    assert _mode_of(moe, L) == ("persistent", "persistent")
    monkeypatch.setenv("VKMOE_DISPATCH", "split")
    assert _mode_of(moe, L) == ("split", "split")
    assert _mode_of(moe, L, dispatch="persistent") == ("persistent", "persistent")  # the argument wins
    monkeypatch.setenv("VKMOE_DISPATCH", "auto")
    monkeypatch.setenv("VKMOE_PERSISTENT_MAX_M", str(m))
    assert _mode_of(moe, L) == ("persistent", "auto")
    monkeypatch.setenv("VKMOE_PERSISTENT_MAX_M", str(m - 1))
    assert _mode_of(moe, L) == ("split", "auto")
    monkeypatch.delenv("VKMOE_PERSISTENT_MAX_M")
    assert _mode_of(moe, L) == ("split", "auto")
    residency.store_crossover(moe.device, "tiny", m, "test")  # this process's store: seen at once
    assert _mode_of(moe, L) == ("persistent", "auto")
    monkeypatch.setattr(residency, "STAT_INTERVAL_S", 0.0)  # another process's store, once the interval passed
    path = residency.cache_path()
    with open(path) as f:
        data = json.load(f)
    data[residency.device_key(moe.device)][residency.CROSSOVER_KEY]["shapes"]["tiny"]["max_m"] = m - 1
    with open(path + ".new", "w") as f:
        json.dump(data, f)
    os.replace(path + ".new", path)
    assert _mode_of(moe, L) == ("split", "auto")
    monkeypatch.setenv("VKMOE_DISPATCH", "sometimes")
    with pytest.raises(ValueError, match="VKMOE_DISPATCH"):
        _mode_of(moe, L)


def test_an_evicted_shape_takes_its_plans_along(tiny, monkeypatch):
    """With room for one shape, a call of another shape evicts the first with its plans, and the first shape's
    next call plans and records again (right output)."""
    L, moe = tiny
    monkeypatch.setenv("VKMOE_SHAPE_CACHE", "1")
    x, ids, w, ref = _inputs(L)
    for rows in (len(ids), 1, len(ids)):
        assert rel_rms(moe(x[:rows], ids[:rows], w[:rows], dispatch="split"), ref[:rows]) < GOLDEN_TOL
        assert {key[:2] for key in moe._plans} == {(rows, ids.shape[1])}
