"""Synthetic EXL3 MoE layers for benchmarks: trellises written on the device, routing drawn on the host.

A DeepSeek-V3 layer is 5.6 GB of trellis and a cold-weights benchmark rotates several copies, so uploading
random words from numpy through staging buffers would dominate the run. `random_projection` writes the words
with shaders/fill_random.comp (a hash of the word index and a seed; every bit pattern is a valid trellis) and
uploads only the small suh/svh vectors (vkmoe.exl3.synthetic.random_scales, as for host-made layers).
`fill_words_numpy` is the same hash on the host, for tests. Routings come from vkmoe.exl3.synthetic.

    moe = random_moe(dev, E=128, H=2048, I=768)          # an Exl3MoeMlp, weights on the device
    ids, w = random_routing(m=4, experts=128, top_k=8, seed=1)  # distinct ids per row, weights summing to 1
"""
import numpy as np

from ..exl3 import Exl3Tensor
from ..exl3.synthetic import DOWN_OUT_SCALE, GATELESS_ACTIVATIONS, random_routing, random_scales
from ..vk import CommandRecorder, PushConstants
from . import kernels
from ..layout import ACTIVATIONS, CODEBOOKS, ceil_div
from .moe import Exl3MoeMlp

__all__ = ["FillPush", "SyntheticProjection", "fill_random", "fill_words_numpy", "random_projection",
           "random_moe", "random_routing", "projection_seed", "moe_tensors", "device_heap_bytes"]

FILL_WORKGROUP = 256          # local_size_x of shaders/fill_random.comp
FILL_GROUPS_X = 4096          # workgroups per row of a fill dispatch (1 Mi words)
FILL_ROWS = 64                # rows per dispatch at most: 64 Mi words (256 MiB) per dispatch
_M32 = np.uint64(0xFFFFFFFF)


class FillPush(PushConstants):
    fields = [("base", "<u4"), ("count", "<u4"), ("seed", "<u4")]


# ---------------------------------------------------------------------------------------------- the hash
def _lowbias32(x):
    """Chris Wellons' lowbias32 on uint64 arrays holding 32-bit values (the shader's hash)."""
    x = np.asarray(x, np.uint64) & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _M32
    x ^= x >> np.uint64(16)
    return x


def fill_words_numpy(count, seed, start=0):
    """Words start..start+count-1 as shaders/fill_random.comp writes them: lowbias32(i + lowbias32(seed ^ K))."""
    mix = _lowbias32(np.uint64((int(seed) ^ 0xA511E9B3) & 0xFFFFFFFF))
    i = np.arange(start, start + count, dtype=np.uint64)
    return _lowbias32((i + mix) & _M32).astype(np.uint32)


def fill_random(device, buf, seed, cmd=None):
    """Write the hash words into all of `buf` (its size rounded down to 4 bytes) on the device.

    Records into `cmd` (a recording CommandRecorder; a barrier follows) or, without one, submits its own
    command buffer and waits. Each invocation writes one word and loops nowhere; dispatches cover at most
    FILL_GROUPS_X x FILL_ROWS workgroups, within maxComputeWorkGroupCount."""
    count = buf.size // 4
    if count == 0:
        return
    if count >= 1 << 32:
        raise ValueError(f"fill_random: {buf.size} bytes is more than 2^32 words")
    pipe = kernels.pipeline(device, "fill_random", FillPush)
    limit = device.limits.maxComputeWorkGroupCount
    gx_max = max(1, min(FILL_GROUPS_X, limit[0]))
    rows_max = max(1, min(FILL_ROWS, limit[1]))
    own = cmd is None
    if own:
        cmd = CommandRecorder(device)
        cmd.begin()
    try:
        dset = pipe.bind(buf)
        base = 0
        while base < count:
            left = count - base
            gx = min(gx_max, ceil_div(left, FILL_WORKGROUP))
            rows = min(rows_max, ceil_div(left, gx * FILL_WORKGROUP))
            cmd.dispatch(pipe, dset, (gx, rows), FillPush(base=base, count=count, seed=int(seed) & 0xFFFFFFFF))
            base += gx * rows * FILL_WORKGROUP
        cmd.barrier()
        if own:
            cmd.end()
            cmd.submit(wait=True)
    finally:
        if own:
            cmd.close()


def projection_seed(seed, index):
    """The fill seed of projection `index` (0 gate, 1 up, 2 down) of a layer built with `seed`."""
    return (int(seed) * 0x9E3779B1 + 0x632BE5AB * (index + 1)) & 0xFFFFFFFF


