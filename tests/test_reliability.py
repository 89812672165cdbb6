"""Regression tests for the faults found by using vkmoe as a hostile user would (issue 13): loop-cap safe
zero rows, a closed device, broken or unwritable caches, arrays shared with the caller, leaks, and validation
gaps. Each test compares real outputs (poisoned first) with the float64 reference or exact zeros."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import vkmoe
from vkmoe.exl3 import reference
from goldens import golden_files, load_layer, rel_rms

TOL = 3e-3
TINY = next(p for p in golden_files() if p.endswith("a_tiny_silu_k4.npz"))  # H 256, I 128, E 8, mul1 K4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_layer():
    return load_layer(TINY)


# ------------------------------------------------------------------------------ 1: zero rows vs the loop cap
def test_unrouted_tokens_get_zero_rows_past_the_loop_cap(device, tiny_layer):
    """m * H / 256 = 70,000 > 65,536: the old single-workgroup zero sweep stopped early on Mesa 22.3 and left
    NaN poison in thousands of rows. Only token 0 is routed; every other row must be exactly 0, token 0's row
    must match the reference, and split and persistent must agree bit for bit."""
    L = tiny_layer
    m, H = 70_000, L.hidden_size
    rng = np.random.default_rng(1)
    x = rng.standard_normal((m, H)).astype(np.float16)
    expert_count = np.zeros(L.num_experts, np.int64)
    expert_count[3] = 1
    token_sorted, weight_sorted = np.array([0]), np.array([0.75], np.float32)
    outs = {}
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation="silu") as moe:
        for mode in ("split", "persistent"):
            y = moe.forward_sorted(x, expert_count, token_sorted, weight_sorted, dispatch=mode)
            assert y.shape == (m, H)
            nan_rows = int(np.isnan(y).any(axis=1).sum())
            assert nan_rows == 0, f"{mode}: {nan_rows} rows kept the NaN poison"
            assert not y[1:].any(), f"{mode}: unrouted rows are not zero"
            outs[mode] = y
    ref = reference.moe_forward(x[:1], np.array([[3]]), np.array([[0.75]]), L.gate, L.up, L.down,
                                activation="silu")
    assert rel_rms(outs["split"][:1], ref) < TOL
    assert np.array_equal(outs["split"], outs["persistent"])


# ------------------------------------------------------------------------------------ 2: a closed device
def _run_script(body, env=None, timeout=240):
    """Run `body` in a fresh interpreter (a crash must not take the test run with it); returns the result."""
    script = textwrap.dedent("""
        import sys, threading
        import numpy as np
        sys.path.insert(0, {tests!r})
        import vkmoe
        from goldens import load_layer
        L = load_layer({tiny!r})
    """).format(tests=os.path.join(REPO, "tests"), tiny=TINY) + textwrap.dedent(body)
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=REPO)


def _assert_closed_error(result):
    assert result.returncode == 0, f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr[-3000:]}"
    assert "OK" in result.stdout, result.stdout
    assert "validation:" not in result.stderr, result.stderr[-3000:]


CLOSED_CASES = {
    "layer called after close": """
        dev = vkmoe.Device()
        moe = vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, dispatch="split")
        c = L.calls[0]
        moe(c["x"], c["selected"], c["weights"])
        dev.close()
        try:
            moe(c["x"], c["selected"], c["weights"])
        except vkmoe.VkmoeError as exc:
            assert "is closed" in str(exc) and "vkmoe.Device" in str(exc), exc
            print("OK", exc)
        moe.close()  # closing the layer afterwards is harmless
    """,
    "op created on a closed device": """
        dev = vkmoe.Device()
        dev.close()
        for make in (lambda: vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down),
                     lambda: vkmoe.Exl3Linear(dev, L.up[0]),
                     lambda: dev.memory.allocate(64),
                     lambda: vkmoe.CommandRecorder(dev)):
            try:
                make()
                raise SystemExit("no error")
            except vkmoe.VkmoeError as exc:
                assert "is closed" in str(exc), exc
        print("OK")
    """,
    "close while another thread runs forwards": """
        dev = vkmoe.Device()
        moe = vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, dispatch="split")
        c = L.calls[0]
        ref = moe(c["x"], c["selected"], c["weights"])
        outcome = {}
        started = threading.Event()
        def worker():
            n = 0
            try:
                while True:
                    y = moe(c["x"], c["selected"], c["weights"])
                    assert np.array_equal(y, ref)
                    n += 1
                    started.set()
            except vkmoe.VkmoeError as exc:
                outcome["error"], outcome["n"] = exc, n
            except BaseException as exc:
                outcome["other"] = exc
            started.set()
        t = threading.Thread(target=worker)
        t.start()
        started.wait(120)
        dev.close()
        t.join(120)
        assert "other" not in outcome, outcome
        assert "is closed" in str(outcome["error"]), outcome
        print("OK", outcome["n"], "forwards before close")
    """,
}


@pytest.mark.parametrize("case", sorted(CLOSED_CASES))
def test_closed_device_raises_instead_of_crashing(case):
    _assert_closed_error(_run_script(CLOSED_CASES[case]))
