"""The residency cache: what `probe_residency` measured, per (driver + device, pipeline variant).

The persistent launch plan reads it with `lookup(device, variant)`; `store(device, report)` writes a probe report.
One JSON file, `residency.json`, in vkmoe's cache directory (VKMOE_CACHE_DIR or the user cache dir).

A variant is what changes how many workgroups fit on a compute unit: (workgroup size, shared memory bytes).
The device key is `device.identity` plus the compute-unit count and where it came from, because lavapipe's
co-resident count follows LP_NUM_THREADS, which is read at device creation and is not part of the identity: a
result measured with 3 worker threads must never plan a grid for a process running 2.
"""
import copy
import os
import time

from .. import forksafe
from ..vk.cachefile import cache_path as _cache_path, location_key, read_json, warn, write_json

FILENAME = "residency.json"
FORMAT = 1  # bump when the entry layout changes; entries of another format are ignored
_lock = forksafe.Lock()
_unsaved = {}  # device key -> entries stored by this process that the file could not take (kept in memory)


def cache_path():
    return _cache_path(FILENAME)


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


def _load(fresh=False):
    """The cache as {device key: {entry key: entry}}; device entries that are not objects are dropped (with a
    warning), what this process could not write is laid over the file. `fresh`: read the file now and return
    data the caller may modify (stores); else the memoized file, read only (lookups copy what they return)."""
    data = dict(read_json(FILENAME) if fresh else _read_file())
    for key in [k for k, v in data.items() if not isinstance(v, dict)]:
        warn(f"ignoring the residency cache entry {key!r}: expected an object, found {type(data[key]).__name__}")
        del data[key]
    for key, entries in _unsaved.items():
        data[key] = {**data.get(key, {}), **entries}
    return data


_memo = {}  # path -> ((inode, mtime_ns, size), parsed file)
# Auto mode looks the cache up on every MoE call (a decode step makes thousands): the file's path and stat are
# checked at most this often, so a store by ANOTHER process is seen within this many seconds (this process's own
# stores are seen at once: _save forgets the check).
STAT_INTERVAL_S = 0.5
_checked = {"at": None, "where": None, "data": {}}  # when and where the file was last looked at, what it held
_NO_FILE = {}  # what a missing file holds: one object, so that looking at a still missing file changes nothing
# Bumped whenever lookups may answer differently: _read_file found other data (a store) or looked in another
# place, or _unsaved (laid over the file) changed. Memos of answers compare it (version()).
_generation = [0]


def _read_file():
    """The cache file parsed, re-read only when its stat changes (a store by this or another process): no file
    reads per call, and at most one path lookup and stat per STAT_INTERVAL_S. Shared: callers must not modify it."""
    now, where = time.monotonic(), location_key()
    at = _checked["at"]
    if at is not None and now - at < STAT_INTERVAL_S and _checked["where"] == where:
        return _checked["data"]
    path = cache_path()
    try:
        st = os.stat(path)
    except OSError:
        data = _NO_FILE
    else:
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # write_json replaces the file: a new inode each time
        hit = _memo.get(path)
        if hit is None or hit[0] != stamp:
            hit = _memo[path] = (stamp, read_json(FILENAME))
        data = hit[1]
    if data is not _checked["data"] or where != _checked["where"]:
        _generation[0] += 1
    _checked.update(at=now, where=where, data=data)
    return data


def version():
    """A number that changes whenever lookups may answer differently: after a store by this process at once, by
    another process within STAT_INTERVAL_S (the file is looked at as lookups look at it). For a memo of answers
    derived from the cache, checked on every call (the MoE call's dispatch decision: sched.plan.DecisionInputs).
    It does not look the cache's place up (~1.6 us): such a memo watches cachefile.LOCATION_VARIABLES itself."""
    at = _checked["at"]
    if at is None or time.monotonic() - at >= STAT_INTERVAL_S:
        with _lock:
            _read_file()
    return _generation[0]


def forget_checks():
    """Look at the file again on the next lookup (after a store, or when VKMOE_CACHE_DIR changed)."""
    _checked["at"] = None


def _save(data, key):
    """Write the cache; when that fails, keep device `key`'s entries in memory for this process."""
    forget_checks()
    _generation[0] += 1  # (whether the file or _unsaved takes the data)
    if write_json(FILENAME, data):
        _unsaved.pop(key, None)
    elif key is not None:
        _unsaved[key] = dict(data.get(key, {}))


def _is_count(value):
    return type(value) is int and value >= 0


def _entry_problem(entry):
    """Why a cached variant entry cannot plan a launch (None when it can)."""
    if not isinstance(entry, dict):
        return f"expected an object, found {type(entry).__name__}"
    if type(entry.get("persistent")) is not bool:
        return f"persistent={entry.get('persistent')!r} is not true/false"
    if not _is_count(entry.get("grid")):
        return f"grid={entry.get('grid')!r} is not a count"
    co = entry.get("co_resident")
    if not isinstance(co, dict) or not _is_count(co.get("min")):
        return f"co_resident={co!r} has no count 'min'"
    return None


