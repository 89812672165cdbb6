"""Driver quirks found by measurement, cached per (driver, device) in the vkmoe cache directory."""
import json
import os
import threading

import numpy as np

_lock = threading.Lock()
PROBE_ITERATIONS = 200_000  # well past lavapipe 22.3's 65,535 cap, cheap everywhere


def cache_dir():
    """VKMOE_CACHE_DIR, else the platform's user cache directory from platformdirs ($XDG_CACHE_HOME/vkmoe or
    ~/.cache/vkmoe on Linux, ~/Library/Caches/vkmoe on macOS, %LOCALAPPDATA%\\vkmoe\\Cache on Windows)."""
    import platformdirs

    path = os.environ.get("VKMOE_CACHE_DIR") or platformdirs.user_cache_dir("vkmoe", appauthor=False)
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


def _run_probe_shader(device, shader, words, groups, push=None):
    """Run a one-buffer probe shader over `words` (uint32, uploaded first) and return the buffer afterwards."""
    from .commands import CommandRecorder
    from .pipeline import Pipeline

    pipe = Pipeline(device, shader, push=type(push) if push is not None else None)
    buf = device.memory.allocate(4 * len(words))
    try:
        buf.upload(np.asarray(words, dtype=np.uint32))
        with CommandRecorder(device) as rec:
            rec.begin()
            rec.dispatch(pipe, pipe.bind(buf), groups, push)
            rec.end()
            rec.submit(wait=True, timeout=60)
        return buf.download(np.uint32)
    finally:
        buf.close()
        pipe.close()


def measure_loop_iteration_cap(device):
    """Run one invocation through a loop of PROBE_ITERATIONS; return the iteration count where the driver
    stopped it, or None when the loop ran to the end."""
    from .pipeline import PushConstants

    class LoopProbePush(PushConstants):
        fields = [("iterations", "<u4")]

    init = np.full(1026, 0xFFFFFFFF, dtype=np.uint32)  # 1024 words the exit test reads, then the result
    init[1024:] = 0
    ran = int(_run_probe_shader(device, "loop_probe", init, 1, LoopProbePush(iterations=PROBE_ITERATIONS))[1024])
    return None if ran >= PROBE_ITERATIONS else ran


def measure_f16_fma_fused(device):
    """True when the driver's fp16 fma(1024 + B, c1, c0) rounds once for every mul1 byte sum B, i.e. the packed
    fp16 mul1 decode gives the CUDA arm's exact bits; None when the device has no fp16 arithmetic."""
    if not device.features.get("shaderFloat16"):
        return None
    got = _run_probe_shader(device, "f16_fma_probe", np.zeros(1024, np.uint32), 16)[:1021].astype(np.uint16)
    exact = ((1024 + np.arange(1021)) * 1774 - 2721792).astype(np.float64) * 2.0 ** -18  # (1024+B)*c1 + c0
    return bool(np.array_equal(got, exact.astype(np.float16).view(np.uint16)))


def measure_subgroups_linear(device):
    """True when a 256-invocation workgroup's subgroups are laid out linearly over its invocations."""
    return bool(_run_probe_shader(device, "subgroup_layout_probe", np.zeros(256, np.uint32), 1).all())


MEASUREMENTS = {"loop_iteration_cap": measure_loop_iteration_cap, "f16_fma_fused": measure_f16_fma_fused,
                "subgroups_linear": measure_subgroups_linear}


def detect_quirks(device, refresh=False):
    key = device.identity
    with _lock:
        entries = _load()
        # an entry written before a quirk existed is measured again
        if not refresh and key in entries and set(MEASUREMENTS) <= set(entries[key]):
            return entries[key]
    quirks = {name: measure(device) for name, measure in MEASUREMENTS.items()}
    with _lock:
        entries = _load()
        entries[key] = quirks
        _store(entries)
    return quirks
