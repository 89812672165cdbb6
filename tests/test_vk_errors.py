"""One way to check a Vulkan call: VulkanError names the function and the VkResult by name."""
import pytest
import vulkan as vk

from vkmoe.vk.errors import VulkanError, call, check, result_name


@pytest.mark.parametrize("code, name", [(vk.VK_ERROR_DEVICE_LOST, "VK_ERROR_DEVICE_LOST"),
                                        (vk.VK_ERROR_OUT_OF_DEVICE_MEMORY, "VK_ERROR_OUT_OF_DEVICE_MEMORY"),
                                        (vk.VK_TIMEOUT, "VK_TIMEOUT"), (-123456, "VkResult -123456")])
def test_result_names(code, name):
    assert result_name(code) == name


def test_check_raises_with_function_and_result_name():
    assert check("vkQueueWaitIdle", vk.VK_SUCCESS) == vk.VK_SUCCESS
    assert check("vkWaitForFences", vk.VK_TIMEOUT, ok=(vk.VK_SUCCESS, vk.VK_TIMEOUT)) == vk.VK_TIMEOUT
    with pytest.raises(VulkanError, match="^vkWaitForFences failed with VK_ERROR_DEVICE_LOST$") as exc:
        check("vkWaitForFences", vk.VK_ERROR_DEVICE_LOST, ok=(vk.VK_SUCCESS, vk.VK_TIMEOUT))
    assert (exc.value.call, exc.value.result) == ("vkWaitForFences", "VK_ERROR_DEVICE_LOST")


def test_call_maps_binding_exceptions_to_result_names():
    def fails():
        raise vk.VkErrorOutOfHostMemory()

    with pytest.raises(VulkanError) as exc:
        call("vkAllocateMemory", fails)
    assert (exc.value.call, exc.value.result) == ("vkAllocateMemory", "VK_ERROR_OUT_OF_HOST_MEMORY")
