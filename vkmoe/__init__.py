"""vkmoe: exllamav3's fused EXL3 Mixture-of-Experts MLP on any Vulkan device.

    dev = vkmoe.Device()
    moe = vkmoe.Exl3MoeMlp(dev, gate, up, down, activation="silu")
    y = moe(hidden, expert_ids, expert_weights)
"""
from .vk import (Buffer, CommandRecorder, Device, DeviceSelectionError, Pipeline, PushConstants, TimeoutError,
                 ValidationError, VkmoeError, VulkanError, list_devices)
from .exl3 import Exl3Tensor  # noqa: E402  (the format layer has no Vulkan dependency)
from . import exl3  # noqa: F401

from ._version import __version__  # noqa: F401  (the one place: vkmoe/_version.py)


def __getattr__(name):
    # The ops import lazily so that `import vkmoe` stays cheap and works while an op module is being built.
    if name == "Exl3Linear":
        from .ops.linear import Exl3Linear
        return Exl3Linear
    if name == "Exl3MoeMlp":
        from .ops.moe import Exl3MoeMlp
        return Exl3MoeMlp
    if name == "probe_residency":
        from .sched.probe import probe_residency
        return probe_residency
    if name == "cpu":
        import importlib
        return importlib.import_module(".cpu", __name__)
    raise AttributeError(f"module 'vkmoe' has no attribute {name!r}")
