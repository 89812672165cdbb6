"""A MoE layer's experts split over several Vulkan devices (expert parallelism).

Each device holds a contiguous range of the layer's experts as an ordinary Exl3MoeMlp (a shard) whose GEMM plans
are those of the whole layer, so an expert gives the same bits wherever it is placed. A call hands every shard
the global routing with the ids of other shards' experts replaced by -1 (skipped on the device), runs the shards
concurrently (one thread per device: each waits on its own queue, none waits for another's host round trip), and
sums the per-(token, slot) rows on the host in slot order, starting from 0.0 in float32: the same additions in
the same order as one device's token sum, so the result is bit for bit that of the whole layer on one device,
however the experts are placed.

Cross-host distribution is out of scope: a runtime places shards on several hosts with its own transport and sums
the per-slot rows in slot order the same way.
"""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..vk.errors import closed_op_error
from .host_arrays import host_array
from .moe import Exl3MoeMlp


def even_ranges(num_experts, shards):
    """[(first, count)] splitting num_experts into `shards` contiguous ranges, the larger ones first."""
    if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= num_experts:
        raise ValueError(f"shards: expected an int in 1..{num_experts} (the layer's experts), got {shards!r}")
    base, extra = divmod(num_experts, shards)
    ranges, first = [], 0
    for i in range(shards):
        count = base + (1 if i < extra else 0)
        ranges.append((first, count))
        first += count
    return ranges


def check_ranges(ranges, num_experts):
    """Ranges must be (first, count) pairs that cover [0, num_experts) in order, with no overlap and no gap."""
    if not isinstance(ranges, (list, tuple)) or not ranges:
        raise ValueError(f"ranges: expected a non-empty list of (first, count) pairs, got {ranges!r}")
    expected = 0
    for i, r in enumerate(ranges):
        if (not isinstance(r, (list, tuple)) or len(r) != 2
                or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in r)):
            raise ValueError(f"ranges[{i}]: expected a (first, count) pair of ints, got {r!r}")
        first, count = int(r[0]), int(r[1])
        if count < 1:
            raise ValueError(f"ranges[{i}] = {r!r}: count must be >= 1")
        if first != expected:
            what = "overlaps the previous range" if first < expected else "leaves a gap after the previous range"
            raise ValueError(f"ranges[{i}] = {r!r} {what}: expected first = {expected} (ranges must cover "
                             f"[0, {num_experts}) in order)")
        expected = first + count
    if expected != num_experts:
        raise ValueError(f"ranges cover [0, {expected}) but the layer has {num_experts} experts")
    return [(int(a), int(b)) for a, b in ranges]


