"""tools/probe_residency / `python -m vkmoe probe` / vkmoe.probe_residency on whichever lavapipe the environment
selects. On lavapipe the co-resident count is the worker-thread count, which the driver reads from LP_NUM_THREADS
at device creation: hence subprocesses."""
import json
import os
import subprocess
import sys

import pytest

import vkmoe
from vkmoe.sched import residency
from vkmoe.sched.probe import CALIBRATION_LENGTHS, OPEN_WINDOW_MS_CPU, SpinBudget, format_report, probe_residency, spin_ns_per_iter
from subproc import python_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _probe_cli(*args, threads=None, cache_dir=None, timeout=120):
    env = python_env()
    if threads is not None:
        env["LP_NUM_THREADS"] = str(threads)
    if cache_dir is not None:
        env["VKMOE_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "probe_residency"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)



def _is_lavapipe():
    with vkmoe.Device() as d:
        return d.is_lavapipe


@pytest.mark.parametrize("threads", [2, 3])
def test_finds_worker_threads(threads, tmp_path):
    if not _is_lavapipe():
        pytest.skip("the worker-thread count is lavapipe's")
    # Up to three probes until one finds every worker and times no barrier out: with more worker threads than cores
    # and other test processes busy beside it, a worker the OS keeps off the cores can miss a discovery's poll or
    # outlast a barrier's spin (a warm three-process run on this 2-core machine counted 3 barrier timeouts at 3
    # threads).
    for _ in range(3):
        out = _probe_cli("--json", "--no-cache", "--repeats", "3", threads=threads, cache_dir=tmp_path)
        assert out.returncode in (0, 3), out.stderr[-3000:]
        report = json.loads(out.stdout)
        assert report["litmus_violations"] == 0  # (never load: a message seen without its data, on any attempt)
        if (out.returncode == 0 and report["barrier_timeouts"] == 0
                and all(v["co_resident"]["min"] == threads for v in report["variants"])):
            break
    assert report["device"]["compute_units"] == threads
    for v in report["variants"]:
        assert v["co_resident"]["min"] == threads, v["co_resident"]
        assert v["co_resident"]["median"] == threads
    assert report["verdict"]["grid"] == threads
    # Every check ran at that grid: no barrier timeouts, no message-passing violations.
    assert report["barrier_timeouts"] == 0
    assert report["litmus_violations"] == 0
    assert report["verdict"]["persistent"] and out.returncode == 0
    assert not os.listdir(tmp_path) or not os.path.exists(tmp_path / "residency.json")  # --no-cache
    major = int(report["device"]["mesa_version"].split(".")[0])
    cap = report["quirks"]["loop_iteration_cap"]
    if major == 22:
        assert cap is not None and 65000 <= cap <= 66000
    elif major >= 25:
        assert cap is None
    assert "validation_messages" not in report


def test_spin_calibration_survives_a_slowed_run():
    short_n, long_n = CALIBRATION_LENGTHS
    ns = 2000.0  # lavapipe's order of magnitude: 2 us per iteration of a 256-invocation workgroup
    fixed = 0.05  # ms of dispatch cost in each run

    def run(n, stalled_ms=0.0):
        return fixed + n * ns * 1e-6 + stalled_ms

    clean_short, clean_long = run(short_n), run(long_n)
    assert spin_ns_per_iter([clean_short] * 3, [clean_long] * 3) == pytest.approx(ns)
    # One pair's long run stalled: the fastest long run is the clean one.
    assert spin_ns_per_iter([clean_short] * 3, [run(long_n, 30.0), clean_long, clean_long]) == pytest.approx(ns)
    # Every short run slowed to nearly the long one's time (the failure CI met): the difference would say ~0.06 ns
    # per iteration and every spin bound would last 30,000 times longer than meant. The floor keeps the estimate
    # within 2x of the truth, so a spin window lasts at most twice its intended time.
    slowed = [clean_long - 0.00005] * 3
    got = spin_ns_per_iter(slowed, [clean_long] * 3)
    assert ns / 2 <= got <= ns
    budget = SpinBudget(None, got, is_cpu=True)
    assert budget.open_iters * ns * 1e-6 <= 2 * OPEN_WINDOW_MS_CPU  # the CPU driver's window, at most doubled
    # A short run slower than the long one (negative difference) gives the same floor, never a negative cost.
    assert spin_ns_per_iter([clean_long + 1.0] * 3, [clean_long] * 3) == pytest.approx(0.5 * clean_long * 1e6 / long_n)


def test_in_process_report_and_cache(dev, tmp_path, monkeypatch):
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path))
    report = probe_residency(dev, variants=[(256, 16384), (128, 8192)], progress=False, repeats=3)
    assert dev.take_validation_messages() == []
    assert set(report) >= {"device", "variants", "quirks", "barrier_us", "dispatch_us", "litmus_violations", "verdict"}
    assert set(report["verdict"]) == {"persistent", "reason", "grid"}
    assert "loop_iteration_cap" in report["quirks"]
    assert report["barrier_us"] > 0 and report["dispatch_us"] > 0
    for v in report["variants"]:
        assert v["co_resident"]["min"] >= 1 and v["co_resident"]["median"] >= v["co_resident"]["min"]
    if dev.is_lavapipe:
        assert report["verdict"]["persistent"] and report["verdict"]["grid"] == dev.compute_units
        assert report["litmus_violations"] == (0 if dev.compute_units >= 2 else None)
    assert report["cache"] == str(tmp_path / "residency.json")
    entry = residency.lookup(dev, (256, 16384))
    assert entry is not None and entry["grid"] == report["variants"][0]["verdict"]["grid"]
    assert entry["persistent"] == report["variants"][0]["verdict"]["persistent"]
    assert residency.lookup(dev, {"workgroup_size": 128, "shared_bytes": 8192})["co_resident"]["min"] >= 1
    assert residency.lookup(dev, (64, 4096)) is None
    text = format_report(report)
    assert "Verdict: persistent" in text and "co-resident" in text.lower()
    if dev.mesa_version:
        assert f"Mesa {dev.mesa_version}" in text


