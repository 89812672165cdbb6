"""tools/check_goldens' bit-for-bit comparison of two builds (--save-bits, then --same-bits): the same build passes,
an output changed by one bit or missing fails and is named, and bad arguments say what was expected."""
import json
import os
import subprocess
import sys

import numpy as np

from subproc import REPO, python_env

TOOL = os.path.join(REPO, "tools", "check_goldens")


def _run(*args):
    return subprocess.run([sys.executable, TOOL, "--only", "a_tiny", *args], cwd=REPO, env=python_env(),
                          capture_output=True, text=True, timeout=600)


def _same_bits_report(stdout):
    return json.loads(next(line for line in stdout.splitlines() if line.startswith('{"same_bits"')))


def test_same_bits_passes_for_the_same_build_and_names_a_changed_or_missing_output(tmp_path):
    saved = str(tmp_path / "before.npz")
    first = _run("--save-bits", saved)
    assert first.returncode == 0 and first.stdout.rstrip().endswith("PASS"), first.stdout + first.stderr
    with np.load(saved) as f:
        outputs = {key: f[key] for key in f.files}
    # the golden file's calls in both modes, and every linear at every row count
    assert any(key.endswith(":persistent") for key in outputs) and any(key.endswith(":split") for key in outputs)
    assert sum(key.startswith("linear:") for key in outputs) == 16, sorted(outputs)
    assert all(np.isfinite(v).all() and np.abs(v).max() > 0 for v in outputs.values())  # real numbers, not zeros

    again = _run("--same-bits", saved)
    assert again.returncode == 0 and _same_bits_report(again.stdout)["differing"] == [], again.stdout

    split_key = next(key for key in outputs if key.endswith(":split"))
    linear_key = next(key for key in outputs if key.startswith("linear:"))
    changed = dict(outputs)
    flipped = changed[split_key].copy()
    flipped.view(np.uint16).flat[3] ^= 1  # one bit of one value
    changed[split_key] = flipped
    del changed[linear_key]
    np.savez(saved, **changed)
    bad = _run("--same-bits", saved)
    assert bad.returncode == 1 and bad.stdout.rstrip().endswith("FAIL (2 calls or outputs)"), bad.stdout
    assert sorted(_same_bits_report(bad.stdout)["differing"]) == sorted([split_key, linear_key]), bad.stdout


def test_bad_arguments_say_what_was_expected(tmp_path):
    missing = _run("--same-bits", str(tmp_path / "none.npz"))
    assert missing.returncode == 2 and "--same-bits: no file" in missing.stderr and "--save-bits" in missing.stderr
    nothing = subprocess.run([sys.executable, TOOL, "--only", "no_such_layer"], cwd=REPO, env=python_env(),
                             capture_output=True, text=True, timeout=600)
    assert nothing.returncode == 2 and "--only: no golden file's name contains 'no_such_layer'" in nothing.stderr
    both = _run("--save-bits", "a.npz", "--same-bits", "b.npz")
    assert both.returncode == 2 and "not allowed with" in both.stderr
