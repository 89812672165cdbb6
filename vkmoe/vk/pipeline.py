"""Compute pipelines from the package's SPIR-V, with typed push constants and specialization constants.

Push constants are numpy structured dtypes (`PushConstants` subclasses), never untyped lists of numbers, and
their size is checked against the block the shader declares (read from the SPIR-V). Specialization constants
are typed by the shader itself: the host value is converted to the declared type, and an id the shader does
not declare is an error.
"""
import os
import struct

import numpy as np
import vulkan as vk

from .. import forksafe
from . import spirv
from .errors import VkmoeError, call, check, foreign_device_error
from .statistics import pipeline_statistics

ffi = vk.ffi
SPV_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_spv")


def load_spirv(name):
    """The SPIR-V of vkmoe shader `name` (vkmoe/_spv/NAME.spv), or of the .spv file at path `name`."""
    path = name if name.endswith(".spv") else os.path.join(SPV_DIR, name + ".spv")
    if not os.path.exists(path):
        raise VkmoeError(
            f"compiled shader {name}.spv not found in {SPV_DIR}; build it with `python setup.py build_shaders` "
            "(needs glslc) or copy a prebuilt vkmoe/_spv/"
        )
    with open(path, "rb") as f:
        return f.read()


class PushConstants:
    """Base of typed push-constant blocks. Subclasses set `fields = [(name, numpy dtype), ...]` in the
    order and with the 4-byte types the GLSL block declares."""

    fields = []

    def __init__(self, **values):
        dtype = self.dtype()
        unknown = set(values) - set(dtype.names or ())
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}; fields: {dtype.names}")
        missing = set(dtype.names or ()) - set(values)
        if missing:
            raise TypeError(f"{type(self).__name__} needs field(s) {sorted(missing)}")
        self._record = np.zeros((), dtype=dtype)
        for name, value in values.items():
            kind = dtype.fields[name][0]
            if kind.kind in "ui":
                info = np.iinfo(kind)
                if not info.min <= int(value) <= info.max:
                    raise ValueError(f"{type(self).__name__}.{name}={value} does not fit {kind}")
                self._record[name] = int(value)
            else:
                self._record[name] = value

    @classmethod
    def dtype(cls):
        return np.dtype(list(cls.fields))

    @classmethod
    def size(cls):
        return cls.dtype().itemsize

    def tobytes(self):
        return self._record.tobytes()


# VK_PIPELINE_SHADER_STAGE_CREATE_REQUIRE_FULL_SUBGROUPS_BIT (Vulkan 1.3): the binding defines only the EXT alias,
# as None
REQUIRE_FULL_SUBGROUPS = 0x2
_SPEC_PACK = {"bool": "<I", "int32": "<i", "uint32": "<I", "float32": "<f"}


