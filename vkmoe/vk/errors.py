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


class DeviceClosedError(VkmoeError):
    """A vkmoe.Device (or an object made from it) was used after Device.close()."""


def closed_op_error(op):
    """The error of an op or block used after its close(): one message for all of them."""
    return VkmoeError(f"this {type(op).__name__} is closed (its close() ran, its device memory is freed): make a "
                      "new one")


def foreign_device_error(name, what, theirs, ours):
    """The error for an argument (a `what`: Buffer, DeviceArray, CommandRecorder) of another vkmoe.Device than the
    op's. Two Device objects of one GPU print alike, so the message says when that is the case."""
    same_gpu = (" (a second Device object of the same GPU: memory and command buffers belong to the Device object "
                "that made them)" if repr(theirs) == repr(ours) else "")
    return ValueError(f"{name} is a {what} of another vkmoe.Device ({theirs!r}){same_gpu}; this op runs on {ours!r}")


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
        code = next((c for c, cls in vk.exception_codes.items() if isinstance(exc, cls)), None)
        raise VulkanError(name, result_name(code) if code is not None else type(exc).__name__) from None


_SUCCESS_CODES = ("VK_SUCCESS", "VK_NOT_READY", "VK_TIMEOUT", "VK_EVENT_SET", "VK_EVENT_RESET", "VK_INCOMPLETE",
                  "VK_SUBOPTIMAL_KHR")


def result_name(result):
    """The name of a raw VkResult code, e.g. -4 -> "VK_ERROR_DEVICE_LOST" (the core name, not an alias)."""
    import vulkan as vk

    names = [n for n in dir(vk) if n.startswith("VK_ERROR_") or n in _SUCCESS_CODES]
    matches = sorted((n for n in names if getattr(vk, n) == result), key=len)
    return matches[0] if matches else f"VkResult {result}"


def check(name, result, ok=(0,)):
    """For `vk.lib` calls, which return a raw VkResult: raise VulkanError naming the call and the result unless
    `result` is one of `ok` (VK_SUCCESS by default); returns the result."""
    if result not in ok:
        raise VulkanError(name, result_name(result))
    return result
