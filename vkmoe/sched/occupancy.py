"""The co-resident count of one pipeline, measured by that pipeline's own binary.

How many workgroups of a pipeline a device keeps resident at once depends on that pipeline's registers and shared
memory, so a stand-in kernel (tools/probe_residency) can only bound it. The persistent MoE kernel therefore has a
discovery mode (shaders/include/occupancy.glsl behind a push-constant branch of the same binary): the op records
the discovery dispatches, this module chooses the poll bounds, runs them, reads the result and keeps it in memory
and in the residency cache, per (driver + device, pipeline key). The persistent plan never launches more
workgroups than this count.
"""

import numpy as np

from .. import forksafe
from ..vk import CommandRecorder
from . import residency
from .probe import (BASE_SHARED_BYTES, DEFAULT_WORKGROUP_SIZE, HOST_TIMEOUT_S, SLOT_WORDS, SpinBudget,
                    calibrate_spin, residency_pipeline, summarize_discovery)

REPEATS = 3              # the plan takes the smallest clean count
LAUNCH_PER_CU = 16       # more 256-invocation workgroups per compute unit than any device keeps resident
PARAM_WORDS = 12         # OCC_PARAMS in occupancy.glsl: open, wait and lock iterations, written by the host

_lock = forksafe.Lock()
_measured = {}           # (device key, pipeline key) -> measurement
_budgets = {}            # device key -> SpinBudget


def _budget(device):
    key = residency.device_key(device)
    with _lock:
        if key in _budgets:
            return _budgets[key]
    pipe = residency_pipeline(device, DEFAULT_WORKGROUP_SIZE, BASE_SHARED_BYTES)
    buf = device.memory.allocate(4 * SLOT_WORDS * 2, host_visible=True)
    try:
        ns = calibrate_spin(device, pipe, buf)
    finally:
        buf.close()
        pipe.close()
    budget = SpinBudget(device.quirks.get("loop_iteration_cap"), ns, device.device_type == "cpu")
    with _lock:
        _budgets[key] = budget
    return budget


def launch_size(device):
    """Workgroups a discovery launches: more than can be resident, within the device's dispatch limit."""
    return int(min(LAUNCH_PER_CU * max(1, device.compute_units or 16), device.limits.maxComputeWorkGroupCount[0]))


def measured(device, pipeline_key):
    """The measurement for this pipeline if it was taken (in this process or cached on disk), else None."""
    key = (residency.device_key(device), pipeline_key)
    with _lock:
        hit = _measured.get(key)
    if hit is None:
        hit = residency.lookup_pipeline(device, pipeline_key)
        if hit is not None:
            with _lock:
                _measured[key] = hit
    return hit


def measure(device, pipeline_key, record_discovery, timeout=HOST_TIMEOUT_S):
    """The co-resident count of a pipeline ({"min", "median", "samples", "launched", ...}), measured once per
    device and pipeline key. record_discovery(rec, words_buffer, launched, loop_budget) records ONE discovery
    dispatch of `launched` workgroups whose 16 result words go to words_buffer, and returns what must stay alive
    until the submission finished (e.g. its descriptor set, freed afterwards)."""
    hit = measured(device, pipeline_key)
    if hit is not None:
        return hit
    budget = _budget(device)
    launched = launch_size(device)
    params = np.zeros(SLOT_WORDS, np.uint32)
    params[PARAM_WORDS:PARAM_WORDS + 3] = (budget.open_iters, budget.wait_iters, budget.lock_iters)
    bufs, keep = [], []
    try:
        for _ in range(REPEATS + 1):
            bufs.append(device.memory.allocate(4 * SLOT_WORDS, host_visible=True))
            bufs[-1].upload(params)
        with CommandRecorder(device) as rec:
            # One workgroup first, in its own submission: a driver that compiles the pipeline at its first
            # dispatch (lavapipe) must not spend the timed measurement's bound on that. Its wait names no
            # timeout, so this first run of a fresh recording gets the recorder's compile bound.
            rec.begin()
            keep.append(record_discovery(rec, bufs[0], 1, budget.budget))
            rec.host_barrier()
            rec.end()
            rec.submit(wait=True)
            rec.begin()
            for b in bufs[1:]:
                keep.append(record_discovery(rec, b, launched, budget.budget))
                rec.barrier()
            rec.host_barrier()
            rec.end()
            rec.submit(wait=True, timeout=timeout)
        words = np.stack([b.array(np.uint32)[:SLOT_WORDS].copy() for b in bufs[1:]])
    finally:
        for k in keep:
            if k is not None:
                k.free()
        for b in bufs:
            b.close()
    result = summarize_discovery(words, launched)
    result.pop("runs")
    with _lock:
        _measured[(residency.device_key(device), pipeline_key)] = result
    try:
        residency.store_pipeline(device, pipeline_key, result)
    except OSError:
        pass  # an unwritable cache: the measurement still serves this process
    return result
