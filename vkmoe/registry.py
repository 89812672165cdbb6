"""Op registry: which implementation of each op (`exl3_linear`, `exl3_moe_mlp`) runs on which backend.

    from vkmoe import registry
    registry.available()                       # [(op, backend)] usable on this machine
    moe = registry.create("exl3_moe_mlp", gate, up, down, activation="silu")   # best backend
    lin = registry.create("exl3_linear", tensor, backend="cpu")

Backends: "vulkan" (the ops in vkmoe.ops, on a vkmoe.Device) and "cpu" (vkmoe.cpu, the native tier). Every
op object has the call signature of the Vulkan op, so callers never branch on the backend.

Choice: an explicit `backend=` argument, else VKMOE_BACKEND=vulkan|cpu, else "vulkan" when a Vulkan device can
be created (probed once per process and cached) and the op's module imports, else "cpu".
"""
from __future__ import annotations

import contextlib
import importlib

import numpy as np

from typing import TYPE_CHECKING

from . import forksafe, knobs
from .exl3 import Exl3Tensor
from .ops.host_arrays import describe, dispatch_of, fp16_rows, host_array, out_dtype_of

if TYPE_CHECKING:  # names used in type hints only
    from .vk import Device

__all__ = [
    "BACKENDS",
    "OPS",
    "RegistryError",
    "available",
    "closed_error",
    "create",
    "default_device",
    "is_available",
    "register",
    "registered",
    "reset",
    "select_backend",
    "simulate_no_vulkan",
    "unregister",
    "vulkan_status",
]

BACKENDS = ("vulkan", "cpu")
OPS = ("exl3_linear", "exl3_moe_mlp")
ENV_BACKEND = "VKMOE_BACKEND"


class RegistryError(LookupError):
    """An op/backend that is not registered or not usable here; the message lists what exists."""


class _Entry:
    __slots__ = ("op", "backend", "factory", "available_fn")

    def __init__(self, op, backend, factory, available_fn):
        self.op, self.backend, self.factory, self.available_fn = op, backend, factory, available_fn


_entries: dict = {}  # (op, backend) -> _Entry, in registration order
_lock = forksafe.RLock()


def register(op: str, backend: str, factory, available_fn=None, replace: bool = False) -> None:
    """Register `factory(*args, device=..., **kw) -> callable op object` for (op, backend).

    `available_fn() -> (bool, reason)` says whether it can run on this machine; None = always.
    """
    if not callable(factory):
        raise TypeError(f"factory for ({op!r}, {backend!r}) is not callable")
    with _lock:
        if (op, backend) in _entries and not replace:
            raise RegistryError(f"({op!r}, {backend!r}) is already registered (pass replace=True to override)")
        _entries[(op, backend)] = _Entry(op, backend, factory, available_fn or (lambda: (True, "")))


def unregister(op: str, backend: str) -> None:
    """Remove a registration (for plug-ins and tests)."""
    with _lock:
        _entry(op, backend)
        del _entries[(op, backend)]


def registered() -> list:
    """Every registered (op, backend) pair."""
    with _lock:
        return list(_entries)


def _describe() -> str:
    return ", ".join(f"{op}/{be}" for op, be in registered()) or "nothing"


def _entry(op: str, backend: str) -> _Entry:
    with _lock:
        e = _entries.get((op, backend))
    if e is None:
        _check_op(op)
        backends = [b for o, b in registered() if o == op]
        raise RegistryError(f"op {op!r} has no backend {backend!r}; it has: {', '.join(backends)}")
    return e


def is_available(op: str, backend: str):
    """(usable, reason) for one registered pair; unknown pairs raise RegistryError."""
    return _entry(op, backend).available_fn()


def available() -> list:
    """The (op, backend) pairs that can run on this machine."""
    return [(op, be) for op, be in registered() if is_available(op, be)[0]]


# ------------------------------------------------------------------------------------------- Vulkan probe
_probe_cache = None  # (usable, reason) once probed
_default_device = None
_forced_no_vulkan = 0


def _probe_vulkan():
    """Create (and keep) a default Device. Returns (usable, reason). Tests monkeypatch this."""
    global _default_device
    try:
        from .vk import Device
        _default_device = Device()
    except Exception as exc:  # no loader, no ICD, no device matching VKMOE_DEVICE, missing features...
        return False, f"no usable Vulkan device ({type(exc).__name__}: {exc})"
    return True, f"Vulkan device {_default_device.name!r}"


def vulkan_status():
    """(usable, reason) for the Vulkan backend; the probe runs once per process (see reset())."""
    global _probe_cache
    if _forced_no_vulkan:
        return False, "Vulkan disabled by registry.simulate_no_vulkan()"
    with _lock:
        if _probe_cache is None:
            _probe_cache = _probe_vulkan()
        return _probe_cache


