"""Arrays callers already have: numpy arrays, anything with `__dlpack__` on the CPU (a torch CPU tensor is read
without a copy), anything with `__array__`, and Python lists (for ids). Also the ops' `out_dtype`.

Every failure names the argument, what was expected and what was received (type, shape, dtype).
"""
from __future__ import annotations

import numpy as np

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
