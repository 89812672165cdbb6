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