def default_device():
    """The Device the probe created (shared by every op created without `device=`)."""
    ok, reason = vulkan_status()
    if not ok or _default_device is None:
        raise RegistryError(f"vulkan backend unavailable: {reason}")
    return _default_device


def reset() -> None:
    """Forget the cached probe (and drop the default device) so the next query probes again."""
    global _probe_cache, _default_device
    with _lock:
        _probe_cache = None
        _default_device = None


@contextlib.contextmanager
def simulate_no_vulkan():
    """Within the block the Vulkan backend reports itself unusable (for tests of the CPU fallback)."""
    global _forced_no_vulkan
    with _lock:
        _forced_no_vulkan += 1
    try:
        yield
    finally:
        with _lock:
            _forced_no_vulkan -= 1


# ------------------------------------------------------------------------------------------ choosing
def _env_backend():
    value = knobs.get(ENV_BACKEND)
    if value is None:
        return None
    backends = list(dict.fromkeys(b for _, b in registered()))
    if value not in backends:
        raise RegistryError(f"{ENV_BACKEND}={value!r} is not a backend; expected one of: {', '.join(backends)} "
                            "(or unset for automatic choice)")
    return value


def _check_op(op):
    ops = sorted({o for o, _ in registered()})
    if op not in ops:
        raise RegistryError(f"unknown op {op!r}; registered ops: {', '.join(ops)} "
                            f"(op/backend pairs: {_describe()})")


def _usable(op, backend, device):
    if backend == "vulkan" and device is not None:
        _entry(op, backend)
        return _op_importable(op)  # an explicit device stands in for the probe
    return is_available(op, backend)


def select_backend(device: "Device | None" = None, ops: "str | tuple[str, ...] | None" = None) -> str:
    """"vulkan" when a usable Vulkan device exists (or `device` is given) and every op in `ops` can run on it,
    else "cpu". VKMOE_BACKEND=vulkan|cpu overrides; forcing a backend that cannot run here is an error."""
    ops = (ops,) if isinstance(ops, str) else tuple(ops or ())
    for op in ops:
        _check_op(op)
    forced = _env_backend()
    if forced is not None:
        if forced == "vulkan" and device is None:
            ok, reason = vulkan_status()
            if not ok:
                raise RegistryError(f"{ENV_BACKEND}=vulkan but {reason}")
        for op in ops:
            ok, reason = _usable(op, forced, device)
            if not ok:
                raise RegistryError(f"{ENV_BACKEND}={forced} but {op} cannot run on it: {reason}")
        return forced
    if device is None and not vulkan_status()[0]:
        return "cpu"
    if all((op, "vulkan") in _entries and _usable(op, "vulkan", device)[0] for op in ops):
        return "vulkan"
    return "cpu"


def create(op: str, *args, backend: "str | None" = None, device: "Device | None" = None, **kw):
    """Build op `op` on `backend` (None = select_backend). Vulkan ops run on `device` (default: the probed one)."""
    _check_op(op)
    if backend is None:
        backend = select_backend(device=device, ops=(op,))
    entry = _entry(op, backend)
    ok, reason = _usable(op, backend, device)
    if not ok:
        usable = ", ".join(f"{o}/{b}" for o, b in available()) or "nothing"
        raise RegistryError(f"{op}/{backend} is registered but cannot run here: {reason}; usable here: {usable}")
    return entry.factory(*args, device=device, **kw)


# ----------------------------------------------------------------------------------- built-in entries
_OP_MODULES = {"exl3_linear": ("vkmoe.ops.linear", "Exl3Linear"), "exl3_moe_mlp": ("vkmoe.ops.moe", "Exl3MoeMlp")}


def _op_importable(op):
    modname, cls = _OP_MODULES[op]
    try:
        getattr(importlib.import_module(modname), cls)
    except Exception as exc:
        return False, f"{modname}.{cls} cannot be imported ({type(exc).__name__}: {exc})"
    return True, ""


def _vulkan_available(op):
    def check():
        ok, reason = _op_importable(op)
        if not ok:
            return ok, reason
        return vulkan_status()
    return check


def _cpu_available():
    try:
        importlib.import_module("vkmoe.cpu")
    except Exception as exc:  # the native tier is not built, or cffi is missing
        return False, f"vkmoe.cpu cannot be imported ({type(exc).__name__}: {exc})"
    return True, ""


def _vulkan_factory(op):
    def factory(*args, device=None, **kw):
        modname, cls = _OP_MODULES[op]
        return getattr(importlib.import_module(modname), cls)(device if device is not None else default_device(),
                                                              *args, **kw)
    return factory


