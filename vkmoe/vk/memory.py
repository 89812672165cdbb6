"""Buffers sub-allocated from a few large memory blocks.

A layer has thousands of small tensors; one vkAllocateMemory per tensor would hit the driver's allocation
limit and cost time, so memory comes in blocks of BLOCK_BYTES, each with ONE VkBuffer spanning it, and a
vkmoe Buffer is an (offset, size) range of a block, bound to descriptors with that offset and range.

Four kinds of memory (`Buffer.kind`): "device" (weights and scratch: the largest device-local heap), "host"
(host-visible, preferably cached), and the two an op's per-call inputs and outputs live in, so that a call
needs no staging copy and no submission of its own: "upload" (the host writes, the device reads: device-local
AND host-visible where the device offers it, e.g. a discrete GPU's BAR / resizable-BAR heap, else host
memory the shaders read directly) and "readback" (the device writes, the host reads: host-visible, cached
where possible, because reading device-local memory through the BAR from the CPU is slow).
"""
import math
import threading

import numpy as np
import vulkan as vk

from .errors import VkmoeError, call, check

ffi = vk.ffi

BLOCK_BYTES = 64 << 20
# Per-call input/output buffers are small, and a discrete GPU's device-local host-visible heap may be only
# 256 MiB (no resizable BAR): blocks of this kind are smaller.
IO_BLOCK_BYTES = 4 << 20
KINDS = ("device", "host", "upload", "readback")
_USAGE = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
          | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
_HOST = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT


