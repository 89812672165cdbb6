"""Exl3Linear: y = x · W (+ bias) for an EXL3 tensor, on a Vulkan device (spec sections 2 and 6).

Two dispatches: the input Hadamard (fp16 rows, suh applied), then the GEMM with the output Hadamard fused
(one workgroup per 128-column band and k-split; the last split of a band finishes it)."""
import numpy as np

from ..exl3 import Exl3Tensor
from ..vk import CommandRecorder
from . import kernels
from .host_arrays import describe, host_array, out_dtype_of
from .plan import gemm_plan

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # names used in type hints only
    import vkmoe

FP16_MAX = 65504.0


def _check_x(x, k):
    x = host_array(x, "x")
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x: expected shape (m, {k}) float16 or float32, got {describe(x)}")
    if x.dtype == np.float32:  # rounded to float16, the op's input precision
        if x.size and np.nanmax(np.abs(x)) > FP16_MAX:
            raise ValueError(f"x: float32 values beyond float16's range (|x| <= {FP16_MAX:g}) cannot be rounded to "
                             "the op's float16 input")
        x = x.astype(np.float16)
    if x.dtype != np.float16:
        raise TypeError(f"x: expected float16 or float32 (rounded to float16, the op's input precision), got "
                        f"{describe(x)}")
    return np.ascontiguousarray(x)


class Exl3Linear:
    """One EXL3 linear layer resident on `device`. `layer(x)` for x (m, k) float16 returns (m, n) float16."""

    def __init__(self, device: "vkmoe.Device", tensor: Exl3Tensor):
        if not isinstance(tensor, Exl3Tensor):
            raise TypeError(f"tensor must be a vkmoe.Exl3Tensor, got {type(tensor).__name__}")
        self.device, self.tensor = device, tensor
        self.k, self.n, self.bits, self.codebook = tensor.k, tensor.n, tensor.bits, tensor.codebook
        mem = device.memory
        self._trellis = mem.allocate(tensor.trellis.nbytes)
        self._trellis.upload(tensor.trellis)
        self._suh = mem.allocate(tensor.suh.nbytes)
        self._suh.upload(tensor.suh)
        self._svh = mem.allocate(tensor.svh.nbytes)
        self._svh.upload(tensor.svh)
        self.has_bias = tensor.bias is not None
        self._bias = mem.allocate(tensor.n * 2)
        self._bias.upload(tensor.bias.astype(np.float16) if self.has_bias else np.zeros(tensor.n, np.float16))
        self._scratch = {}  # m -> (xh, partial, counters) for record()
        self._io = {}       # m -> (x, y, recorder) for __call__
        self._owned = [self._trellis, self._suh, self._svh, self._bias]
        self.last_gpu_ms = None

    # ---------------------------------------------------------------------------------------------- record
    def _scratch_for(self, m):
        plan = gemm_plan(self.device, m, self.k, self.n)
        key = (m, plan.splits)
        if key not in self._scratch:
            mem = self.device.memory
            xh = mem.allocate(m * self.k * 2)
            partial = mem.allocate(plan.splits * m * self.n * 4)
            counters = mem.allocate(plan.row_chunks * (self.n // 128) * 4)
            counters.upload(np.zeros(plan.row_chunks * (self.n // 128), np.uint32))
            self._scratch[key] = (xh, partial, counters)
            self._owned += [xh, partial, counters]
        return plan, self._scratch[key]

    def record(self, cmd: CommandRecorder, x_buf: "vkmoe.Buffer", y_buf: "vkmoe.Buffer", m: int):
        """Append y = x · W (+ bias) to a recording CommandRecorder. x_buf holds (m, k) fp16, y_buf receives
        (m, n) fp16. Ends with a barrier, so later commands may read y_buf."""
        if m <= 0:
            return
        if x_buf.size < m * self.k * 2 or y_buf.size < m * self.n * 2:
            raise ValueError(f"x_buf needs {m * self.k * 2} bytes and y_buf {m * self.n * 2} for m={m}")
        plan, (xh, partial, counters) = self._scratch_for(m)
        dev = self.device
        had = kernels.pipeline(dev, "exl3_had_in", kernels.HadInPush)
        cmd.dispatch(had, had.bind(x_buf, self._suh, xh), -(-m * (self.k // 128) // 4), had.push(m=m, k=self.k))
        cmd.barrier()
        spec = {0: self.bits, 1: kernels.CODEBOOK_IDS[self.codebook], 2: plan.rows, 3: self.has_bias}
        gemm = kernels.pipeline(dev, "exl3_linear", kernels.LinearPush, spec, decode=True)
        dset = gemm.bind(xh, self._trellis, self._svh, self._bias, y_buf, partial, counters)
        cmd.dispatch(gemm, dset, (self.n // 128, plan.splits, plan.row_chunks),
                     gemm.push(m=m, k=self.k, n=self.n, splits=plan.splits, kt_per_split=plan.kt_per_split))
        cmd.barrier()

    # ---------------------------------------------------------------------------------------------- call
    def __call__(self, x: np.ndarray, out_dtype=np.float16) -> np.ndarray:
        """x (m, k) float16 or float32 (a numpy array, a CPU DLPack tensor, anything with __array__) ->
        (m, n) out_dtype: float16 (what the op computes), or float32 (the same values, widened)."""
        dtype = out_dtype_of(out_dtype)
        x = _check_x(x, self.k)
        m = x.shape[0]
        if m == 0:
            return np.zeros((0, self.n), dtype)
        if m not in self._io:
            mem = self.device.memory
            xb, yb = mem.allocate(m * self.k * 2), mem.allocate(m * self.n * 2)
            rec = CommandRecorder(self.device, timestamps=2)
            rec.begin()
            rec.timestamp()
            self.record(rec, xb, yb, m)
            rec.timestamp()
            rec.end()
            self._io[m] = (xb, yb, rec)
            self._owned += [xb, yb]
        xb, yb, rec = self._io[m]
        xb.upload(x)
        rec.submit(wait=True)
        self.last_gpu_ms = rec.elapsed_ms()
        return yb.download(np.float16, (m, self.n)).astype(dtype, copy=False)

    def dequantize(self) -> np.ndarray:
        """The decoded (k, n) fp16 matrix Ŵ, computed by the GPU decoder (no scales applied)."""
        dev = self.device
        pipe = kernels.pipeline(dev, "exl3_dequant", kernels.DequantPush,
                                {0: self.bits, 1: kernels.CODEBOOK_IDS[self.codebook]}, decode=True)
        out = dev.memory.allocate(self.k * self.n * 4)
        try:
            lanes = (self.k // 16) * (self.n // 16) * 8
            with CommandRecorder(dev) as rec:
                rec.begin()
                rec.dispatch(pipe, pipe.bind(self._trellis, out), -(-lanes // 256), pipe.push(k=self.k, n=self.n))
                rec.end()
                rec.submit(wait=True)
            bits = out.download(np.uint32, (self.k, self.n))
        finally:
            out.close()
        return bits.astype(np.uint16).view(np.float16)

    def close(self):
        for _, _, rec in self._io.values():
            rec.close()
        for b in self._owned:
            b.close()
        self._io, self._scratch, self._owned = {}, {}, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