class ShardedMoeMlp:
    """The routed experts of one MoE layer over several devices. `devices`: vkmoe.Device per shard; gate/up/down:
    the WHOLE layer's expert lists (gate None for relu2); `ranges`: [(first, count)] per device (default: an even
    split). `layer(hidden, expert_ids, expert_weights)` takes global expert ids and returns (m, H) float32."""

    def __init__(self, devices, gate, up, down, activation="silu", act_limit=0.0, ranges=None, dispatch=None):
        devices = list(devices) if isinstance(devices, (list, tuple)) else devices
        if not isinstance(devices, list) or not devices:
            raise ValueError(f"devices: expected a non-empty list of vkmoe.Device, got {devices!r}")
        if not isinstance(up, (list, tuple)) or not up:
            raise TypeError("up must be a non-empty list of vkmoe.Exl3Tensor (one per expert)")
        self.E = len(up)
        self.ranges = check_ranges(ranges if ranges is not None else even_ranges(self.E, len(devices)), self.E)
        if len(self.ranges) != len(devices):
            raise ValueError(f"ranges has {len(self.ranges)} entries but there are {len(devices)} devices")
        self.shards = []
        try:
            for dev, (first, count) in zip(devices, self.ranges):
                part = slice(first, first + count)
                shard = Exl3MoeMlp(dev, None if gate is None else list(gate[part]), list(up[part]),
                                   list(down[part]), activation=activation, act_limit=act_limit, dispatch=dispatch)
                shard.plan_experts = self.E  # the whole layer's plans: an expert's bits do not depend on placement
                shard.rows_kind = "readback"  # the host reads the rows after every call
                self.shards.append(shard)
        except BaseException:
            self.close()
            raise
        self.H = self.shards[0].H
        self._make_pool()

    def _make_pool(self):
        """One thread per shard. Per process: a fork() child has none of the parent's pool threads, so work given
        to the parent's pool there would never run (the call would hang instead of raising the forked-device
        error)."""
        self._pool = ThreadPoolExecutor(max_workers=len(self.shards), thread_name_prefix="vkmoe-shard")
        self._pool_pid = os.getpid()
        return self._pool

    @classmethod
    def from_shards(cls, shards, ranges):
        """Wrap existing shards (Exl3MoeMlp, one per range, e.g. device-filled benchmark layers); their plans are
        set to the whole layer's."""
        self = cls.__new__(cls)
        try:  # (the pairs' form is checked by check_ranges; this only needs the total it checks against)
            self.E = sum(int(pair[1]) for pair in ranges)
        except (TypeError, ValueError, IndexError, KeyError):
            raise ValueError(f"ranges: expected a non-empty list of (first, count) pairs, got {ranges!r}") from None
        self.ranges = check_ranges(ranges, self.E)
        shards = list(shards) if isinstance(shards, (list, tuple)) else shards
        if not isinstance(shards, list) or not all(isinstance(sh, Exl3MoeMlp) for sh in shards) or \
                len(shards) != len(self.ranges) or any(sh.E != c for sh, (_, c) in zip(shards, self.ranges)):
            raise ValueError("shards: expected one Exl3MoeMlp per range, holding `count` experts each")
        self.shards = list(shards)
        for shard in self.shards:
            shard.plan_experts = self.E
            shard.rows_kind = "readback"
        self.H = self.shards[0].H
        self._make_pool()
        return self

    @classmethod
    def from_safetensors(cls, devices, path, prefix, activation="silu", act_limit=0.0, ranges=None, dispatch=None,
                         num_experts=None):
        """Load `{prefix}.experts.{e}.{gate,up,down}_proj` from a .safetensors file, a model directory or a dict,
        each device reading only its own experts' tensors."""
        from ..exl3.loaders import count_moe_experts, load_moe_experts

        E = num_experts or count_moe_experts(path, prefix)
        ranges = check_ranges(ranges if ranges is not None else even_ranges(E, len(devices)), E)
        parts = [load_moe_experts(path, prefix, num_experts, expert_range=r) for r in ranges]
        gated = parts[0]["gate"] is not None
        if not gated and activation != "relu2":
            raise ValueError(f"{prefix}: no gate_proj tensors; a gateless layer needs activation='relu2'")
        joined = {p: (None if not gated and p == "gate" else [t for part in parts for t in part[p]])
                  for p in ("gate", "up", "down")}
        # The experts are held by the shards only: each device uploads its own range.
        return cls(devices, joined["gate"], joined["up"], joined["down"], activation=activation,
                   act_limit=act_limit, ranges=ranges, dispatch=dispatch)

    def _shard_call(self, shards, index, hidden, ids, weights, dispatch):
        first, count = self.ranges[index]
        local = ids - first
        local[(ids < first) | (ids >= first + count)] = -1  # another shard's expert: skipped on this device
        return shards[index].slot_rows(hidden, local, weights, dispatch)

    def __call__(self, hidden, expert_ids, expert_weights, dispatch=None):
        shards, pool = self.shards, self._pool  # (close() may run in another thread: read each once)
        if not shards or pool is None:
            raise closed_op_error(self)
        if self._pool_pid != os.getpid():  # a fork() child: its own threads (the shards then say the device is gone)
            pool = self._make_pool()
        hidden = host_array(hidden, "hidden")
        expert_ids, expert_weights = host_array(expert_ids, "expert_ids"), host_array(expert_weights, "expert_weights")
        # The op's own checks, with ids addressing the whole layer's experts.
        shards[0]._check_inputs(hidden, expert_ids, expert_weights, experts=self.E)
        m, top_k = expert_ids.shape
        ids = np.ascontiguousarray(expert_ids, np.int32)
        weights = np.ascontiguousarray(expert_weights, np.float32)
        x = np.ascontiguousarray(hidden)
        try:
            futures = [pool.submit(self._shard_call, shards, i, x, ids, weights, dispatch) for i in range(len(shards))]
        except RuntimeError:  # the pool was shut down by a close() since the check above
            raise closed_op_error(self) from None
        rows = [f.result() for f in futures]
        owner = np.searchsorted([first + count for first, count in self.ranges], ids, side="right")
        slots = rows[0]
        for i, r in enumerate(rows[1:], 1):  # each (token, slot) row from the shard that holds its expert
            np.copyto(slots, r, where=(owner == i)[:, :, None])
        # Slot order from 0.0 in float32, as the device sums a token's rows: the same bits. (Every slot is valid
        # here: __call__ accepts only ids of the layer.)
        out = np.zeros((m, self.H), np.float32)
        for s in range(top_k):
            out += slots[:, s]
        return out

    def close(self):
        for shard in getattr(self, "shards", []):
            shard.close()
        self.shards = []
        pool = getattr(self, "_pool", None)
        if pool is not None:
            if self._pool_pid == os.getpid():  # (a fork() child has none of the parent's pool threads to wait for)
                pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
