"""A layer's experts over several devices (vkmoe.ops.sharded): two vkmoe.Device instances on the one lavapipe
stand in for two GPUs (conftest's `device` and this module's own `dev`). The sharded output must equal the whole layer on one device bit for bit, whatever the
placement, and bad ranges must be refused with a clear error."""
import numpy as np
import pytest

import vkmoe
from goldens import golden_files, load_layer, poison_scratch, rel_rms
from vkmoe.ops.sharded import ShardedMoeMlp, check_ranges, even_ranges

LAYER = golden_files()[1]  # b_mixed_bits: 16 experts, mixed bit widths, top-4


@pytest.fixture(scope="module")
def layer():
    return load_layer(LAYER)


@pytest.fixture(scope="module")
def whole(device, layer):
    with vkmoe.Exl3MoeMlp(device, layer.gate, layer.up, layer.down, activation=layer.activation,
                          act_limit=layer.act_limit) as moe:
        yield {i: moe(c["x"], c["selected"], c["weights"], dispatch="split") for i, c in enumerate(layer.calls)}


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("ranges", [None, [(0, 1), (1, 15)], [(0, 11), (11, 5)]],
                         ids=["even", "one-and-rest", "uneven"])
def test_sharded_equals_the_whole_layer_bit_for_bit(device, dev, layer, whole, ranges):
    with ShardedMoeMlp([device, dev], layer.gate, layer.up, layer.down, activation=layer.activation,
                       act_limit=layer.act_limit, ranges=ranges) as sharded:
        for i, c in enumerate(layer.calls):
            out = sharded(c["x"], c["selected"], c["weights"], dispatch="split")
            assert np.isfinite(out).all()
            assert np.array_equal(_bits(out), _bits(whole[i])), (ranges, i)
            assert rel_rms(out, c["ref_out"]) < 3e-3


def test_three_shards_and_persistent_mode_give_the_same_bits(device, dev, layer, whole):
    with ShardedMoeMlp([device, dev, device], layer.gate, layer.up, layer.down,
                       activation=layer.activation, act_limit=layer.act_limit, ranges=[(0, 3), (3, 9), (12, 4)]) as s:
        c = layer.calls[0]
        for mode in ("split", "persistent"):
            for shard in s.shards:  # (persistent must not pass on what split left in the shards' scratch)
                poison_scratch(shard)
            assert np.array_equal(_bits(s(c["x"], c["selected"], c["weights"], dispatch=mode)), _bits(whole[0])), mode


def test_a_token_whose_experts_are_all_elsewhere_gets_its_rows_from_the_other_shard(device, dev, layer):
    c = layer.calls[0]
    ids = np.sort(c["selected"], axis=1)
    with ShardedMoeMlp([device, dev], layer.gate, layer.up, layer.down, activation=layer.activation,
                       act_limit=layer.act_limit, ranges=[(0, 8), (8, 8)]) as s, \
            vkmoe.Exl3MoeMlp(device, layer.gate, layer.up, layer.down, activation=layer.activation,
                             act_limit=layer.act_limit) as moe:
        ids = np.tile(np.array([[12, 13, 14, 15]], np.int32), (c["x"].shape[0], 1))  # all on shard 1
        expect = moe(c["x"], ids, c["weights"], dispatch="split")
        assert np.array_equal(_bits(s(c["x"], ids, c["weights"])), _bits(expect))


@pytest.mark.parametrize("ranges, match", [
    ([(0, 8), (6, 10)], "overlaps"), ([(0, 8), (9, 7)], "gap"), ([(0, 8), (8, 9)], "cover"),
    ([(0, 16), (16, 0)], "count must be >= 1"), ([(0, 8)], "cover"), ([(0, "8"), (8, 8)], "pair of ints"),
    ([], "non-empty"),
])
def test_bad_ranges_are_refused(device, dev, layer, ranges, match):
    with pytest.raises(ValueError, match=match):
        ShardedMoeMlp([device, dev], layer.gate, layer.up, layer.down, activation=layer.activation,
                      ranges=ranges)


