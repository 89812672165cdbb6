"""DeviceArray: an array that stays in device memory between ops, and the per-call transfers of an op.

    x = DeviceArray.from_numpy(dev, hidden)          # or the result of an op called with out="device"
    y = moe(x, ids, weights, out="device")           # no host trip for hidden or the output
    y.numpy()                                        # fetch when the host needs it

An op that takes or returns DeviceArrays still runs its own recorded command buffer on its own input and output
buffers: the copies from an input DeviceArray and into the output one are recorded per call into small command
buffers that go into the SAME vkQueueSubmit as the op's (CallTransfers), so a call stays one submission. Arrays a
caller passes again (the same input and/or output array as an earlier call of that shape) are bound instead, in a
recording of their own, with no copies at all (RepeatedArrays).
"""
import math
from collections import OrderedDict

import numpy as np

from ..vk import CommandRecorder, DeviceClosedError, VkmoeError, expect_device
from ..vk.errors import foreign_device_error


class DeviceArray:
    """A C-ordered array of `shape` and `dtype` in a device buffer of `device`.

    Made by ops called with out="device", by DeviceArray.empty / from_numpy, or around a Buffer of the caller's
    (DeviceArray(buffer, shape, dtype), not owned: close() then leaves the buffer alone)."""

    def __init__(self, buffer, shape, dtype, owned=False):
        self.shape = _shape(shape)
        self.dtype = _dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        if buffer is not None and not all(hasattr(buffer, a) for a in ("size", "closed", "device")):
            raise TypeError(f"buffer: expected a vkmoe Buffer or None, got {type(buffer).__name__}")
        if self.nbytes and buffer is None:
            raise ValueError(f"a DeviceArray of shape {self.shape} {self.dtype} needs a buffer")
        if buffer is not None and buffer.size < self.nbytes:
            raise ValueError(f"shape {self.shape} of {self.dtype} needs {self.nbytes} bytes; the buffer holds "
                             f"{buffer.size}")
        self.buffer = buffer
        self._device = buffer.device if buffer is not None else None
        self._owned = owned
        self._closed = False

    @classmethod
    def empty(cls, device, shape, dtype):
        """An uninitialised DeviceArray in device memory (no buffer at all when it has no elements)."""
        expect_device(device)
        dims, dt = _shape(shape), _dtype(dtype)
        nbytes = math.prod(dims) * dt.itemsize
        if nbytes:  # (the error names the argument, not a buffer the caller never asked for)
            device.memory.check_fits(f"shape: {dims} of {dt}", nbytes)
        buffer = device.memory.allocate(nbytes) if nbytes else None
        arr = cls(buffer, shape, dtype, owned=True)
        arr._device = device
        return arr

    @classmethod
    def from_numpy(cls, device, array):
        """A DeviceArray holding a copy of `array` (empty() checks the device)."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"array must be a numpy array, got {type(array).__name__}")
        arr = cls.empty(device, array.shape, array.dtype)
        if arr.nbytes:
            try:
                arr.buffer.upload(np.ascontiguousarray(array))
            except BaseException:  # (the buffer was left allocated until the device closed)
                arr.close()
                raise
        return arr

    @property
    def device(self):
        return self._device

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def closed(self):
        """True once close() ran, the buffer was closed or its device was closed."""
        if self._closed or self.buffer is None:
            return self._closed
        return self.buffer.closed or self._device.closed

    def numpy(self):
        """A new numpy array with the contents. An op's call returns after its submission finished; a recording of
        the caller's that uses this array and was submitted without waiting is waited for first (VKMOE_TIMEOUT),
        so the read never races the GPU."""
        self._check_open("numpy()")
        if not self.nbytes:
            return np.zeros(self.shape, self.dtype)
        return self.buffer.download(self.dtype, self.shape)  # (which waits for such a run: Buffer.download)

    def _check_open(self, what):
        if self.closed:
            raise VkmoeError(f"{what}: the DeviceArray {self.shape} {self.dtype} is closed (its buffer or its "
                             "device was closed)")

    def check(self, name, device, shape, dtype):
        """Raise a clear error unless this array is open, lives on `device` and has `dtype` and `shape`
        (None in `shape` matches any size). Returns self."""
        if self.closed:
            raise VkmoeError(f"{name} is a closed DeviceArray (its buffer or its device was closed)")
        if self._device is not device:
            raise foreign_device_error(name, "DeviceArray", self._device, device)
        # (a numpy dtype equals its scalar type: no np.dtype() per call; the ops pass dtypes, and numpy's builtin
        # ones are singletons: `is` is the usual answer)
        if self.dtype is not dtype and self.dtype != dtype:
            raise TypeError(f"{name} must be {np.dtype(dtype)}, got a DeviceArray of {self.dtype}")
        if shape != self.shape and not _shape_matches(shape, self.shape):  # (equal shapes skip the per-axis test)
            want = "(" + ", ".join("m" if w is None else str(w) for w in shape) + ")"
            raise ValueError(f"{name} must have shape {want}, got a DeviceArray of shape {self.shape}")
        return self

    def close(self):
        """Free the buffer if this array owns it (arrays returned by ops do, and DeviceArray.empty / from_numpy's)."""
        if self._owned and self.buffer is not None and not self.buffer.closed and not self._device.closed:
            self.buffer.close()  # (a closed device already gave all its memory back)
        self._closed = True

    def __del__(self):
        # An owned array dropped without close() gives its memory back (it stayed allocated until the device
        # closed: a decode loop taking out="device" arrays and dropping them ran the device out of memory).
        try:
            if self._owned and not self._closed:
                self.close()
        except Exception:  # (at interpreter exit, or a failure nobody could handle in a finalizer)
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = " closed" if self.closed else ""
        return f"<vkmoe.DeviceArray {self.shape} {self.dtype}{state}>"


def _shape(shape):
    """`shape` as a tuple of ints >= 0 (an int n: (n,)); TypeError / ValueError naming it (2.5 and "4" were
    taken as 2 and 4, a negative size failed as a buffer size)."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape: expected a tuple of integers, got {shape!r}") from None
    if any(isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) for d in dims):
        raise TypeError(f"shape: expected a tuple of integers, got {shape!r}")
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must have non-negative dimensions, got {dims}")
    return tuple(int(d) for d in dims)


def _dtype(dtype):
    """`dtype` as a numeric numpy dtype (object and string dtypes were taken)."""
    dt = np.dtype(dtype)
    if dt.kind not in "biuf":
        raise TypeError(f"dtype: expected a numeric dtype, got {dt}")
    return dt


def _shape_matches(want, shape):
    """Whether `shape` has `want`'s dimensions, None in `want` matching any size (a loop, not a generator: this
    runs for every DeviceArray argument of a call, e.g. hidden (None, H))."""
    if len(want) != len(shape):
        return False
    for w, d in zip(want, shape):
        if w is not None and w != d:
            return False
    return True


def _last_gpu_ms(op):
    t = op.last_gpu_time
    return None if t is None else t.ms


# The `last_gpu_ms` property of the ops whose last call's vkmoe.vk.GpuTime is their `last_gpu_time`.
last_gpu_ms = property(_last_gpu_ms, doc="""The GPU time of the last call in ms (its timestamps, read when this is
    asked for), None before the first call; NaN when a later call submitted first (one that then failed, or a read
    racing it from another thread).""")


def resolve_out(out, device, shape, dtype, reads=()):
    """An op's `out` argument: None (return numpy), "device" (a new DeviceArray) or a DeviceArray to fill.
    Returns None or the DeviceArray the op writes. reads: the op's (name, input) pairs; a DeviceArray out may not
    share memory with a DeviceArray input (ValueError)."""
    if out is None:
        return None
    if isinstance(out, str):
        if out != "device":
            raise ValueError(f"out must be None, 'device' or a vkmoe DeviceArray, got {out!r}")
        return DeviceArray.empty(device, shape, dtype)
    if isinstance(out, DeviceArray):
        out.check("out", device, shape, dtype)
        refuse_shared_memory(out, reads)
        return out
    raise TypeError(f"out must be None, 'device' or a vkmoe DeviceArray, got {type(out).__name__}")


def refuse_shared_memory(out, reads):
    """ValueError when the DeviceArray `out` shares memory with a DeviceArray among the (name, input) `reads`: a
    call that binds both (a repeated pair) would read the input while its tails write the output (the linear's
    direct mode at m = 1 reads x in every GEMM workgroup)."""
    for name, value in reads:
        if isinstance(value, DeviceArray) and _share_memory(out, value):
            raise ValueError(f"out shares device memory with {name}: the op reads {name} while it writes out; pass "
                             "a separate DeviceArray")


def _share_memory(a, b):
    """Whether two DeviceArrays' bytes overlap (the same VkBuffer, overlapping ranges)."""
    if a.buffer is None or b.buffer is None or a.buffer.handle != b.buffer.handle:
        return False
    a0, b0 = a.buffer.offset, b.buffer.offset
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


