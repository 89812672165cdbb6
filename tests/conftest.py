"""Shared fixtures: one Vulkan device per test session, and checks after every test that the Khronos
validation layer (VKMOE_VALIDATION=1) reported nothing and that the environment is as the test found it."""
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


def _vkmoe_environment():
    return {k: v for k, v in os.environ.items() if k.startswith("VKMOE_") or k in ("XDG_CACHE_HOME", "HOME")}


@pytest.fixture(autouse=True)
def _environment_left_as_found():
    """A test that changes the runner's VKMOE_* variables (os.environ instead of monkeypatch) changes every later
    test: test_probe once deleted VKMOE_CACHE_DIR, and the rest of the run read and wrote the user's cache."""
    before = _vkmoe_environment()
    yield
    after = _vkmoe_environment()
    assert after == before, f"the test left the environment changed: {set(before.items()) ^ set(after.items())}"


def pytest_report_header(config):
    try:
        import vkmoe

        with vkmoe.Device() as dev:
            return f"vkmoe device: {dev.name} / {dev.driver_info} / api {dev.info()['api']}"
    except Exception as exc:  # the report header must never break collection
        return f"vkmoe device: unavailable ({exc})"