def closed_error(op):
    """vkmoe.vk's error for an op or block used after close() (closed_op_error), imported here so that the CPU
    backend needs no Vulkan layer: where that cannot be imported, a ValueError with the same message."""
    try:
        from .vk.errors import closed_op_error
    except Exception:  # (vkmoe.vk imports the binding, which needs the Vulkan loader)
        return ValueError(f"this {type(op).__name__} is closed (its close() ran): make a new one")
    return closed_op_error(op)


def _host_out(out):
    if out is not None:
        raise ValueError(f"out: the cpu backend returns numpy arrays (out=None); got {out!r}, which needs the "
                         "vulkan backend")


class _CpuOp:
    """What the CPU backend's ops share with the Vulkan ops around the call: close(), `with`, the closed error."""

    backend = "cpu"
    _closed = False

    def close(self):
        """Nothing to free (the tensors stay the caller's); later calls raise, as a closed Vulkan op's do."""
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._closed:
            raise closed_error(self)


class CpuExl3Linear(_CpuOp):
    """vkmoe.cpu.linear behind Exl3Linear's call: x (m, k) float16 (or float32, rounded to float16) -> (m, n) of
    out_dtype (float16 by default); the same argument checks."""

    def __init__(self, tensor, device=None):
        from . import cpu
        if not isinstance(tensor, Exl3Tensor):
            raise TypeError(f"tensor must be a vkmoe.Exl3Tensor, got {type(tensor).__name__}")
        self._cpu = cpu
        self.tensor = tensor
        self.k, self.n = tensor.k, tensor.n

    def __call__(self, x, out=None, out_dtype=np.float16):
        self._check_open()
        dtype = out_dtype_of(out_dtype)
        x = fp16_rows(x, self.k)
        _host_out(out)
        y = self._cpu.linear(x, self.tensor).astype(np.float16)  # the op's output precision
        return y if dtype == np.float16 else y.astype(dtype)

    def __repr__(self):
        return f"CpuExl3Linear(k={self.k}, n={self.n})"


class CpuExl3MoeMlp(_CpuOp):
    """vkmoe.cpu.moe_forward behind Exl3MoeMlp's call: hidden (m, H) float16, expert_ids, expert_weights ->
    (m, H) of out_dtype (float32 by default); the same argument checks (the layer's when it is made); `dispatch` is
    checked and has nothing to choose (one path); `last_run` mirrors the op's."""

    def __init__(self, gate, up, down, activation="silu", act_limit=0.0, dispatch=None, device=None):
        from . import cpu
        from .exl3.reference import validate_moe_layer

        self.E, self.H, self.I = validate_moe_layer(gate, up, down, activation, act_limit)
        dispatch_of(dispatch)
        self._cpu = cpu
        self.gate, self.up, self.down = gate, up, down
        self.activation, self.act_limit = activation, float(act_limit)
        self.num_experts = self.E
        self.last_run = None

    def __call__(self, hidden, expert_ids, expert_weights, dispatch=None, out=None, out_dtype=np.float32):
        from .exl3.reference import check_op_routing

        self._check_open()
        dispatch_of(dispatch)
        dtype = out_dtype_of(out_dtype)
        _host_out(out)
        h = host_array(hidden, "hidden")
        if h.ndim != 2 or h.shape[1] != self.H:
            raise ValueError(f"hidden: expected shape (m, {self.H}) float16, got {describe(h)}")
        if h.dtype != np.float16:
            raise TypeError(f"hidden must be float16, got {h.dtype}")
        ids, w = host_array(expert_ids, "expert_ids"), host_array(expert_weights, "expert_weights")
        if ids.ndim == 2 and ids.dtype.kind in "iu" and w.shape == ids.shape:  # else moe_forward says what is wrong
            check_op_routing(ids, w, self.E)  # the same rules as the Vulkan op's __call__
        y = self._cpu.moe_forward(h, ids, w, self.gate, self.up, self.down, activation=self.activation,
                                  act_limit=self.act_limit)
        self.last_run = {"mode": "cpu", "backend": "cpu"}
        return np.asarray(y, dtype=dtype)

    def __repr__(self):
        return f"CpuExl3MoeMlp(experts={self.num_experts}, activation={self.activation!r})"


def _cpu_linear_factory(tensor, device=None):
    return CpuExl3Linear(tensor)


def _cpu_moe_factory(gate, up, down, activation="silu", act_limit=0.0, dispatch=None, device=None):
    return CpuExl3MoeMlp(gate, up, down, activation=activation, act_limit=act_limit, dispatch=dispatch)


for _op in OPS:
    register(_op, "vulkan", _vulkan_factory(_op), _vulkan_available(_op))
register("exl3_linear", "cpu", _cpu_linear_factory, _cpu_available)
register("exl3_moe_mlp", "cpu", _cpu_moe_factory, _cpu_available)
