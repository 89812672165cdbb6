"""Device: instance, physical-device choice, logical device with the features vkmoe's shaders use, one compute
queue, and the capability report (`info()`)."""
import functools
import logging
import numbers
import os
import threading
import weakref

import vulkan as vk

from .. import forksafe, knobs
from . import statistics
from .in_flight import InFlight
from .errors import (VULKAN_INSTALL_HINT, DeviceClosedError, DeviceSelectionError, NoVulkanError,
                     VkmoeError, VulkanError, call, check)

ffi = vk.ffi
log = logging.getLogger("vkmoe")

_DEVICE_TYPE_RANK = {  # default choice: a real GPU before a CPU implementation
    vk.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: 0,
    vk.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: 1,
    vk.VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: 2,
    vk.VK_PHYSICAL_DEVICE_TYPE_OTHER: 3,
    vk.VK_PHYSICAL_DEVICE_TYPE_CPU: 4,
}
_DEVICE_TYPE_NAME = {
    vk.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: "discrete-gpu",
    vk.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: "integrated-gpu",
    vk.VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: "virtual-gpu",
    vk.VK_PHYSICAL_DEVICE_TYPE_OTHER: "other",
    vk.VK_PHYSICAL_DEVICE_TYPE_CPU: "cpu",
}
_VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"


def _version(v):
    return f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


# Extension features vkmoe enables where the device has them (Device.features names them): (feature, extension,
# its feature struct, the struct's sType constant).
_EXTENSION_FEATURES = (
    ("cooperativeMatrix", "VK_KHR_cooperative_matrix", "VkPhysicalDeviceCooperativeMatrixFeaturesKHR",
     "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR"),
    ("shaderDeviceClock", "VK_KHR_shader_clock", "VkPhysicalDeviceShaderClockFeaturesKHR",
     "VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_CLOCK_FEATURES_KHR"),
)


def _new_struct(ctype, stype, chain_to=None):
    s = ffi.new(ctype + "*")
    s.sType = stype
    if chain_to is not None:
        s.pNext = chain_to
    return s


def _validation_requested():
    return knobs.get("VKMOE_VALIDATION")


class _Instance:
    """One VkInstance per process (and per validation setting): devices share it."""

    _lock = forksafe.Lock()  # (a fork() child finds it released: vkmoe.forksafe)
    _instances = {}

    @classmethod
    def get(cls, validation):
        with cls._lock:
            _check_not_forked_from_a_gpu_process()  # (before any Vulkan call: the driver may hang there)
            inst = cls._instances.get(validation)
            if inst is None:
                inst = cls._instances[validation] = cls(validation)
            return inst

    def __init__(self, validation):
        self.validation = validation
        self.messages = []  # validation warnings/errors, drained by Device.take_validation_messages()
        layers, extensions = [], []
        if validation:
            available = [layer.layerName for layer in vk.vkEnumerateInstanceLayerProperties()]
            if _VALIDATION_LAYER not in available:
                raise VkmoeError(
                    f"VKMOE_VALIDATION=1 but {_VALIDATION_LAYER} is not installed "
                    "(Debian: apt-get install vulkan-validationlayers)"
                )
            layers.append(_VALIDATION_LAYER)
            extensions.append(vk.VK_EXT_DEBUG_UTILS_EXTENSION_NAME)
        try:
            loader_version = vk.vkEnumerateInstanceVersion()
        except Exception:  # loaders before 1.1 lack the entry point
            loader_version = vk.VK_MAKE_VERSION(1, 0, 0)
        api = min(loader_version, vk.VK_MAKE_VERSION(1, 3, 0))
        self.api_version = api
        app = vk.VkApplicationInfo(
            sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO,
            pApplicationName="vkmoe",
            pEngineName="vkmoe",
            apiVersion=api,
        )
        info = vk.VkInstanceCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
            pApplicationInfo=app,
            enabledLayerCount=len(layers),
            ppEnabledLayerNames=layers or None,
            enabledExtensionCount=len(extensions),
            ppEnabledExtensionNames=extensions or None,
        )
        try:
            self.handle = call("vkCreateInstance", vk.vkCreateInstance, info, None)
        except VulkanError as exc:
            if exc.result != "VK_ERROR_INCOMPATIBLE_DRIVER":  # what the loader returns when it found no driver
                raise
            raise NoVulkanError(f"the Vulkan loader found no driver (vkCreateInstance: {exc.result}); "
                                f"{VULKAN_INSTALL_HINT}") from None
        self._messenger = None
        if validation:
            self._install_messenger()

    def _install_messenger(self):
        def on_message(severity, types, data, user_data):
            text = ffi.string(data.pMessage).decode(errors="replace")
            level = logging.ERROR if severity & vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT else logging.WARNING
            log.log(level, "validation: %s", text)
            self.messages.append(text)
            return 0

        create = vk.vkGetInstanceProcAddr(self.handle, "vkCreateDebugUtilsMessengerEXT")
        info = vk.VkDebugUtilsMessengerCreateInfoEXT(
            sType=vk.VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT,
            messageSeverity=vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
            messageType=vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT,
            pfnUserCallback=on_message,
        )
        self._callback = on_message  # the binding keeps only a module-level reference; keep ours too
        self._messenger = create(self.handle, info, None)

    def physical_devices(self):
        """[(VkPhysicalDevice, its VkPhysicalDeviceProperties)], one properties query each (a GPU among them marks
        the process: _note_gpu_driver)."""
        found = [(pd, vk.vkGetPhysicalDeviceProperties(pd))
                 for pd in call("vkEnumeratePhysicalDevices", vk.vkEnumeratePhysicalDevices, self.handle)]
        _note_gpu_driver([props for _, props in found])
        return found