# DeviceArrays a call passes again are bound in a recording of their own instead of copied to and from the io
# buffers: at most BOUND_RECORDINGS such recordings per (shape, path), the oldest evicted, and the pairs of arrays
# seen once remembered up to BOUND_SEEN (a fresh array per call, e.g. out="device" chained into the next op, stays
# on the copies: a recording per call would cost more than they do).
BOUND_RECORDINGS, BOUND_SEEN = 4, 32


def make_room_for_bound(recordings, prefix, close):
    """Before a new bound recording whose key starts with `prefix` goes into `recordings` (a dict: oldest first):
    pop and close(entry) the oldest bound ones with that prefix beyond BOUND_RECORDINGS - 1. A bound recording's
    key is its prefix followed by its arrays' Buffers, so it is longer than the prefix."""
    n = len(prefix)
    older = [k for k in recordings if len(k) > n and k[:n] == prefix]
    for k in older[:max(0, len(older) - (BOUND_RECORDINGS - 1))]:
        close(recordings.pop(k))


class RepeatedArrays:
    """The (shape..., input Buffer, output Buffer) pairs of DeviceArrays an op's calls passed, oldest first
    (Exl3MoeMlp, Exl3Linear). On the H200 a MoE call that copied them cost 13-16 us more than a numpy one;
    bound, the same as a numpy one (BENCHMARKS.md, ninth session)."""

    def __init__(self):
        self._seen = OrderedDict()

    def binding(self, shape, x, target):
        """(input Buffer or None, output Buffer or None) to bind in the call's recording, or None (the io buffers,
        DeviceArrays copied): bound from a pair's second call on. shape: a tuple; x: the call's input (a
        DeviceArray or not); target: the DeviceArray the output goes to, or None."""
        h = x.buffer if isinstance(x, DeviceArray) else None
        o = target.buffer if target is not None else None
        if h is None and o is None:
            return None
        key = (*shape, h, o)
        seen = self._seen
        if key in seen:
            seen.move_to_end(key)
            return h, o
        seen[key] = True
        if len(seen) > BOUND_SEEN:
            seen.popitem(last=False)
        return None


