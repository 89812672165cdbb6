"""The shaders' fp16 rounding, bit for bit against numpy (tests/shaders/test_rounding.comp): common.glsl's rn16 and
rn16_pair as the output tails apply them, RN16(RN16(a · r) · s) (the pair through hadamard128.glsl's had_out_pair).
A compiler may fold an fp16 pack and the unpack after it into nothing and keep the fp32 value: the NVIDIA driver
(H100) and Mesa 25's lavapipe did so here (908 of 4096 values one fp16 step off) until the packed word went through
common.glsl's opaque_zero(); the tests of the ops allow a tolerance where these roundings act and did not see it
(BENCHMARKS.md, thirtieth session)."""
import os

import numpy as np

from vkmoe.exl3.reference import HAD_SCALE_F32
from vkmoe.vk import CommandRecorder, Pipeline, PushConstants

ROUNDING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "_spv",
                        "test_rounding.spv")


class RoundingPush(PushConstants):
    fields = [("pairs", "<u4")]


def _f16(x):
    return np.asarray(x, np.float32).astype(np.float16)


def test_fp16_roundings_are_kept(device):
    rng = np.random.default_rng(5)
    n = 4096
    # fp32 values of every magnitude fp16 holds after the scale, most of them not fp16 values themselves
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-12, 12, n))).astype(np.float32)
    s = _f16(rng.standard_normal(n) * np.exp2(rng.integers(-6, 3, n)))
    ref = _f16(_f16(a * HAD_SCALE_F32).astype(np.float32) * s.astype(np.float32))
    assert np.isfinite(ref).all()
    # (else the test could not fail: the unrounded product gives other fp16 values for many elements)
    assert np.mean(ref != _f16(a * HAD_SCALE_F32 * s.astype(np.float32))) > 0.05
    pipe = Pipeline(device, ROUNDING, push=RoundingPush)
    mem = device.memory
    ba, bs, b1, b2 = mem.allocate(a.nbytes), mem.allocate(s.nbytes), mem.allocate(s.nbytes), mem.allocate(s.nbytes)
    try:
        ba.upload(a)
        bs.upload(s)
        for b in (b1, b2):  # poison
            b.upload(np.full(n, np.nan, np.float16))
        with CommandRecorder(device) as rec:
            rec.begin()
            dset = pipe.bind(ba, bs, b1, b2)
            rec.dispatch(pipe, dset, (n // 2 + 255) // 256, pipe.push(pairs=n // 2))
            rec.end()
            rec.submit(wait=True)
            dset.free()
        one, pair = b1.download(np.float16), b2.download(np.float16)
    finally:
        for b in (ba, bs, b1, b2):
            b.close()
        pipe.close()
    assert np.array_equal(one.view(np.uint16), ref.view(np.uint16)), np.sum(one != ref)
    assert np.array_equal(pair.view(np.uint16), ref.view(np.uint16)), np.sum(pair != ref)
