"""CommandRecorder: record dispatches, barriers, copies and timestamps into a reusable command buffer; submit
and wait with a timeout (vkmoe.TimeoutError instead of blocking forever).

Submission is on every op call's path, so it goes to the cffi functions directly with structs built once per
recorder, and the wait spins on the fence status for a short while before sleeping (on the H200 host an empty
submit + wait took 71.6 us sleeping in vkWaitForFences and 42.9 us spinning)."""
import contextlib
import functools
import math
import time
import weakref

import numpy as np
import vulkan as vk

from .. import forksafe, knobs
from .errors import TimeoutError, VkmoeError, call, check, foreign_device_error

ffi = vk.ffi

# How long wait() polls vkGetFenceStatus before it sleeps in vkWaitForFences: longer than a small kernel, short
# enough that a long one costs little CPU. On a CPU device (lavapipe) the "GPU" is the host's own cores, which
# a spinning thread would take from the driver's workers, so it never spins there.
SPIN_BEFORE_SLEEP_S = 0.0005

# On a GPU a recorder whose last run took longer spins about that long (RUN_SPIN_FACTOR x the time its last wait
# saw, in steps of SPIN_STEP_S, at most MAX_SPIN_S) before it sleeps: waking from vkWaitForFences cost the H100 host
# 200-350 us per submission (tools/bench_decode: 16 chained Qwen3 blocks, 634 us of GPU work, took 901 us of wall
# time sleeping past the 0.5 ms spin). A spin ends as soon as the fence signals, so a longer bound costs no latency,
# only a busy core while a long run runs (what CUDA's default wait does too).
RUN_SPIN_FACTOR = 1.25
SPIN_STEP_S = 0.00005
MAX_SPIN_S = 0.01

# How long the first run of a freshly recorded command buffer may take when the caller names no timeout: lavapipe
# compiles a pipeline at its first dispatch (4.5 s for a tiny split layer on Mesa 25, 70-140 s for a persistent
# one on a cold, busy machine), which must not be mistaken for a hung device. Later runs get VKMOE_TIMEOUT.
COMPILE_TIMEOUT_S = 600

# Timestamp slots one recorder may have: far more than any chain of layers needs (tools/bench_decode's 58 layers x 24
# phases), bounded because the slots' host array is allocated up front.
MAX_TIMESTAMP_SLOTS = 1 << 16

_submissions = 0  # vkQueueSubmit calls made by this process (submission_count())
_native_submissions = 0  # those made through the native call path (native_submission_count())


def submission_count():
    """How many vkQueueSubmit calls CommandRecorders have made in this process (for tests and profiling)."""
    return _submissions


def native_submission_count():
    """How many of them the native call path (begin_native) made: tests and tools see which path ran."""
    return _native_submissions


def _submit_info(handles):
    """(a VkSubmitInfo of these command buffers, the handle array it points at: keep both alive)."""
    array = ffi.new("VkCommandBuffer[]", handles)
    info = ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": len(handles),
                                     "pCommandBuffers": array})
    return info, array

_SHADER_STAGES = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
_ACCESS = (vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_READ_BIT
           | vk.VK_ACCESS_TRANSFER_WRITE_BIT)


def _holds_device(method):
    """Run a recording method with the device held open: a concurrent Device.close() waits for the driver call
    instead of freeing the command buffer under it, and a call after close() raises DeviceClosedError."""
    @functools.wraps(method)
    def held(self, *args, **kwargs):
        with self.device.use():
            return method(self, *args, **kwargs)
    return held


