"""The checks of an op's record(): the caller's command buffer and raw Buffers, named as the caller passed them.

record() appends to a caller's recording and binds the caller's Buffers in place, so nothing copies them and no
later step would notice a wrong one: a buffer too small would be read or written past its end by the GPU.
"""
from contextlib import contextmanager

import numpy as np

from ..vk import CommandRecorder
from ..vk.commands import check_buffer
from ..vk.errors import foreign_device_error


def check_recorder(device, cmd, name="cmd"):
    """`cmd`: a CommandRecorder of `device` (TypeError / ValueError naming it as `name`)."""
    if not isinstance(cmd, CommandRecorder):
        raise TypeError(f"{name}: expected a vkmoe CommandRecorder, got {type(cmd).__name__}")
    if cmd.device is not device:
        raise foreign_device_error(name, "CommandRecorder", cmd.device, device)


def check_buffers(device, buffers):
    """`buffers` {argument name: (Buffer, bytes it must hold)}: each an open vkmoe Buffer of `device` of at least
    that size (TypeError / ValueError / VkmoeError for a closed one, naming the argument)."""
    for name, (buf, need) in buffers.items():
        check_buffer(name, buf, device)
        if buf.size < need:
            raise ValueError(f"{name} holds {buf.size} bytes; this call needs {need}")


def check_rows(m, minimum=0):
    """`m`, the rows (tokens) a record() is given: an integer >= minimum (TypeError / ValueError naming m). A
    negative m recorded nothing, silently, and a float one failed deep in the plan."""
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)):
        raise TypeError(f"m: expected an integer number of rows, got {type(m).__name__} {m!r}")
    if m < minimum:
        raise ValueError(f"m: expected an integer >= {minimum}, got {m}")
    return int(m)


@contextmanager
def all_or_nothing(cmd, what):
    """Around the commands an op's record() appends to a caller's `cmd`: if it fails partway (out of memory for a
    pipeline, the device closed), the commands it appended stay in cmd, so cmd is spoiled: its submit() raises,
    naming `what` and the error, until begin() again (instead of running half an op)."""
    try:
        yield
    except BaseException as exc:
        cmd.spoil(f"{what} failed partway through its commands ({type(exc).__name__}: {exc})")
        raise
