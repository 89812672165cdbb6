"""The native call path: the host side of a recorded op call (write the inputs into mapped buffers, reset the
fence, submit, wait, read the output) in two C calls of vkmoe._native (native/vkn_call.c) instead of numpy view
writes and about ten calls into the `vulkan` binding (each a libffi call from Python). The C side spins on the fence for the recorder's spin
time (CommandRecorder.spin_s, or on a GPU about as long as its last run took); a longer wait is CommandRecorder._wait's, with VKMOE_TIMEOUT, as on the Python
path.

The C side links no Vulkan: it calls the same loader functions the binding calls, by the addresses the binding
exposes, so validation layers see every call. vkmoe._native is optional (it is built with a C compiler); without
it, or with VKMOE_NATIVE_CALL=0, `enabled()` is False and the ops run their Python path, which does the same.
"""
from typing import NamedTuple

import numpy as np
import vulkan as vk

from .. import knobs
from .errors import check

try:
    from .. import _native
except ImportError:  # an unbuilt checkout: the Python path runs
    _native = None
# An older build of the module has only the CPU tier.
_lib = _native.lib if _native is not None and hasattr(_native.lib, "vkn_call_submit") else None
_ffi = _native.ffi if _lib is not None else None
NULL = _ffi.NULL if _ffi is not None else None

# The loader entry points the C side calls, by vkn_call field: (function name, the field's C type).
_ENTRY_POINTS = {"reset_fences": ("vkResetFences", "vkn_reset_fences_fn"),
                 "queue_submit": ("vkQueueSubmit", "vkn_queue_submit_fn"),
                 "get_fence_status": ("vkGetFenceStatus", "vkn_get_fence_status_fn")}


def available():
    """Whether vkmoe._native has the call path (it is built with a C compiler; see README)."""
    return _lib is not None


def enabled():
    """Whether op calls take the native call path now: available, and VKMOE_NATIVE_CALL is not 0."""
    return _lib is not None and knobs.get("VKMOE_NATIVE_CALL")


def _address(cdata):
    return int(vk.ffi.cast("uintptr_t", cdata))


def _conversions():
    """{(from dtype, to dtype): vkn conversion code} of what the C side converts itself (exactly as numpy does);
    a copy between equal dtypes is VKN_CONV_COPY, other pairs numpy converts first."""
    pairs = ((np.int64, np.int32, _lib.VKN_CONV_I64_TO_I32), (np.float64, np.float32, _lib.VKN_CONV_F64_TO_F32),
             (np.float16, np.float32, _lib.VKN_CONV_F16_TO_F32))
    return {(np.dtype(a), np.dtype(b)): code for a, b, code in pairs}


class IndexRule(NamedTuple):
    """An input's values are integers in [0, bound), distinct within each row of `row` elements."""
    bound: int
    row: int


class BoundedRule(NamedTuple):
    """An input's values are finite, with |v| <= limit."""
    limit: float


class _Rejected(Exception):
    """vkn_call_submit found a checked input breaking its rule (nothing was copied or submitted)."""


class _Slot:
    """One mapped buffer of a call (input `index`; the output's is None): its dtype and shape, the conversions
    the C side does into it (`into`, by source dtype: the code already shifted to the slot's place in the packed
    convs) and out of it (`out_of`, by destination dtype), and the rule C may check its input against
    (check_bit: its bit in vkn_call_submit's mask, 0 without a rule). Run reads these on every call."""
    __slots__ = ("index", "dtype", "shape", "count", "into", "out_of", "rule", "check_bit")

    def __init__(self, index, struct, buffer, dtype, shape, rule=None):
        if not buffer.mapped:
            raise ValueError("the native call path needs host-mapped io buffers")
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)
        struct.mapped = _ffi.cast("void *", _address(buffer.block.pointer + buffer.offset))
        struct.count = self.count = int(np.prod(self.shape, dtype=np.int64))
        struct.elem_bytes = self.dtype.itemsize
        if struct.count * self.dtype.itemsize > buffer.size:
            raise ValueError(f"{self.shape} {self.dtype} does not fit the {buffer.size}-byte buffer")
        self.index, shift = index, _CONV_BITS * (index or 0)
        self.into = {self.dtype: _COPY, **{a: c << shift for (a, b), c in _CONVERSIONS.items() if b == self.dtype}}
        self.out_of = {self.dtype: _COPY, **{b: c for (a, b), c in _CONVERSIONS.items() if a == self.dtype}}
        self.rule, self.check_bit = rule, 0 if rule is None else 1 << index
        if isinstance(rule, IndexRule):
            struct.rule, struct.bound, struct.row = _lib.VKN_RULE_INDEX, rule.bound, rule.row
            if rule.row < 1 or self.count % rule.row:
                raise ValueError(f"{self.shape} does not split into rows of {rule.row}")
        elif isinstance(rule, BoundedRule):
            struct.rule, struct.limit = _lib.VKN_RULE_BOUNDED, rule.limit
        elif rule is not None:
            raise TypeError(f"rule must be an IndexRule or a BoundedRule, got {rule!r}")

    def conversion_into(self, dtype):
        """The packed conversion code C copies a host array of numpy dtype `dtype` into this slot with, or None
        where numpy must convert it first. (numpy's builtin dtypes are singletons: the usual input, already of the
        slot's dtype, needs no hash.)"""
        return _COPY if dtype is self.dtype else self.into.get(dtype)


