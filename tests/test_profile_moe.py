"""tools/profile_moe: the split path's phases are named by what the plan puts in each dispatch (the activation
moves to the down dispatch with stage3_in_down; direct mode has no routing pass), and the tool runs end to end."""
import json
import os
import re
import runpy
import subprocess
import sys
from types import SimpleNamespace

import pytest

from subproc import REPO, python_env

TOOL = os.path.join(REPO, "tools", "profile_moe")


@pytest.mark.parametrize("direct, in_down, token_sum, expected", [
    (True, True, False, ["gate/up GEMM with its own stage 1", "activation + down GEMM + output"]),
    (True, False, False, ["gate/up GEMM with its own stage 1 + activation", "down GEMM + output"]),
    (False, True, False, ["route + stage 1 (gather + had_in)", "gate/up GEMM", "activation + down GEMM + output"]),
    (False, False, False, ["route + stage 1 (gather + had_in)", "gate/up GEMM + activation", "down GEMM + output"]),
    (False, False, True, ["route + stage 1 (gather + had_in)", "gate/up GEMM + activation", "down GEMM + output",
                          "token sums"]),
])
def test_phase_names_follow_the_plan(direct, in_down, token_sum, expected):
    plan = SimpleNamespace(direct=direct, stage3_in_down=in_down, token_sum_pass=token_sum)
    assert runpy.run_path(TOOL, run_name="profile_moe")["phase_names"](plan) == expected


def test_the_tool_names_and_times_each_phase_of_the_plan_it_ran(tmp_path):
    path = tmp_path / "profile.json"
    out = subprocess.run([sys.executable, TOOL, "--shape", "small", "--m", "1,16", "--iters", "2", "--json", str(path)],
                         cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "split total" in line]
    assert len(lines) == 2, out.stdout
    for line in lines:
        total = float(re.search(r"split total\s+([\d.]+) us", line).group(1))
        phases = [float(v) for v in re.findall(r" ([\d.]+)(?= \||$)", line.split(" us | ", 1)[1])]
        # 2 (direct mode) to 4 (the token-sum pass: GPU plans from m = 8); which ones: the JSON check below
        assert 2 <= len(phases) <= 4 and all(v > 0 for v in phases), line
        assert total > 0 and abs(sum(phases) - total) <= 0.1 * total, line
        assert ("activation" in line) and line.count("activation") == 1, line
    # --json: the figures printed, with the fields every docs/bench file keeps
    doc = json.loads(path.read_text())
    assert doc["tool"] == "profile_moe" and doc["device"]["name"] and doc["shape"]["name"] == "small" and doc["time"]
    assert doc["io"] == "device"  # bench_moe's placement, unless --io call
    assert [r["m"] for r in doc["results"]] == [1, 16] and all(r["mode"] == "split" for r in doc["results"])
    for line, r in zip(lines, doc["results"]):
        assert f"{r['median_us']:8.1f}" in line and r["plan"]["m"] == r["m"], (line, r)
        assert list(r["phases_median_us"]) == \
            runpy.run_path(TOOL, run_name="profile_moe")["phase_names"](SimpleNamespace(**r["plan"]))
        assert line.count(" | ") == len(r["phases_median_us"]), (line, r)  # the line prints every phase
        # the persistent kernel's total on the same buffers, or why it did not run (never both, never neither)
        p = r["persistent"]
        assert (p["median_us"] is None) != (p["reason"] is None), p
        assert p["median_us"] is None or (p["median_us"] > 0 and "persistent total" in out.stdout), p


def test_io_call_profiles_with_the_call_paths_buffers(tmp_path):
    """--io call: the numpy call path's buffers (the output in host memory), recorded in the JSON."""
    path = tmp_path / "profile.json"
    out = subprocess.run([sys.executable, TOOL, "--shape", "small", "--m", "1", "--iters", "1", "--io", "call",
                          "--json", str(path)], cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    doc = json.loads(path.read_text())
    assert doc["io"] == "call" and [r["m"] for r in doc["results"]] == [1] and doc["results"][0]["median_us"] > 0


def test_co_resident_says_why_an_fma_batch_is_not_counted(tmp_path):
    """--co-resident counts the coop stages' workgroups (lavapipe has no cooperative matrices: tests/test_moe_coop.py
    tests the count through the emulate builds); an FMA batch gets the reason, printed and in the JSON."""
    path = tmp_path / "profile.json"
    out = subprocess.run([sys.executable, TOOL, "--shape", "small", "--m", "1", "--iters", "1", "--co-resident",
                          "--json", str(path)], cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "co-resident workgroups: not counted: m=1 runs the FMA stages" in out.stdout, out.stdout
    (r,) = json.loads(path.read_text())["results"]
    assert "FMA stages" in r["co_resident"]["reason"]
