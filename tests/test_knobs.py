"""VKMOE_* variables: one parser (vkmoe/knobs.py), read at call time, bad values name the variable, and one
README table documents exactly them."""
import glob
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from goldens import golden_files, load_layer, rel_rms
from vkmoe import knobs
from vkmoe.sched import plan as sched_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_PACKAGE = set(knobs.OUTSIDE_PACKAGE)


def test_every_package_read_goes_through_knobs():
    offenders = []
    for path in glob.glob(os.path.join(REPO, "vkmoe", "**", "*.py"), recursive=True):
        if os.path.basename(path) == "knobs.py":
            continue
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if re.search(r"environ[^\n]*VKMOE_|getenv\([^)]*VKMOE_", line):
                    offenders.append(f"{os.path.relpath(path, REPO)}:{n}: {line.strip()}")
    assert not offenders, "read VKMOE_* through vkmoe.knobs:\n" + "\n".join(offenders)


def test_readme_table_lists_exactly_the_knobs():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    first_column = [line.split("|")[1] for line in section.splitlines() if line.startswith("|")]
    documented = set(re.findall(r"`(VKMOE_\w+)`", "\n".join(first_column)))
    assert documented - NOT_PACKAGE == set(knobs.KNOBS)
    assert text.count("## Environment variables") == 1


@pytest.mark.parametrize("name, text", [
    ("VKMOE_TIMEOUT", "abc"), ("VKMOE_TIMEOUT", "-1"), ("VKMOE_TIMEOUT", "0"), ("VKMOE_TIMEOUT", "inf"),
    ("VKMOE_GEMM_WG_PER_CU", "0"), ("VKMOE_GEMM_WG_PER_CU", "four"), ("VKMOE_PERSISTENT_GRID", "abc"),
    ("VKMOE_PERSISTENT_GRID", "-3"), ("VKMOE_PERSISTENT_MAX_M", "-1"), ("VKMOE_PERSISTENT_MAX_M", "1.5"),
    ("VKMOE_MOE_ROWS", "3"), ("VKMOE_MOE_ROWS", "x"), ("VKMOE_DECODE", "fp8"), ("VKMOE_DISPATCH", "fast"),
    ("VKMOE_VALIDATION", "maybe"), ("VKMOE_PERSISTENT_WG_PER_CU", "0"), ("VKMOE_MOE_SPLITS", "4"),
    ("VKMOE_MOE_SPLITS", "4,0"), ("VKMOE_MOE_SPLITS", "a,b"), ("VKMOE_MOE_SPLITS", "1,2,3"),
])
def test_bad_value_names_the_variable(monkeypatch, name, text):
    monkeypatch.setenv(name, text)
    with pytest.raises(knobs.KnobError, match=re.escape(f"{name}={text!r}: expected")):
        knobs.get(name)


@pytest.mark.parametrize("name, text, value", [
    ("VKMOE_TIMEOUT", "2.5", 2.5), ("VKMOE_TIMEOUT", "", 60.0), ("VKMOE_GEMM_WG_PER_CU", " 8 ", 8),
    ("VKMOE_MOE_ROWS", "16", 16), ("VKMOE_MOE_ROWS", "", None), ("VKMOE_DISPATCH", "Split", "split"),
    ("VKMOE_VALIDATION", "no", False), ("VKMOE_VALIDATION", "1", True), ("VKMOE_PERSISTENT_MAX_M", "0", 0),
    ("VKMOE_MOE_SPLITS", "4, 3", (4, 3)), ("VKMOE_MOE_SPLITS", "", None),
])
def test_good_values(monkeypatch, name, text, value):
    monkeypatch.setenv(name, text)
    assert knobs.get(name) == value


def test_moe_splits_knob_sets_the_plan(monkeypatch):
    """VKMOE_MOE_SPLITS forces the k-splits (within the plan's bounds: at least 4 k-tiles per split)."""
    from vkmoe.ops.plan import moe_plan

    dev = SimpleNamespace(compute_units=132, quirks={"loop_iteration_cap": None}, features={})  # no coop
    monkeypatch.setenv("VKMOE_MOE_SPLITS", "4,3")
    p = moe_plan(dev, 1, 8, 128, 2048, 768, True)
    assert (p.splits_gu, p.kt_gu, p.splits_d, p.kt_d) == (4, 32, 3, 16)
    monkeypatch.setenv("VKMOE_MOE_SPLITS", "100,100")  # capped: 128 and 48 k-tiles, >= 4 per split
    p = moe_plan(dev, 1, 8, 128, 2048, 768, True)
    assert (p.splits_gu, p.splits_d) == (32, 12)


def test_read_at_call_time_not_at_import():
    """A bad VKMOE_TIMEOUT does not break `import vkmoe`; the wait that needs it raises, naming it."""
    code = ("import vkmoe, vkmoe.vk.commands\n"
            "from vkmoe import knobs\n"
            "try:\n    knobs.get('VKMOE_TIMEOUT')\nexcept knobs.KnobError as e:\n    print('raised:', e)\n")
    env = dict(os.environ, VKMOE_TIMEOUT="abc")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "raised: VKMOE_TIMEOUT='abc': expected a positive number of seconds" in out.stdout


