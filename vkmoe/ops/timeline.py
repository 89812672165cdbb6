"""The persistent kernel's clock timeline: what its timing build (VKMOE_PERSISTENT_CLOCK=1) stored per workgroup.

The timing build is the same kernel with invocation 0 of each workgroup storing the device's realtime clock at
the marks of layout.CLOCK_MARKS (shaders/include/moe_stages.glsl, MOE_CLOCK). A Timeline holds one launch's
marks in microseconds from its first workgroup's start (NaN where a workgroup never reached a mark: a tail it
did not run, a stage it had no item of) and summarizes them across workgroups: where a decode step's time goes,
phase by phase (tools/bench_moe --timeline).
"""
import numpy as np

from .. import layout


class Timeline:
    """One persistent launch's marks: `us[mark]` is an array over the launch's workgroups."""

    def __init__(self, words: np.ndarray):
        """words: (workgroups, layout.CLOCK_WORDS_PER_WG) uint32, as the timing build left them."""
        words = np.asarray(words, np.uint32)
        if words.ndim != 2 or words.shape[1] != layout.CLOCK_WORDS_PER_WG or not len(words):
            raise ValueError(f"words: expected shape (workgroups, {layout.CLOCK_WORDS_PER_WG}), got {words.shape}")
        n = len(layout.CLOCK_MARKS)
        lo, hi = words[:, 0:2 * n:2], words[:, 1:2 * n:2]
        ticks = lo.astype(np.uint64) | (hi.astype(np.uint64) << np.uint64(32))
        starts = ticks[:, 0]
        if not starts.all():
            raise ValueError(f"{int((starts == 0).sum())} of {len(starts)} workgroups have no start mark: not a "
                             "launch of the timing build over this grid")
        if hi.any():  # a 64-bit clock
            rel = (ticks.astype(np.int64) - np.int64(starts.min())) / 1e3
        else:
            # A 32-bit clock: both lavapipes (Mesa 22.3 and 25) store 0 as the high word of clockRealtime2x32EXT,
            # so the low word wraps every 2^32 ns (4.3 s) and a launch that straddles a wrap had marks "before" its
            # start. Differences modulo 2^32, read as signed, are right for any launch shorter than 2^31 ns (2.1 s):
            # each mark against workgroup 0's start, then shifted so that the earliest start is 0.
            since = (lo.astype(np.int64) - np.int64(lo[0, 0])) % (1 << 32)
            since[since >= 1 << 31] -= 1 << 32
            rel = (since - since[:, 0].min()) / 1e3
        rel[ticks == 0] = np.nan
        self.workgroups = len(words)
        self.us = {name: rel[:, i] for i, name in enumerate(layout.CLOCK_MARKS)}
        self.waits = words[:, layout.CLOCK_WAITS].astype(np.int64)
        self.wait_us = words[:, layout.CLOCK_WAITS + 1].astype(np.int64) / 1e3

    def summary(self) -> dict:
        """{mark: {"reached", "p10", "median", "last"} in us}, plus "waits": the spinning waits per workgroup
        (median) and their total time (median of the workgroups that waited)."""
        out = {}
        for name, v in self.us.items():
            seen = v[np.isfinite(v)]
            out[name] = ({"reached": int(len(seen)), "p10": round(float(np.percentile(seen, 10)), 2),
                          "median": round(float(np.median(seen)), 2), "last": round(float(seen.max()), 2)}
                         if len(seen) else {"reached": 0})
        waited = self.wait_us[self.waits > 0]
        out["waits"] = {"per_workgroup": float(np.median(self.waits)),
                        "us_median": round(float(np.median(waited)), 2) if len(waited) else 0.0}
        return out
