"""When a benchmark's submissions start to count (tools/bench_moe, tools/bench_linear, tools/bench_decode)."""
import time

# A GPU that idled while the host prepared the work (made the layers, or let a pipeline measure itself) comes back
# at a low clock, and a warm-up counted in submissions alone can end before the clock is back: on the H200 a
# 100-submission warm-up right after the persistent pipeline's discovery still timed the Qwen3 shape's m = 1 at
# 87-120 us instead of 33 (BENCHMARKS.md, ninth session). So on a GPU a warm-up also lasts at least this long.
GPU_WARMUP_SECONDS = 1.0


class WarmUp:
    """Submissions 0, 1, 2, ... (made in that order) are untimed until `count` of them were made and `seconds`
    have passed since the WarmUp was made; then `iters` timed ones follow."""

    def __init__(self, count, seconds, iters):
        self.count, self.iters = count, iters
        self._deadline = time.monotonic() + seconds
        self.first_timed = None  # the first timed submission, once known

    def more(self, i):
        """Whether submission i is still to be made."""
        return self.first_timed is None or i < self.first_timed + self.iters

    def begin(self, i):
        """Called right before submission i is made; whether it is timed."""
        if self.first_timed is None and i >= self.count and time.monotonic() >= self._deadline:
            self.first_timed = i
        return self.first_timed is not None

    def timed(self, i):
        """Whether submission i, already begun, is timed."""
        return self.first_timed is not None and i >= self.first_timed
