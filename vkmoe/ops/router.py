"""The MoE router on a Vulkan device: logits GEMV, then the family's scoring, selection and weights.

    router = DeviceRouter(device, "dots", weight, top_k=8, bias=b, n_group=8, topk_group=4, norm=True,
                          routed_scaling_factor=2.5)
    ids, weights = router(hidden)          # numpy in and out, one submission (tests; the block records it)

shaders/moe_router.comp: the GEMV (x · Wᵀ with W in the checkpoint's dtype, fp32 sums in a fixed order) by
workgroups of ROUTER_EXPERTS_PER_WG experts, then the selection by the last workgroup of each token to arrive,
in one dispatch. RouterGemv (shaders/moe_router_logits.comp) is the GEMV alone (the shared-expert gate).
Families and their math: vkmoe/models/routing.py, the numpy twin; both break ties toward the lower index.
"""
import numpy as np

from .. import layout
from ..layout import MAX_GRID_X, MAX_TOP_K, ROUTER_FAMILIES, ROUTER_MAX_GROUPS
from ..layout import ROUTE_MAX_EXPERTS as MAX_EXPERTS
from ..vk import CommandRecorder, PushConstants, expect_device
from . import kernels
from .device_array import close_recording
from .recorded_call import POISON_F32


class RouterLogitsPush(PushConstants):
    fields = [("m", "<u4"), ("E", "<u4"), ("H", "<u4")]


class RouterPush(PushConstants):
    fields = [("m", "<u4"), ("E", "<u4"), ("H", "<u4"), ("top_k", "<u4"), ("n_group", "<u4"), ("topk_group", "<u4"),
              ("norm", "<u4"), ("has_bias", "<u4"), ("has_scale", "<u4"), ("vocab", "<u4"),
              ("routed_scaling_factor", "<f4"), ("op_scale", "<f4")]


def check_tokens(m):
    """One workgroup per token on a grid axis: at most MAX_GRID_X tokens per call."""
    if m > MAX_GRID_X:
        raise ValueError(f"m={m} tokens: the device router takes at most {MAX_GRID_X} per call; split the batch")


def weight_words(weight):
    """(array to upload, WKIND name) for a router weight, keeping the checkpoint's precision: fp16 stays fp16,
    a float32 array holding bf16 values (the checkpoint reader widens BF16 exactly) is uploaded as bf16 (its
    top 16 bits), anything else as fp32."""
    w = np.asarray(weight)
    if w.dtype == np.float16:
        return np.ascontiguousarray(w), "float16"
    w32 = np.ascontiguousarray(w, dtype=np.float32)
    bits = w32.view(np.uint32)
    if not np.any(bits & 0xFFFF):
        return np.ascontiguousarray(bits >> 16, dtype=np.uint16), "bfloat16"
    return w32, "float32"


class RouterGemv:
    """logits (m, E) fp32 = x (m, H) · Wᵀ on the device, W (E, H) uploaded once in its own precision."""

    def __init__(self, device, weight):
        expect_device(device)
        w = np.asarray(weight)
        if w.ndim != 2 or w.shape[1] % 8:  # the GEMV reads 8 columns at a time (16-byte loads)
            raise ValueError(f"router weight: expected (E, H) with H a multiple of 8, got {w.shape}")
        self.device, (self.E, self.H) = device, w.shape
        data, self.kind = weight_words(w)
        self.values = data  # what the device multiplies (tests compare the numpy router on the same values)
        self.weight_buffer = device.memory.allocate(data.nbytes)
        self.weight_buffer.upload(data)

    def record(self, cmd, x_buf, x_f32, logits_buf, m):
        """Append the GEMV of m rows of x_buf ((m, H) fp32 when x_f32 else fp16) into logits_buf; no barrier.
        Returns the descriptor set."""
        spec = {layout.SPEC_ROUTER_WKIND: layout.ROUTER_WEIGHT_KINDS[self.kind], layout.SPEC_ROUTER_X_F32: bool(x_f32)}
        pipe = kernels.pipeline(self.device, "moe_router_logits", RouterLogitsPush, spec)
        dset = pipe.bind(x_buf, self.weight_buffer, logits_buf)
        groups = (layout.ceil_div(self.E, layout.ROUTER_EXPERTS_PER_WG), m)
        cmd.dispatch(pipe, dset, groups, RouterLogitsPush(m=m, E=self.E, H=self.H))
        return dset

    def close(self):
        self.weight_buffer.close()


