"""A long but bounded run on the queue, for tests of what happens while a submission is still running (timeouts,
closing what it uses): tests/shaders/test_spin.comp, compiled into tests/_spv by `setup.py build_shaders`."""
import os

import numpy as np
import pytest
import vulkan as vk

from vkmoe.vk import CommandRecorder, Pipeline, PushConstants

SPIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_spv", "test_spin.spv")


class SpinPush(PushConstants):
    fields = [("iterations", "<u4")]


def spin_words(groups):
    """The 32-bit words a spin dispatch of `groups` workgroups reads and writes."""
    return 1024 + 64 * groups


def spin_recorder(pipe, buf, groups, iterations):
    """A recorder of one spin dispatch over `buf` (spin_words(groups) words), run once to completion (lavapipe
    compiles at the first run): submit(wait=False) it, or ride it before a recording, for a run of seconds."""
    rec = CommandRecorder(pipe.device)
    rec.begin()
    rec.dispatch(pipe, pipe.bind(buf), groups, pipe.push(iterations=iterations))
    rec.end()
    rec.submit(wait=True, timeout=600)
    return rec


class SpinRun:
    """A spin pipeline, its buffer and recorder (spin_recorder) of one device; closed with `with`."""

    def __init__(self, device, groups=256, iterations=20000):
        self.pipe = Pipeline(device, SPIN, push=SpinPush)
        self.buf = device.memory.allocate(4 * spin_words(groups))
        self.buf.upload(np.arange(spin_words(groups), dtype=np.uint32))
        self.rec = spin_recorder(self.pipe, self.buf, groups, iterations)

    def close(self):
        self.rec.close()
        self.buf.close()
        self.pipe.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def fence_signalled(rec):
    """Whether `rec`'s last submission is over, read from its fence (without waiting or touching its bookkeeping);
    a recorder whose close() freed its fence had seen its run end."""
    if rec.handle is None:
        return True
    return vk.lib.vkGetFenceStatus(rec.device.handle, rec._fence) == vk.VK_SUCCESS


def skip_if_over(rec, what):
    """Skip the test when `rec`'s run has ended already: the device ran the spin too fast for `what` to happen
    while it runs (lavapipe takes seconds; a GPU may take a millisecond)."""
    if fence_signalled(rec):
        pytest.skip(f"the spin run ended before {what}: this device runs it too fast to show anything")
