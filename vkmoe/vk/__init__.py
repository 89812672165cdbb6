"""vkmoe.vk: a thin typed layer over the `vulkan` cffi binding. It knows nothing of EXL3 or MoE."""
from .errors import (VULKAN_INSTALL_HINT, DeviceClosedError, DeviceSelectionError, NoVulkanError, TimeoutError,
                     ValidationError, VkmoeError, VulkanError)

try:
    import vulkan  # noqa: F401  (the binding loads libvulkan when imported)
except OSError as exc:  # "Cannot find Vulkan SDK version": no loader on this machine
    raise NoVulkanError(f"the Vulkan loader (libvulkan.so.1) could not be loaded ({exc}); "
                        f"{VULKAN_INSTALL_HINT}") from None
from .commands import CommandRecorder, GpuTime  # noqa: E402
from .device import Device, expect_device, list_devices  # noqa: E402
from .memory import Buffer  # noqa: E402
from .pipeline import Pipeline, PushConstants  # noqa: E402
from .statistics import StatisticsUnavailableError  # noqa: E402

__all__ = ["Device", "expect_device", "list_devices", "Buffer", "Pipeline", "PushConstants", "CommandRecorder", "GpuTime",
           "VkmoeError", "VulkanError", "TimeoutError", "ValidationError", "DeviceSelectionError", "NoVulkanError",
           "DeviceClosedError", "StatisticsUnavailableError"]