# ------------------------------------------------------------------------------------------ projections
class SyntheticProjection:
    """All E experts of one projection on the device, compatible with vkmoe.ops.moe._Projection: trellis
    words back to back ((k/16, n/16, 16*bits) uint16 per expert), suh (E, k) and svh (E, n) fp16."""

    def __init__(self, device, E, k, n, bits, seed, out_scale=1.0, codebook="mul1"):
        for name, v in (("k", k), ("n", n)):
            if v <= 0 or v % 128:
                raise ValueError(f"{name} must be a positive multiple of 128, got {v}")
        if not 1 <= bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {bits}")
        if E <= 0:
            raise ValueError(f"E must be positive, got {E}")
        self.bits, self.k, self.n, self.E = int(bits), int(k), int(n), int(E)
        self.seed = int(seed) & 0xFFFFFFFF
        self.trellis_bytes_per_expert = k * n * bits // 8
        self.trellis_bytes = E * self.trellis_bytes_per_expert
        limit = device.limits.maxStorageBufferRange
        if self.trellis_bytes > limit:
            raise ValueError(f"{E} experts x {k} x {n} at {bits} bits = {self.trellis_bytes} trellis bytes in one "
                             f"buffer, more than this device's maxStorageBufferRange ({limit})")
        mem = device.memory
        self.trellis = self.suh = self.svh = None
        self.buffers = ()
        try:
            self.trellis = mem.allocate(self.trellis_bytes)
            fill_random(device, self.trellis, self.seed)
            suh, svh = random_scales(np.random.default_rng([self.seed, 1]), k, n, codebook, out_scale, batch=(E,))
            self.suh = mem.allocate(E * k * 2)
            self.suh.upload(suh)
            self.svh = mem.allocate(E * n * 2)
            self.svh.upload(svh)
        except Exception:
            self.close()
            raise
        self.buffers = (self.trellis, self.suh, self.svh)

    @property
    def nbytes(self):
        return self.trellis_bytes + 2 * self.E * (self.k + self.n)

    def to_tensors(self, codebook="mul1"):
        """Host copies (downloaded) as one Exl3Tensor per expert, for references and the CPU tier."""
        tiles = (self.k // 16, self.n // 16, 16 * self.bits)
        words = self.trellis.download(np.uint16).reshape((self.E,) + tiles)
        suh = self.suh.download(np.float16, (self.E, self.k))
        svh = self.svh.download(np.float16, (self.E, self.n))
        return [Exl3Tensor(words[e], suh[e], svh[e], codebook=codebook) for e in range(self.E)]

    def close(self):
        for b in (self.trellis, self.suh, self.svh):
            if b is not None:
                b.close()
        self.trellis = self.suh = self.svh = None
        self.buffers = ()


def random_projection(device, E, k, n, bits, seed, out_scale=1.0, codebook="mul1"):
    """E experts of a k -> n EXL3 projection with device-filled trellis words (see SyntheticProjection)."""
    return SyntheticProjection(device, E, k, n, bits, seed, out_scale=out_scale, codebook=codebook)


def random_moe(device, E, H, I, bits=4, codebook="mul1", activation="silu", seed=0, dispatch=None, act_limit=0.0):
    """An Exl3MoeMlp with E random experts (H -> I gate/up, I -> H down), trellises filled on the device.
    Output scale: gate/up ~1, down ~0.5 per expert, so a routed sum is O(0.1-1) for unit-RMS input.
    `bits` is an int or a (gate, up, down) triple. Close it (or use `with`) to free the device memory."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {sorted(CODEBOOKS)}, got {codebook!r}")
    gb, ub, db = (bits, bits, bits) if np.isscalar(bits) else tuple(bits)
    made = []
    try:
        gate = None
        if activation not in GATELESS_ACTIVATIONS:
            gate = random_projection(device, E, H, I, gb, projection_seed(seed, 0), 1.0, codebook)
            made.append(gate)
        up = random_projection(device, E, H, I, ub, projection_seed(seed, 1), 1.0, codebook)
        made.append(up)
        down = random_projection(device, E, I, H, db, projection_seed(seed, 2), DOWN_OUT_SCALE, codebook)
        made.append(down)
        return Exl3MoeMlp.from_projections(device, codebook, gate, up, down, activation=activation,
                                           act_limit=act_limit, dispatch=dispatch)
    except Exception:
        for p in made:
            p.close()
        raise


def moe_tensors(moe):
    """(gate, up, down) host Exl3Tensor lists of a random_moe layer (downloaded; gate None if gateless)."""
    gate = moe._gate.to_tensors(moe.codebook) if moe.gated else None
    return gate, moe._up.to_tensors(moe.codebook), moe._down.to_tensors(moe.codebook)


def device_heap_bytes(device):
    """Size of the memory heap vkmoe allocates device buffers from (bytes)."""
    import vulkan as vk

    props = vk.vkGetPhysicalDeviceMemoryProperties(device.physical)
    heap = props.memoryTypes[device.memory.device_type].heapIndex
    return int(props.memoryHeaps[heap].size)
