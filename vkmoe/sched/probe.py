"""probe_residency: may this device run vkmoe's persistent kernel, and with how many workgroups?

Vulkan guarantees neither that workgroups of one dispatch run concurrently nor that a spinning workgroup lets
another one progress, so the persistent path is only safe with a grid whose workgroups are all resident at once.
The probe measures that number per pipeline variant, in the kernel (vendor counts are hints), then checks the
group barrier and cross-workgroup message passing at that grid, and gives a verdict that the launch plan reads
from the residency cache.

Every wait is bounded twice: inside the shaders by iteration counts (kept well under lavapipe 22.3's silent
65,535-iteration loop cap), and on the host by CommandRecorder.submit(timeout=...).
"""
import statistics
import sys
import time

import numpy as np

from ..vk import CommandRecorder, Pipeline, PushConstants
from ..vk.errors import VkmoeError
from ..vk.report import format_info
from . import residency

DEFAULT_WORKGROUP_SIZE = 256
BASE_SHARED_BYTES = 16 << 10  # all that Vulkan guarantees
SYNC_SHARED_BYTES = 16        # what sync.glsl declares (a bool, padded): kept out of the variant's pad array
MAX_LAUNCH = 4096
SLOT_WORDS = 16
HOST_TIMEOUT_S = 20.0
LITMUS_WORKGROUP_SIZE = 64
UNCAPPED_BUDGET = 0xFFFFFFFF
# Specialization-constant ids of shaders/probes/probe_{residency,barrier,litmus}.comp: all three take their
# workgroup size from local_size_x_id = 0; probe_residency's SHARED_WORDS (its pad array) is constant_id 1.
SPEC_PROBE_WORKGROUP_SIZE, SPEC_PROBE_SHARED_WORDS = 0, 1
# probe_litmus.comp: a header (W_ABORT .. W_CHECKED), then one line per (pair, round) ([0] flag, noise, data).
LITMUS_HEADER_WORDS, LITMUS_LINE_WORDS = 16, 16


class _ResidencyPush(PushConstants):
    fields = [("slot", "<u4"), ("launched", "<u4"), ("open_iters", "<u4"), ("wait_iters", "<u4"),
              ("lock_iters", "<u4"), ("budget", "<u4")]


class _BarrierPush(PushConstants):
    fields = [("rounds", "<u4"), ("spin_iters", "<u4"), ("budget", "<u4")]


class _LitmusPush(PushConstants):
    fields = [("rounds", "<u4"), ("spin_iters", "<u4"), ("budget", "<u4"), ("pairs", "<u4")]


# Word offsets of one measurement's 16 words (OCC_* in shaders/include/occupancy.glsl).
_W_ABORT, _W_PARTICIPANTS, _W_LATE, _W_TIMEOUTS, _W_ARRIVED, _W_OPENER_SPENT, _W_OPENER_HIT, _W_JOINER_SPENT = 0, 4, 5, 6, 7, 8, 9, 11