def list_devices():
    """[(index, name, type, driver info)] of the Vulkan devices visible to this process."""
    inst = _Instance.get(_validation_requested())
    out = []
    for index, (_, props) in enumerate(inst.physical_devices()):
        out.append((index, props.deviceName, _DEVICE_TYPE_NAME.get(props.deviceType, "?")))
    return out


def _check_selector(selector):
    """A device index >= 0, a name substring or None (1.5, True or -1 were looked up as name substrings)."""
    if selector is None or isinstance(selector, str):
        return
    if isinstance(selector, bool) or not isinstance(selector, numbers.Integral):
        raise TypeError(f"selector: expected a device index or a substring of its name, got "
                        f"{type(selector).__name__} {selector!r}")
    if selector < 0:
        raise DeviceSelectionError(f"selector: a device index is >= 0, got {selector}")


def _select(physical_devices, selector):
    described = []
    for index, (pd, props) in enumerate(physical_devices):
        described.append((index, pd, props.deviceName, props.deviceType))
    if not described:
        raise DeviceSelectionError("no Vulkan device found (is a Vulkan driver installed? Debian: mesa-vulkan-drivers)")
    listing = "; ".join(f"{i}: {name}" for i, _, name, _ in described)
    if selector is None or str(selector).strip() == "":
        return min(described, key=lambda d: (_DEVICE_TYPE_RANK.get(d[3], 9), d[0]))
    text = str(selector).strip()
    if text.isdigit():
        index = int(text)
        if index >= len(described):
            raise DeviceSelectionError(f"device index {index} out of range; devices are: {listing}")
        return described[index]
    matches = [d for d in described if text.lower() in d[2].lower()]
    if not matches:
        raise DeviceSelectionError(f"no Vulkan device name contains {text!r}; devices are: {listing}")
    return matches[0]



_COMPONENT_TYPES = {getattr(vk, f"VK_COMPONENT_TYPE_{t.upper()}_KHR"): t for t in (
    "float16", "float32", "float64", "sint8", "sint16", "sint32", "sint64", "uint8", "uint16", "uint32", "uint64")}
_SCOPES = {vk.VK_SCOPE_DEVICE_KHR: "device", vk.VK_SCOPE_WORKGROUP_KHR: "workgroup",
           vk.VK_SCOPE_SUBGROUP_KHR: "subgroup", vk.VK_SCOPE_QUEUE_FAMILY_KHR: "queue-family"}


