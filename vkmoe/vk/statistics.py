"""What the driver reports about a pipeline's compiled executables (VK_KHR_pipeline_executable_properties):
register count, shared memory, spills and the like, per executable, for tuning kernels.

A device captures them only when opened with `Device(pipeline_statistics=True)` (or VKMOE_PIPELINE_STATISTICS=1):
the extension is enabled then, and every pipeline is created with VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR,
which may change how the driver compiles it (so it is never on by default).
"""
import vulkan as vk

from .errors import VkmoeError, check

ffi = vk.ffi
EXTENSION = "VK_KHR_pipeline_executable_properties"
FEATURE = "pipelineExecutableInfo"


class StatisticsUnavailableError(VkmoeError):
    """Pipeline statistics were asked of a device that does not offer them, or was not opened to capture them."""


def unavailable(device):
    """Why `device` cannot capture pipeline statistics (a sentence naming what is missing), or None."""
    if EXTENSION not in device.extensions:
        return f"{device.name} does not offer {EXTENSION}: its driver reports no pipeline statistics"
    if not device.features.get(FEATURE):
        return f"{device.name} offers {EXTENSION} without its {FEATURE} feature: no pipeline statistics"
    return None


def query_feature(physical, extensions):
    """Whether the physical device has the extension and its pipelineExecutableInfo feature."""
    if EXTENSION not in extensions:
        return False
    feature = new_feature_struct()
    f2 = ffi.new("VkPhysicalDeviceFeatures2*")
    f2.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2
    f2.pNext = feature
    vk.vkGetPhysicalDeviceFeatures2(physical, f2)
    return bool(feature.pipelineExecutableInfo)


def new_feature_struct(chain_to=None, enable=False):
    """A VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR (for a feature query, or enabled for vkCreateDevice)."""
    s = ffi.new("VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR*")
    s.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR
    s.pipelineExecutableInfo = int(enable)
    if chain_to is not None:
        s.pNext = chain_to
    return s


def _entry_point(device, name):
    """Extension function `name` of the logical device, through vkGetDeviceProcAddr (the raw one: the binding's
    wrappers leave the sType of the arrays they allocate unset)."""
    address = vk.lib.vkGetDeviceProcAddr(device.handle, name.encode())
    if address == ffi.NULL:
        raise StatisticsUnavailableError(f"{device.name}: vkGetDeviceProcAddr found no {name}, although "
                                         f"{EXTENSION} is enabled")
    return ffi.cast("PFN_" + name, address)


_FORMATS = {
    vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR: lambda v: bool(v.b32),
    vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR: lambda v: int(v.i64),
    vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR: lambda v: int(v.u64),
    vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_FLOAT64_KHR: lambda v: float(v.f64),
}


def statistic_value(stat):
    """The Python value (bool, int or float) of one VkPipelineExecutableStatisticKHR."""
    try:
        return _FORMATS[stat.format](stat.value)
    except KeyError:
        raise VkmoeError(f"statistic {ffi.string(stat.name).decode(errors='replace')!r} has unknown format "
                         f"{stat.format}") from None


def _enumerate(name, fn, device, info, ctype, stype):
    """The two-call enumeration of `fn(device, info, count, array)`: the count, then the array of `ctype` (each
    element's sType set to `stype`, as the caller must). Returns the filled array (it owns its memory)."""
    count = ffi.new("uint32_t*")
    check(name, fn(device.handle, info, count, ffi.NULL))
    items = ffi.new(ctype + "[]", count[0])
    for i in range(count[0]):
        items[i].sType = stype
    check(name, fn(device.handle, info, count, items))
    return items


def pipeline_statistics(device, pipeline, label):
    """{executable name: {statistic name: value}} of pipeline handle `pipeline` (`label` names it in errors);
    a name the driver gives two executables gets " #2", " #3" ... Raises StatisticsUnavailableError where the
    device cannot capture them or was opened without pipeline_statistics."""
    reason = unavailable(device)
    if reason:
        raise StatisticsUnavailableError(f"{label}: {reason}")
    if not device.pipeline_statistics:
        raise StatisticsUnavailableError(
            f"{label}: {device.name} was opened without pipeline statistics; open it with "
            "vkmoe.Device(pipeline_statistics=True) or VKMOE_PIPELINE_STATISTICS=1")
    get_props = _entry_point(device, "vkGetPipelineExecutablePropertiesKHR")
    get_stats = _entry_point(device, "vkGetPipelineExecutableStatisticsKHR")
    info = ffi.new("VkPipelineInfoKHR*")
    info.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_INFO_KHR
    info.pipeline = pipeline
    props = _enumerate("vkGetPipelineExecutablePropertiesKHR", get_props, device, info,
                       "VkPipelineExecutablePropertiesKHR", vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_PROPERTIES_KHR)
    out = {}
    for index, executable in enumerate(props):
        exe = ffi.new("VkPipelineExecutableInfoKHR*")
        exe.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR
        exe.pipeline = pipeline
        exe.executableIndex = index
        stats = _enumerate("vkGetPipelineExecutableStatisticsKHR", get_stats, device, exe,
                           "VkPipelineExecutableStatisticKHR", vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR)
        name = base = ffi.string(executable.name).decode(errors="replace") or f"executable {index}"
        copy = 1
        while name in out:
            copy += 1
            name = f"{base} #{copy}"
        out[name] = {ffi.string(s.name).decode(errors="replace"): statistic_value(s) for s in stats}
    return out