class _Block:
    """One VkDeviceMemory + a VkBuffer over all of it, with a first-fit free list."""

    def __init__(self, manager, size, memory_type, mapped):
        dev = manager.device
        self.device = dev
        self.size = size
        self.memory_type = memory_type
        info = vk.VkBufferCreateInfo(sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=size, usage=_USAGE,
                                     sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE)
        self.buffer = call("vkCreateBuffer", vk.vkCreateBuffer, dev.handle, info, None)
        req = vk.vkGetBufferMemoryRequirements(dev.handle, self.buffer)
        if not (req.memoryTypeBits >> memory_type) & 1:
            vk.vkDestroyBuffer(dev.handle, self.buffer, None)
            raise VkmoeError("the chosen memory type cannot back storage buffers on this device")
        alloc = vk.VkMemoryAllocateInfo(sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                                        allocationSize=req.size, memoryTypeIndex=memory_type)
        try:
            self.memory = call("vkAllocateMemory", vk.vkAllocateMemory, dev.handle, alloc, None)
        except Exception:
            vk.vkDestroyBuffer(dev.handle, self.buffer, None)
            raise
        call("vkBindBufferMemory", vk.vkBindBufferMemory, dev.handle, self.buffer, self.memory, 0)
        self.pointer = None
        if mapped:
            out = ffi.new("void**")
            result = vk.lib.vkMapMemory(dev.handle, self.memory, 0, size, 0, out)
            if result != vk.VK_SUCCESS:
                self.destroy()
                check("vkMapMemory", result)
            self.pointer = ffi.cast("char*", out[0])
        self.free = [(0, size)]  # sorted (offset, size) holes

    def allocate(self, size, alignment):
        for i, (off, hole) in enumerate(self.free):
            start = -(-off // alignment) * alignment
            if start + size <= off + hole:
                pieces = []
                if start > off:
                    pieces.append((off, start - off))
                if off + hole > start + size:
                    pieces.append((start + size, off + hole - start - size))
                self.free[i:i + 1] = pieces
                return start
        return None

    def release(self, offset, size):
        self.free.append((offset, size))
        self.free.sort()
        merged = []
        for off, sz in self.free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((off, sz))
        self.free = merged

    @property
    def empty(self):
        return self.free == [(0, self.size)]

    def destroy(self):
        if not self.device._handle_alive:  # (the device is gone, or its handles are a fork() parent's)
            return
        h = self.device.handle
        if self.pointer is not None:
            vk.vkUnmapMemory(h, self.memory)
        vk.vkDestroyBuffer(h, self.buffer, None)
        vk.vkFreeMemory(h, self.memory, None)


class Buffer:
    """A range of device memory usable as a storage buffer.

    Host-visible buffers expose `.array(dtype, shape)`, a zero-copy numpy view. Device-local ones are
    filled and read with `upload()` / `download()` (a direct copy where the memory is host-visible anyway,
    as on lavapipe; else through a staging buffer and a transfer command).
    """

    def __init__(self, manager, block, offset, size, kind):
        self._manager = manager
        self.block = block
        self.offset = offset
        self.size = size
        self.kind = kind
        self.host_visible = kind == "host"  # allocate(host_visible=True)
        self._closed = False
        self._views = {}  # (dtype, shape, offset) -> host_view()'s numpy view

    @property
    def handle(self):
        return self.block.buffer

    @property
    def device(self):
        return self._manager.device

    @property
    def closed(self):
        return self._closed

    @property
    def mapped(self):
        """Whether the host can read and write this buffer directly (array(), upload/download with no copy)."""
        return self.block.pointer is not None

    def _check_open(self):
        if self._closed:
            raise VkmoeError("buffer used after close()")

    def array(self, dtype, shape=None, offset=0):
        """Zero-copy numpy view of a host-visible buffer from byte `offset` (valid until close())."""
        self._check_open()
        self.device.check_open()  # the view itself is valid only while the device is open
        if self.block.pointer is None:
            raise VkmoeError("array() needs a host-visible buffer; use download() for device-local memory")
        dtype = np.dtype(dtype)
        count = (self.size - offset) // dtype.itemsize if shape is None else int(np.prod(shape))
        if offset < 0 or offset + count * dtype.itemsize > self.size:
            raise ValueError(f"shape {shape} of {dtype} at offset {offset} needs {offset + count * dtype.itemsize} "
                             f"bytes; buffer has {self.size}")
        view = np.frombuffer(ffi.buffer(self.block.pointer + self.offset + offset, count * dtype.itemsize),
                             dtype=dtype)
        return view if shape is None else view.reshape(shape)

    def host_view(self, dtype, shape, offset=0):
        """array(dtype, shape, offset), made once and kept: for the input and output buffers an op writes and reads
        on every call (a dict lookup instead of upload()/download()'s checks and copies through bytes). Touch it
        only while holding device.use() (a closed device's memory is unmapped) and never after close()."""
        key = (dtype, shape, offset)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.array(dtype, shape, offset)
        return view

    def upload(self, data, offset=0):
        """Copy a numpy array (any shape, C order) into the buffer at byte `offset` (after a run of the caller's
        submit(wait=False) that uses the buffer: _wait_for_unwaited_runs)."""
        self._check_open()
        if not isinstance(data, np.ndarray):
            raise TypeError(f"upload() expects a numpy array, got {type(data).__name__}")
        if data.dtype == object:
            raise TypeError("upload() expects a numeric numpy array, got dtype object")
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if offset < 0 or offset + raw.nbytes > self.size:
            raise ValueError(f"upload of {raw.nbytes} bytes at offset {offset} does not fit a {self.size}-byte buffer")
        self._wait_for_unwaited_runs()
        with self.device.use():  # a closed device's memory is unmapped: raise instead of writing into it
            self._manager.write(self, offset, raw)

    def download(self, dtype=np.uint8, shape=None, offset=0):
        """Read the buffer (or `shape` elements of `dtype` from byte `offset`) into a new numpy array (after a run of
        the caller's submit(wait=False) that uses the buffer: _wait_for_unwaited_runs)."""
        self._check_open()
        dtype = np.dtype(dtype)
        # math.prod: np.prod costs ~3 us on a small tuple, and a decode call downloads on every call
        count = (self.size - offset) // dtype.itemsize if shape is None else math.prod(shape)
        nbytes = count * dtype.itemsize
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"download of {nbytes} bytes at offset {offset} exceeds the {self.size}-byte buffer")
        self._wait_for_unwaited_runs()
        with self.device.use():
            raw = self._manager.read(self, offset, nbytes)
        out = raw.view(dtype)
        return out if shape is None else out.reshape(shape)

    def _wait_for_unwaited_runs(self):
        """upload() and download() first wait for a run of the caller's submit(wait=False) that uses this buffer
        (vkmoe.TimeoutError past VKMOE_TIMEOUT): writing under it changed what it read, and reading under it gave
        what it had not written yet. One truth test when there is none."""
        in_flight = self.device.in_flight
        if in_flight.has_unwaited:
            in_flight.wait_for_unwaited((self,))

    def close(self):
        """Closed for use at once; the memory is given back once no run on the queue uses it (vk.in_flight)."""
        with self._manager._lock:  # (two threads closing one buffer gave its range back twice)
            if self._closed:
                return
            self._closed = True
        self._views.clear()
        self.device.in_flight.release(self, self._release, "a Buffer")

    def _release(self):
        self._manager.release(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<vkmoe.Buffer {self.size} B {self.kind} @ {self.offset}>"


class MemoryManager:
    """Owns the blocks of one Device and hands out Buffers."""

    def __init__(self, device):
        self.device = device
        # Reentrant, and _busy says this thread is inside allocate()/release(): a garbage collection that runs
        # there (any allocation of a Python object may start one) can run a dropped layer's finalizer, which
        # closes its buffers and so calls release() on this thread. A plain lock deadlocked there (seen in the
        # full suite on lavapipe); such a release is deferred until the outer call is done with the blocks.
        self._lock = threading.RLock()
        self._busy = False
        self._deferred = []
        self._blocks = {kind: [] for kind in KINDS}
        props = vk.vkGetPhysicalDeviceMemoryProperties(device.physical)
        types = [(i, props.memoryTypes[i].propertyFlags, props.memoryTypes[i].heapIndex)
                 for i in range(props.memoryTypeCount)]
        heap_size = {i: props.memoryHeaps[i].size for i in range(props.memoryHeapCount)}
        local = [t for t in types if t[1] & vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT]
        # Device memory: the largest device-local heap; within it prefer memory the CPU cannot see (the
        # real VRAM on a discrete GPU). On a unified-memory device (lavapipe) it is also host-visible.
        local.sort(key=lambda t: (-heap_size[t[2]], bool(t[1] & vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT)))
        host = [t for t in types if (t[1] & _HOST) == _HOST]
        if not host:
            raise VkmoeError(f"{device.name}: no host-visible coherent memory type")
        # Host memory: prefer cached (fast reads back) and not device-local (keep VRAM for weights).
        host.sort(key=lambda t: (not t[1] & vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT,
                                 bool(t[1] & vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)))
        self.device_type = (local or host)[0][0]
        self.device_mappable = bool((local or host)[0][1] & vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT) and bool(
            (local or host)[0][1] & vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT)
        self.host_type = host[0][0]
        # Upload memory: device-local and host-visible (a discrete GPU's BAR heap, where shader reads stay on
        # the device); uncached is fine, the host only writes it. Else plain host memory.
        bar = [t for t in local if (t[1] & _HOST) == _HOST]
        self.upload_type = bar[0][0] if bar else self.host_type
        self._types = {"device": self.device_type, "host": self.host_type, "upload": self.upload_type,
                       "readback": self.host_type}
        limits = device.limits
        self.alignment = max(256, limits.minStorageBufferOffsetAlignment)
        self.max_range = limits.maxStorageBufferRange
        self._staging = None
        self._transfer = None

    def allocate(self, nbytes, host_visible=False, kind=None):
        """A buffer of `nbytes`: device memory, host memory with host_visible=True, or one of KINDS."""
        kind = ("host" if host_visible else "device") if kind is None else kind
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):  # ("64" and 1.5 were taken)
            raise TypeError(f"nbytes: expected an integer number of bytes, got {type(nbytes).__name__} {nbytes!r}")
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"buffer size must be positive, got {nbytes}")
        if nbytes > self.max_range:
            raise ValueError(f"buffer of {nbytes} bytes exceeds this device's maxStorageBufferRange "
                             f"({self.max_range} bytes); split the data")
        size = -(-nbytes // 16) * 16
        mapped = kind != "device" or self.device_mappable
        with self.device.use(), self._lock:
            outer, self._busy = self._busy, True
            try:
                return self._allocate_locked(size, nbytes, kind, mapped)
            finally:
                self._busy = outer
                if not outer:
                    self._release_deferred()

    def _allocate_locked(self, size, nbytes, kind, mapped):
        blocks = self._blocks[kind]
        for block in blocks:
            offset = block.allocate(size, self.alignment)
            if offset is not None:
                return Buffer(self, block, offset, nbytes, kind)
        block_bytes = IO_BLOCK_BYTES if kind in ("upload", "readback") else BLOCK_BYTES
        try:
            block = _Block(self, max(block_bytes, size), self._types[kind], mapped)
        except VkmoeError:
            if kind != "upload" or self.upload_type == self.host_type:
                raise
            # The device-local host-visible heap is small and may be full: host memory serves as well.
            kind = "readback"
            blocks = self._blocks[kind]
            block = _Block(self, max(block_bytes, size), self._types[kind], mapped)
        blocks.append(block)
        offset = block.allocate(size, self.alignment)
        return Buffer(self, block, offset, nbytes, kind)

    def check_fits(self, what, nbytes):
        """ValueError "{what} would need N bytes, more than this device's maxStorageBufferRange ..." when one
        buffer of nbytes would not fit (what: the caller's words for it, naming the argument behind it)."""
        if nbytes > self.max_range:
            raise ValueError(f"{what} would need {nbytes} bytes, more than this device's maxStorageBufferRange "
                             f"({self.max_range}); split the batch")

    def allocate_all(self, sizes, kinds=None, names=None):
        """Buffers of the given byte sizes (and KINDS, default device memory), all or none: every size is checked
        before anything is allocated, and a failure part-way closes what was already allocated (a rejected call
        must not leak). names: what each buffer is, for check_fits' message when one is too large."""
        sizes = [int(n) for n in sizes]
        kinds = list(kinds) if kinds is not None else ["device"] * len(sizes)
        for i, n in enumerate(sizes):
            if names is not None:
                self.check_fits(names[i], n)
            if not 0 < n <= self.max_range:
                raise ValueError(f"buffer of {n} bytes: expected 1 .. {self.max_range} bytes (this device's "
                                 "maxStorageBufferRange); split the data or the batch")
        done = []
        try:
            for n, kind in zip(sizes, kinds):
                done.append(self.allocate(n, kind=kind))
        except BaseException:
            for b in done:
                b.close()
            raise
        return done

    def after_fork(self):
        """In a fork() child (Device._left_by_fork): a fresh lock (a thread of the parent may have held it)."""
        self._lock = threading.RLock()
        self._busy, self._deferred = False, []

    def release(self, buf):
        with self._lock:
            if self._busy:  # re-entered from a finalizer inside allocate()/release() (see __init__)
                self._deferred.append(buf)
                return
            self._busy = True
            try:
                self._release_locked(buf)
            finally:
                self._busy = False
                self._release_deferred()

    def _release_deferred(self):
        """Release the buffers deferred while this thread was inside allocate()/release() (lock held)."""
        while self._deferred:
            buf = self._deferred.pop()
            self._busy = True
            try:
                self._release_locked(buf)
            finally:
                self._busy = False

    def _release_locked(self, buf):
        size = -(-buf.size // 16) * 16
        buf.block.release(buf.offset, size)
        blocks = self._blocks[buf.kind]
        # Keep one empty block per kind for reuse; give the others back to the driver.
        if buf.block.empty and sum(b.empty for b in blocks) > 1:
            blocks.remove(buf.block)
            buf.block.destroy()

    def block_count(self):
        return sum(len(b) for b in self._blocks.values())

    # -------------------------------------------------------------------------------------- data movement
    def _staging_buffer(self, nbytes):
        if self._staging is None or self._staging.size < nbytes:
            if self._staging is not None:
                self._staging.close()
            self._staging = self.allocate(max(nbytes, 1 << 20), host_visible=True)
        return self._staging

    def _copy(self, src, src_off, dst, dst_off, nbytes):
        from .commands import CommandRecorder

        if self._transfer is None:
            self._transfer = CommandRecorder(self.device, untracked=True)
        rec = self._transfer
        rec.begin()
        rec.copy(src, dst, nbytes, src_offset=src_off, dst_offset=dst_off)
        rec.end()
        rec.submit(wait=True)

    _CHUNK = 32 << 20

    def write(self, buf, offset, raw):
        if buf.block.pointer is not None:
            ffi.memmove(buf.block.pointer + buf.offset + offset, ffi.from_buffer(raw), raw.nbytes)
            return
        with self.device._lock:
            for start in range(0, raw.nbytes, self._CHUNK):
                part = raw[start:start + self._CHUNK]
                staging = self._staging_buffer(min(raw.nbytes, self._CHUNK))
                ffi.memmove(staging.block.pointer + staging.offset, ffi.from_buffer(part), part.nbytes)
                self._copy(staging, 0, buf, offset + start, part.nbytes)

    def read(self, buf, offset, nbytes):
        out = np.empty(nbytes, dtype=np.uint8)
        if buf.block.pointer is not None:
            ffi.memmove(ffi.from_buffer(out), buf.block.pointer + buf.offset + offset, nbytes)
            return out
        with self.device._lock:
            for start in range(0, nbytes, self._CHUNK):
                n = min(self._CHUNK, nbytes - start)
                staging = self._staging_buffer(min(nbytes, self._CHUNK))
                self._copy(buf, offset + start, staging, 0, n)
                ffi.memmove(ffi.from_buffer(out[start:start + n]), staging.block.pointer + staging.offset, n)
        return out

    def close(self):
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None
        self._staging = None
        for blocks in self._blocks.values():
            for block in blocks:
                block.destroy()
            blocks.clear()
