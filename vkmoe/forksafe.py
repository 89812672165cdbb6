"""Locks that a fork() child finds released.

A child process of fork() has one thread, but a copy of every lock as the parent's threads held it at that moment:
a lock that another thread of the parent held (an op's call lock during a forward, a cache's lock during a lookup)
stays held in the child forever, and the child's first call that takes it hangs instead of raising the
forked-device error (vkmoe.vk.device). The locks made here belong to the process that takes them: in a child, the
first acquire replaces the parent's copy with a fresh lock. A leaf module (it imports nothing from vkmoe).

Not for threading.Condition (the devices' own locks, renewed by Device._left_by_fork) and not needed where an
object renews its locks in its own at-fork step (vk.in_flight, vk.memory).
"""
import os
import threading

__all__ = ["Lock", "RLock"]

_generation = 0  # how many fork()s this process descends from; a lock made in an earlier one is renewed
_renew = threading.Lock()


def _after_fork_in_child():
    global _generation, _renew
    _generation += 1
    _renew = threading.Lock()  # (a thread of the parent may have held it)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _ForkSafeLock:
    __slots__ = ("_make", "_lock", "_generation")

    def __init__(self, make):
        self._make = make
        self._lock = make()
        self._generation = _generation

    def _current(self):
        if self._generation != _generation:  # (one int comparison while the process has not forked)
            with _renew:  # two threads of the child must not each make their own
                if self._generation != _generation:
                    self._lock = self._make()
                    self._generation = _generation
        return self._lock

    def acquire(self, blocking=True, timeout=-1):
        return self._current().acquire(blocking, timeout)

    def release(self):
        self._lock.release()

    def __enter__(self):
        return self._current().__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)

    def __repr__(self):
        return f"<vkmoe.forksafe {self._lock!r}>"


def Lock():
    """threading.Lock that a fork() child finds released."""
    return _ForkSafeLock(threading.Lock)


def RLock():
    """threading.RLock that a fork() child finds released."""
    return _ForkSafeLock(threading.RLock)
