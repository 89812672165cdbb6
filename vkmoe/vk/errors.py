"""Exceptions raised by vkmoe. Every Vulkan failure names the call and the VkResult."""
import builtins


class VkmoeError(Exception):
    """Base class of vkmoe's own errors."""


class VulkanError(VkmoeError):
    """A Vulkan call returned an error VkResult."""

    def __init__(self, call, result):
        self.call = call
        self.result = result
        super().__init__(f"{call} failed with {result}")


class TimeoutError(VkmoeError, builtins.TimeoutError):  # noqa: A001 - deliberately vkmoe.TimeoutError
    """The GPU did not finish a submission within the allowed time. The device may need to be recreated."""


class ValidationError(VkmoeError):
    """The Khronos validation layer reported a problem (only with VKMOE_VALIDATION=1)."""


class DeviceSelectionError(VkmoeError, LookupError):
    """No Vulkan device matched the requested index or name."""


# What a machine without Vulkan needs; the CPU tier does not.
VULKAN_INSTALL_HINT = (
    "install a Vulkan loader and a driver: on Debian/Ubuntu `apt-get install libvulkan1 mesa-vulkan-drivers` "
    "(mesa-vulkan-drivers includes lavapipe, a driver that runs on the CPU), on Fedora `dnf install vulkan-loader "
    "mesa-vulkan-drivers`, or your GPU vendor's driver. The CPU tier (vkmoe.cpu, registry backend \"cpu\") works "
    "without Vulkan"
)


class NoVulkanError(VkmoeError):
    """This machine has no Vulkan loader, or the loader found no driver; the message says what to install."""


def call(name, fn, *args):
    """Call a `vulkan` binding function, turning its exception classes into VulkanError naming the call."""
    import vulkan as vk

    try:
        return fn(*args)
    except (vk.VkError, vk.VkException) as exc:  # the binding raises one class per VkResult
        raise VulkanError(name, type(exc).__name__) from None