def test_cache_written_by_cli_and_force_fail(tmp_path, monkeypatch):
    ok = _probe_cli("--json", "--repeats", "2", cache_dir=tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "probe [" in ok.stderr  # the progress bar goes to stderr
    with vkmoe.Device() as d, monkeypatch.context() as env:
        # (monkeypatch, not os.environ: deleting the variable afterwards took the runner's own VKMOE_CACHE_DIR
        # away from every later test, which then read and wrote the user's cache directory)
        env.setenv("VKMOE_CACHE_DIR", str(tmp_path))
        entry = residency.lookup(d, (256, 16384))
    assert entry is not None and entry["persistent"] and entry["grid"] == json.loads(ok.stdout)["verdict"]["grid"]

    before = (tmp_path / "residency.json").read_text()
    failed = _probe_cli("--force-fail", "--repeats", "1", "--quiet", cache_dir=tmp_path)
    assert failed.returncode == 3, failed.stderr[-3000:]
    assert "NOT allowed" in failed.stdout and "--force-fail" in failed.stdout
    assert (tmp_path / "residency.json").read_text() == before  # a forced failure is never cached


def test_error_exit_codes(tmp_path):
    bad = _probe_cli("--device", "no-such-device", "--quiet", cache_dir=tmp_path)
    assert bad.returncode == 2
    assert "no-such-device" in bad.stderr
    assert _probe_cli("--bogus-flag", cache_dir=tmp_path).returncode == 2


def test_info_cli():
    env = python_env()
    text = subprocess.run([sys.executable, "-m", "vkmoe", "info"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    js = subprocess.run([sys.executable, "-m", "vkmoe", "info", "--json"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=60)
    info = json.loads(js.stdout)
    assert info["name"] in text.stdout
    if info["mesa_version"]:
        assert f"Mesa {info['mesa_version']}" in text.stdout
    demo = subprocess.run([sys.executable, "-m", "vkmoe", "demo"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert demo.returncode == 0 and info["name"] in demo.stdout