def test_wait_rejects_a_bad_timeout(device, monkeypatch):
    from vkmoe.vk import CommandRecorder

    with CommandRecorder(device) as rec:
        rec.begin()
        rec.end()
        rec.spin_s = 0  # (a GPU's wait spins first, and an empty buffer ends within the spin: the knob went unread)
        monkeypatch.setenv("VKMOE_TIMEOUT", "-1")
        with pytest.raises(knobs.KnobError, match="VKMOE_TIMEOUT"):
            rec.submit(wait=True)
        rec.wait(timeout=30)  # the submission itself went through; an explicit timeout needs no knob


def test_split_reads_no_persistent_knob(monkeypatch):
    """A broken VKMOE_PERSISTENT_GRID must not break dispatch="split"; a persistent request names the variable."""
    monkeypatch.setenv("VKMOE_PERSISTENT_GRID", "abc")
    plan = SimpleNamespace(m=1, top_k=1, R=1, max_chunks=2, splits_gu=1, kt_gu=1, splits_d=1, kt_d=1)
    decision = sched_plan.decide(object(), plan, "split", 8, 256, 128, True)
    assert (decision.mode, decision.plan) == ("split", None)
    with pytest.raises(knobs.KnobError, match="VKMOE_PERSISTENT_GRID"):
        sched_plan.decide(object(), plan, "persistent", 8, 256, 128, True)


def test_split_runs_with_a_broken_persistent_grid(device, monkeypatch):
    import vkmoe

    L = load_layer(next(p for p in golden_files() if os.path.basename(p).startswith("a_tiny")))
    call = L.calls[0]
    monkeypatch.setenv("VKMOE_PERSISTENT_GRID", "abc")
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation=L.activation, dispatch="split") as moe:
        out = moe(call["x"], call["selected"], call["weights"])
        assert moe.last_run["mode"] == "split" and moe.last_run["persistent_plan"] is None
        assert np.isfinite(out).all() and rel_rms(out, call["ref_out"]) < 3e-3
        with pytest.raises(knobs.KnobError, match="VKMOE_PERSISTENT_GRID"):
            moe(call["x"], call["selected"], call["weights"], dispatch="persistent")


def test_set_unset_and_replaced_environments_are_read(monkeypatch):
    """knobs.get reads os.environ's own dict (cheap for unset variables): every change must still be seen."""
    monkeypatch.delenv("VKMOE_TIMEOUT", raising=False)
    assert knobs.get("VKMOE_TIMEOUT") == 60.0
    monkeypatch.setenv("VKMOE_TIMEOUT", "2")
    assert knobs.get("VKMOE_TIMEOUT") == 2.0
    monkeypatch.delenv("VKMOE_TIMEOUT")
    assert knobs.get("VKMOE_TIMEOUT") == 60.0
    monkeypatch.setattr(os, "environ", {"VKMOE_TIMEOUT": "3"})  # not CPython's mapping: its get() is used
    assert knobs.get("VKMOE_TIMEOUT") == 3.0


def test_moe_rows_knob_offers_exactly_the_plans_row_counts(monkeypatch):
    """VKMOE_MOE_ROWS's choices (a literal: knobs is a leaf module) are the row counts ops.plan.rows_for picks, the
    largest being layout.MOE_ROWS_MAX, which sizes the FMA stages' per-row shared arrays."""
    from vkmoe import layout
    from vkmoe.ops import plan
    planned = {plan.rows_for(m) for m in range(1, 4 * layout.MOE_ROWS_MAX)}
    accepted = set()
    for rows in range(2 * layout.MOE_ROWS_MAX + 1):
        monkeypatch.setenv("VKMOE_MOE_ROWS", str(rows))
        try:
            accepted.add(knobs.get("VKMOE_MOE_ROWS"))
        except knobs.KnobError:
            pass
    assert accepted == planned
    assert max(accepted) == layout.MOE_ROWS_MAX


def test_a_device_warns_about_unknown_and_bad_variables(monkeypatch):
    """A misspelt VKMOE_DISPATH was ignored without a word, and VKMOE_NATIVE_CALL=2 let a layer's first call run and
    failed its second (the first to read it). Device() now warns about both, once per name and value; a bad value
    still raises only where it is read (a bad persistent knob must never stop a split call)."""
    import warnings

    monkeypatch.setattr(knobs, "_warned", set())
    monkeypatch.setenv("VKMOE_DISPATH", "split")
    monkeypatch.setenv("VKMOE_NATIVE_CALL", "2")
    monkeypatch.setenv("VKMOE_GOLDEN_DIR", os.environ.get("VKMOE_GOLDEN_DIR", "tests/data/golden"))
    with pytest.warns(knobs.KnobWarning) as seen:
        knobs.warn_about_environment()
    messages = sorted(str(w.message) for w in seen)
    assert len(messages) == 2, messages
    assert "VKMOE_DISPATH is not a vkmoe variable (did you mean VKMOE_DISPATCH?)" in messages[0]
    assert "VKMOE_NATIVE_CALL='2': expected 1/0" in messages[1] and "will raise KnobError" in messages[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        knobs.warn_about_environment()  # (once per name and value)
    import vkmoe
    monkeypatch.setenv("VKMOE_MOE_ROWS", "3")
    with pytest.warns(knobs.KnobWarning, match="VKMOE_MOE_ROWS='3'"):
        vkmoe.Device().close()
    with pytest.raises(knobs.KnobError, match="VKMOE_MOE_ROWS"):
        knobs.get("VKMOE_MOE_ROWS")