def _cooperative_matrix_shapes(instance, physical):
    """vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR as dicts {M, N, K, A, B, C, result, saturating, scope}
    (called through the raw entry point: the binding's wrapper leaves the array's sType unset)."""
    name = "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"
    address = vk.lib.vkGetInstanceProcAddr(instance, name.encode())
    if address == ffi.NULL:
        return []
    fn = ffi.cast("PFN_" + name, address)
    count = ffi.new("uint32_t*")
    check(name, fn(physical, count, ffi.NULL))
    props = ffi.new("VkCooperativeMatrixPropertiesKHR[]", count[0])
    for i in range(count[0]):
        props[i].sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
    check(name, fn(physical, count, props))
    return [{"M": p.MSize, "N": p.NSize, "K": p.KSize, "A": _COMPONENT_TYPES.get(p.AType, p.AType),
             "B": _COMPONENT_TYPES.get(p.BType, p.BType), "C": _COMPONENT_TYPES.get(p.CType, p.CType),
             "result": _COMPONENT_TYPES.get(p.ResultType, p.ResultType), "saturating": bool(p.saturatingAccumulation),
             "scope": _SCOPES.get(p.scope, p.scope)} for p in props[0:count[0]]]


class _DeviceHold:
    """Device.use(): registers the blocks running driver calls (stateless per block, so one instance serves all).
    No lock on the way in and out (every op call passes here; taking the lock in both cost ~0.5 us of ~0.9 on the
    dev machine): a block registers in d._holds first and looks at d._closed then, close() sets d._closed first
    and then waits under d._idle until d._holds is empty. So either the block sees the device closed and leaves,
    or close() sees the block and waits for it. list.append and list.pop are atomic, and the GIL keeps the order
    of these steps between threads."""
    __slots__ = ("_device",)

    def __init__(self, device):
        self._device = device

    def __enter__(self):
        d = self._device
        d._holds.append(None)
        if d._closed:
            self.__exit__()
            d.check_open()  # raises
        return d

    def __exit__(self, *exc):
        d = self._device
        d._holds.pop()
        if d._closed and not d._holds:
            with d._idle:
                d._idle.notify_all()  # close() waits for the last block
        return False

def expect_device(value, name="device"):
    """`value` if it is a vkmoe.Device, else a TypeError naming the argument (the constructors that take a device
    check it first, instead of failing on an attribute of whatever was passed)."""
    if not isinstance(value, Device):
        raise TypeError(f"{name}: expected a vkmoe.Device, got {type(value).__name__}")
    return value


# Every Device opened in this process: a child process after fork() marks them closed at once (_after_fork_in_child).
_open_devices = weakref.WeakSet()
_fork_parent = None  # in a fork() child of a process that had used Vulkan: the parent's pid (Device() errors say so)
# The first GPU (any device but a CPU driver) whose driver this process loaded: the loader loads every driver
# when an instance enumerates devices, so a process that opened only lavapipe on a GPU machine has the GPU's
# driver and its threads too. A fork() child of such a process makes no Vulkan call at all: a GPU driver's state
# and threads stay in the parent. NVIDIA's driver refused vkCreateDevice in such a child, and once (an H100,
# thirty-first session, three other test processes on the GPU) a child that opened a new Device hung until it
# was killed. lavapipe alone runs a new instance in the child, so a machine without a GPU leaves this unset.
_gpu_driver = None


def _note_gpu_driver(properties):
    """Remember the first GPU among the enumerated devices' VkPhysicalDeviceProperties (_gpu_driver)."""
    global _gpu_driver
    for props in properties:
        if _gpu_driver is None and props.deviceType != vk.VK_PHYSICAL_DEVICE_TYPE_CPU:
            _gpu_driver = props.deviceName


def _check_not_forked_from_a_gpu_process():
    if _fork_parent is not None and _gpu_driver is not None:
        raise VkmoeError(f"this process was forked from process {_fork_parent}, which had loaded the Vulkan driver of "
                         f"{_gpu_driver!r}: a GPU driver does not survive fork(), so vkmoe makes no Vulkan call "
                         "here; start this process with multiprocessing's 'spawn' method instead")