class _Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, enabled, total):
        self.enabled, self.total, self.done = enabled, max(1, total), 0
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = time.monotonic()

    def step(self, what):
        if not self.enabled:
            return
        self.done = min(self.total, self.done + 1)
        width = 24
        fill = width * self.done // self.total
        line = f"probe [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {what}"
        if self.tty:
            sys.stderr.write("\r\x1b[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self):
        if self.enabled and self.tty:
            sys.stderr.write(f"\r\x1b[Kprobe done in {time.monotonic() - self.t0:.1f} s\n")
            sys.stderr.flush()


def default_variants(device):
    """Workgroup size 256 with 16 KiB of shared memory, and with the device maximum when that is larger."""
    variants = [(DEFAULT_WORKGROUP_SIZE, BASE_SHARED_BYTES)]
    max_shared = int(device.limits.maxComputeSharedMemorySize)
    if max_shared > BASE_SHARED_BYTES:
        variants.append((DEFAULT_WORKGROUP_SIZE, max_shared))
    return variants


# How long a discovery's poll stays open. A CPU driver may run more worker threads than cores: a waiting thread
# needs the OS to schedule it, which takes a time slice or two (several ms), so its poll stays open longer.
OPEN_WINDOW_MS_GPU, OPEN_WINDOW_MS_CPU = 5.0, 40.0


class SpinBudget:
    """Iteration bounds for the shaders. With a loop cap every invocation's total stays below it; without one
    the bounds come from the calibrated time per spin iteration."""

    def __init__(self, cap, ns_per_iter, is_cpu):
        self.cap = cap
        self.ns_per_iter = max(ns_per_iter, 1e-3)
        open_ms = OPEN_WINDOW_MS_CPU if is_cpu else OPEN_WINDOW_MS_GPU
        if cap:
            self.budget = max(1024, cap - 4096)  # margin for the loops around the spins
            self.lock_iters = min(2000, self.budget // 16)
            self.open_iters = max(64, min(self._iters(open_ms), (self.budget - 2 * self.lock_iters) // 3))
            self.wait_iters = self.budget - self.lock_iters
            self.spin_iters = self.budget  # a barrier wait may use whatever the invocation has left
        else:
            self.budget = UNCAPPED_BUDGET
            self.lock_iters = max(1000, self._iters(200.0))
            self.open_iters = max(64, self._iters(open_ms))
            self.wait_iters = 4 * self.open_iters + self.lock_iters
            self.spin_iters = max(1000, self._iters(500.0))
        for name in ("lock_iters", "open_iters", "wait_iters", "spin_iters"):
            setattr(self, name, int(min(getattr(self, name), 0x7FFFFFFF)))

    def _iters(self, ms):
        return int(ms * 1e6 / self.ns_per_iter)

    def as_dict(self):
        return {"loop_cap": self.cap, "ns_per_iter": round(self.ns_per_iter, 2), "budget": self.budget,
                "open_iters": self.open_iters, "wait_iters": self.wait_iters, "lock_iters": self.lock_iters,
                "spin_iters": self.spin_iters}


def _run_zeroed(device, pipe, buffer_words, record, timeout, timestamps=0):
    """One submission of a probe: zero-filled host-visible buffers of `buffer_words` words each (a probe's word
    indices are fixed and its counters must start at 0), then `record(rec, descriptor_sets)`, one set per
    buffer. Waits for it (bounded by `timeout`) and returns (each buffer's words, the timestamps in ms, the
    wall-clock seconds of the submission)."""
    bufs, sets = [], []
    try:
        for n in buffer_words:
            bufs.append(device.memory.allocate(4 * n, host_visible=True))
            sets.append(pipe.bind(bufs[-1]))
        with CommandRecorder(device, timestamps=timestamps) as rec:
            rec.begin()
            for b in bufs:
                rec.fill(b, 0)
            rec.barrier()
            record(rec, sets)
            rec.host_barrier()
            rec.end()
            t0 = time.monotonic()
            rec.submit(wait=True, timeout=timeout)
            wall = time.monotonic() - t0
            stamps = rec.timestamps_ms()
        words = [b.array(np.uint32).copy() for b in bufs]
    finally:
        for d in sets:
            d.free()
        for b in bufs:
            b.close()
    return words, stamps, wall


def warm_up(device, pipe, buf):
    """One short dispatch of the residency pipeline `pipe` (one workgroup, every spin 1-10 iterations): some
    drivers (lavapipe) compile a pipeline at its first dispatch, which must count neither against a measurement's
    HOST_TIMEOUT_S nor in its timings. The wait names no timeout, so this first run of a fresh recording gets the
    recorder's compile bound (vk.commands.COMPILE_TIMEOUT_S): in a cold three-process test run on a
    2-core machine, Mesa 25's took over 20 s."""
    dset = pipe.bind(buf)
    try:
        with CommandRecorder(device) as rec:
            rec.begin()
            rec.fill(buf, 0)
            rec.barrier()
            rec.dispatch(pipe, dset, 1, pipe.push(slot=0, launched=2, open_iters=1, wait_iters=1, lock_iters=10,
                                                  budget=100))
            rec.end()
            rec.submit(wait=True)
    finally:
        dset.free()


# Spin calibration: each pair runs a short and a long spin; the per-iteration cost is the difference of the two
# lengths' times (which cancels the dispatch's fixed cost). Several pairs, and the fastest time of each length:
# a CPU driver's worker thread can be kept off a core for milliseconds, which inflates one run, never shrinks it.
CALIBRATION_LENGTHS = (200, 1000)
CALIBRATION_PAIRS = 3
# The difference is trusted down to this fraction of the long run's whole time per iteration (an upper bound:
# it includes the fixed cost, which is small beside 1000 iterations). Below it, the short run was slowed and the
# difference underestimates the iteration: every spin bound derived from it would last many times longer than
# intended (a CI run on 2 cores got a 20 s host timeout that way).
CALIBRATION_FLOOR = 0.5


def spin_ns_per_iter(short_ms, long_ms, lengths=CALIBRATION_LENGTHS):
    """Nanoseconds per spin iteration from the times (ms) of the short and long runs of every pair."""
    short, long_ = min(short_ms), min(long_ms)
    upper = long_ * 1e6 / lengths[1]
    diff = (long_ - short) * 1e6 / (lengths[1] - lengths[0])
    return max(diff, CALIBRATION_FLOOR * upper, 1e-3)


def calibrate_spin(device, pipe, buf):
    """Nanoseconds per spin-loop iteration of one workgroup (timestamps; see CALIBRATION_*). `buf`: two
    measurement slots of scratch, zeroed before each pair."""
    warm_up(device, pipe, buf)
    dset = pipe.bind(buf)
    try:
        with CommandRecorder(device, timestamps=3 * CALIBRATION_PAIRS) as rec:
            rec.begin()
            for _ in range(CALIBRATION_PAIRS):
                rec.fill(buf, 0)
                rec.barrier()
                for slot, n in enumerate(CALIBRATION_LENGTHS):
                    rec.timestamp()
                    # launched=2 with one workgroup: the opener never sees everyone, so it spins the full window.
                    rec.dispatch(pipe, dset, 1, pipe.push(slot=slot, launched=2, open_iters=n, wait_iters=n,
                                                          lock_iters=1000, budget=60000))
                    rec.barrier()
                rec.timestamp()
            rec.end()
            rec.submit(wait=True, timeout=HOST_TIMEOUT_S)
            stamps = rec.timestamps_ms()
    finally:
        dset.free()
    short = [stamps[3 * k + 1] - stamps[3 * k] for k in range(CALIBRATION_PAIRS)]
    long_ = [stamps[3 * k + 2] - stamps[3 * k + 1] for k in range(CALIBRATION_PAIRS)]
    return spin_ns_per_iter(short, long_)


def residency_pipeline(device, wg, shared_bytes):
    """The stand-in residency pipeline: `wg` invocations per workgroup and about `shared_bytes` of shared memory."""
    words = max(16, (shared_bytes - SYNC_SHARED_BYTES) // 4)
    return Pipeline(device, "probe_residency", push=_ResidencyPush,
                    spec={SPEC_PROBE_WORKGROUP_SIZE: wg, SPEC_PROBE_SHARED_WORDS: words})


def _measure_co_resident(device, pipe, budget, repeats, launched, timeout):
    def record(rec, sets):
        for slot in range(repeats):
            rec.dispatch(pipe, sets[0], launched, pipe.push(slot=slot, launched=launched,
                                                            open_iters=budget.open_iters,
                                                            wait_iters=budget.wait_iters,
                                                            lock_iters=budget.lock_iters, budget=budget.budget))
            rec.barrier()

    (w,), _, wall = _run_zeroed(device, pipe, [SLOT_WORDS * repeats], record, timeout)
    return dict(summarize_discovery(w.reshape(repeats, SLOT_WORDS), launched), wall_s=round(wall, 3))


def summarize_discovery(words, launched):
    """The co-resident count from the (repeats, 16) words of occupancy.glsl measurements of one grid."""
    runs = []
    for row in words:
        runs.append({
            "participants": int(row[_W_PARTICIPANTS]), "late": int(row[_W_LATE]),
            "timeouts": int(row[_W_TIMEOUTS]), "arrived": int(row[_W_ARRIVED]),
            "abort": int(row[_W_ABORT]), "opener_iters": int(row[_W_OPENER_SPENT]),
            "all_joined": bool(row[_W_OPENER_HIT]), "joiner_iters": int(row[_W_JOINER_SPENT]),
        })
    # A repeat with a timed-out joiner (or an abort) may have let a second workgroup join in the same slot, so
    # it could overcount: only clean repeats count.
    clean = [r["participants"] for r in runs if r["timeouts"] == 0 and r["abort"] == 0
             and r["arrived"] == launched]
    return {
        "min": min(clean) if clean else 0,
        "median": int(statistics.median_low(clean)) if clean else 0,
        "samples": clean,
        "launched": launched,
        "saturated": bool(clean) and max(clean) >= launched,  # every launched workgroup joined: a lower bound
        "discarded": len(runs) - len(clean),
        "runs": runs,
    }


def _barrier_check(device, grid, rounds, budget, timeout, reps=3):
    pipe = Pipeline(device, "probe_barrier", push=_BarrierPush,
                    spec={SPEC_PROBE_WORKGROUP_SIZE: DEFAULT_WORKGROUP_SIZE})
    # One small buffer per dispatch: the shader's word indices are fixed and barrier words must start at 0.
    # Slots 2*rep (0 rounds) and 2*rep + 1 (R rounds), then one for the empty dispatches.
    nslots = 2 * reps + 1
    empty_dispatches = 50

    def record(rec, sets):
        # (0 rounds, R rounds) pairs: the difference is the cost of R barriers at this grid.
        for rep in range(reps):
            for k, r in enumerate((0, rounds)):
                rec.timestamp()
                rec.dispatch(pipe, sets[2 * rep + k], grid,
                             pipe.push(rounds=r, spin_iters=budget.spin_iters, budget=budget.budget))
                rec.barrier()
            rec.timestamp()
        rec.timestamp()
        for _ in range(empty_dispatches):
            rec.dispatch(pipe, sets[-1], grid, pipe.push(rounds=0, spin_iters=1, budget=budget.budget))
            rec.barrier()
        rec.timestamp()

    try:
        words, stamps, _ = _run_zeroed(device, pipe, [SLOT_WORDS] * nslots, record, timeout,
                                       timestamps=3 * reps + 2)
    finally:
        pipe.close()
    w = np.stack(words)
    per_barrier = []
    for rep in range(reps):
        t0, t1, t2 = stamps[3 * rep:3 * rep + 3]
        per_barrier.append(((t2 - t1) - (t1 - t0)) * 1e3 / rounds)
    dispatch_us = (stamps[-1] - stamps[-2]) * 1e3 / empty_dispatches
    timed = w[1:2 * reps:2]  # the R-round slots
    return {
        "grid": grid,
        "rounds": rounds,
        "timeouts": int(timed[:, 3].sum()),
        "violations": int(timed[:, 5].sum()),
        "completed": [int(x) for x in timed[:, 6]],
        "abort": int(timed[:, 2].max()),
        "barrier_us": round(max(0.0, statistics.median(per_barrier)), 3),
        "dispatch_us": round(dispatch_us, 3),
    }


def _litmus(device, grid, budget, timeout, rounds=256):
    pairs = grid // 2
    if pairs == 0:
        return {"grid": grid, "pairs": 0, "violations": None, "skipped": "needs 2 co-resident workgroups"}
    pipe = Pipeline(device, "probe_litmus", push=_LitmusPush,
                    spec={SPEC_PROBE_WORKGROUP_SIZE: LITMUS_WORKGROUP_SIZE})
    def record(rec, sets):
        rec.dispatch(pipe, sets[0], grid, pipe.push(rounds=rounds, spin_iters=budget.spin_iters,
                                                    budget=budget.budget, pairs=pairs))

    try:
        (w,), _, _ = _run_zeroed(device, pipe, [LITMUS_HEADER_WORDS + pairs * rounds * LITMUS_LINE_WORDS], record,
                                 timeout)
    finally:
        pipe.close()
    checked = int(w[3])
    return {"grid": grid, "pairs": pairs, "rounds": rounds, "violations": int(w[1]), "timeouts": int(w[2]),
            "checked": checked, "complete": checked == pairs * rounds * 8, "abort": int(w[0])}


def _verdict(variant, cu, force_fail):
    co = variant["co_resident"]
    measured = co["min"]
    grid = min(measured, cu) if cu else measured
    reasons = []
    if measured < 1:
        reasons.append("no co-resident workgroup could be measured")
    bar, lit = variant.get("barrier"), variant.get("litmus")
    if bar is not None:
        if bar["timeouts"]:
            reasons.append(f"{bar['timeouts']} spin-barrier timeout(s) at grid {bar['grid']}")
        if bar["violations"]:
            reasons.append(f"{bar['violations']} spin-barrier violation(s)")
    if lit is not None and lit.get("violations"):
        reasons.append(f"{lit['violations']} message-passing violation(s)")
    if lit is not None and lit.get("timeouts"):
        reasons.append(f"{lit['timeouts']} message-passing timeout(s)")
    if force_fail:
        need = co["launched"] + 1
        reasons.append(f"--force-fail: requires {need} co-resident workgroups, more than were launched")
    if reasons:
        return {"persistent": False, "reason": "; ".join(reasons), "grid": grid}
    basis = f"{measured} co-resident (min of {len(co['samples'])})"
    if co.get("saturated"):
        basis += f", all {co['launched']} launched joined: a lower bound"
    if cu and measured > cu:
        basis += f", capped at {cu} compute units"
    why = f"{basis}; 0 barrier timeouts"
    why += ", 0 litmus violations" if lit and lit.get("violations") == 0 else ", litmus not applicable (grid 1)"
    return {"persistent": True, "reason": why, "grid": grid}


def _check_variants(dev, variants, pipes, budget, repeats, launched, rounds, cu, timeout, force_fail, bar):
    out_variants, checks = [], {}
    for (wg, smem), pipe in zip(variants, pipes):
        co = _measure_co_resident(dev, pipe, budget, repeats, launched, timeout)
        bar.step(f"co-resident wg{wg}/{smem // 1024} KiB: {co['min']}")
        grid = min(co["min"], cu) if cu else co["min"]
        v = {"workgroup_size": wg, "shared_bytes": smem, "co_resident": co}
        if grid >= 1:
            # Barrier and litmus do not depend on the variant's shared memory: run once per grid.
            if grid not in checks:
                b = _barrier_check(dev, grid, rounds, budget, timeout)
                bar.step(f"barrier at grid {grid}: {b['barrier_us']:.1f} us")
                lit = _litmus(dev, grid, budget, timeout)
                bar.step(f"litmus at grid {grid}: {lit['violations']} violations")
                checks[grid] = (b, lit)
            else:
                bar.step("barrier (same grid)")
                bar.step("litmus (same grid)")
            v["barrier"], v["litmus"] = checks[grid]
            v["barrier_us"] = v["barrier"]["barrier_us"]
            v["litmus_violations"] = v["litmus"]["violations"]
        else:
            v["barrier"] = v["litmus"] = None
            v["barrier_us"] = v["litmus_violations"] = None
            bar.step("barrier skipped")
            bar.step("litmus skipped")
        v["verdict"] = _verdict(v, cu, force_fail)
        out_variants.append(v)
    return out_variants


def probe_residency(device=None, variants=None, progress=False, repeats=5, rounds=200, store=True,
                    force_fail=False, timeout=HOST_TIMEOUT_S):
    """Measure co-residency per variant, check the spin barrier and message passing at the planned grid, and
    return the report (`format_report` prints it). `variants`: [(workgroup_size, shared_bytes), ...].
    `store`: write the result to the residency cache (never done with `force_fail`, a test hook that makes
    the verdict fail by requiring more co-resident workgroups than were launched)."""
    from ..vk import Device

    own = device is None
    dev = Device() if own else device
    t_start = time.monotonic()
    try:
        variants = [tuple(int(x) for x in v) for v in (variants or default_variants(dev))]
        max_shared = int(dev.limits.maxComputeSharedMemorySize)
        max_wg = int(dev.limits.maxComputeWorkGroupInvocations)
        for wg, smem in variants:
            if not 1 <= wg <= max_wg:
                raise VkmoeError(f"variant workgroup size {wg} is outside 1..{max_wg} on {dev.name}")
            if not SYNC_SHARED_BYTES + 64 <= smem <= max_shared:
                raise VkmoeError(f"variant shared memory {smem} B is outside {SYNC_SHARED_BYTES + 64}..{max_shared}")
        bar = _Progress(progress, 2 + 3 * len(variants))
        info = dev.info()
        quirks = dict(info["quirks"])
        cap = quirks.get("loop_iteration_cap")
        bar.step("device + quirks")
        cu = dev.compute_units
        launched = min(MAX_LAUNCH, max(64, 4 * (cu or 16)), int(dev.limits.maxComputeWorkGroupCount[0]))
        pipes = [residency_pipeline(dev, wg, smem) for wg, smem in variants]
        try:
            cal_buf = dev.memory.allocate(4 * SLOT_WORDS * 2, host_visible=True)
            try:
                ns = calibrate_spin(dev, pipes[0], cal_buf)
                for p in pipes[1:]:  # (calibrate_spin warmed pipes[0] up)
                    warm_up(dev, p, cal_buf)
            finally:
                cal_buf.close()
            budget = SpinBudget(cap, ns, dev.device_type == "cpu")
            bar.step("calibrated spin")
            out_variants = _check_variants(dev, variants, pipes, budget, repeats, launched, rounds, cu, timeout,
                                           force_fail, bar)
        finally:
            for p in pipes:
                p.close()
        bar.close()
        first = out_variants[0]
        ok = all(v["verdict"]["persistent"] for v in out_variants)
        bad = [f"wg{v['workgroup_size']}/{v['shared_bytes']} B: {v['verdict']['reason']}"
               for v in out_variants if not v["verdict"]["persistent"]]
        verdict = {
            "persistent": ok,
            "reason": first["verdict"]["reason"] if ok else "; ".join(bad),
            "grid": min(v["verdict"]["grid"] for v in out_variants),
        }
        seen, all_checks = set(), []
        for v in out_variants:  # each (barrier, litmus) pair once
            if v["barrier"] is not None and id(v["barrier"]) not in seen:
                seen.add(id(v["barrier"]))
                all_checks.append((v["barrier"], v["litmus"]))
        violations = [lit["violations"] for _, lit in all_checks if lit.get("violations") is not None]
        report = {
            "device": info,
            "variants": out_variants,
            "quirks": quirks,
            "barrier_us": first.get("barrier_us"),
            "dispatch_us": all_checks[0][0]["dispatch_us"] if all_checks else None,
            "barrier_timeouts": sum(b["timeouts"] for b, _ in all_checks),
            "litmus_violations": sum(violations) if violations else None,
            "verdict": verdict,
            "spin": budget.as_dict(),
            "forced_fail": bool(force_fail),
            "elapsed_s": round(time.monotonic() - t_start, 2),
            "cache": None,
        }
        if store and not force_fail:
            report["cache"] = residency.store(dev, report)
        return report
    finally:
        if own:
            dev.close()


def format_report(report):
    """The human-readable report (what `python -m vkmoe probe` prints without --json)."""
    lines = [format_info(report["device"]), "", "Co-resident workgroups (measured in the kernel):"]
    cu = report["device"].get("compute_units")
    for v in report["variants"]:
        co = v["co_resident"]
        extra = " (every launched workgroup joined: a lower bound)" if co.get("saturated") else ""
        lines.append(f"  wg {v['workgroup_size']:4d}, shared {v['shared_bytes'] // 1024:3d} KiB: min {co['min']}, "
                     f"median {co['median']} of {co['samples']}, launched {co['launched']}{extra}"
                     + (f", {co['discarded']} repeat(s) discarded" if co.get("discarded") else ""))
    lines.append(f"  compute units: {cu} ({report['device'].get('compute_units_source')})")
    lines.append("")
    seen = set()
    for v in report["variants"]:
        b, lit = v.get("barrier"), v.get("litmus")
        if b is None or b["grid"] in seen:
            continue
        seen.add(b["grid"])
        lines.append(f"Spin barrier at grid {b['grid']}: {b['rounds']} rounds x 3, {b['timeouts']} timeouts, "
                     f"{b['violations']} violations, {b['barrier_us']:.2f} us per barrier "
                     f"(dispatch + pipeline barrier: {b['dispatch_us']:.2f} us)")
        if lit.get("violations") is None:
            lines.append(f"Message-passing litmus: skipped ({lit.get('skipped')})")
        else:
            lines.append(f"Message-passing litmus at grid {lit['grid']} ({lit['pairs']} pair(s) x {lit['rounds']} "
                         f"rounds, queue-family scope, atomics hammering the same lines): {lit['violations']} "
                         f"violations, {lit['timeouts']} timeouts, {lit['checked']} words checked")
    lines.append("")
    q = report["quirks"]
    cap = q.get("loop_iteration_cap")
    lines.append("Quirks: loop iteration cap " + (f"{cap} (loops silently end; spins bounded below it)"
                                                   if cap else "none"))
    for k, val in q.items():
        if k != "loop_iteration_cap":
            lines.append(f"  {k}: {val}")
    s = report["spin"]
    lines.append(f"Spin bounds: {s['ns_per_iter']} ns/iteration, poll window {s['open_iters']} iterations, "
                 f"per-invocation budget {s['budget']}")
    lines.append("")
    vd = report["verdict"]
    lines.append(f"Verdict: persistent {'ALLOWED' if vd['persistent'] else 'NOT allowed (use split dispatches)'}, "
                 f"grid {vd['grid']} workgroup(s)")
    lines.append(f"  because: {vd['reason']}")
    if report.get("forced_fail"):
        lines.append("  (--force-fail was given: not cached)")
    elif report.get("cache"):
        lines.append(f"  cached in {report['cache']}")
    lines.append(f"Probe time: {report['elapsed_s']} s")
    return "\n".join(lines)