class DeviceRouter:
    """One layer's router on `device`. family: a key of layout.ROUTER_FAMILIES; weight (E, H); bias (E,) or None
    (selection only); per_expert_scale (E,) or None (std); tid2eid (V, top_k) ints (sqrtsp_hash); op_scale
    multiplies every weight (the block's interm_div)."""

    def __init__(self, device, family, weight, top_k, bias=None, per_expert_scale=None, tid2eid=None,
                 n_group=1, topk_group=1, norm=True, routed_scaling_factor=1.0, op_scale=1.0):
        if family not in ROUTER_FAMILIES:
            raise ValueError(f"family: expected one of {', '.join(ROUTER_FAMILIES)}, got {family!r}")
        self.device, self.family = device, family
        self.gemv = RouterGemv(device, weight)
        E = self.E = self.gemv.E
        if not 1 <= E <= MAX_EXPERTS:
            raise ValueError(f"{E} experts: the device router takes 1 to {MAX_EXPERTS}")
        if not 1 <= top_k <= min(E, MAX_TOP_K):
            raise ValueError(f"top_k={top_k}: expected 1 <= top_k <= {min(E, MAX_TOP_K)}")
        if family == "dots" and n_group > 1 and (E % n_group or n_group > ROUTER_MAX_GROUPS
                                                 or not 1 <= topk_group <= n_group):
            raise ValueError(f"n_group={n_group}, topk_group={topk_group}: expected n_group dividing E={E}, at "
                             f"most {ROUTER_MAX_GROUPS}, and 1 <= topk_group <= n_group")
        self.top_k = top_k
        self.vocab = 0 if tid2eid is None else int(np.shape(tid2eid)[0])
        if family == "sqrtsp_hash" and tid2eid is None:
            raise ValueError("family 'sqrtsp_hash' needs the tid2eid table")
        mem = device.memory
        self._bias = self._upload(bias, np.float32)
        self._scale = self._upload(per_expert_scale, np.float32)
        self._table = self._upload(tid2eid, np.int32)
        self._buffers = [b for b in (self._bias, self._scale, self._table) if b is not None]
        self._dummy = mem.allocate(16)  # bound where a table is absent (never read: has_* = 0)
        self._counters = [mem.allocate(64 * 4)]
        self._counters[0].upload(np.zeros(64, np.uint32))
        self._buffers.append(self._dummy)
        self.push_values = dict(E=E, top_k=top_k, n_group=max(1, int(n_group)) if family == "dots" else 1,
                                topk_group=int(topk_group), norm=int(bool(norm)), has_bias=int(bias is not None),
                                has_scale=int(per_expert_scale is not None), vocab=self.vocab,
                                routed_scaling_factor=float(routed_scaling_factor), op_scale=float(op_scale))
        self._calls = {}  # (m, x_f32) -> (x, tokens, ids, weights, logits buffers, recorder, descriptor sets)

    def _upload(self, array, dtype):
        if array is None:
            return None
        a = np.ascontiguousarray(np.asarray(array), dtype=dtype)
        buf = self.device.memory.allocate(max(a.nbytes, 16))
        buf.upload(a)
        return buf

    def record(self, cmd, x_buf, x_f32, tokens_buf, logits_buf, ids_buf, weights_buf, m):
        """Append the router of m tokens (one dispatch: shaders/moe_router.comp): logits into logits_buf ((m, E)
        fp32 scratch), int32 ids and fp32 weights (m, top_k) into ids_buf / weights_buf. tokens_buf: (m,) int32
        token ids (hash layers; else any buffer). Ends with a barrier. Returns the descriptor sets."""
        sets = []
        for step in self.steps(x_buf, x_f32, tokens_buf, logits_buf, ids_buf, weights_buf, m):
            sets.append(step(cmd))
            cmd.barrier()
        return sets

    def steps(self, x_buf, x_f32, tokens_buf, logits_buf, ids_buf, weights_buf, m):
        """record()'s dispatches as functions(cmd) -> descriptor set, no barriers (the caller puts one after
        each, and may record independent work beside them)."""
        check_tokens(m)
        spec = {layout.SPEC_ROUTER_WKIND: layout.ROUTER_WEIGHT_KINDS[self.gemv.kind],
                layout.SPEC_ROUTER_X_F32: bool(x_f32), layout.SPEC_ROUTER_FAMILY: ROUTER_FAMILIES[self.family]}
        pipe = kernels.pipeline(self.device, "moe_router", RouterPush, spec)
        counters, d = self._counters_for(m), self._dummy

        def route(cmd):
            dset = pipe.bind(x_buf, self.gemv.weight_buffer, logits_buf, self._bias or d, self._scale or d,
                             self._table or d, tokens_buf, ids_buf, weights_buf, counters)
            cmd.dispatch(pipe, dset, (layout.ceil_div(self.E, layout.ROUTER_EXPERTS_PER_WG), m),
                         RouterPush(m=m, H=self.gemv.H, **self.push_values))
            return dset

        return [route]

    def _counters_for(self, m):
        """The per-token arrival counters (zero between dispatches: the last arrival resets its own). One buffer
        for every m up to its size; a larger m gets a new one (the old stays: recordings may use it)."""
        if self._counters[-1].size < m * 4:
            buf = self.device.memory.allocate(max(m, 2 * self._counters[-1].size // 4) * 4)
            buf.upload(np.zeros(buf.size // 4, np.uint32))
            self._counters.append(buf)
        return self._counters[-1]

    def __call__(self, hidden, input_ids=None):
        """hidden (m, H) float16 or float32 numpy -> (ids int64 (m, top_k), weights float32 (m, top_k)), one
        submission. input_ids (m,) for sqrtsp_hash."""
        h = np.asarray(hidden)
        if h.ndim != 2 or h.shape[1] != self.gemv.H or h.dtype not in (np.float16, np.float32):
            raise ValueError(f"hidden: expected (m, {self.gemv.H}) float16 or float32, got {h.dtype} {h.shape}")
        m = h.shape[0]
        if m == 0:
            return np.zeros((0, self.top_k), np.int64), np.zeros((0, self.top_k), np.float32)
        tokens = np.zeros(m, np.int32) if input_ids is None else np.ascontiguousarray(input_ids, dtype=np.int32)
        xb, tb, ib, wb, lb, rec, _ = self._call_buffers(m, h.dtype == np.float32)
        xb.upload(np.ascontiguousarray(h))
        tb.upload(tokens)
        rec.submit(wait=True)
        return (ib.download(np.int32, (m, self.top_k)).astype(np.int64), wb.download(np.float32, (m, self.top_k)))

    def _call_buffers(self, m, x_f32):
        key = (m, x_f32)
        if key not in self._calls:
            mem = self.device.memory
            bufs = mem.allocate_all([m * self.gemv.H * (4 if x_f32 else 2), m * 4, m * self.top_k * 4,
                                     m * self.top_k * 4, m * self.E * 4],
                                    kinds=["upload", "upload", "readback", "readback", "device"])
            xb, tb, ib, wb, lb = bufs
            rec = CommandRecorder(self.device)
            rec.begin()
            rec.fill(ib, POISON_F32)  # poisoned: every slot must be written
            rec.fill(wb, POISON_F32)
            rec.barrier()
            sets = self.record(rec, xb, x_f32, tb, lb, ib, wb, m)
            rec.host_barrier()
            rec.end()
            self._calls[key] = (*bufs, rec, sets)
        return self._calls[key]

    def close(self):
        for *bufs, rec, sets in self._calls.values():
            close_recording(rec, sets, bufs)
        self._calls.clear()
        self.gemv.close()
        for b in self._buffers + self._counters:
            b.close()