class NativeCall:
    """The vkn_call of one recorded op call: the entry points, the recorder's device, queue and fence, the
    mapped buffers its host inputs go to (up to four: (Buffer, dtype, shape) or (Buffer, dtype, shape, rule),
    rule an IndexRule or a BoundedRule that C may check the input against) and its output comes from (Buffer,
    dtype, shape). Valid while the recorder and the buffers are (the op frees them together)."""
    PENDING = None  # set below: vkn_call_finish's "still running"

    def __init__(self, rec, inputs, output):
        if len(inputs) > _INPUTS:
            raise ValueError(f"the native call path takes at most {_INPUTS} inputs, got {len(inputs)}")
        self.rec, self.lib = rec, _lib
        c = self.struct = _ffi.new("vkn_call *")
        for field, (name, ctype) in _ENTRY_POINTS.items():
            setattr(c, field, _ffi.cast(ctype, _address(vk.ffi.addressof(vk.lib, name))))
        dev = rec.device
        c.device = _ffi.cast("void *", _address(dev.handle))
        c.queue = _ffi.cast("void *", _address(dev.queue))
        c.fence = _ffi.cast("uint64_t *", _address(rec._fences))
        c.spin_s = self._spin_s = rec._spin_next  # (_spin_s: what the struct holds, compared without cffi)
        self.inputs = [_Slot(i, getattr(c, "in")[i], *spec) for i, spec in enumerate(inputs)]
        self.output = _Slot(None, c.out, *output)

    def run(self, arrays, out_dtype=None, before=(), after=(), check=None):
        """Copy `arrays` (numpy arrays of the inputs' shapes, any dtype numpy can convert; None: the input is
        not written, e.g. a DeviceArray copied by a rider) into the mapped inputs, submit with `before` /
        `after` riders, wait, and return the output as a new numpy array of `out_dtype` (a numpy dtype; None:
        no output copy, returns None). The caller holds device.use().

        check: None, or the caller's own check of the inputs' values, check(arrays), which raises on bad input
        (the authority, and what names the problem). C then checks the inputs that have rules instead, in the
        same call as the copies (cheaper than any numpy reduction on a decode step's few values); check runs only
        where C cannot do it: on an input numpy converts first (C would see the converted values), and when C
        rejects one (so that the error is the caller's)."""
        convs = checks = 0
        sources, from_buffer = [NULL] * _INPUTS, _ffi.from_buffer
        for slot, a in zip(self.inputs, arrays):
            if a is None:
                continue
            if a.size != slot.count:  # the C copy trusts the sizes: never read past an array (the op checked
                raise ValueError(f"expected an array of shape {slot.shape}, got {a.shape}")  # the shape)
            source, conv = None, slot.conversion_into(a.dtype)
            if conv is not None:
                try:
                    source = from_buffer(a)
                except ValueError:  # not C-contiguous
                    pass
            if source is None:  # numpy converts it first
                if check is not None and slot.check_bit:
                    check(arrays)  # on the values as the caller gave them: then C need check none
                    check = None
                conv, source = _COPY, from_buffer(np.ascontiguousarray(a, slot.dtype))  # (the cdata keeps it)
            sources[slot.index] = source
            convs |= conv
            checks |= slot.check_bit
        if check is None:
            checks = 0
        self._begin(convs, checks, sources, arrays, check, before, after)
        # (while the GPU runs: the output array costs the call no wall time here)
        out, out_conv, dst = None, 0, NULL
        if out_dtype is not None:
            slot = self.output
            out_conv = _COPY if out_dtype is slot.dtype else slot.out_of.get(out_dtype)
            out = np.empty(slot.shape, slot.dtype if out_conv is None else out_dtype)
            out_conv, dst = out_conv or 0, from_buffer(out)
        self.rec.finish_native(self, out_conv, dst)
        if out is not None and out.dtype is not out_dtype and out.dtype != out_dtype:  # a narrowing the C side
            out = out.astype(out_dtype)  # does not do (numpy rounds)
        return out

    def prepare(self, dtypes):
        """What run_prepared needs for host inputs of numpy dtypes `dtypes` (one per input slot, in order): the
        packed conversions, the check mask and the byte sizes the inputs must have, or None where C cannot take
        one of them as it is (run() then has numpy convert it first). An op keeps it per call signature
        (Exl3MoeMlp's hot calls)."""
        convs = checks = 0
        if len(dtypes) != len(self.inputs):
            return None
        for slot, dtype in zip(self.inputs, dtypes):
            conv = slot.conversion_into(dtype)
            if conv is None:
                return None
            convs, checks = convs | conv, checks | slot.check_bit
        return convs, checks, [slot.count * np.dtype(dtype).itemsize for slot, dtype in zip(self.inputs, dtypes)]

    def run_prepared(self, prepared, arrays, check):
        """run(arrays, the output slot's dtype, check=check) for host inputs the caller vouches for: numpy arrays
        of exactly the slots' shapes and of the dtypes `prepared` (prepare) was made for; each must be
        C-contiguous (else ValueError, from cffi, before anything is written or submitted). The same copies,
        checks and submission as run() with none of its per-slot decisions (a decode step's calls are the same
        signature every time). The caller holds device.use()."""
        convs, checks, nbytes = prepared
        from_buffer = _ffi.from_buffer
        sources = [from_buffer(a) for a in arrays]
        if [len(s) for s in sources] != nbytes:  # (as run(): the C copy trusts the sizes; never read past an array)
            raise ValueError(f"expected arrays of shapes {[slot.shape for slot in self.inputs]}, got "
                             f"{[a.shape for a in arrays]}")
        sources += [NULL] * (_INPUTS - len(sources))
        self._begin(convs, checks, sources, arrays, check)
        # (while the GPU runs: the output array costs the call no wall time here)
        out = np.empty(self.output.shape, self.output.dtype)
        self.rec.finish_native(self, _COPY, from_buffer(out))
        return out

    def _begin(self, convs, checks, sources, arrays, check, before=(), after=()):
        """The submission of run() and run_prepared() (CommandRecorder.begin_native): where C rejects a checked
        input, the caller's check(arrays) raises, naming the problem; if it finds none, C's rule was stricter than
        the caller's check, which is the authority, and the inputs go in unchecked."""
        rec = self.rec
        if rec._spin_next != self._spin_s:  # (the spin the last run asks for; tests change spin_s too)
            self.struct.spin_s = self._spin_s = rec._spin_next
        try:
            rec.begin_native(self, convs, checks, sources, before, after)
        except _Rejected:
            check(arrays)
            rec.begin_native(self, convs, 0, sources, before, after)

    def raise_error(self, result):
        """VulkanError naming the entry point that returned `result` (_Rejected: a checked input broke its
        rule)."""
        if result == _lib.VKN_REJECTED:
            raise _Rejected(self.struct.rejected)
        name = _FAILED_CALLS.get(self.struct.failed, "the native call path")
        check(name, result)


if _lib is not None:
    NativeCall.PENDING = _lib.VKN_PENDING
    _CONVERSIONS = _conversions()  # built once, not per mapped buffer
    _INPUTS, _CONV_BITS, _COPY = _lib.VKN_CALL_INPUTS, _lib.VKN_CONV_BITS, _lib.VKN_CONV_COPY
    _FAILED_CALLS = {_lib.VKN_FAILED_RESET: "vkResetFences", _lib.VKN_FAILED_SUBMIT: "vkQueueSubmit",
                     _lib.VKN_FAILED_STATUS: "vkGetFenceStatus"}
