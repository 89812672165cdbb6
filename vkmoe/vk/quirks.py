"""Driver quirks found by measurement, cached per (driver, device) in the vkmoe cache directory."""
import json
import os
import threading

import numpy as np

_lock = threading.Lock()
PROBE_ITERATIONS = 200_000  # well past lavapipe 22.3's 65,535 cap, cheap everywhere


def cache_dir():
    path = os.environ.get("VKMOE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "vkmoe")
    os.makedirs(path, exist_ok=True)
    return path


def _cache_path():
    return os.path.join(cache_dir(), "quirks.json")


def _load():
    try:
        with open(_cache_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _store(entries):
    tmp = _cache_path() + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(tmp, _cache_path())


def measure_loop_iteration_cap(device):
    """Run one invocation through a loop of PROBE_ITERATIONS; return the iteration count where the driver
    stopped it, or None when the loop ran to the end."""
    from .commands import CommandRecorder
    from .pipeline import Pipeline, PushConstants

    class LoopProbePush(PushConstants):
        fields = [("iterations", "<u4")]

    pipe = Pipeline(device, "loop_probe", push=LoopProbePush)
    buf = device.memory.allocate(4 * 1026)
    try:
        init = np.full(1026, 0xFFFFFFFF, dtype=np.uint32)
        init[1024:] = 0
        buf.upload(init)
        dset = pipe.bind(buf)
        with CommandRecorder(device) as rec:
            rec.begin()
            rec.dispatch(pipe, dset, 1, pipe.push(iterations=PROBE_ITERATIONS))
            rec.end()
            rec.submit(wait=True, timeout=60)
        ran = int(buf.download(np.uint32)[1024])
        return None if ran >= PROBE_ITERATIONS else ran
    finally:
        buf.close()
        pipe.close()


def measure_f16_fma_fused(device):
    """True when the driver's fp16 fma(1024 + B, c1, c0) rounds once for every mul1 byte sum B, i.e. the packed
    fp16 mul1 decode gives the CUDA arm's exact bits; None when the device has no fp16 arithmetic."""
    if not device.features.get("shaderFloat16"):
        return None
    from .commands import CommandRecorder
    from .pipeline import Pipeline

    pipe = Pipeline(device, "f16_fma_probe")
    buf = device.memory.allocate(4 * 1024)
    try:
        buf.upload(np.zeros(1024, np.uint32))
        with CommandRecorder(device) as rec:
            rec.begin()
            rec.dispatch(pipe, pipe.bind(buf), 16)
            rec.end()
            rec.submit(wait=True, timeout=60)
        got = buf.download(np.uint32)[:1021].astype(np.uint16)
    finally:
        buf.close()
        pipe.close()
    exact = ((1024 + np.arange(1021)) * 1774 - 2721792).astype(np.float64) * 2.0 ** -18  # (1024+B)*c1 + c0
    return bool(np.array_equal(got, exact.astype(np.float16).view(np.uint16)))


def measure_subgroups_linear(device):
    """True when a 256-invocation workgroup's subgroups are laid out linearly over its invocations."""
    from .commands import CommandRecorder
    from .pipeline import Pipeline

    pipe = Pipeline(device, "subgroup_layout_probe")
    buf = device.memory.allocate(4 * 256)
    try:
        buf.upload(np.zeros(256, np.uint32))
        with CommandRecorder(device) as rec:
            rec.begin()
            rec.dispatch(pipe, pipe.bind(buf), 1)
            rec.end()
            rec.submit(wait=True, timeout=60)
        return bool(buf.download(np.uint32).all())
    finally:
        buf.close()
        pipe.close()


def detect_quirks(device, refresh=False):
    key = device.identity
    with _lock:
        entries = _load()
        if not refresh and key in entries and "subgroups_linear" in entries[key]:
            return entries[key]
    quirks = {"loop_iteration_cap": measure_loop_iteration_cap(device),
              "f16_fma_fused": measure_f16_fma_fused(device),
              "subgroups_linear": measure_subgroups_linear(device)}
    with _lock:
        entries = _load()
        entries[key] = quirks
        _store(entries)
    return quirks
