"""Shared fixtures: one Vulkan device per test session, and a check after every test that the Khronos
validation layer (VKMOE_VALIDATION=1) reported nothing."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/goldens.py


@pytest.fixture(scope="session")
def device():
    import vkmoe

    dev = vkmoe.Device()
    yield dev
    dev.close()


@pytest.fixture(scope="module")
def dev():
    """A device of the test module's own, for modules that probe, time out or close things on purpose."""
    import vkmoe

    d = vkmoe.Device()
    d.take_validation_messages()
    yield d
    d.close()


@pytest.fixture(autouse=True)
def _no_validation_messages(request):
    yield
    for name in ("device", "dev"):
        if name in request.fixturenames:
            messages = request.getfixturevalue(name).take_validation_messages()
            assert not messages, f"validation layer reported {len(messages)} message(s): {messages[:3]}"


def pytest_report_header(config):
    try:
        import vkmoe

        with vkmoe.Device() as dev:
            return f"vkmoe device: {dev.name} / {dev.driver_info} / api {dev.info()['api']}"
    except Exception as exc:  # the report header must never break collection
        return f"vkmoe device: unavailable ({exc})"
