"""Inputs callers already have (DLPack, __array__, lists) and out_dtype on Exl3MoeMlp and Exl3Linear."""
import numpy as np
import pytest

import vkmoe
from vkmoe.exl3 import reference
from vkmoe.ops.host_arrays import host_array

from goldens import rel_rms


class DLPackOnly:
    """A CPU tensor that offers only the DLPack protocol (as a torch CPU tensor does to numpy)."""

    def __init__(self, arr):
        self._arr = arr
        self.shape, self.dtype = arr.shape, arr.dtype

    def __dlpack__(self, **kw):
        return self._arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


class OnAnotherDevice:
    shape = (2, 256)

    def __dlpack__(self, **kw):
        raise BufferError("Unsupported device in DLTensor")

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA


class ArrayLike:
    def __init__(self, arr):
        self._arr = arr

    def __array__(self, dtype=None, copy=None):
        return self._arr if dtype is None else self._arr.astype(dtype)


def test_host_array_reads_dlpack_without_a_copy():
    base = np.arange(12, dtype=np.float16).reshape(3, 4)
    got = host_array(DLPackOnly(base), "hidden")
    assert got.dtype == np.float16 and got.shape == (3, 4) and np.shares_memory(got, base)
    assert np.array_equal(host_array([[1, 2], [3, 4]], "expert_ids"), [[1, 2], [3, 4]])
    assert host_array(ArrayLike(base), "hidden") is base


@pytest.mark.parametrize("value, match", [
    (OnAnotherDevice(), r"hidden: expected an array in host \(CPU\) memory, got a .*OnAnotherDevice of shape \(2, 256\)"),
    ([[1.0, 2.0], [3.0]], r"hidden: expected an array of numbers, got a list"),
    ("text", r"hidden: expected a numpy array, an object with __array__ or __dlpack__ .* got a str"),
])
def test_host_array_says_what_it_received(value, match):
    with pytest.raises(TypeError, match=match):
        host_array(value, "hidden")


@pytest.fixture(scope="module")
def layer(device):
    gate, up, down = vkmoe.random_moe_layer(256, 128, experts=4, seed=5)
    ids, w = vkmoe.random_routing(3, 4, 2, seed=6)
    x = np.random.default_rng(7).standard_normal((3, 256)).astype(np.float16)
    ref = reference.moe_forward(x, ids, w, gate, up, down)
    with vkmoe.Exl3MoeMlp(device, gate, up, down, dispatch="split") as moe:
        yield moe, x, ids, w, ref


def test_moe_accepts_dlpack_array_like_and_lists(layer):
    moe, x, ids, w, ref = layer
    base = moe(x, ids, w)
    assert base.dtype == np.float32 and rel_rms(base, ref) < 3e-3
    for args in ((DLPackOnly(x), ids.tolist(), w.tolist()), (ArrayLike(x), DLPackOnly(ids), ArrayLike(w))):
        assert np.array_equal(moe(*args), base)


def test_moe_out_dtype(layer):
    moe, x, ids, w, ref = layer
    y16 = moe(x, ids, w, out_dtype=np.float16)
    assert y16.dtype == np.float16 and np.array_equal(y16, moe(x, ids, w).astype(np.float16))
    assert rel_rms(y16, ref) < 3e-3
    with pytest.raises(ValueError, match=r"out_dtype: expected numpy.float16 or numpy.float32, got .*int8"):
        moe(x, ids, w, out_dtype=np.int8)


def test_moe_forward_sorted_out_dtype(layer):
    moe, x, ids, w, ref = layer
    order = np.argsort(ids.reshape(-1), kind="stable")
    count = np.bincount(ids.reshape(-1), minlength=4)
    tokens = (np.arange(ids.size) // ids.shape[1])[order]
    y = moe.forward_sorted(DLPackOnly(x), count, tokens.tolist(), w.reshape(-1)[order], out_dtype="float16")
    assert y.dtype == np.float16 and rel_rms(y, ref) < 3e-3


def test_moe_error_names_what_it_received(layer):
    moe, x, ids, w, _ = layer
    with pytest.raises(ValueError, match=r"hidden: expected shape \(m, 256\) float16, got a numpy.ndarray of shape "
                                         r"\(3, 128\) and dtype float16"):
        moe(x[:, :128], ids, w)


def test_linear_float32_input_and_out_dtype(device):
    t = vkmoe.random_exl3_tensor(256, 128, bits=4, seed=9)
    x32 = np.random.default_rng(10).standard_normal((5, 256)).astype(np.float32)
    x16 = x32.astype(np.float16)
    with vkmoe.Exl3Linear(device, t) as linear:
        y16 = linear(x16)
        assert y16.dtype == np.float16
        assert rel_rms(y16, reference.linear_forward(x16, t)) < 3e-3
        assert np.array_equal(linear(x32), y16)                         # float32 is rounded to float16 first
        y32 = linear(DLPackOnly(x16), out_dtype=np.float32)
        assert y32.dtype == np.float32 and np.array_equal(y32, y16.astype(np.float32))
        assert linear(np.zeros((0, 256), np.float32), out_dtype=np.float32).dtype == np.float32
        with pytest.raises(ValueError, match="out_dtype"):
            linear(x16, out_dtype=np.float64)


def test_torch_cpu_tensor_without_a_copy():
    torch = pytest.importorskip("torch", reason="torch is not installed here; DLPackOnly stands in for it above")
    t = torch.arange(8, dtype=torch.float16).reshape(2, 4)
    arr = host_array(t, "hidden")
    t[0, 0] = 42
    assert arr[0, 0] == 42