class Pipeline:
    """One compute pipeline: shader module, descriptor set layout (storage buffers 0..n-1), layout, pipeline."""

    def __init__(self, device, shader, push=None, spec=None, required_subgroup_size=None, binding_count=None,
                 allow_unused_spec=False, full_subgroups=False):
        self.device = device
        self.name = shader
        code = load_spirv(shader)
        try:
            self.interface = spirv.reflect(code)
        except ValueError as exc:  # a corrupt or foreign file: name it (rebuilding the shaders replaces it)
            raise VkmoeError(f"{shader}: {exc}") from None
        self.push_type = push
        declared = self.interface.push_constant_size
        given = push.size() if push is not None else 0
        if declared != given:
            raise VkmoeError(f"{shader}: the shader declares a {declared}-byte push-constant block but "
                             f"{push.__name__ if push else 'no push type'} is {given} bytes")
        # A family of shaders sharing one descriptor layout passes binding_count: the compiler drops the
        # bindings a member never touches, so the reflected set may have gaps.
        declared_bindings = self.interface.bindings
        if binding_count is None:
            if declared_bindings != list(range(len(declared_bindings))):
                raise VkmoeError(f"{shader}: storage-buffer bindings must be 0..n-1, got {declared_bindings}")
            binding_count = len(declared_bindings)
        elif declared_bindings and max(declared_bindings) >= binding_count:
            raise VkmoeError(f"{shader} uses binding {max(declared_bindings)}, beyond binding_count={binding_count}")
        # Vulkan guarantees only 4 storage buffers per stage (the MoE shaders bind 21): a device with fewer gets a
        # clear error here rather than a failed descriptor set layout.
        limit = getattr(getattr(device, "limits", None), "maxPerStageDescriptorStorageBuffers", None)
        if isinstance(limit, int) and binding_count > limit:
            raise VkmoeError(f"{shader} binds {binding_count} storage buffers; this device allows "
                             f"{limit} per shader stage (maxPerStageDescriptorStorageBuffers)")
        self.binding_count = binding_count
        self.spec = dict(spec or {})
        self._allow_unused_spec = allow_unused_spec
        # full_subgroups: every subgroup of a workgroup has all its invocations (the device's computeFullSubgroups)
        self._full_subgroups = full_subgroups
        self.handle = self.layout = self.set_layout = self._module = None
        self._closed = False
        self._free_lock = forksafe.Lock()
        with device.use():  # a concurrent Device.close() waits until the pipeline exists and is tracked
            try:
                self._create_objects(code, given, required_subgroup_size)
            except BaseException:
                self._destroy_objects()  # a failed constructor must not leak what it already created
                raise
            self._pool = _DescriptorPools(device, self.binding_count)
            device.track(self)

    def _create_objects(self, code, given, required_subgroup_size):
        h = self.device.handle
        self._module = call("vkCreateShaderModule", vk.vkCreateShaderModule, h, vk.VkShaderModuleCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(code), pCode=code), None)
        bindings = [vk.VkDescriptorSetLayoutBinding(binding=i, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                    descriptorCount=1, stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT)
                    for i in range(self.binding_count)]
        self.set_layout = call("vkCreateDescriptorSetLayout", vk.vkCreateDescriptorSetLayout, h,
                               vk.VkDescriptorSetLayoutCreateInfo(
                                   sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
                                   bindingCount=len(bindings), pBindings=bindings or None), None)
        ranges = [vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=given)] if given else []
        self.layout = call("vkCreatePipelineLayout", vk.vkCreatePipelineLayout, h, vk.VkPipelineLayoutCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, setLayoutCount=1, pSetLayouts=[self.set_layout],
            pushConstantRangeCount=len(ranges), pPushConstantRanges=ranges or None), None)
        self._create_pipeline(required_subgroup_size)

    def _destroy_objects(self):
        if not self.device._handle_alive:  # (the device is gone, or its handles are a fork() parent's)
            self.handle = self.layout = self.set_layout = self._module = None
            return
        h = self.device.handle
        if self.handle is not None:
            vk.vkDestroyPipeline(h, self.handle, None)
        if self.layout is not None:
            vk.vkDestroyPipelineLayout(h, self.layout, None)
        if self.set_layout is not None:
            vk.vkDestroyDescriptorSetLayout(h, self.set_layout, None)
        if self._module is not None:
            vk.vkDestroyShaderModule(h, self._module, None)
        self.handle = self.layout = self.set_layout = self._module = None

    def _create_pipeline(self, required_subgroup_size):
        declared = self.interface.spec_constants
        entries, data = [], b""
        for spec_id, value in sorted(self.spec.items()):
            if spec_id not in declared:
                if self._allow_unused_spec:
                    continue  # a family of shaders shares one spec map; the compiler drops what one never uses
                raise VkmoeError(f"{self.name}: specialization constant id {spec_id} is not declared by the shader "
                                 f"(declared: {sorted(declared)})")
            kind = declared[spec_id]
            if kind not in _SPEC_PACK:
                raise VkmoeError(f"{self.name}: specialization constant {spec_id} has unsupported type {kind}")
            value = bool(value) if kind == "bool" else value
            packed = struct.pack(_SPEC_PACK[kind], int(value) if kind != "float32" else float(value))
            entries.append((spec_id, len(data), 4))
            data += packed
        keep = []
        stage = ffi.new("VkPipelineShaderStageCreateInfo*")
        stage.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO
        stage.stage = vk.VK_SHADER_STAGE_COMPUTE_BIT
        stage.module = self._module
        entry_name = ffi.new("char[]", b"main")
        stage.pName = entry_name
        keep.append(entry_name)
        if entries:
            map_entries = ffi.new("VkSpecializationMapEntry[]", len(entries))
            for i, (cid, off, size) in enumerate(entries):
                map_entries[i].constantID, map_entries[i].offset, map_entries[i].size = cid, off, size
            blob = ffi.new("char[]", data)
            spec_info = ffi.new("VkSpecializationInfo*")
            spec_info.mapEntryCount = len(entries)
            spec_info.pMapEntries = map_entries
            spec_info.dataSize = len(data)
            spec_info.pData = blob
            stage.pSpecializationInfo = spec_info
            keep += [map_entries, blob, spec_info]
        if self._full_subgroups:
            stage.flags = REQUIRE_FULL_SUBGROUPS
        if required_subgroup_size:
            req = ffi.new("VkPipelineShaderStageRequiredSubgroupSizeCreateInfo*")
            req.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_REQUIRED_SUBGROUP_SIZE_CREATE_INFO
            req.requiredSubgroupSize = required_subgroup_size
            stage.pNext = req
            keep.append(req)
        info = ffi.new("VkComputePipelineCreateInfo*")
        info.sType = vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO
        if self.device.pipeline_statistics:  # the device was opened to capture them (Pipeline.statistics)
            info.flags = vk.VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR
        info.stage = stage[0]
        info.layout = self.layout
        out = ffi.new("VkPipeline*")
        result = vk.lib.vkCreateComputePipelines(self.device.handle, ffi.NULL, 1, info, ffi.NULL, out)
        check("vkCreateComputePipelines", result)
        self.handle = out[0]

    def statistics(self):
        """What the driver reports about this pipeline's compiled code: {executable name: {statistic: value}}
        (e.g. NVIDIA's "Register Count", "Shared Memory Size"), through VK_KHR_pipeline_executable_properties.
        Needs a device opened with pipeline_statistics=True; raises vkmoe.vk.statistics.StatisticsUnavailableError
        naming what is missing otherwise."""
        with self.device.use():
            if self._closed:
                raise VkmoeError(f"{self.name}: the pipeline is closed")
            return pipeline_statistics(self.device, self.handle, self.name)

    def push(self, **values):
        if self.push_type is None:
            raise VkmoeError(f"{self.name} takes no push constants")
        return self.push_type(**values)

    @property
    def closed(self):
        return self._closed

    def bind(self, *buffers):
        """A descriptor set binding `buffers` (vkmoe Buffers, in binding order) to this pipeline's layout."""
        if self._closed:
            raise VkmoeError(f"{self.name}: the pipeline is closed")
        if len(buffers) != self.binding_count:
            raise VkmoeError(f"{self.name} binds {self.binding_count} buffers, got {len(buffers)}")
        for i, b in enumerate(buffers):
            if b is None or getattr(b, "_closed", True):
                raise VkmoeError(f"{self.name}: binding {i} is not an open vkmoe Buffer")
            if b.device is not self.device:  # (its VkBuffer in this device's descriptor set: a driver crash)
                raise foreign_device_error(f"{self.name}: binding {i}", "Buffer", b.device, self.device)
        return self._pool.allocate(self.set_layout, buffers)

    def close(self):
        """Closed for use at once; destroyed once no run on the queue uses it (vk.in_flight), or by the device's
        close."""
        if not self._closed:
            self._closed = True
            self.device.in_flight.release(self, self._free, "a Pipeline")
        elif self.device.closed:  # the device's close: destroy it now if a deferred free has not yet
            self._free()

    def _free(self):
        with self._free_lock:  # (the device's close and a deferred free may both come)
            if self.layout is None:
                return
            self._pool.close()
            self._destroy_objects()
            self.device.untrack(self)