def _check_timeout(timeout):
    """A caller's timeout: a number of seconds >= 0 (NaN failed deep in the wait, or not at all)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)) \
            or not timeout >= 0:
        raise ValueError(f"timeout: expected a number of seconds >= 0 or None, got {timeout!r}")


def wait_fences(device, fences, seconds):
    """Whether `fences` (a cffi VkFence[1] of `device`) signalled within `seconds`, waited for in slices of at
    most 0.25 s (Ctrl-C stays responsive); VulkanError if the wait fails (a lost device). The caller holds the
    device (device.use())."""
    deadline = time.monotonic() + seconds
    left = max(0.0, seconds)
    while True:
        result = vk.lib.vkWaitForFences(device.handle, 1, fences, vk.VK_TRUE, int(min(left, 0.25) * 1e9))
        if result == vk.VK_SUCCESS:
            return True
        check("vkWaitForFences", result, ok=(vk.VK_TIMEOUT,))
        left = deadline - time.monotonic()
        if left <= 0:
            return False


def check_buffer(name, buf, device):
    """`buf` (the argument `name`) an open vkmoe Buffer of `device`: TypeError / VkmoeError / ValueError naming it.
    Duck-typed: vk.memory imports this module, so no isinstance on its Buffer. (vkmoe.ops.record_args checks the
    ops' raw-buffer arguments with it too.)"""
    if not all(hasattr(buf, a) for a in ("closed", "size", "offset", "handle", "device")):
        raise TypeError(f"{name}: expected a vkmoe Buffer, got {type(buf).__name__}")
    if buf.closed:
        raise VkmoeError(f"{name} is a closed Buffer")
    if buf.device is not device:
        raise foreign_device_error(name, "Buffer", buf.device, device)


def _first_run_running(recorder, submission, submitted_at, now):
    """Whether `recorder`'s submission number `submission` (a first run, submitted at `submitted_at`) is, as far as
    its owner has seen, still running, and within its compile allowance."""
    return (recorder._pending and recorder.submissions == submission
            and now < submitted_at + COMPILE_TIMEOUT_S)


class GpuTime:
    """The GPU time of one submission of a recorder (between its first and last timestamps), read from the query
    pool only when `ms` is asked for: vkGetQueryPoolResults is a driver call (10-50 us on lavapipe) that an op
    would otherwise make on every call for a number a runtime rarely reads. While this object is referenced, the
    recorder reads it before anything overwrites the results (its next submission, re-recording or close), so
    `ms` is always that of its own submission."""
    __slots__ = ("_rec", "_ms", "__weakref__")

    def __init__(self, rec):
        self._rec, self._ms = rec, None

    @property
    def ms(self):
        rec = self._rec  # None once read or forgotten (by this or another thread)
        if rec is not None:
            rec._settle(self, hold=True)
        return self._ms

    def forget(self):
        """Nobody will ask for this time (an op about to submit again drops its last report's): the recorder
        then need not read it before that submission; `ms` becomes NaN unless it was read already."""
        rec = self._rec
        if rec is not None:  # (None: read, forgotten, or settled by a later submission)
            self._rec = None
            if self._ms is None:
                self._ms = float("nan")
            rec._gpu_time = None  # the recorder's next gpu_time() makes a new one


UNREAD_GPU_TIME = GpuTime(None)  # the GpuTime of a submission whose results are gone: ms NaN
UNREAD_GPU_TIME._ms = float("nan")


class CommandRecorder:
    """A command buffer with its own pool, fence and timestamp query pool.

    Recording: begin(); dispatch()/barrier()/copy()/fill()/timestamp() ...; end(). A recorded buffer can be
    submitted any number of times. `timestamps` sets how many timestamp slots exist (0 = none).
    """

    def __init__(self, device, timestamps=0, untracked=False):
        try:
            use = device.use
        except AttributeError:  # (device.expect_device's message; device.py imports this module: no isinstance)
            raise TypeError(f"device: expected a vkmoe.Device, got {type(device).__name__}") from None
        if isinstance(timestamps, bool) or not isinstance(timestamps, (int, np.integer)) \
                or not 0 <= timestamps <= MAX_TIMESTAMP_SLOTS:  # (10**9 slots took 8 GB of host memory at once)
            raise ValueError(f"timestamps: expected an integer number of slots in 0 .. {MAX_TIMESTAMP_SLOTS}, got "
                             f"{timestamps!r}")
        with use():  # a concurrent Device.close() waits until the recorder exists and is tracked
            self._create(device, timestamps, untracked)

    def _create(self, device, timestamps, untracked):
        self.device = device
        h = device.handle
        self._pool = call("vkCreateCommandPool", vk.vkCreateCommandPool, h, vk.VkCommandPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT, queueFamilyIndex=device.queue_family), None)
        self.handle = call("vkAllocateCommandBuffers", vk.vkAllocateCommandBuffers, h, vk.VkCommandBufferAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=self._pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
        self._fence = call("vkCreateFence", vk.vkCreateFence, h,
                           vk.VkFenceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO), None)
        self.timestamp_slots = int(timestamps)
        self._query_pool = None
        if self.timestamp_slots:
            if device.timestamp_valid_bits == 0:
                raise VkmoeError(f"{device.name}: the compute queue has no timestamp support")
            self._query_pool = call("vkCreateQueryPool", vk.vkCreateQueryPool, h, vk.VkQueryPoolCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO, queryType=vk.VK_QUERY_TYPE_TIMESTAMP,
                queryCount=self.timestamp_slots), None)
        self._recording = False
        self._recorded = False
        self._pending = False
        self.submissions = 0  # of this command buffer
        self._fresh = False  # recorded since its last submission: the next run may include the driver's compile
        self._pending_fresh = False  # the pending submission is such a first run (waits get COMPILE_TIMEOUT_S)
        self._queued_behind = ()  # other recorders' first runs that were on the queue when this one was submitted
        self._close_deferred = False  # close() found its submission still running: the objects go later (close())
        self._riding_on = None  # the recorder whose submission (and fence) carried this buffer last
        self._adaptive_spin = device.device_type != "cpu"
        self._run_s = 0.0  # how long the last wait saw this buffer's run take (from submission to the fence)
        self._submit_t = 0.0
        self.spin_s = 0.0 if device.device_type == "cpu" else SPIN_BEFORE_SLEEP_S  # (sets _spin_next)
        # Built once: what submit() and wait() hand to the cffi functions.
        self._fences = ffi.new("VkFence[1]", [self._fence])
        self._own_info = _submit_info([self.handle])  # a submission of this buffer alone
        self._rider_key = self._rider_info = None  # the last submission with riders: its riders and its info
        self._last_riders = ()  # the riders of the last submission (None: this buffer's place)
        self._stamp_data = ffi.new("uint64_t[]", max(1, self.timestamp_slots))
        bits = device.timestamp_valid_bits
        self._stamp_mask = (1 << bits) - 1 if bits < 64 else (1 << 64) - 1
        self._stamp_period_ms = device.limits.timestampPeriod * 1e-6
        self._stamp_lock = forksafe.Lock()
        self._gpu_time = None  # a weak reference to the GpuTime of the last submission (see gpu_time())
        self._next_timestamp = 0
        self._keep = []  # descriptor sets and push data referenced by the recorded commands
        # The Buffers, Pipelines and descriptor sets the recorded commands use (vk.in_flight: closing one waits for
        # a run of this buffer, and marks the recording stale: _stale says why it may not be submitted again).
        self._uses = set()
        self._stale = None
        self._untracked = untracked
        # close() from two threads (the owner's and the device's close) freed everything twice: one at a time, and
        # a nested close() on the same thread (a finalizer that a collection runs inside it) does nothing.
        self._close_lock = forksafe.RLock()
        self._closing = False
        device.in_flight.add(self)
        if not untracked:
            device.track(self)

    # ------------------------------------------------------------------------------------------- recording
    @_holds_device
    def begin(self):
        self._check_open()
        self._wait_for_carrier()
        if self._pending:
            self.wait()
        self._settle_gpu_time()
        call("vkResetCommandBuffer", vk.vkResetCommandBuffer, self.handle, 0)
        call("vkBeginCommandBuffer", vk.vkBeginCommandBuffer, self.handle, vk.VkCommandBufferBeginInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
        self._recording, self._recorded = True, False
        self._keep = []
        self._uses, self._stale = set(), None
        self._next_timestamp = 0
        if self._query_pool is not None:
            vk.vkCmdResetQueryPool(self.handle, self._query_pool, 0, self.timestamp_slots)
        return self

    def _check_open(self):
        self.device.check_open()
        if self.handle is None or self._close_deferred:
            raise VkmoeError("CommandRecorder used after close()")

    def _check_recording(self):
        self._check_open()
        if not self._recording:
            raise VkmoeError("record commands between begin() and end()")

    @_holds_device
    def dispatch(self, pipeline, descriptor_set, groups, push=None):
        """Dispatch `pipeline` over `groups` workgroups (int or (x, y, z)) with a descriptor set and push block."""
        self._check_recording()
        self._check_dispatch_objects(pipeline, descriptor_set)
        counts = (groups,) if np.isscalar(groups) else tuple(groups)
        if not 1 <= len(counts) <= 3 or any(isinstance(n, bool) or not isinstance(n, (int, np.integer))
                                            for n in counts):
            raise TypeError(f"{pipeline.name}: groups must be an integer or 1 to 3 integers, got {groups!r}")
        x, y, z = counts + (1,) * (3 - len(counts))
        limit = self.device.limits.maxComputeWorkGroupCount
        for axis, (n, cap) in enumerate(zip((x, y, z), limit)):
            if not 0 <= n <= cap:
                raise VkmoeError(f"{pipeline.name}: {n} workgroups on axis {axis}: expected 0 .. {cap} (the device's "
                                 "limit)")
        if push is not None and not isinstance(push, pipeline.push_type or type(None)):
            raise TypeError(f"{pipeline.name} expects push constants of type {pipeline.push_type.__name__}, "
                            f"got {type(push).__name__}")
        if pipeline.push_type is not None and push is None:
            raise TypeError(f"{pipeline.name} needs push constants ({pipeline.push_type.__name__})")
        self._note_uses(pipeline, descriptor_set, *descriptor_set.buffers)
        cb = self.handle
        vk.vkCmdBindPipeline(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipeline.handle)
        vk.vkCmdBindDescriptorSets(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipeline.layout, 0, 1,
                                   [descriptor_set.handle], 0, None)
        self._keep.append(descriptor_set)
        if push is not None:
            data = ffi.new("char[]", push.tobytes())
            self._keep.append(data)
            vk.lib.vkCmdPushConstants(cb, pipeline.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, pipeline.push_type.size(),
                                      data)
        if x and y and z:
            vk.vkCmdDispatch(cb, x, y, z)

    def _check_dispatch_objects(self, pipeline, descriptor_set):
        """The pipeline and descriptor set of a dispatch: open, of this device, every bound buffer open (a closed
        pipeline crashed the driver in vkCmdBindPipeline; a freed buffer's descriptor is undefined on the GPU)."""
        if not hasattr(pipeline, "layout") or getattr(pipeline, "closed", True) or pipeline.handle is None:
            what = "closed" if hasattr(pipeline, "layout") else f"not a vkmoe Pipeline ({type(pipeline).__name__})"
            raise VkmoeError(f"pipeline: {getattr(pipeline, 'name', 'the pipeline')} is {what}")
        if pipeline.device is not self.device:
            raise foreign_device_error(f"pipeline {pipeline.name}", "Pipeline", pipeline.device, self.device)
        if getattr(descriptor_set, "handle", None) is None or not hasattr(descriptor_set, "buffers"):
            raise VkmoeError(f"{pipeline.name}: the descriptor set is freed or not one of Pipeline.bind()'s")
        for i, b in enumerate(descriptor_set.buffers):
            if b.closed:
                raise VkmoeError(f"{pipeline.name}: the descriptor set's binding {i} is a closed Buffer")
            if b.device is not self.device:
                raise foreign_device_error(f"{pipeline.name}: the descriptor set's binding {i}", "Buffer", b.device,
                                           self.device)

    def _note_uses(self, *objs):
        """Note open objects (checked by the caller) that the command being recorded uses, before it is recorded:
        from then on closing one waits for this buffer's runs (vk.in_flight). One that another thread closed
        since the caller's check is refused here, and the command is not recorded."""
        uses = self._uses
        new = [o for o in objs if o not in uses]
        uses.update(new)
        closed = next((o for o in objs if o.closed), None)
        if closed is not None:
            uses.difference_update(new)
            raise VkmoeError(f"{type(closed).__name__} {getattr(closed, 'name', '')}".rstrip()
                             + " was closed while a command using it was being recorded")

    @_holds_device
    def barrier(self):
        """Make every earlier shader/transfer write visible to every later shader/transfer access."""
        self._check_recording()
        mb = vk.VkMemoryBarrier(sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, srcAccessMask=_ACCESS, dstAccessMask=_ACCESS)
        vk.vkCmdPipelineBarrier(self.handle, _SHADER_STAGES, _SHADER_STAGES, 0, 1, [mb], 0, None, 0, None)

    @_holds_device
    def host_barrier(self):
        """Make shader writes visible to host reads after the fence (for host-visible result buffers)."""
        self._check_recording()
        mb = vk.VkMemoryBarrier(sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, srcAccessMask=_ACCESS,
                                dstAccessMask=vk.VK_ACCESS_HOST_READ_BIT)
        vk.vkCmdPipelineBarrier(self.handle, _SHADER_STAGES, vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, [mb], 0, None, 0, None)

    @_holds_device
    def copy(self, src, dst, nbytes, src_offset=0, dst_offset=0):
        """Copy nbytes from src (at src_offset) to dst (at dst_offset): both open Buffers of this device, the
        ranges inside them and not overlapping (checked: a recorded copy past a buffer's end, or of a freed one,
        is undefined on the GPU)."""
        self._check_recording()
        self._check_range("src", src, src_offset, nbytes)
        self._check_range("dst", dst, dst_offset, nbytes)
        a, b = src.offset + src_offset, dst.offset + dst_offset
        if src.handle == dst.handle and a < b + nbytes and b < a + nbytes:
            raise ValueError(f"copy: the src and dst ranges overlap ({nbytes} bytes at {a} and at {b} of one "
                             "VkBuffer)")
        self._note_uses(src, dst)
        region = vk.VkBufferCopy(srcOffset=a, dstOffset=b, size=nbytes)
        vk.vkCmdCopyBuffer(self.handle, src.handle, dst.handle, 1, [region])

    @_holds_device
    def fill(self, buf, value=0, nbytes=None, offset=0):
        """Fill with a repeated 32-bit word (size rounded down to a multiple of 4; offset a multiple of 4; the
        range inside the buffer, checked)."""
        self._check_recording()
        check_buffer("buf", buf, self.device)
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset % 4:
            raise ValueError(f"fill: offset must be a multiple of 4 bytes, got {offset!r}")
        size = buf.size - offset if nbytes is None else nbytes
        if isinstance(size, (int, np.integer)) and not isinstance(size, bool) and 0 <= size < 4:
            return  # (nothing to fill after rounding down)
        self._check_range("buf", buf, offset, size)
        self._note_uses(buf)
        vk.vkCmdFillBuffer(self.handle, buf.handle, buf.offset + offset, size // 4 * 4, int(value) & 0xFFFFFFFF)

    def _check_range(self, name, buf, offset, nbytes):
        """`buf` an open Buffer of this device holding nbytes (> 0) at offset (>= 0); errors name the argument."""
        check_buffer(name, buf, self.device)
        for what, v in (("offset", offset), ("nbytes", nbytes)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name}: {what} must be an integer, got {type(v).__name__} {v!r}")
        if offset < 0 or nbytes <= 0 or offset + nbytes > buf.size:
            raise ValueError(f"{name}: {nbytes} bytes at offset {offset} do not fit its {buf.size} bytes")

    def spoil(self, reason):
        """Refuse to submit this recording (submit() raises naming `reason`) until begin() starts a new one: a
        caller's record() that failed partway has left some of its commands in it, and running them would compute
        something else without a word (vkmoe.ops.record_args.all_or_nothing)."""
        if self._stale is None:
            self._stale = reason

    @_holds_device
    def timestamp(self):
        """Write a timestamp after all earlier commands; returns its slot index."""
        self._check_recording()
        if self._next_timestamp >= self.timestamp_slots:
            raise VkmoeError(f"all {self.timestamp_slots} timestamp slots are used; make the recorder with more")
        slot = self._next_timestamp
        vk.vkCmdWriteTimestamp(self.handle, vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, self._query_pool, slot)
        self._next_timestamp += 1
        return slot

    @_holds_device
    def end(self):
        self._check_recording()
        call("vkEndCommandBuffer", vk.vkEndCommandBuffer, self.handle)
        self._recording, self._recorded, self._fresh = False, True, True
        return self

    # ----------------------------------------------------------------------------------------- submission
    def submit(self, wait=True, timeout=None, before=(), after=()):
        """Submit the recorded buffer, with the recorded buffers of the recorders in `before` and `after`
        around it in the same vkQueueSubmit (one submission, one fence: this recorder's). Submission order
        spans the buffers, so barriers recorded in one order the commands of the others."""
        # One hold of the device for the submission and the wait: close() waits for both.
        with self.device.use():
            return self.submit_held(wait, timeout, before, after)

    def submit_held(self, wait=True, timeout=None, before=(), after=()):
        """submit() for a caller that holds device.use() around it already (an op's call, which holds it for
        its mapped io buffers anyway): each re-entry of use() costs about a microsecond, and this runs on every
        op call."""
        dev = self.device
        if timeout is not None:
            _check_timeout(timeout)
        riders, info = self._prepare_submit(timeout, before, after)
        with dev._lock:
            check("vkResetFences", vk.lib.vkResetFences(dev.handle, 1, self._fences))
            check("vkQueueSubmit", vk.lib.vkQueueSubmit(dev.queue, 1, info, self._fence))
            self._submitted(riders)
        if not wait:  # (an op later called with an array this run uses waits for it: InFlight.wait_for_unwaited)
            dev.in_flight.note_unwaited(self, riders)
            return self
        self._wait(timeout)
        return self

    def _left_running(self):
        """A wait gave up (a timeout, an interrupt) while the submission may still run: noted as a caller's
        unwaited one, so that reading or writing what it uses waits for it (InFlight.wait_for_unwaited)."""
        if self._pending:
            self.device.in_flight.note_unwaited(self, self._last_riders)

    def begin_native(self, call, convs, checks, sources, before=(), after=()):
        """submit_held(wait=True) through the native call path (vkmoe.vk.fastcall.NativeCall `call`, made for
        this recorder), in two halves: this one, then finish_native. The host inputs `sources` (4 cdata pointers or
        NULL, converted by the packed `convs`) are checked against their rules (the slots in the bit mask `checks`:
        call.raise_error raises when one breaks its rule, before anything is copied or submitted) and copied into
        their mapped buffers, the fence reset and the buffer submitted with `before` / `after` riders (one C call
        under the queue lock). The GPU then runs while the caller prepares what finish_native needs (the output
        array). Same checks, bookkeeping, errors and timeout as submit_held + wait; the caller holds device.use()."""
        global _native_submissions
        riders, info = self._prepare_submit(None, before, after)
        with self.device._lock:
            result = call.lib.vkn_call_submit(call.struct, info, convs, checks, *sources)
            if result:
                call.raise_error(result)
            self._submitted(riders)
            _native_submissions += 1

    def finish_native(self, call, out_conv, dst):
        """The second half of a native submission (begin_native): spin on the fence, sleep past the spin as
        submit_held's wait does (VKMOE_TIMEOUT), then copy the output into dst (NULL: none)."""
        lib, c = call.lib, call.struct
        result = lib.vkn_call_finish(c, out_conv, dst)
        if result == call.PENDING:  # still running after the spin: sleep as submit_held's wait does, then copy
            self._wait(None, spun=True)
            result = lib.vkn_call_finish(c, out_conv, dst)
        if result:
            call.raise_error(result)
        self._ran()

    def _prepare_submit(self, timeout, before, after):
        """What every submission checks and settles first: this buffer and the riders recorded, the last
        submission finished and its GPU time read if someone holds it. Returns (riders, the VkSubmitInfo)."""
        if self.handle is None or self.device._closed or self._close_deferred or self._stale:  # (usually no call)
            self._check_open()
            raise VkmoeError(f"submit(): this recording cannot run again: {self._stale}; record it again (begin() "
                             "... end())")
        if not self._recorded:
            raise VkmoeError("submit() needs a recorded command buffer (begin() ... end())")
        riders = (*before, None, *after) if before or after else ()  # None: this buffer's place
        for r in riders:
            if r is None:
                continue
            if not isinstance(r, CommandRecorder):
                raise TypeError(f"submit(before=, after=) takes CommandRecorders, got {type(r).__name__}")
            if r is self or riders.count(r) > 1:  # (one command buffer twice in a submission: invalid)
                raise ValueError("submit(before=, after=): each recorder at most once, and not the submitting one")
            if not r._recorded or r.device is not self.device or r.handle is None:
                raise VkmoeError("submit(before=, after=) takes recorded CommandRecorders of the same device")
            if r._stale:
                raise VkmoeError(f"submit(before=, after=): a recording there cannot run again: {r._stale}; record "
                                 "it again (begin() ... end())")
            r._wait_for_carrier()
        if self._pending:
            self._wait(timeout)
        if self._gpu_time is not None:
            self._settle_gpu_time()
        if not riders:
            return riders, self._own_info[0]
        if riders != self._rider_key:  # (an op's call: the same transfer recorders every time)
            self._rider_key = riders
            self._rider_info = _submit_info([r.handle for r in before] + [self.handle] + [r.handle for r in after])
        return riders, self._rider_info[0]

    def _submitted(self, riders):
        """The bookkeeping of a submission that the driver accepted (under the device's queue lock)."""
        global _submissions
        _submissions += 1
        self._pending = True
        self._submit_t = time.perf_counter()
        self._pending_fresh, self._fresh = self._fresh, False
        self.submissions += 1
        first_runs = self.device._first_runs
        if first_runs:  # (usually empty: one test per call)
            now = time.monotonic()
            for r, (n, t) in list(first_runs.items()):
                if not _first_run_running(r, n, t, now):
                    del first_runs[r]
            self._queued_behind = [(r, n, t) for r, (n, t) in first_runs.items()]
        elif self._queued_behind:
            self._queued_behind = ()
        if self._pending_fresh:
            first_runs[self] = (self.submissions, time.monotonic())
        for r in riders:
            if r is not None:
                r._riding_on = self
        self._last_riders = riders

    def _wait_for_carrier(self):
        """A buffer submitted with another recorder's submission may be re-recorded only once that finished."""
        carrier, self._riding_on = self._riding_on, None
        if carrier is not None and carrier.handle is not None and carrier._pending:
            carrier.wait()

    def wait(self, timeout=None):
        """Wait for the last submission; raise vkmoe.TimeoutError after `timeout` seconds."""
        if timeout is not None:
            _check_timeout(timeout)
        if not self._pending:
            return
        with self.device.use():  # close() waits for this wait (bounded by `timeout`) instead of freeing the fence
            self._wait(timeout)

    def _wait(self, timeout, spun=False):
        """_wait_for_fence; a wait that raises (a timeout, an interrupt) leaves the submission noted as running
        (_left_running)."""
        try:
            self._wait_for_fence(timeout, spun)
        except BaseException:
            self._left_running()
            raise

    def _wait_for_fence(self, timeout, spun=False):
        """Wait for the pending submission: spin for spin_s (unless the caller `spun` already), then sleep for up
        to `timeout` seconds (None: VKMOE_TIMEOUT, or COMPILE_TIMEOUT_S for the first run of a fresh recording)
        in slices."""
        if self._spin_next > 0 and not spun:
            status = self._spin(self._spin_next)
            if status == vk.VK_SUCCESS:
                self._ran()
                return
            if status != vk.VK_NOT_READY:
                check("vkGetFenceStatus", status)
        compiling = timeout is None and self._pending_fresh
        default_timeout = timeout is None  # (a caller's own timeout is a hard bound: never extended below)
        timeout = knobs.get("VKMOE_TIMEOUT") if timeout is None else float(timeout)
        if compiling:
            timeout = max(timeout, COMPILE_TIMEOUT_S)
        while not wait_fences(self.device, self._fences, timeout):
            if default_timeout and self._behind_a_compile():
                # Queued behind another recorder's first run that may still be compiling (another thread's new
                # recording on lavapipe): this submission has not started; give it its own time once that is done.
                continue
            what = ("the first run of a newly recorded command buffer (which may include the driver's shader "
                    "compile)" if compiling else "the GPU")
            raise TimeoutError(f"{what} did not finish within {timeout:g} s; the device may be hung and should be "
                               "recreated")
        self._ran()

    def _behind_a_compile(self):
        """Whether a first run that was on the queue ahead of this submission is still running within its compile
        allowance (COMPILE_TIMEOUT_S from its submission). Read from the other recorders' own bookkeeping (their
        owners' waits clear _pending): no call on their fences, which their owners may destroy meanwhile."""
        if not self._queued_behind:
            return False
        now = time.monotonic()
        return any(_first_run_running(r, n, t, now) for r, n, t in self._queued_behind)

    def _spin(self, seconds):
        """Poll the fence for up to `seconds`; returns the last VkResult (VK_NOT_READY: still running)."""
        get_status, handle, fence = vk.lib.vkGetFenceStatus, self.device.handle, self._fence
        end = time.perf_counter() + seconds
        status = get_status(handle, fence)
        while status == vk.VK_NOT_READY and time.perf_counter() < end:
            status = get_status(handle, fence)
        return status

    @property
    def pending(self):
        return self._pending

    @property
    def spin_s(self):
        """The shortest spin of a wait before it sleeps (0: never spin; on a GPU the wait of a recorder whose runs
        take longer spins about as long as the last one took: _spin_next)."""
        return self._spin_base

    @spin_s.setter
    def spin_s(self, seconds):
        self._spin_base = seconds
        self._spin_next = self._next_spin()

    def _next_spin(self):
        spin, longer = self._spin_base, RUN_SPIN_FACTOR * self._run_s
        if self._adaptive_spin and spin > 0 and longer > spin:
            spin = min(MAX_SPIN_S, math.ceil(longer / SPIN_STEP_S) * SPIN_STEP_S)
        return spin

    def _ran(self):
        """The pending submission is over (a wait saw its fence signal): note how long it took."""
        self._pending = False
        if self._adaptive_spin:
            self._run_s = time.perf_counter() - self._submit_t
            self._spin_next = self._next_spin()

    def timestamps_ms(self):
        """Timestamps written by the last completed submission, in milliseconds from the first one."""
        if self._pending:
            self.wait()
        n = self._next_timestamp
        if n == 0:
            return []
        if self._fresh:  # (the query pool holds nothing yet: vkGetQueryPoolResults said VK_NOT_READY)
            raise VkmoeError("timestamps_ms(): this recording has not been submitted yet (submit() it first)")
        with self.device.use():
            self._check_open()
            ticks = self._ticks()
        mask, period_ms = self._stamp_mask, self._stamp_period_ms
        return [((t - ticks[0]) & mask) * period_ms for t in ticks]

    def _ticks(self):
        """The raw timestamps of the last completed submission (valid bits only); the caller holds the device."""
        n, data = self._next_timestamp, self._stamp_data
        check("vkGetQueryPoolResults", vk.lib.vkGetQueryPoolResults(
            self.device.handle, self._query_pool, 0, n, 8 * n, data, 8,
            vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT))
        mask = self._stamp_mask
        return [int(data[i]) & mask for i in range(n)]

    def elapsed_ms(self, first=0, last=None):
        stamps = self.timestamps_ms()
        last = len(stamps) - 1 if last is None else last
        return stamps[last] - stamps[first]

    def gpu_time(self):
        """The GpuTime of the last completed submission: elapsed_ms() read only if and when someone asks."""
        t = self._gpu_time() if self._gpu_time is not None else None
        if t is None:  # (a live one is this submission's: a submission settles and drops the last one)
            t = GpuTime(self)
            self._gpu_time = weakref.ref(t)
        return t

    def gpu_time_of(self, submission):
        """The GpuTime of this recorder's submission that made `submissions` equal to `submission`, for a caller
        that keeps that number rather than make a GpuTime for every submission (an op, whose report a runtime
        rarely reads): gpu_time() while no later submission has overwritten its results, else UNREAD_GPU_TIME
        (ms NaN). The caller orders this after that submission and before any other (an op: under its call
        lock)."""
        if self.handle is None or self.submissions != submission:
            return UNREAD_GPU_TIME
        return self.gpu_time()

    def _settle_gpu_time(self):
        """Before the query results are overwritten or freed: read them into the last submission's GpuTime if
        anyone still holds it (nobody does on an op's usual call path, which then reads nothing). A live one
        means no submission since, so the results are that submission's."""
        ref, self._gpu_time = self._gpu_time, None
        t = ref() if ref is not None else None
        if t is not None:
            self._settle(t, hold=False)  # the callers hold the device, or are closing it

    def _settle(self, t, hold):
        with self._stamp_lock:  # once, whichever of the GpuTime's reader and the recorder comes first
            if t._ms is not None:
                return
            try:
                with self.device.use() if hold else contextlib.nullcontext():
                    t._ms = self._read_elapsed_ms()
            except VkmoeError:
                t._ms = float("nan")  # the results are gone (the device was closed or lost)
            t._rec = None

    def _read_elapsed_ms(self):
        """elapsed_ms() for the whole submission, holding nothing (close() may run inside Device.close())."""
        if self.handle is None:
            raise VkmoeError("CommandRecorder used after close()")
        if self._next_timestamp == 0:
            raise VkmoeError("the recorded commands wrote no timestamp")
        ticks = self._ticks()
        return ((ticks[-1] - ticks[0]) & self._stamp_mask) * self._stamp_period_ms

    def close(self):
        """Free the command buffer, its pool, fence and query pool, after its last submission finished. If that
        submission is still running when the wait gives up (VKMOE_TIMEOUT: a hung or very busy device), freeing
        them would be undefined: the recorder is closed for use and they are freed by a later close() or by the
        device's close (after vkDeviceWaitIdle)."""
        with self._close_lock:
            if self.handle is None or self._closing:
                return
            self._closing = True
            try:
                self._close_locked()
            finally:
                self._closing = False

    def _close_locked(self):
        if not self.device._handle_alive:  # the device is gone (it freed these), or its handles are a fork() parent's
            self._forget()
            return
        if self._pending:
            try:
                self.wait()
            except Exception:
                pass
            if self._pending and vk.lib.vkGetFenceStatus(self.device.handle, self._fence) != vk.VK_SUCCESS:
                self._close_deferred = True
                return
            self._pending = False
        self._settle_gpu_time()
        h = self.device.handle
        if self._query_pool is not None:
            vk.vkDestroyQueryPool(h, self._query_pool, None)
        vk.vkDestroyFence(h, self._fence, None)
        vk.vkFreeCommandBuffers(h, self._pool, 1, [self.handle])
        vk.vkDestroyCommandPool(h, self._pool, None)
        self._forget()

    def _forget(self):
        self.handle = None
        self._pending = False
        self._keep = []
        self._uses = set()
        self.device.in_flight.discard(self)
        if not self._untracked:
            self.device.untrack(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
