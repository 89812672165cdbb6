"""vkmoe.vk: a thin typed layer over the `vulkan` cffi binding. It knows nothing of EXL3 or MoE."""
from .commands import CommandRecorder
from .device import Device, list_devices
from .errors import DeviceClosedError, DeviceSelectionError, TimeoutError, ValidationError, VkmoeError, VulkanError
from .memory import Buffer
from .pipeline import Pipeline, PushConstants

__all__ = ["Device", "list_devices", "Buffer", "Pipeline", "PushConstants", "CommandRecorder", "VkmoeError",
           "VulkanError", "TimeoutError", "ValidationError", "DeviceSelectionError",
           "DeviceClosedError"]