class CallTransfers:
    """The copies of one op call between DeviceArrays and the op's own input/output buffers, recorded into two
    small command buffers submitted with the op's recorded one: [copies in] [op] [copies out], ONE submission.
    Submission order spans command buffers, so a barrier closing the copies in and one opening the copies out
    order them around the op."""

    def __init__(self, device):
        self.device = device
        self._before = None
        self._after = None
        self._recorded = {}  # slot -> the copies it holds now: re-recorded only when they change

    def submit(self, rec, copies_in=(), copies_out=()):
        """Submit `rec` with the copies (src Buffer, dst Buffer, nbytes) and wait; the caller holds the device
        (device.use(): the ops hold it around their mapped io buffers' writes and reads anyway). The first run of
        a newly recorded forward gets the recorder's compile bound (vk.commands.COMPILE_TIMEOUT_S), later ones
        VKMOE_TIMEOUT."""
        before, after = self.riders(copies_in, copies_out)
        rec.submit_held(wait=True, before=before, after=after)

    def riders(self, copies_in=(), copies_out=()):
        """(before, after): the lists of recorders holding the copies, to submit around the op's buffer (recorded
        again only when the copies changed)."""
        before = [self._record("_before", copies_in, barrier_first=False)] if copies_in else []
        after = [self._record("_after", copies_out, barrier_first=True)] if copies_out else []
        return before, after

    def _record(self, slot, copies, barrier_first):
        # The Buffers themselves are the key (compared by identity; a Buffer's memory never moves): the key keeps
        # them alive, so a buffer freed and replaced can never match a stale recording.
        key = list(copies)
        rec = getattr(self, slot)
        if rec is not None and self._recorded.get(slot) == key:
            return rec  # a runtime calling with the same arrays: the copies are recorded already
        if rec is None:
            rec = CommandRecorder(self.device)
            setattr(self, slot, rec)
        rec.begin()
        if barrier_first:
            rec.barrier()
        for src, dst, nbytes in copies:
            rec.copy(src, dst, nbytes)
        rec.barrier()
        rec.end()
        self._recorded[slot] = key
        return rec

    def close(self):
        for slot in ("_before", "_after"):
            rec = getattr(self, slot)
            if rec is not None:
                rec.close()
                setattr(self, slot, None)
        self._recorded.clear()


def close_recording(rec, sets=(), buffers=()):
    """Free a recorded command buffer, the descriptor sets its commands use (the recorder does not free them)
    and its buffers."""
    try:
        with rec.device.use():  # a concurrent Device.close() waits for this instead of racing it
            rec.close()
            for d in sets:
                d.free()
    except DeviceClosedError:
        pass  # the device destroyed them with everything made from it
    for b in buffers:
        b.close()
