"""The residency cache: what `probe_residency` measured, per (driver + device, pipeline variant).

The persistent launch plan reads it with `lookup(device, variant)`; `store(device, report)` writes a probe report.
One JSON file, `residency.json`, in vkmoe's cache directory (VKMOE_CACHE_DIR or the user cache dir).

A variant is what changes how many workgroups fit on a compute unit: (workgroup size, shared memory bytes).
The device key is `device.identity` plus the compute-unit count and where it came from, because lavapipe's
co-resident count follows LP_NUM_THREADS, which is read at device creation and is not part of the identity: a
result measured with 3 worker threads must never plan a grid for a process running 2.
"""
import json
import os
import threading
import time

from ..vk.quirks import cache_dir

FILENAME = "residency.json"
FORMAT = 1  # bump when the entry layout changes; entries of another format are ignored
_lock = threading.Lock()


def cache_path():
    return os.path.join(cache_dir(), FILENAME)


def device_key(device):
    return f"{device.identity}|cu={device.compute_units}|{device.compute_units_source}"


def variant_key(variant):
    """'wg256-smem16384' from (256, 16384), {"workgroup_size": 256, "shared_bytes": 16384} or the key itself."""
    if isinstance(variant, str):
        return variant
    if isinstance(variant, dict):
        wg, smem = variant["workgroup_size"], variant["shared_bytes"]
    else:
        wg, smem = variant
    return f"wg{int(wg)}-smem{int(smem)}"


def _load():
    try:
        with open(cache_path()) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save(data):
    path = cache_path()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file, never half of one


def lookup(device, variant):
    """The cached entry for this device and variant (a dict, see `entry_from_report`), or None."""
    with _lock:
        entry = _load().get(device_key(device), {}).get(variant_key(variant))
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return None
    return entry


def entry_from_report(report, variant_report):
    """What the launch plan needs of one variant: its grid and verdict, plus the measurements behind them."""
    verdict = variant_report["verdict"]
    return {
        "format": FORMAT,
        "workgroup_size": variant_report["workgroup_size"],
        "shared_bytes": variant_report["shared_bytes"],
        "co_resident": {k: variant_report["co_resident"][k] for k in ("min", "median", "samples", "launched")},
        "persistent": verdict["persistent"],
        "grid": verdict["grid"],
        "reason": verdict["reason"],
        "barrier_us": variant_report.get("barrier_us"),
        "dispatch_us": report.get("dispatch_us"),
        "litmus_violations": variant_report.get("litmus_violations"),
        "loop_iteration_cap": report["quirks"].get("loop_iteration_cap"),
        "compute_units": report["device"].get("compute_units"),
        "probed_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def store(device, report):
    """Write every variant of a probe report; returns the cache file's path."""
    key = device_key(device)
    with _lock:
        data = _load()
        entries = data.setdefault(key, {})
        for v in report["variants"]:
            entries[variant_key(v)] = entry_from_report(report, v)
        _save(data)
    return cache_path()


def forget(device=None):
    """Drop the entries of `device` (or the whole cache)."""
    with _lock:
        data = _load() if device is not None else {}
        if device is not None:
            data.pop(device_key(device), None)
        _save(data)


CROSSOVER_KEY = "moe-dispatch-crossover"


def store_crossover(device, shape, max_m, evidence):
    """Record, for this device, up to which batch size the persistent kernel beat the split path on a shape
    (written by `tools/bench_moe --store-crossover`; read by auto mode). max_m = 0: it never won."""
    key = device_key(device)
    with _lock:
        data = _load()
        entry = data.setdefault(key, {}).setdefault(CROSSOVER_KEY, {"format": FORMAT, "shapes": {}})
        entry["shapes"][shape] = {"max_m": int(max_m), "evidence": evidence,
                                  "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        _save(data)
    return cache_path()


def lookup_crossover(device):
    """{shape: {"max_m": ..., ...}} measured on this device, or {}."""
    with _lock:
        entry = _load().get(device_key(device), {}).get(CROSSOVER_KEY)
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return {}
    return entry.get("shapes", {})


PIPELINES_KEY = "pipelines"


def store_pipeline(device, pipeline_key, measurement):
    """Record the co-resident count a pipeline measured of itself (vkmoe.sched.occupancy)."""
    key = device_key(device)
    with _lock:
        data = _load()
        entry = data.setdefault(key, {}).setdefault(PIPELINES_KEY, {"format": FORMAT, "entries": {}})
        entry["entries"][pipeline_key] = dict(measurement, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        _save(data)
    return cache_path()


def lookup_pipeline(device, pipeline_key):
    """The measurement `store_pipeline` recorded for this device and pipeline, or None."""
    with _lock:
        entry = _load().get(device_key(device), {}).get(PIPELINES_KEY)
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return None
    found = entry.get("entries", {}).get(pipeline_key)
    if not isinstance(found, dict) or not isinstance(found.get("min"), int) or found["min"] < 0:
        return None
    return found
