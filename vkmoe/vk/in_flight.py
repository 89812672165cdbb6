"""Closing what a submission still uses: Buffers, Pipelines and descriptor sets outlive the runs that use them.

A command buffer on the queue reads the buffers, pipelines and descriptor sets it was recorded with. Freeing one
of them before that run is over is undefined: closing a Buffer under a running lavapipe dispatch crashed the
process (segfault; the validation layer: VUID-vkDestroyBuffer-buffer-00922), and on a GPU it is a fault that loses
the device. A runtime reaches it easily: `block.record(rec, h, out)`, `rec.submit(wait=False)`, then the last
reference to `out` dropped or the layer closed.

So each CommandRecorder notes what its recording uses (CommandRecorder._uses), and these objects close through
InFlight.release(obj, free): the object is closed for use at once; recordings that use it are marked so that
their next submit raises instead of running with a freed object; and free() runs once no submission that may use
it is still on the queue. When one may be (a recorder submitted and not yet waited for), release() waits for
the queue's work so far (a fence of its own behind an empty submission: it never calls a fence that another
thread owns and may reset or destroy meanwhile), bounded by VKMOE_TIMEOUT; if that runs out (a hung or very busy
device) free() runs later, at a release() after that fence signals or at the device's close (after
vkDeviceWaitIdle). Nothing is waited for when no recording in flight uses the object: the usual close costs a
scan of the device's recorders.

The host's own reads and writes (Buffer.upload / download, DeviceArray.numpy(), an op called with a DeviceArray)
wait likewise for the caller's submissions that nobody waited for (submit(wait=False), or a wait that raised):
InFlight.note_unwaited, wait_for_unwaited."""
import threading

import vulkan as vk

from .. import knobs
from .commands import wait_fences
from .errors import DeviceClosedError, TimeoutError, VkmoeError, call

ffi = vk.ffi