def test_range_helpers_and_bad_calls(device, dev, layer):
    assert even_ranges(16, 3) == [(0, 6), (6, 5), (11, 5)]
    assert check_ranges([(0, 10), (10, 6)], 16) == [(0, 10), (10, 6)]
    with pytest.raises(ValueError, match="shards"):
        even_ranges(4, 5)
    with pytest.raises(ValueError, match="3 devices"):
        ShardedMoeMlp([device, dev, device], layer.gate, layer.up, layer.down,
                      activation=layer.activation, ranges=[(0, 8), (8, 8)])
    with ShardedMoeMlp([device, dev], layer.gate, layer.up, layer.down, activation=layer.activation) as s:
        c = layer.calls[0]
        bad = c["selected"].copy()
        bad[0, 0] = 16
        with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 16\)"):
            s(c["x"], bad, c["weights"])
        with pytest.raises(TypeError, match="hidden must be float16"):
            s(c["x"].astype(np.float32), c["selected"], c["weights"])
        with pytest.raises(TypeError, match="expert_weights must be float16/float32"):
            s(c["x"], c["selected"], c["weights"].astype(np.int32))


def test_a_closed_layer_and_bad_shards_raise_clear_errors(device, dev, layer):
    """A call after close() was an IndexError, and from_shards of malformed ranges a bare unpacking error."""
    c = layer.calls[0]
    s = ShardedMoeMlp([device, dev], layer.gate, layer.up, layer.down, activation=layer.activation)
    assert np.isfinite(s(c["x"], c["selected"], c["weights"])).all()
    shards = list(s.shards)
    s.close()
    s.close()  # harmless
    with pytest.raises(vkmoe.VkmoeError, match="this ShardedMoeMlp is closed"):
        s(c["x"], c["selected"], c["weights"])
    for bad in ("x", [(0,)], [None], 5):
        with pytest.raises(ValueError, match="ranges: expected a non-empty list of .first, count. pairs"):
            ShardedMoeMlp.from_shards(shards, bad)
    with pytest.raises(ValueError, match="shards: expected one Exl3MoeMlp per range"):
        ShardedMoeMlp.from_shards([object(), object()], [(0, 8), (8, 8)])


def test_from_a_checkpoint_each_shard_reads_its_experts(device, dev, tmp_path, monkeypatch):
    from vkmoe.exl3 import loaders
    from vkmoe.models import write_checkpoint

    ckpt = write_checkpoint(str(tmp_path / "q"), arch="qwen3_moe", hidden=256, intermediate=128, experts=8, top_k=2,
                            layers=1, seed=5, shards=2)
    prefix = "model.layers.0.mlp"
    read = []
    real = loaders.load_exl3_tensor
    monkeypatch.setattr(loaders, "load_exl3_tensor", lambda src, key: read.append(key) or real(src, key))
    part = loaders.load_moe_experts(ckpt, prefix, expert_range=(5, 3))
    assert part["num_experts"] == 8 and len(part["up"]) == 3
    assert sorted({k.split(".experts.")[1].split(".")[0] for k in read}) == ["5", "6", "7"]  # only its experts
    with pytest.raises(ValueError, match="expert_range"):
        loaders.load_moe_experts(ckpt, prefix, expert_range=(6, 3))
    monkeypatch.undo()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 256)).astype(np.float16)
    ids = np.array([[0, 7], [3, 4], [6, 1]], np.int32)
    w = np.array([[0.6, 0.4], [0.5, 0.5], [0.2, 0.8]], np.float32)
    with vkmoe.Exl3MoeMlp.from_safetensors(device, ckpt, prefix) as moe, \
            ShardedMoeMlp.from_safetensors([device, dev], ckpt, prefix, ranges=[(0, 3), (3, 5)]) as s:
        assert np.array_equal(_bits(s(x, ids, w)), _bits(moe(x, ids, w)))
