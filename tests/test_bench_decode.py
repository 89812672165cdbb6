"""tools/bench_decode on lavapipe (a small shape, a few steps): the report's fields, and with --phases one GPU time
per phase of a block (vkmoe.ops.block: the dispatches between two barriers), in recording order."""
import json
import math
import os
import runpy

import numpy as np

import vkmoe
from vkmoe.vk import CommandRecorder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_decode():
    return runpy.run_path(os.path.join(ROOT, "tools", "bench_decode"), run_name="bench_decode")


def _barriers_of_one_block(dev, tool, m):
    """How many barriers one small-shape block records for m tokens (each closes a phase)."""
    made = tool["make_copies"](dev, tool["SHAPES"]["small"], 1, 1, "split")
    try:
        block = made[0][1]
        x, ob = dev.memory.allocate(m * block.H * 2), dev.memory.allocate(m * block.H * 4)
        x.upload(np.zeros((m, block.H), np.float16))
        count = [0]
        with CommandRecorder(dev) as rec:
            plain = rec.barrier

            def counting():
                plain()
                count[0] += 1

            rec.barrier = counting
            rec.begin()
            sets = block.record_buffers(rec, x, False, None, ob, m)
            rec.end()
        for d in sets:
            d.free()
        x.close()
        ob.close()
        return count[0]
    finally:
        tool["close_copies"](made)


def test_report_and_phases(tmp_path, capsys):
    tool = _bench_decode()
    out = tmp_path / "decode.json"
    assert tool["main"](["--shape", "small", "--layers", "2", "--m", "1", "--iters", "2", "--warmup", "1",
                         "--warmup-seconds", "0", "--phases", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tool"] == "bench_decode" and report["time"] and report["device"]["name"]
    assert report["shape"]["name"] == "small" and report["layers"] == 2
    (r,) = report["results"]
    assert r["m"] == 1 and r["mode"] == "split" and r["median_us"] > 0 and r["gpu_us_per_layer"] > 0
    with vkmoe.Device() as dev:
        phases = _barriers_of_one_block(dev, tool, 1)
    # router + shared up/gate, routed gate/up + shared down, routed down (the fused shared sum at m = 1)
    assert phases >= 3 and len(r["phase_gpu_us"]) == phases, r["phase_gpu_us"]
    assert all(math.isfinite(v) and v >= 0 for v in r["phase_gpu_us"])
    assert "phases (GPU us" in capsys.readouterr().err


def test_no_shared_expert(tmp_path):
    """--no-shared-expert: the small shape's block without its shared expert (the router's phase alone): the
    report says so, and a block has fewer phases (m = 2: no shared activation and sum passes; at m = 1 the block
    fuses them away)."""
    tool = _bench_decode()
    runs = {}
    for flag in ([], ["--no-shared-expert"]):
        out = tmp_path / f"decode{len(flag)}.json"
        assert tool["main"](["--shape", "small", "--layers", "1", "--m", "2", "--iters", "1", "--warmup", "1",
                             "--warmup-seconds", "0", "--phases", "--json", str(out)] + flag) == 0
        runs[bool(flag)] = json.loads(out.read_text())
    assert runs[False]["shape"]["shared_intermediate"] == 256 and runs[True]["shape"]["shared_intermediate"] == 0
    (with_shared,), (without,) = runs[False]["results"], runs[True]["results"]
    assert len(without["phase_gpu_us"]) < len(with_shared["phase_gpu_us"]), (without, with_shared)
