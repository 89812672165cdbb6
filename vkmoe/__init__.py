"""vkmoe: exllamav3's fused EXL3 Mixture-of-Experts MLP on any Vulkan device.

    dev = vkmoe.Device()
    moe = vkmoe.Exl3MoeMlp(dev, gate, up, down, activation="silu")
    y = moe(hidden, expert_ids, expert_weights)

`import vkmoe` loads no Vulkan: the names below are imported when first used, so the format layer (vkmoe.exl3),
the CPU tier (vkmoe.cpu) and the registry's CPU fallback work on a machine without a Vulkan loader. The first
use of a Vulkan name there raises vkmoe.vk.NoVulkanError, whose message says what to install.
"""
import importlib

from . import exl3  # noqa: F401  (the format layer has no Vulkan dependency)
from ._version import __version__  # noqa: F401  (the one place: vkmoe/_version.py)
from .exl3 import Exl3Tensor

# name -> (module, attribute or None for the module itself), imported on first access.
_LAZY = {
    **{name: (".vk", name) for name in ("Buffer", "CommandRecorder", "Device", "DeviceSelectionError",
                                        "NoVulkanError", "Pipeline", "PushConstants", "TimeoutError",
                                        "ValidationError", "VkmoeError", "VulkanError", "list_devices")},
    "Exl3Linear": (".ops.linear", "Exl3Linear"),
    "Exl3MoeMlp": (".ops.moe", "Exl3MoeMlp"),
    "probe_residency": (".sched.probe", "probe_residency"),
    "random_exl3_tensor": (".exl3.synthetic", "random_exl3_tensor"),
    "random_moe_layer": (".exl3.synthetic", "random_moe_layer"),
    "random_routing": (".exl3.synthetic", "random_routing"),
    **{name: ("." + name, None) for name in ("cpu", "registry", "models", "ops", "sched", "vk")},
}

__all__ = ["Exl3Tensor", "__version__", "exl3", *_LAZY]


def __getattr__(name):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'vkmoe' has no attribute {name!r}") from None
    value = importlib.import_module(module, __name__)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