def lookup(device, variant):
    """The cached entry for this device and variant (a dict, see `entry_from_report`), or None. A malformed
    entry is ignored with a warning (probe again to replace it)."""
    vkey = variant_key(variant)
    with _lock:
        entry = _load().get(device_key(device), {}).get(vkey)
    if entry is None or (isinstance(entry, dict) and entry.get("format") != FORMAT):
        return None
    problem = _entry_problem(entry)
    if problem:
        warn(f"ignoring the residency cache entry {vkey} of {device.name}: {problem} (run tools/probe_residency "
             "to measure it again)")
        return None
    return copy.deepcopy(entry)


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
        data = _load(fresh=True)
        entries = data.setdefault(key, {})
        for v in report["variants"]:
            entries[variant_key(v)] = entry_from_report(report, v)
        _save(data, key)
    return cache_path()


CROSSOVER_KEY = "moe-dispatch-crossover"


def store_crossover(device, shape, max_m, evidence, dims=None, measured=None, wins=None):
    """Record, for this device, up to which batch size the persistent kernel beat the split path on a shape
    (written by `tools/bench_moe --store-crossover`; read by auto mode). max_m = 0: it never won. With the
    shape's `dims` ({"E", "H", "I", "top_k"}), the batch sizes `measured` and those where persistent won (`wins`),
    auto mode follows those wins for layers of exactly these dims (sched.plan.auto_prefers_persistent)."""
    key = device_key(device)
    with _lock:
        data = _load(fresh=True)
        entries = data.setdefault(key, {})
        entry = entries.get(CROSSOVER_KEY)
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or not isinstance(entry.get("shapes"), dict):
            entry = entries[CROSSOVER_KEY] = {"format": FORMAT, "shapes": {}}
        record = {"max_m": int(max_m), "evidence": evidence, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if dims is not None:
            record.update(dims={k: int(dims[k]) for k in CROSSOVER_DIMS}, measured=sorted(int(m) for m in measured),
                          wins=sorted(int(m) for m in wins))
        entry["shapes"][shape] = record
        _save(data, key)
    return cache_path()


def lookup_crossover(device):
    """{shape: {"max_m": ..., ...}} measured on this device, or {} (the caller's copy)."""
    return copy.deepcopy(crossover_entries(device))


_crossovers = {}  # device key -> (_generation when they were read, its valid crossover entries)


def crossover_entries(device):
    """lookup_crossover's answer, shared and read-only: for the per-call auto decision (no copy per call)."""
    key = device_key(device)
    with _lock:
        _read_file()
        hit = _crossovers.get(key)
        if hit is not None and hit[0] == _generation[0]:
            return hit[1]
        entries = _valid_crossovers(device, _load().get(key, {}).get(CROSSOVER_KEY))
        _crossovers[key] = (_generation[0], entries)
        return entries


def _valid_crossovers(device, entry):
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return {}
    shapes = entry.get("shapes")
    if not isinstance(shapes, dict):
        warn(f"ignoring the measured crossovers of {device.name}: 'shapes' is not an object")
        return {}
    good = {k: v for k, v in shapes.items() if isinstance(v, dict) and _is_count(v.get("max_m"))}
    if len(good) != len(shapes):
        warn(f"ignoring malformed crossover entries of {device.name}: {sorted(set(shapes) - set(good))}")
    for name, v in good.items():
        if "dims" in v and not _valid_wins(v):  # the max_m still counts, the per-m wins do not
            warn(f"ignoring the per-batch-size wins of {device.name}'s crossover entry {name!r}: "
                 "'dims', 'measured' or 'wins' malformed")
            good[name] = {k: x for k, x in v.items() if k not in _WIN_FIELDS}
    return good


# What a crossover entry's per-m wins are matched on: a layer of exactly these sizes. Not its bits, codebook or
# activation: a layer that differs only in those follows the shape's measurement (bench_moe runs one of each).
CROSSOVER_DIMS = ("E", "H", "I", "top_k")
_WIN_FIELDS = ("dims", "measured", "wins")  # what store_crossover adds to an entry for them


def _valid_wins(v):
    dims, measured, wins = v.get("dims"), v.get("measured"), v.get("wins")
    return (isinstance(dims, dict) and set(dims) == set(CROSSOVER_DIMS) and all(_is_count(x) for x in dims.values())
            and isinstance(measured, list) and measured and all(_is_count(m) for m in measured)
            and measured == sorted(set(measured)) and isinstance(wins, list) and all(_is_count(m) for m in wins)
            and set(wins) <= set(measured))


PIPELINES_KEY = "pipelines"


def store_pipeline(device, pipeline_key, measurement):
    """Record the co-resident count a pipeline measured of itself (vkmoe.sched.occupancy)."""
    key = device_key(device)
    with _lock:
        data = _load(fresh=True)
        entry = data.setdefault(key, {}).setdefault(PIPELINES_KEY, {"format": FORMAT, "entries": {}})
        entry["entries"][pipeline_key] = dict(measurement, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        _save(data, key)
    return cache_path()


def lookup_pipeline(device, pipeline_key):
    """The measurement `store_pipeline` recorded for this device and pipeline, or None."""
    with _lock:
        entry = _load().get(device_key(device), {}).get(PIPELINES_KEY)
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return None
    found = entry.get("entries", {}).get(pipeline_key)
    if not isinstance(found, dict) or not _is_count(found.get("min")):
        return None
    return copy.deepcopy(found)