class InFlight:
    """One device's CommandRecorders (what their recordings use) and the frees waiting for runs to end."""

    def __init__(self, device):
        self.device = device
        self._recorders = set()
        self._deferred = []  # (fence, free): free() once fence signals (or at the device's close)
        # Reentrant: a finalizer that a garbage collection runs inside one of these sections (a dropped layer
        # closing its buffers) may come back on this thread; every section leaves the state consistent for that.
        self._lock = threading.RLock()
        self._closed = False  # the device's close ran the deferred frees: from now on free() runs at once
        # The caller's submit(wait=False) submissions that may still run: submitting recorder -> (its submission
        # count then, the recorders of that submission: it and its riders). An op call's check (wait_for_unwaited)
        # costs one truth test while there are none, and a look at these few recorders' uses otherwise.
        self._unwaited = {}

    def after_fork(self):
        """In a fork() child (Device._left_by_fork): a fresh lock, the frees left to the parent."""
        self._lock = threading.RLock()
        self._closed = True
        self._deferred, self._unwaited = [], {}

    def add(self, recorder):
        with self._lock:
            self._recorders.add(recorder)

    def discard(self, recorder):
        with self._lock:
            self._recorders.discard(recorder)
            self._unwaited.pop(recorder, None)

    def note_unwaited(self, recorder, riders=()):
        """`recorder` was submitted (with `riders`) and its submit() returned without waiting (submit(wait=False))."""
        with self._lock:
            self._unwaited[recorder] = (recorder.submissions, (recorder, *(r for r in riders if r is not None)))

    @property
    def has_unwaited(self):
        """Whether a caller's submit(wait=False) may still run (wait_for_unwaited has work to do)."""
        return bool(self._unwaited)

    def wait_for_unwaited(self, objs):
        """An op call's arrays, a Buffer's upload or download: return once no submission that the caller made with
        submit(wait=False) and that uses one of `objs` (e.g. a chain writing the DeviceArray passed as an op's input)
        may still be on the queue; vkmoe.TimeoutError after VKMOE_TIMEOUT. The op's own submission reads and writes
        them from its first command on, with no barrier ahead of it (a GPU may start it beside the caller's run),
        and the host's copies do not wait at all. Costs one truth test when no such submission was made."""
        if not self._unwaited:
            return
        with self._lock:
            # (gone: waited for by the owner, or submitted again, which noted it anew if it did not wait)
            self._unwaited = {r: (n, group) for r, (n, group) in self._unwaited.items()
                              if r._pending and r.submissions == n}
            noted = dict(self._unwaited)
        if not any(obj in u._uses for _, group in noted.values() for u in group for obj in objs):
            return
        self._wait_for_queue()
        with self._lock:  # every submission noted before the wait is over
            for r, entry in noted.items():
                if self._unwaited.get(r) is entry:
                    del self._unwaited[r]

    def release(self, obj, free, what):
        """Run free() for `obj` (the caller marked it closed already) once no run on the queue may use it;
        `what` names it in the error of a recording that used it and is submitted again."""
        users, closed = self._users(obj)
        for r in users:
            if r._stale is None:
                r._stale = f"it uses {what} that was closed after it was recorded"
        running = any(_submitted_unwaited(r) for r in users)
        if self._deferred:
            self._sweep()
        if closed or not running:  # (closed: the device's close waited for its queue and ran the deferred frees)
            free()  # (as before this module: the usual close, e.g. a dropped DeviceArray's, takes no device hold)
            return
        fence = self._queue_fence()
        if fence is not None and self._wait(fence):
            self._free_now(free)
        else:
            self._defer(fence, free)

    def _wait_for_queue(self):
        """Return once every submission made so far is over; vkmoe.TimeoutError after VKMOE_TIMEOUT."""
        fence = self._queue_fence()
        if fence is None:
            self.device.check_open()  # (closed: DeviceClosedError; lost: the submission's error was raised)
            raise VkmoeError("could not wait for the queue (the device may be lost)")
        if self._wait(fence):
            return
        self._defer(fence, lambda: None)  # (a fence still on the queue may not be destroyed yet)
        raise TimeoutError(f"the submissions using this buffer did not finish within {knobs.get('VKMOE_TIMEOUT'):g} "
                           "s; the device may be hung and should be recreated")

    def _users(self, obj):
        """(the recorders whose recordings use obj, whether the device's close has run the deferred frees)."""
        with self._lock:
            return [r for r in self._recorders if obj in r._uses], self._closed

    def _free_now(self, free):
        """free() with the device held open (a concurrent Device.close() waits for it); when the device is closing,
        its close runs it (after vkDeviceWaitIdle)."""
        try:
            with self.device.use():
                free()
                return
        except DeviceClosedError:
            pass
        self._defer(None, free)

    def _defer(self, fence, free):
        with self._lock:
            if not self._closed:
                self._deferred.append((fence, free))
                return
        # The device's close has run the deferred frees already (its own close of each object frees it too):
        # what is left is bookkeeping, or a free that object's close made idempotent.
        free()

    def _queue_fence(self):
        """A new fence signalled when every submission made so far is over (an empty vkQueueSubmit: its fence's
        signal covers all earlier submissions to the queue), or None when the device is closing or lost."""
        dev = self.device
        try:
            with dev.use():
                fence = call("vkCreateFence", vk.vkCreateFence, dev.handle,
                             vk.VkFenceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO), None)
                with dev._lock:
                    result = vk.lib.vkQueueSubmit(dev.queue, 0, ffi.NULL, fence)
                if result != vk.VK_SUCCESS:
                    vk.vkDestroyFence(dev.handle, fence, None)
                    return None
                return fence
        except VkmoeError:  # closed (DeviceClosedError) or out of memory: the device's close frees it
            return None

    def _wait(self, fence):
        """Whether `fence` signalled within VKMOE_TIMEOUT; it is destroyed if so (under the same device hold: a
        concurrent Device.close() cannot come between)."""
        dev = self.device
        try:
            with dev.use():
                if not wait_fences(dev, ffi.new("VkFence[1]", [fence]), knobs.get("VKMOE_TIMEOUT")):
                    return False
                vk.vkDestroyFence(dev.handle, fence, None)
                return True
        except VkmoeError:  # closing (its close destroys the fence and runs the free) or lost
            return False

    def _sweep(self):
        """Run the deferred frees whose fences have signalled (no waiting). Under the lock throughout, so the
        device's close (which takes it after its vkDeviceWaitIdle) never finds a fence in this thread's hands; a
        nested release on this thread (a finalizer) appends to the fresh list, kept below."""
        dev = self.device
        with self._lock:
            if self._closed:
                return
            deferred, self._deferred = self._deferred, []
            done, waiting = [], []
            try:
                with dev.use():
                    for fence, free in deferred:
                        signalled = fence is not None and vk.lib.vkGetFenceStatus(dev.handle, fence) == vk.VK_SUCCESS
                        (done if signalled else waiting).append((fence, free))
                    for fence, _ in done:
                        vk.vkDestroyFence(dev.handle, fence, None)
            except VkmoeError:  # the device is closing: its close runs them all
                done, waiting = [], deferred
            self._deferred.extend(waiting)
        for _, free in done:
            free()

    def close(self):
        """The device's close, after vkDeviceWaitIdle: run every deferred free; later releases free at once."""
        with self._lock:
            self._closed = True
            deferred, self._deferred = self._deferred, []
            self._recorders.clear()
            self._unwaited = {}
        for fence, free in deferred:
            if fence is not None:
                vk.vkDestroyFence(self.device.handle, fence, None)
            free()


def _submitted_unwaited(rec):
    """Whether `rec`'s commands were submitted (by it, or riding on another recorder's submission) and nobody has
    seen that submission finish: it may still be on the queue."""
    carrier = rec._riding_on
    return rec._pending or (carrier is not None and carrier._pending)

