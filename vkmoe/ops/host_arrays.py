"""Arrays callers already have: numpy arrays, anything with `__dlpack__` on the CPU (a torch CPU tensor is read
without a copy), anything with `__array__`, and Python lists (for ids). Also the ops' other call arguments that
need no device (`out_dtype`, `dispatch`, a linear's host input), so that the CPU backend's ops (vkmoe.registry)
check them with the same code on a machine without a Vulkan loader: this module imports only numpy and the leaf.

Every failure names the argument, what was expected and what was received (type, shape, dtype).
"""
from __future__ import annotations

import numpy as np

from ..layout import DISPATCH_MODES

FP16_MAX = 65504.0

OUT_DTYPES = (np.float16, np.float32)


def describe(value) -> str:
    """'a torch.Tensor of shape (2, 256) and dtype float32' for an error message."""
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__name__}"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    text = f"a {name}"
    if shape is not None:
        text += f" of shape {tuple(shape)}"
    if dtype is not None:
        text += f" and dtype {dtype}"
    return text


def host_array(value, name: str) -> np.ndarray:
    """`value` as a numpy array without copying where the source allows it (numpy, DLPack on the CPU)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:  # e.g. a GPU tensor, or one with grad
            raise TypeError(f"{name}: expected an array in host (CPU) memory, got {describe(value)} that DLPack "
                            f"cannot hand to numpy ({exc})") from None
    if hasattr(value, "__array__") or isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name}: expected an array of numbers, got {describe(value)} ({exc})") from None
        if arr.dtype == object:
            raise TypeError(f"{name}: expected an array of numbers, got {describe(value)} that numpy reads as "
                            "objects (ragged rows or non-numbers)")
        return arr
    raise TypeError(f"{name}: expected a numpy array, an object with __array__ or __dlpack__ (e.g. a CPU torch "
                    f"tensor) or a list, got {describe(value)}")


# The usual arguments, looked up without building dtypes (out_dtype_of runs on every op call).
_KNOWN_OUT = {d: np.dtype(d) for d in OUT_DTYPES + ("float16", "float32")}


def out_dtype_of(out_dtype) -> np.dtype:
    """The checked `out_dtype` argument of an op: float16 or float32."""
    try:
        return _KNOWN_OUT[out_dtype]
    except (KeyError, TypeError):  # TypeError: an unhashable argument, refused below
        pass
    try:
        dtype = np.dtype(out_dtype)
    except TypeError:
        dtype = None
    if dtype not in [np.dtype(d) for d in OUT_DTYPES]:
        raise ValueError(f"out_dtype: expected numpy.float16 or numpy.float32, got {out_dtype!r}")
    return dtype


_MODES = {m: m for m in DISPATCH_MODES}  # the usual arguments, looked up as they are (on every call)


def dispatch_of(dispatch):
    """The checked `dispatch` argument of the MoE op: None (VKMOE_DISPATCH decides) or one of DISPATCH_MODES."""
    if dispatch is None:
        return None
    mode = _MODES.get(dispatch) if type(dispatch) is str else None
    if mode is not None:
        return mode
    mode = str(dispatch).strip().lower()
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch argument={dispatch!r}: expected one of {', '.join(DISPATCH_MODES)}")
    return mode


def beyond_fp16(x) -> bool:
    """Whether float32 / float64 `x` holds values beyond float16's range (Inf included; NaN is not counted, and does
    not hide a large value beside it)."""
    return bool(x.size) and bool(np.nanmax(np.abs(x)) > FP16_MAX)


def fp16_rows(x, k: int, name: str = "x") -> np.ndarray:
    """A linear's host input as the op computes on it: (m, k) float16, float32 rounded to float16 (refused beyond
    its range, rather than turned into Inf)."""
    if type(x) is not np.ndarray:  # (a numpy array, the usual case, skips the call)
        x = host_array(x, name)
    shape = x.shape
    if len(shape) != 2 or shape[1] != k:
        raise ValueError(f"{name}: expected shape (m, {k}) float16 or float32, got {describe(x)}")
    if x.dtype == np.float32:  # rounded to float16, the op's input precision
        if beyond_fp16(x):
            raise ValueError(f"{name}: float32 values beyond float16's range (|{name}| <= {FP16_MAX:g}) cannot be "
                             "rounded to the op's float16 input")
        x = x.astype(np.float16)
    if x.dtype != np.float16:
        raise TypeError(f"{name}: expected float16 or float32 (rounded to float16, the op's input precision), got "
                        f"{describe(x)}")
    return x
