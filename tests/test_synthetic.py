"""vkmoe.ops.synthetic: the device fill shader equals its numpy twin bit for bit, random layers are correct
layers (a forward matches the float64 reference on the downloaded weights), and random routing is valid."""
import numpy as np
import pytest

from goldens import rel_rms
from vkmoe.exl3 import reference
from vkmoe.ops import synthetic

TOL = 3e-3


@pytest.mark.parametrize("count,seed", [(1, 0), (257, 1), (70001, 0xDEADBEEF)])
def test_fill_matches_numpy(device, count, seed):
    buf = device.memory.allocate(4 * count)
    try:
        buf.upload(np.full(count, 0x7FC00000, np.uint32))  # poison: every word must be written
        synthetic.fill_random(device, buf, seed)
        got = buf.download(np.uint32)
    finally:
        buf.close()
    want = synthetic.fill_words_numpy(count, seed)
    assert np.array_equal(got, want), f"first mismatch at word {int(np.argmax(got != want))}"


def test_fill_chunks_and_seeds(device, monkeypatch):
    """Several dispatches (small chunk sizes forced) give the same words as one; seeds give different words."""
    count = 5 * 256 * 3 + 17
    monkeypatch.setattr(synthetic, "FILL_GROUPS_X", 2)
    monkeypatch.setattr(synthetic, "FILL_ROWS", 3)
    buf = device.memory.allocate(4 * count)
    try:
        synthetic.fill_random(device, buf, 7)
        got = buf.download(np.uint32)
    finally:
        buf.close()
    assert np.array_equal(got, synthetic.fill_words_numpy(count, 7))
    assert np.array_equal(synthetic.fill_words_numpy(100, 7, start=50), synthetic.fill_words_numpy(150, 7)[50:])
    assert np.mean(synthetic.fill_words_numpy(1000, 7) == synthetic.fill_words_numpy(1000, 8)) < 0.01


def test_projection_layout(device):
    E, k, n, bits = 3, 128, 256, 3
    with_proj = synthetic.random_projection(device, E, k, n, bits, seed=11)
    try:
        assert (with_proj.bits, with_proj.k, with_proj.n, with_proj.E) == (bits, k, n, E)
        assert with_proj.buffers == (with_proj.trellis, with_proj.suh, with_proj.svh)
        assert with_proj.trellis.size == E * (k // 16) * (n // 16) * 16 * bits * 2
        words = with_proj.trellis.download(np.uint32)
        assert np.array_equal(words, synthetic.fill_words_numpy(words.size, 11))
        tensors = with_proj.to_tensors()
        assert len(tensors) == E and tensors[1].trellis.shape == (k // 16, n // 16, 16 * bits)
        suh = with_proj.suh.download(np.float16, (E, k))
        assert np.all(np.isfinite(suh)) and np.all(suh != 0) and (suh > 0).any() and (suh < 0).any()
    finally:
        with_proj.close()
    assert with_proj.buffers == ()


def test_projection_too_big_for_buffer_range(device):
    k = n = 128 * 64
    E = device.limits.maxStorageBufferRange // (k * n) + 1  # 8 bits: k*n bytes per expert
    with pytest.raises(ValueError, match="maxStorageBufferRange"):
        synthetic.random_projection(device, E, k, n, 8, seed=0)


@pytest.mark.parametrize("m,top_k,E", [(1, 1, 4), (7, 3, 16), (64, 8, 128)])
def test_random_routing(m, top_k, E):
    ids, w = synthetic.random_routing(m, E, top_k, seed=5)
    assert ids.shape == w.shape == (m, top_k) and ids.dtype == np.int32 and w.dtype == np.float32
    assert ids.min() >= 0 and ids.max() < E
    assert all(len(set(row)) == top_k for row in ids.tolist())
    assert np.allclose(w.sum(axis=1), 1.0, atol=1e-6) and (w > 0).all()
    ids2, w2 = synthetic.random_routing(m, E, top_k, seed=5)
    assert np.array_equal(ids, ids2) and np.array_equal(w, w2)


def test_random_moe_matches_reference(device):
    H, I, E, top_k, m = 256, 128, 4, 2, 5
    with synthetic.random_moe(device, E, H, I, bits=4, codebook="mul1", seed=3, dispatch="split") as moe:
        ids, w = synthetic.random_routing(m, E, top_k, seed=1)
        x = np.random.default_rng(0).standard_normal((m, H)).astype(np.float16)
        y = moe(x, ids, w)
        gate, up, down = synthetic.moe_tensors(moe)
    ref = reference.moe_forward(x, ids, w, gate, up, down, activation="silu")
    assert np.all(np.isfinite(y))
    scale = float(np.sqrt(np.mean(ref ** 2)))
    assert 0.02 < scale < 3.0, f"output RMS {scale:.3g}: random scales should give O(0.1-1)"
    err = rel_rms(y, ref)
    assert err < TOL, f"relative RMS {err:.3g} >= {TOL}"