class DescriptorSet:
    def __init__(self, pools, pool, handle, buffers):
        self._pools, self._pool, self.handle, self.buffers = pools, pool, handle, buffers

    @property
    def closed(self):
        return self.handle is None

    def free(self):
        """Freed for use at once; given back to its pool once no run on the queue uses it (vk.in_flight)."""
        with self._pools._lock:  # (two threads freeing one set would both have taken the handle)
            handle, self.handle = self.handle, None
        if handle is not None:
            self._pools.device.in_flight.release(self, lambda: self._pools.free(self._pool, handle),
                                                 "a descriptor set")


class _DescriptorPools:
    """Growable descriptor pools for one pipeline's sets (sets are small; pools hold 64 each)."""

    SETS_PER_POOL = 64

    def __init__(self, device, binding_count):
        self.device = device
        self.binding_count = max(1, binding_count)
        self.pools = []  # [handle, free slots]
        # Descriptor pools are externally synchronised in Vulkan. Reentrant: a garbage collection that runs inside
        # allocate() (cffi allocates there) may finalize a layer whose sets come from these pools, and its free()
        # then takes the lock again on the same thread (a plain lock hung there, seen in the test suite). Freeing
        # a set inside allocate() is sound: both keep the counts of their own pool entry, one step each.
        self._lock = forksafe.RLock()

    def _new_pool(self):
        size = vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                       descriptorCount=self.SETS_PER_POOL * self.binding_count)
        handle = call("vkCreateDescriptorPool", vk.vkCreateDescriptorPool, self.device.handle,
                      vk.VkDescriptorPoolCreateInfo(sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
                                                    flags=vk.VK_DESCRIPTOR_POOL_CREATE_FREE_DESCRIPTOR_SET_BIT,
                                                    maxSets=self.SETS_PER_POOL, poolSizeCount=1, pPoolSizes=[size]),
                      None)
        entry = [handle, self.SETS_PER_POOL]
        self.pools.append(entry)
        return entry

    def allocate(self, layout, buffers):
        with self.device.use(), self._lock:
            return self._allocate(layout, buffers)

    def _allocate(self, layout, buffers):
        entry = next((p for p in self.pools if p[1] > 0), None) or self._new_pool()
        sets = call("vkAllocateDescriptorSets", vk.vkAllocateDescriptorSets, self.device.handle,
                    vk.VkDescriptorSetAllocateInfo(sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
                                                   descriptorPool=entry[0], descriptorSetCount=1, pSetLayouts=[layout]))
        entry[1] -= 1
        handle = sets[0]
        if buffers:
            infos = [vk.VkDescriptorBufferInfo(buffer=b.handle, offset=b.offset, range=b.size) for b in buffers]
            writes = [vk.VkWriteDescriptorSet(sType=vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, dstSet=handle,
                                              dstBinding=i, descriptorCount=1,
                                              descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                              pBufferInfo=[info]) for i, info in enumerate(infos)]
            vk.vkUpdateDescriptorSets(self.device.handle, len(writes), writes, 0, None)
        return DescriptorSet(self, entry, handle, tuple(buffers))

    def free(self, entry, handle):
        with self._lock:
            self._free(entry, handle)

    def _free(self, entry, handle):
        if entry in self.pools and self.device._handle_alive:
            vk.vkFreeDescriptorSets(self.device.handle, entry[0], 1, [handle])
            entry[1] += 1

    def close(self):
        for handle, _ in self.pools if self.device._handle_alive else ():
            vk.vkDestroyDescriptorPool(self.device.handle, handle, None)
        self.pools = []