def _after_fork_in_child():
    """Vulkan objects do not survive fork(): the driver's threads and state stay in the parent (lavapipe's queue
    never ran a submission of the child's copy, which timed out after VKMOE_TIMEOUT; a GPU's state is the
    parent's). So in the child every Device of the parent is closed for use, with an error that says why, and
    nothing is destroyed through its handles (they are the parent's). A new Device makes its own instance (one on
    the parent's instance never ran a submission on lavapipe either)."""
    global _fork_parent
    parent = os.getppid()
    if _open_devices or _Instance._instances or _gpu_driver is not None:
        _fork_parent = parent
    for device in list(_open_devices):
        device._left_by_fork(parent)
    _open_devices.clear()
    _Instance._instances.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Device:
    """A logical Vulkan device with one compute queue.

    `selector` (or the VKMOE_DEVICE environment variable) is a device index or a substring of its name.
    Use as a context manager or call close(); buffers and pipelines made from it must be closed first
    (close() does it for the objects it still tracks).

    `pipeline_statistics` (default: VKMOE_PIPELINE_STATISTICS, off) enables VK_KHR_pipeline_executable_properties,
    and its pipelines capture what the driver reports about them (`Pipeline.statistics()`); capturing may change
    how the driver compiles, so it is only for tuning. A device without the extension raises
    vkmoe.vk.statistics.StatisticsUnavailableError then.
    """

    def __init__(self, selector: "int | str | None" = None, pipeline_statistics: "bool | None" = None):
        _check_selector(selector)
        knobs.warn_about_environment()
        self._closed = True
        self._handle_alive = False  # False once the VkDevice is destroyed (or left to the parent after a fork)
        self._forked_from = None  # the parent's pid, in a child process after fork(): check_open says so
        # Calls into the driver in progress (`use()`: one entry per block); close() waits for them, so another
        # thread's forward ends with DeviceClosedError instead of touching destroyed objects.
        self._holds = []
        # close() waits on it for the last block. Its lock is reentrant (Condition's default): a finalizer that a
        # garbage collection runs while it is held may close objects itself.
        self._idle = threading.Condition()
        self._hold = _DeviceHold(self)
        self.validation = _validation_requested()
        self.instance = _Instance.get(self.validation)
        if selector is None:
            selector = knobs.get("VKMOE_DEVICE")
        self.index, self.physical, self.name, device_type = _select(self.instance.physical_devices(), selector)
        self.device_type = _DEVICE_TYPE_NAME.get(device_type, "other")
        self._query_capabilities()
        if pipeline_statistics is None:
            pipeline_statistics = knobs.get("VKMOE_PIPELINE_STATISTICS")
        self.pipeline_statistics = bool(pipeline_statistics)  # pipelines capture statistics (Pipeline.statistics)
        missing = statistics.unavailable(self) if self.pipeline_statistics else None
        if missing:
            raise statistics.StatisticsUnavailableError(
                f"pipeline statistics were requested (Device(pipeline_statistics=True) or "
                f"VKMOE_PIPELINE_STATISTICS=1), but {missing}")
        try:
            self._create_logical_device()
        except VkmoeError as exc:
            if _fork_parent is None:
                raise
            # (NVIDIA's driver: vkCreateDevice failed with VK_ERROR_INITIALIZATION_FAILED in such a child)
            raise VkmoeError(f"{exc}: this process was forked from process {_fork_parent}, which had opened a "
                             "Vulkan device, and this driver refuses a device in such a child; start it with "
                             "multiprocessing's 'spawn' method instead") from exc
        self._closed = False
        self._handle_alive = True
        self._children = []  # objects to destroy on close, in reverse order
        self._lock = threading.RLock()  # queue submission is externally synchronised in Vulkan
        # First runs of fresh recordings submitted to the queue and not yet seen finished: {CommandRecorder:
        # (its submission number, monotonic submit time)}, kept by vk.commands under _lock. A submission queued
        # behind one may wait for the driver's compile too (lavapipe compiles at the first dispatch).
        self._first_runs = {}
        # The recorders and what their recordings use: Buffers, Pipelines and descriptor sets close through it, so
        # none is freed under a run that still uses it (vk.in_flight).
        self.in_flight = InFlight(self)
        from .memory import MemoryManager  # circular import: memory needs a Device

        self.memory = MemoryManager(self)
        self._quirks = None
        _open_devices.add(self)

    # ----------------------------------------------------------------------------------------- capabilities
    def _query_capabilities(self):
        """What the device reports and whether vkmoe can run on it (raises VkmoeError when it cannot)."""
        subgroup, vendor_counts = self._query_properties()
        self._count_compute_units(*vendor_counts)
        self._query_features()
        self._check_subgroup_ops(subgroup)

    def _query_properties(self):
        """Properties, the driver and the subgroup sizes. Returns the subgroup properties and the vendor structs
        that count compute units (NV, AMD, ARM; None where the extension is missing)."""
        pd = self.physical
        self.extensions = {e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(pd, None)}
        # The binding returns a struct whose owner may be collected: copy it into memory we own.
        self._props = ffi.new("VkPhysicalDeviceProperties*")
        vk.lib.vkGetPhysicalDeviceProperties(pd, self._props)
        props = self._props[0]
        self.api_version = min(props.apiVersion, self.instance.api_version)
        self.limits = props.limits
        # Property chain. Every struct stays referenced from self._prop_chain for as long as it is read.
        chain = []

        def link(ctype, stype, needed=True):
            if not needed:
                return None
            s = _new_struct(ctype, stype, chain[-1] if chain else None)
            chain.append(s)
            return s

        subgroup = link("VkPhysicalDeviceSubgroupProperties", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES)
        v12 = link("VkPhysicalDeviceVulkan12Properties", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_PROPERTIES,
                   self.api_version >= vk.VK_MAKE_VERSION(1, 2, 0))
        sgc = link("VkPhysicalDeviceSubgroupSizeControlProperties",
                   vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_PROPERTIES,
                   self.api_version >= vk.VK_MAKE_VERSION(1, 3, 0))
        dot = link("VkPhysicalDeviceShaderIntegerDotProductProperties",
                   vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_PROPERTIES,
                   self.api_version >= vk.VK_MAKE_VERSION(1, 3, 0))
        nv = link("VkPhysicalDeviceShaderSMBuiltinsPropertiesNV",
                  vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_SM_BUILTINS_PROPERTIES_NV,
                  "VK_NV_shader_sm_builtins" in self.extensions)
        amd = link("VkPhysicalDeviceShaderCoreProperties2AMD",
                   vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_CORE_PROPERTIES_2_AMD,
                   "VK_AMD_shader_core_properties2" in self.extensions)
        arm = link("VkPhysicalDeviceShaderCoreBuiltinsPropertiesARM",
                   vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_CORE_BUILTINS_PROPERTIES_ARM,
                   "VK_ARM_shader_core_builtins" in self.extensions)
        props2 = _new_struct("VkPhysicalDeviceProperties2", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, chain[-1])
        vk.vkGetPhysicalDeviceProperties2(pd, props2)
        self._prop_chain = (chain, props2)

        self.subgroup_size = subgroup.subgroupSize
        self.subgroup_operations = subgroup.supportedOperations
        self.min_subgroup_size = sgc.minSubgroupSize if sgc else self.subgroup_size
        self.max_subgroup_size = sgc.maxSubgroupSize if sgc else self.subgroup_size
        self._size_control_stages = sgc.requiredSubgroupSizeStages if sgc else 0
        if v12 is not None:
            self.driver_name = ffi.string(v12.driverName).decode()
            self.driver_info = ffi.string(v12.driverInfo).decode()
            self.driver_id = int(v12.driverID)
        else:
            self.driver_name, self.driver_info, self.driver_id = "unknown", "", 0
        self.driver_version = props.driverVersion
        self.vendor_id, self.device_id = props.vendorID, props.deviceID
        self.dot_product_accelerated = bool(dot and dot.integerDotProduct4x8BitPackedUnsignedAccelerated)
        return subgroup, (nv, amd, arm)

    def _count_compute_units(self, nv, amd, arm):
        """How many workgroups can be resident at once, as the vendor reports it (a hint; the probe measures)."""
        if nv is not None:
            self.compute_units, self.compute_units_source = int(nv.shaderSMCount), "VK_NV_shader_sm_builtins"
        elif amd is not None:
            self.compute_units = int(amd.activeComputeUnitCount)
            self.compute_units_source = "VK_AMD_shader_core_properties2"
        elif arm is not None:
            self.compute_units, self.compute_units_source = int(arm.shaderCoreCount), "VK_ARM_shader_core_builtins"
        elif self.is_lavapipe:
            threads = os.environ.get("LP_NUM_THREADS")
            if threads and threads.strip().isdigit():
                self.compute_units, self.compute_units_source = int(threads), "lavapipe LP_NUM_THREADS"
            else:
                self.compute_units, self.compute_units_source = os.cpu_count() or 1, "lavapipe worker threads (CPU count)"
        else:
            self.compute_units, self.compute_units_source = None, None

    def _query_features(self):
        """Features: query what exists, record what vkmoe uses; the Vulkan memory model is required."""
        pd = self.physical
        f13 = _new_struct("VkPhysicalDeviceVulkan13Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES) \
            if self.api_version >= vk.VK_MAKE_VERSION(1, 3, 0) else None
        f12 = _new_struct("VkPhysicalDeviceVulkan12Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES, f13)
        f11 = _new_struct("VkPhysicalDeviceVulkan11Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, f12)
        f2 = _new_struct("VkPhysicalDeviceFeatures2", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, f11)
        vk.vkGetPhysicalDeviceFeatures2(pd, f2)
        if self.api_version < vk.VK_MAKE_VERSION(1, 2, 0) or not f12.vulkanMemoryModel:
            raise VkmoeError(f"{self.name}: vkmoe needs Vulkan 1.2 with the vulkanMemoryModel feature")
        self.features = {
            "vulkanMemoryModel": True,
            "vulkanMemoryModelDeviceScope": bool(f12.vulkanMemoryModelDeviceScope),
            "shaderFloat16": bool(f12.shaderFloat16),
            "shaderInt8": bool(f12.shaderInt8),
            "shaderInt16": bool(f2.features.shaderInt16),
            "shaderInt64": bool(f2.features.shaderInt64),
            "storageBuffer16BitAccess": bool(f11.storageBuffer16BitAccess),
            "storageBuffer8BitAccess": bool(f12.storageBuffer8BitAccess),
            "hostQueryReset": bool(f12.hostQueryReset),
            "subgroupSizeControl": bool(f13 and f13.subgroupSizeControl),
            "computeFullSubgroups": bool(f13 and f13.computeFullSubgroups),
            "shaderIntegerDotProduct": bool(f13 and f13.shaderIntegerDotProduct),
            "cooperativeMatrix": self._query_cooperative_matrix(),
            "shaderDeviceClock": self._query_device_clock(),
            statistics.FEATURE: statistics.query_feature(pd, self.extensions),
        }

    def _query_cooperative_matrix(self):
        """VK_KHR_cooperative_matrix: whether the feature is there (then it is enabled), and the matrix shapes the
        device multiplies in self.cooperative_matrix_shapes (empty without it)."""
        self.cooperative_matrix_shapes = []
        if "VK_KHR_cooperative_matrix" not in self.extensions or self.api_version < vk.VK_MAKE_VERSION(1, 3, 0):
            return False
        coop = _new_struct("VkPhysicalDeviceCooperativeMatrixFeaturesKHR",
                           vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR)
        f2 = _new_struct("VkPhysicalDeviceFeatures2", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, coop)
        vk.vkGetPhysicalDeviceFeatures2(self.physical, f2)
        if not coop.cooperativeMatrix:
            return False
        self.cooperative_matrix_shapes = _cooperative_matrix_shapes(self.instance.handle, self.physical)
        return True

    def _query_device_clock(self):
        """VK_KHR_shader_clock's shaderDeviceClock (a realtime clock shaders read; enabled where it exists): what the
        persistent kernel's timing build reads (VKMOE_PERSISTENT_CLOCK)."""
        if "VK_KHR_shader_clock" not in self.extensions:
            return False
        clock = _new_struct("VkPhysicalDeviceShaderClockFeaturesKHR",
                            vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_CLOCK_FEATURES_KHR)
        f2 = _new_struct("VkPhysicalDeviceFeatures2", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, clock)
        vk.vkGetPhysicalDeviceFeatures2(self.physical, f2)
        return bool(clock.shaderDeviceClock)

    @property
    def can_require_subgroup_size(self):
        """Whether a compute pipeline may ask for a subgroup size (Pipeline(required_subgroup_size=...))."""
        return bool(self.features.get("subgroupSizeControl")
                    and self._size_control_stages & vk.VK_SHADER_STAGE_COMPUTE_BIT)

    def _check_subgroup_ops(self, subgroup):
        """Subgroup operations every vkmoe kernel uses (Vulkan 1.1 reports them for the compute stage): what is
        missing goes to missing_subgroup_ops."""
        self.subgroup_compute = bool(subgroup.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT)
        needed = {"ballot": vk.VK_SUBGROUP_FEATURE_BALLOT_BIT, "arithmetic": vk.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT,
                  "shuffle": vk.VK_SUBGROUP_FEATURE_SHUFFLE_BIT}
        self.missing_subgroup_ops = [n for n, bit in needed.items() if not self.subgroup_operations & bit]
        if not self.subgroup_compute:
            self.missing_subgroup_ops.append("compute stage")
        if self.min_subgroup_size < 4:  # routing keeps per-subgroup totals for at most 64 subgroups of 256
            self.missing_subgroup_ops.append("subgroup size >= 4")

    @property
    def is_lavapipe(self):
        return "llvmpipe" in self.name.lower() or self.driver_name.lower() == "llvmpipe"

    # ---------------------------------------------------------------------------------------- logical device
    def _create_logical_device(self):
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(self.physical)
        candidates = [i for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        if not candidates:
            raise VkmoeError(f"{self.name}: no queue family supports compute")
        # Prefer a family with timestamps; among those the first (usually the universal queue).
        candidates.sort(key=lambda i: families[i].timestampValidBits == 0)
        self.queue_family = candidates[0]
        self.timestamp_valid_bits = families[self.queue_family].timestampValidBits
        f = self.features
        f13 = None
        if self.api_version >= vk.VK_MAKE_VERSION(1, 3, 0):
            f13 = _new_struct("VkPhysicalDeviceVulkan13Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES)
            f13.subgroupSizeControl = f["subgroupSizeControl"]
            f13.computeFullSubgroups = f["computeFullSubgroups"]
            f13.shaderIntegerDotProduct = f["shaderIntegerDotProduct"]
        f12 = _new_struct("VkPhysicalDeviceVulkan12Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES, f13)
        f12.vulkanMemoryModel = 1
        f12.vulkanMemoryModelDeviceScope = f["vulkanMemoryModelDeviceScope"]
        f12.shaderFloat16 = f["shaderFloat16"]
        f12.shaderInt8 = f["shaderInt8"]
        f12.storageBuffer8BitAccess = f["storageBuffer8BitAccess"]
        f12.hostQueryReset = f["hostQueryReset"]
        f11 = _new_struct("VkPhysicalDeviceVulkan11Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, f12)
        f11.storageBuffer16BitAccess = f["storageBuffer16BitAccess"]
        extensions, chain = [], [f11]  # extension feature structs go in front of the core ones
        for feature, extension, struct, stype in _EXTENSION_FEATURES:
            if f[feature]:
                s = _new_struct(struct, getattr(vk, stype), chain[-1])
                setattr(s, feature, 1)
                chain.append(s)
                extensions.append(extension)
        if self.pipeline_statistics:
            chain.append(statistics.new_feature_struct(chain[-1], enable=True))
            extensions.append(statistics.EXTENSION)
        f2 = _new_struct("VkPhysicalDeviceFeatures2", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, chain[-1])
        f2.features.shaderInt16 = f["shaderInt16"]
        f2.features.shaderInt64 = f["shaderInt64"]
        priorities = ffi.new("float[1]", [1.0])
        queue_info = ffi.new("VkDeviceQueueCreateInfo*")
        queue_info.sType = vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO
        queue_info.queueFamilyIndex = self.queue_family
        queue_info.queueCount = 1
        queue_info.pQueuePriorities = priorities
        info = ffi.new("VkDeviceCreateInfo*")
        info.sType = vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO
        info.pNext = f2
        info.queueCreateInfoCount = 1
        info.pQueueCreateInfos = queue_info
        names = [ffi.new("char[]", e.encode()) for e in extensions]
        name_array = ffi.new("char*[]", names)
        info.enabledExtensionCount = len(names)
        info.ppEnabledExtensionNames = name_array if names else ffi.NULL
        handle = ffi.new("VkDevice*")
        result = vk.lib.vkCreateDevice(self.physical, info, ffi.NULL, handle)
        check("vkCreateDevice", result)
        self.handle = handle[0]
        self.queue = vk.vkGetDeviceQueue(self.handle, self.queue_family, 0)

    # ------------------------------------------------------------------------------------------------ report
    @property
    def mesa_version(self):
        """'22.3.6' for a Mesa driver, else None."""
        import re

        m = re.search(r"Mesa (\d+\.\d+\.\d+)", self.driver_info)
        return m.group(1) if m else None

    @property
    def quirks(self):
        """Driver behaviours found by measurement (cached per driver and device)."""
        if self._quirks is None:
            from .quirks import detect_quirks

            self._quirks = detect_quirks(self)
        return self._quirks

    @functools.cached_property
    def identity(self):
        """A key naming this driver + device, for caches of measurements (made once: what it names never changes,
        and auto mode's residency lookup uses it on every MoE call)."""
        return f"{self.name}|{self.driver_name}|{self.driver_info}|{self.driver_version:#x}|{self.vendor_id:#x}:{self.device_id:#x}"

    def info(self) -> dict:
        L = self.limits
        return {
            "name": self.name,
            "index": self.index,
            "type": self.device_type,
            "driver": self.driver_name,
            "driver_info": self.driver_info,
            "mesa_version": self.mesa_version,
            "api": _version(self.api_version),
            "vendor_id": self.vendor_id,
            "device_id": self.device_id,
            "subgroup_size": self.subgroup_size,
            "subgroup_size_range": [self.min_subgroup_size, self.max_subgroup_size],
            "compute_units": self.compute_units,
            "compute_units_source": self.compute_units_source,
            "limits": {
                "max_shared_memory": L.maxComputeSharedMemorySize,
                "max_workgroup_invocations": L.maxComputeWorkGroupInvocations,
                "max_workgroup_size": list(L.maxComputeWorkGroupSize),
                "max_workgroup_count": list(L.maxComputeWorkGroupCount),
                "max_storage_buffer_range": L.maxStorageBufferRange,
                "max_push_constants_size": L.maxPushConstantsSize,
                "max_storage_buffers_per_stage": L.maxPerStageDescriptorStorageBuffers,
                "timestamp_period_ns": L.timestampPeriod,
            },
            "features": dict(self.features),
            "cooperative_matrix_shapes": list(self.cooperative_matrix_shapes),
            "integer_dot_product_accelerated": self.dot_product_accelerated,
            "validation": self.validation,
            "pipeline_statistics": self.pipeline_statistics,
            "quirks": dict(self.quirks),
        }

    # ------------------------------------------------------------------------------------------- validation
    def take_validation_messages(self):
        """Return and clear the validation messages reported so far (always [] without VKMOE_VALIDATION=1)."""
        messages = list(self.instance.messages)
        self.instance.messages.clear()
        return messages

    # ------------------------------------------------------------------------------------------- lifetime
    def track(self, obj):
        self._children.append(obj)
        return obj

    def untrack(self, obj):
        try:
            self._children.remove(obj)
        except ValueError:
            pass

    def check_open(self):
        """Raise DeviceClosedError naming this device if close() has been called."""
        if self._closed:
            if self._forked_from is not None:
                raise DeviceClosedError(
                    f"{self!r} was opened by process {self._forked_from}, which this process was forked from: Vulkan "
                    "objects do not survive fork(). Open a new vkmoe.Device in this process (or start it with "
                    "multiprocessing's 'spawn' method)")
            raise DeviceClosedError(f"{self!r} is closed; objects made from it cannot be used (open a new vkmoe.Device)")

    def _left_by_fork(self, parent):
        """This process is a fork() child of the one that opened the device (_after_fork_in_child): closed for use,
        its handles never touched again (every close and free here looks at _handle_alive), and fresh locks (a
        thread of the parent, absent here, may have held one at the fork)."""
        self._forked_from = parent
        self._closed = True
        self._handle_alive = False
        self._holds = []
        self._idle = threading.Condition()
        self._lock = threading.RLock()
        self.in_flight.after_fork()
        self.memory.after_fork()

    def use(self):
        """Hold the device open for the calls into the driver inside a `with` block: close() waits until no block
        is running, and a block started after close() raises DeviceClosedError. On every driver call's path, so
        a small reusable context manager (no generator) that wakes close() only when it waits."""
        return self._hold

    def wait_idle(self):
        with self.use(), self._lock:
            call("vkDeviceWaitIdle", vk.vkDeviceWaitIdle, self.handle)

    def close(self):
        """Destroy the device and what was made from it. New calls are refused at once; calls already running
        in other threads (a submission wait is bounded by its timeout) finish first."""
        with self._idle:
            if self._closed:
                return
            self._closed = True
            while self._holds:  # (_DeviceHold: a block that registered before this saw the device open)
                self._idle.wait()
        if not self._handle_alive:
            return
        try:
            vk.vkDeviceWaitIdle(self.handle)
        except Exception:  # a lost device still has to be destroyed
            pass
        self.in_flight.close()  # the frees that waited for runs (none is running now)
        for obj in reversed(list(self._children)):
            obj.close()
        self.memory.close()
        vk.vkDestroyDevice(self.handle, None)
        self._handle_alive = False

    @property
    def closed(self):
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return f"<vkmoe.Device {self.index}: {self.name} ({self.driver_info or self.driver_name})>"
