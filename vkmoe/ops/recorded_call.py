"""RecordedCall: an op call's recorded command buffer with its mapped io buffers, and the host side of one call:
write the inputs, ONE submission, wait, read the output. Exl3MoeMlp, Exl3Linear and the device block run every
call through it.

Two paths do the same. From a recording's second submission on, where vkmoe._native has it (and
VKMOE_NATIVE_CALL is not 0), the native call path (vkmoe.vk.fastcall) does the copies, the submission and the
wait in two C calls. Otherwise, and always for a recording's first submission (which may include the driver's
lazy shader compile and gets the compile bound, CallTransfers.submit), numpy views of the mapped buffers and
CommandRecorder.submit_held. DeviceArray inputs and outputs are copied on the device by CallTransfers' riders in
the same submission on both paths, except those the recording binds itself (bound_inputs, bound_output: the
recordings of Exl3MoeMlp and Exl3Linear for arrays a caller passes again, device_array.RepeatedArrays), which
need no copy at all.
"""
import math

import numpy as np

from ..vk import fastcall
from .device_array import DeviceArray

_U32 = np.dtype(np.uint32)
POISON_F32 = 0x7FC00000  # a quiet NaN: what an op's output starts as, so an element the device forgets shows up
# The most hot call signatures an op keeps (Exl3MoeMlp, DeviceMoeBlock: a server sees many m; one more clears them).
HOT_CALLS_MAX = 64


class RecordedCall:
    """`rec` (recorded, with the forward's commands) and its io: `inputs` [(Buffer, dtype, shape)] that the host
    writes (mapped upload memory; a fourth element, a fastcall.IndexRule or BoundedRule, lets the native path
    check that input's values in C: see run's `check`), `output` (Buffer, dtype, shape) that the host reads
    (mapped readback memory), optionally followed by a status word."""

    def __init__(self, rec, inputs, output, bound_inputs=(), bound_output=False):
        """bound_inputs: the input slots whose DeviceArray the recording binds itself (the call passes that array
        and nothing is copied); bound_output: likewise the output (the call's target)."""
        self.rec, self.inputs, self.output = rec, list(inputs), output
        self.bound_inputs, self.bound_output = frozenset(bound_inputs), bound_output
        self._status_offset = math.prod(output[2]) * np.dtype(output[1]).itemsize
        self._native = None  # the fastcall.NativeCall, made at the first call that takes that path

    def run(self, transfers, arrays, target=None, out_dtype=None, check=None):
        """One call: `arrays` per input a numpy array of its shape (written, converted to its dtype) or a
        DeviceArray (copied on the device); the output goes to the DeviceArray `target`, or (None) comes back
        as a new numpy array of numpy dtype `out_dtype`. Returns that array, or None for a target. The caller
        holds the op's call lock and device.use() (a closed device's memory is unmapped).

        check: None, or the op's check of the inputs' values, check(arrays), raising on bad input before
        anything is written or submitted: the Python path runs it, the native path checks the inputs' rules in C
        instead and runs it only where C cannot decide (NativeCall.run)."""
        on_device = DeviceArray in map(type, arrays)
        if (on_device or target is not None) and self.rec.device.in_flight.has_unwaited:
            self.rec.device.in_flight.wait_for_unwaited(
                [a.buffer for a in (*arrays, target) if isinstance(a, DeviceArray)])
        copies_in = [(a.buffer, spec[0], a.nbytes) for i, (a, spec) in enumerate(zip(arrays, self.inputs))
                     if isinstance(a, DeviceArray) and i not in self.bound_inputs] if on_device else ()
        copies_out = [(self.output[0], target.buffer, target.nbytes)] \
            if target is not None and not self.bound_output else ()
        rec = self.rec
        if rec.submissions and fastcall.enabled():
            native = self._native
            if native is None:
                native = self._native = fastcall.NativeCall(rec, self.inputs, self.output)
            before, after = transfers.riders(copies_in, copies_out) if copies_in or copies_out else ((), ())
            if on_device:  # (written on the device: by the copies or in place)
                arrays = [None if isinstance(a, DeviceArray) else a for a in arrays]
            return native.run(arrays, None if target is not None else out_dtype, before, after, check)
        if check is not None:
            check(arrays)
        for a, (buf, dtype, shape, *_) in zip(arrays, self.inputs):
            if not isinstance(a, DeviceArray):
                buf.host_view(dtype, shape)[...] = a
        transfers.submit(rec, copies_in, copies_out)
        if target is not None:
            return None
        buf, dtype, shape = self.output
        return buf.host_view(dtype, shape).astype(out_dtype)

    @property
    def native(self):
        """The fastcall.NativeCall of this call, or None before a call took the native path."""
        return self._native

    def status_word(self):
        """The uint32 the recording copied right behind the output (a persistent launch's abort word)."""
        return int(self.output[0].host_view(_U32, (1,), self._status_offset)[0])
