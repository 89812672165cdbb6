"""vkmoe.models: routing, SparseMoeBlock from generated checkpoints (CPU and Vulkan backends) against a float64
numpy block, checkpoint errors, and the checkpoint generator/tool."""
import importlib
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from vkmoe import registry
from vkmoe.models import (Checkpoint, CheckpointError, MissingTensorError, MoeConfig, SparseMoeBlock,
                          sigmoid_group_topk, softmax_topk, write_checkpoint)
from subproc import python_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ops_importable():
    try:
        importlib.import_module("vkmoe.ops.moe").Exl3MoeMlp
        importlib.import_module("vkmoe.ops.linear").Exl3Linear
    except Exception as exc:  # noqa: BLE001 - any import failure means "not landed yet"
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


_OPS_OK, _OPS_WHY = _ops_importable()
needs_vulkan_ops = pytest.mark.skipif(not _OPS_OK, reason=f"vkmoe.ops.moe/vkmoe.ops.linear not importable yet "
                                                          f"({_OPS_WHY})")

QWEN = dict(arch="qwen3_moe", hidden=256, intermediate=128, experts=8, top_k=2, layers=2, seed=11)
DEEPSEEK = dict(arch="deepseek_v3", hidden=256, intermediate=128, experts=8, top_k=2, layers=1, n_group=2,
                topk_group=1, shared_experts=1, seed=12, shards=2)


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv("VKMOE_BACKEND", raising=False)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("qwen3_moe")), **QWEN)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("deepseek_v3")), **DEEPSEEK)


def _rms(a):
    return float(np.sqrt(np.mean(np.square(np.asarray(a, np.float64)))))


def _rel_rms(out, want):
    return _rms(np.asarray(out, np.float64) - want) / _rms(want)


def _hidden(m, H=256, seed=0, dtype=np.float16):
    return np.random.default_rng(seed).standard_normal((m, H)).astype(dtype)


def _check_block(block, hidden):
    ids32, _ = block.route(hidden)
    ids64, w64 = block.route(hidden.astype(np.float64), dtype=np.float64)
    # fp32 and fp64 routers agree on random data; compare on the same routing so only the experts are tested.
    assert np.array_equal(ids32, ids64)
    out = block(hidden)
    assert out.dtype == np.float32 and out.shape == hidden.shape
    assert np.all(np.isfinite(out))
    want = block.reference(hidden)
    assert 0.05 < _rms(want) < 2.0, "generated checkpoint should give block outputs of rms O(0.1-1)"
    err = _rel_rms(out, want)
    assert err < 3e-3, f"relative RMS error {err:.2e}"
    return out


# ------------------------------------------------------------------------------------------------ routing
def test_softmax_topk_all_equal_logits():
    ids, w = softmax_topk(np.zeros((3, 8), np.float32), 4, norm_topk_prob=True)
    assert np.array_equal(ids, np.tile(np.arange(4), (3, 1)))  # ties break toward lower expert ids
    np.testing.assert_allclose(w, 0.25, rtol=1e-6)


def test_softmax_topk_ties_pick_distinct_experts():
    logits = np.array([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0]], np.float32)
    ids, w = softmax_topk(logits, 3, norm_topk_prob=True)
    assert ids.tolist() == [[1, 2, 3]]
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_softmax_topk_k_equals_num_experts():
    logits = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    ids, w = softmax_topk(logits, 8, norm_topk_prob=True)
    assert all(sorted(r) == list(range(8)) for r in ids.tolist())
    assert np.all(np.diff(np.take_along_axis(logits, ids, -1), axis=-1) <= 0)  # descending score order
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_softmax_topk_without_norm_keeps_full_softmax_probs():
    logits = np.random.default_rng(1).standard_normal((4, 8))
    ids, w = softmax_topk(logits, 2, norm_topk_prob=False)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(w, np.take_along_axis(p, ids, -1), rtol=1e-12)
    assert np.all(w.sum(-1) < 1)


def test_sigmoid_group_topk_bias_selects_but_does_not_weight():
    logits = np.array([[0.5, 0.4, 0.3, 0.2]])
    bias = np.array([0.0, 0.0, 0.0, 1.0])
    ids, w = sigmoid_group_topk(logits, bias, 2, n_group=1, topk_group=1, norm_topk_prob=True,
                                routed_scaling_factor=2.5)
    assert ids.tolist() == [[3, 0]]
    s = 1 / (1 + np.exp(-logits[0, [3, 0]]))
    np.testing.assert_allclose(w[0], 2.5 * s / s.sum(), rtol=1e-12)


def test_sigmoid_group_topk_group_limit():
    # Expert 0 alone is best, but group 1 (experts 4..7) has the larger top-2 sum, so only group 1 is kept.
    logits = np.array([[3.0, -3.0, -3.0, -3.0, 1.0, 1.0, 0.0, 0.0]])
    ids, w = sigmoid_group_topk(logits, None, 2, n_group=2, topk_group=1, norm_topk_prob=True,
                                routed_scaling_factor=1.0)
    assert ids.tolist() == [[4, 5]]
    ids2, _ = sigmoid_group_topk(logits, None, 2, n_group=2, topk_group=2, norm_topk_prob=True,
                                 routed_scaling_factor=1.0)
    assert ids2.tolist() == [[0, 4]]


def test_sigmoid_group_topk_all_equal_and_k_equals_group():
    ids, w = sigmoid_group_topk(np.zeros((2, 8)), np.zeros(8), 4, n_group=2, topk_group=1, norm_topk_prob=True,
                                routed_scaling_factor=2.5)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    np.testing.assert_allclose(w, 2.5 / 4, rtol=1e-12)
    ids, w = sigmoid_group_topk(np.zeros((1, 8)), None, 8, n_group=1, topk_group=1, norm_topk_prob=False,
                                routed_scaling_factor=1.0)
    assert sorted(ids[0].tolist()) == list(range(8))
    np.testing.assert_allclose(w, 0.5, rtol=1e-12)


def test_block_routing_distinct_and_normalised(qwen_dir, deepseek_dir):
    h = _hidden(64)
    q = SparseMoeBlock.from_checkpoint(qwen_dir, 0, backend="cpu")
    ids, w = q.route(h)
    assert ids.shape == (64, 2) and w.dtype == np.float32
    assert all(len(set(r)) == 2 for r in ids.tolist())
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
    d = SparseMoeBlock.from_checkpoint(deepseek_dir, 0, backend="cpu")
    ids, w = d.route(h)
    assert all(len(set(r)) == 2 for r in ids.tolist())
    assert np.all((ids // 4)[:, 0] == (ids // 4)[:, 1]), "topk_group=1: both experts from one group"
    np.testing.assert_allclose(w.sum(-1), d.config.routed_scaling_factor, rtol=1e-5)
    assert len(set((ids // 4)[:, 0].tolist())) == 2, "random tokens should use both groups"


# ------------------------------------------------------------------------------------------- blocks, CPU
@pytest.mark.parametrize("layer", [0, 1])
def test_qwen3_block_cpu(qwen_dir, layer):
    block = SparseMoeBlock.from_checkpoint(qwen_dir, layer, backend="cpu")
    assert block.backend == "cpu" and block.shared is None
    _check_block(block, _hidden(9, seed=layer))
    assert block.last_run["mode"] == "cpu"


def test_qwen3_block_fp32_input(qwen_dir):
    block = SparseMoeBlock.from_checkpoint(qwen_dir, 0, backend="cpu")
    _check_block(block, _hidden(5, seed=3, dtype=np.float32))


def test_deepseek_block_cpu(deepseek_dir):
    block = SparseMoeBlock.from_checkpoint(deepseek_dir, 0, backend="cpu")
    assert block.shared is not None and set(block.shared_ops) == {"gate", "up", "down"}
    out = _check_block(block, _hidden(9, seed=4))
    # The shared expert really contributes: the routed part alone is far from the block output.
    ids, w = block.route(_hidden(9, seed=4))
    routed = block.moe(_hidden(9, seed=4), ids, w)
    assert _rel_rms(routed, out.astype(np.float64)) > 0.1


def test_block_empty_batch(qwen_dir):
    block = SparseMoeBlock.from_checkpoint(qwen_dir, 0, backend="cpu")
    assert block(np.zeros((0, 256), np.float16)).shape == (0, 256)


def test_block_rejects_bad_hidden(qwen_dir):
    block = SparseMoeBlock.from_checkpoint(qwen_dir, 0, backend="cpu")
    with pytest.raises(ValueError, match="256"):
        block(np.zeros((2, 128), np.float16))


@pytest.mark.parametrize("bad,arch", [(np.nan, "qwen3"), (np.nan, "deepseek"), (np.inf, "qwen3")])
def test_cpu_block_names_the_token_whose_routing_is_not_finite(qwen_dir, deepseek_dir, bad, arch):
    """A NaN hidden value (or an Inf under softmax, whose scores it turns to NaN; sigmoid maps Inf to 1): the CPU
    backend refuses the token's non-finite routing weights naming hidden and the token (the routed op's own check
    would name expert_weights, which the caller never passed)."""
    for path in (qwen_dir if arch == "qwen3" else deepseek_dir,):
        block = SparseMoeBlock.from_checkpoint(path, 0, backend="cpu")
        x = np.full((3, 256), 0.1, np.float16)
        x[1, 5] = bad
        with pytest.raises(ValueError, match="hidden: token 1's routing weights are not finite"), \
                np.errstate(invalid="ignore", over="ignore"):
            block(x)
        assert np.isfinite(block(x[[0, 2]])).all()


@pytest.mark.parametrize("backend", ["cpu", pytest.param("vulkan", marks=needs_vulkan_ops)])
def test_block_refuses_float32_hidden_beyond_float16s_range(qwen_dir, deepseek_dir, backend, request):
    """The experts take hidden in float16: 7e4 became Inf there and the token's row NaN (the vulkan backend) with no
    word. Refused naming hidden, on both backends; 6e4 still runs."""
    device = request.getfixturevalue("device") if backend == "vulkan" else None
    for path, who in ((qwen_dir, "routed experts"), (deepseek_dir, "routed and shared experts")):
        block = SparseMoeBlock.from_checkpoint(path, 0, backend=backend, device=device)
        x = np.full((3, 256), 0.01, np.float32)
        for big in (7e4, -7e4, np.inf):
            x[1, 5] = big
            with pytest.raises(ValueError, match=f"hidden: float32 values beyond float16's range.*the {who} take"):
                block(x)
            x[0, 3] = np.nan  # (a NaN beside it hid it: numpy's max of a row with NaN is NaN)
            with pytest.raises(ValueError, match="beyond float16's range"), np.errstate(invalid="ignore"):
                block(x)
            x[0, 3] = 0.01
        x[1, 5] = 6e4
        with np.errstate(over="ignore", invalid="ignore"):  # (the big token's own row may overflow)
            y, y64 = block(x), block(x.astype(np.float64))
        assert y.shape == (3, 256) and np.isfinite(y[[0, 2]]).all()
        np.testing.assert_array_equal(y64[[0, 2]], y[[0, 2]])
        block.close()


def test_block_picks_cpu_without_vulkan(qwen_dir):
    with registry.simulate_no_vulkan():
        block = SparseMoeBlock.from_checkpoint(qwen_dir, 0)
    assert block.backend == "cpu"


def test_block_env_backend_cpu(qwen_dir, monkeypatch):
    monkeypatch.setenv("VKMOE_BACKEND", "cpu")
    assert SparseMoeBlock.from_checkpoint(qwen_dir, 0).backend == "cpu"


# ---------------------------------------------------------------------------------------- blocks, Vulkan
@needs_vulkan_ops
def test_qwen3_block_vulkan(qwen_dir, device):
    block = SparseMoeBlock.from_checkpoint(qwen_dir, 1, backend="vulkan", device=device)
    assert block.backend == "vulkan"
    _check_block(block, _hidden(4, seed=5))
    assert "mode" in block.last_run


@needs_vulkan_ops
def test_deepseek_block_vulkan(deepseek_dir, device):
    block = SparseMoeBlock.from_checkpoint(deepseek_dir, 0, backend="vulkan", device=device)
    _check_block(block, _hidden(4, seed=6))


@needs_vulkan_ops
def test_block_auto_backend_is_vulkan_with_device(qwen_dir, device):
    assert SparseMoeBlock.from_checkpoint(qwen_dir, 0, device=device).backend == "vulkan"


# ----------------------------------------------------------------------------------- checkpoint errors
def _copy(src, tmp_path, edit_config=None):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(src, dst)
    if edit_config:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        edit_config(cfg)
        with open(path, "w") as f:
            json.dump(cfg, f)
    return dst


def test_missing_expert_tensor_names_key(tmp_path):
    d = write_checkpoint(str(tmp_path / "c"), **dict(QWEN, layers=1, omit=["model.layers.0.mlp.experts.3.up_proj"]))
    with pytest.raises(MissingTensorError) as exc:
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")
    assert "model.layers.0.mlp.experts.3.up_proj" in str(exc.value)


def test_missing_router_names_key(tmp_path):
    d = write_checkpoint(str(tmp_path / "c"), **dict(QWEN, layers=1, omit=["model.layers.0.mlp.gate.weight"]))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.0\.mlp\.gate\.weight"):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")


def test_missing_score_bias_names_key(tmp_path):
    d = write_checkpoint(str(tmp_path / "c"),
                         **dict(DEEPSEEK, omit=["model.layers.0.mlp.gate.e_score_correction_bias"]))
    with pytest.raises(MissingTensorError, match="e_score_correction_bias"):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")


def test_missing_shared_expert_names_key(tmp_path):
    d = write_checkpoint(str(tmp_path / "c"),
                         **dict(DEEPSEEK, omit=["model.layers.0.mlp.shared_experts.down_proj"]))
    with pytest.raises(MissingTensorError, match=r"shared_experts\.down_proj"):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")


# A config.json edit that no checkpoint file matches: the error names what disagrees.
@pytest.mark.parametrize("source, edit, exc, match", [
    ("qwen_dir", dict(num_experts=6), CheckpointError, r"experts\.6.*num_experts=6"),
    ("qwen_dir", dict(num_experts=10), MissingTensorError,
     r"model\.layers\.0\.mlp\.experts\.8\.gate_proj.*num_experts=10"),
    ("qwen_dir", dict(hidden_size=200), CheckpointError, "hidden_size=200"),
    ("qwen_dir", dict(moe_intermediate_size=256), CheckpointError, r"experts\.0\.gate_proj.*256x128.*256x256"),
    ("deepseek_dir", dict(first_k_dense_replace=1), CheckpointError, "dense"),
    ("qwen_dir", dict(model_type="llama", architectures=["LlamaForCausalLM"]), CheckpointError, "LlamaForCausalLM"),
], ids=["fewer_experts_than_files", "more_experts_than_files", "hidden_not_multiple_of_128",
        "intermediate_mismatch_names_key", "dense_layer_rejected", "unsupported_architecture"])
def test_config_edit_rejected(source, edit, exc, match, request, tmp_path):
    d = _copy(request.getfixturevalue(source), tmp_path, lambda c: c.update(edit))
    with pytest.raises(exc, match=match):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")


# Values of the wrong kind: each was taken (a string as its number, 2.5 as 2, true as 1.0, a negative or NaN
# scaling that turned the routed output around or into NaN, num_hidden_layers 0 with layer 0 loading) or failed
# with a bare float() message. The error names the key and what it must be.
@pytest.mark.parametrize("source, key, value, match", [
    ("deepseek_dir", "routed_scaling_factor", -1.0, r"routed_scaling_factor=-1\.0 must be a finite number > 0"),
    ("deepseek_dir", "routed_scaling_factor", 0, r"routed_scaling_factor=0 must be a finite number > 0"),
    ("deepseek_dir", "routed_scaling_factor", float("nan"), r"routed_scaling_factor=nan must be a finite number"),
    ("deepseek_dir", "routed_scaling_factor", float("inf"), r"routed_scaling_factor=inf must be a finite number"),
    ("deepseek_dir", "routed_scaling_factor", True, r"routed_scaling_factor=True must be a finite number"),
    ("deepseek_dir", "routed_scaling_factor", "abc", r"routed_scaling_factor='abc' must be a finite number"),
    ("qwen_dir", "hidden_size", "256", r"hidden_size='256' is not an integer"),
    ("qwen_dir", "hidden_size", 256.5, r"hidden_size=256\.5 is not an integer"),
    ("qwen_dir", "num_experts_per_tok", 2.5, r"num_experts_per_tok=2\.5 is not an integer"),
    ("qwen_dir", "num_experts_per_tok", True, r"num_experts_per_tok=True is not an integer"),
    ("qwen_dir", "norm_topk_prob", "yes", r"norm_topk_prob='yes' is not true or false"),
    ("qwen_dir", "num_hidden_layers", 0, r"num_hidden_layers=0 must be >= 1"),
    ("qwen_dir", "num_hidden_layers", 1.5, r"num_hidden_layers=1\.5 is not an integer"),
    ("deepseek_dir", "n_shared_experts", 1.5, r"n_shared_experts=1\.5 is not an integer"),
    ("qwen_dir", "rms_norm_eps", -1e-6, r"rms_norm_eps=-1e-06 must be a finite number > 0"),
], ids=lambda v: str(v)[:24])
def test_config_values_of_the_wrong_kind_are_named(source, key, value, match, request, tmp_path):
    d = _copy(request.getfixturevalue(source), tmp_path, lambda c: c.update({key: value}))
    with pytest.raises(CheckpointError, match=match):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")


def test_integral_floats_and_nulls_in_config_still_load(qwen_dir, tmp_path):
    """What some writers emit: 8.0 for an integer, null for a key with a default."""
    d = _copy(qwen_dir, tmp_path, lambda c: c.update(num_experts=float(c["num_experts"]), norm_topk_prob=None))
    block = SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")
    assert block.config.num_experts == 8 and block.config.norm_topk_prob is True


def test_router_shape_mismatch_names_key(tmp_path):
    d = write_checkpoint(str(tmp_path / "c"), **dict(QWEN, layers=1))
    other = write_checkpoint(str(tmp_path / "o"), **dict(QWEN, layers=1, hidden=384))
    from safetensors.numpy import load_file, save_file
    t = load_file(os.path.join(d, "model.safetensors"))
    t["model.layers.0.mlp.gate.weight"] = load_file(os.path.join(other, "model.safetensors"))[
        "model.layers.0.mlp.gate.weight"]
    save_file(t, os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate\.weight.*\(8, 384\).*\(8, 256\)"):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")


def test_layer_out_of_range(qwen_dir):
    with pytest.raises(CheckpointError, match="layer_index=5"):
        SparseMoeBlock.from_checkpoint(qwen_dir, 5, backend="cpu")


@pytest.mark.parametrize("bad", ["1", 1.0, True, None])
def test_layer_index_that_is_not_an_integer_is_named(qwen_dir, bad):
    """(was "'<' not supported between instances of 'str' and 'int'" for "1", and layer 1 for True)"""
    with pytest.raises(TypeError, match=r"layer_index: expected an integer, got "):
        SparseMoeBlock.from_checkpoint(qwen_dir, bad, backend="cpu")


def test_route_refuses_a_dtype_it_cannot_compute_in(qwen_dir):
    """route(dtype=) is the router's arithmetic: an integer dtype gave integer logits and meaningless experts."""
    block = SparseMoeBlock.from_checkpoint(qwen_dir, 0, backend="cpu")
    h = _hidden(2)
    for bad in (np.int32, np.float16, "int64"):
        with pytest.raises(ValueError, match=r"dtype: the router computes in float32 or float64, got "):
            block.route(h, dtype=bad)
    ids32, _ = block.route(h, dtype=np.float32)
    ids64, _ = block.route(h, dtype=np.float64)
    assert ids32.shape == (2, block.config.top_k) and np.array_equal(np.sort(ids32, 1), np.sort(ids64, 1))


def test_index_points_to_missing_shard(deepseek_dir, tmp_path):
    d = _copy(deepseek_dir, tmp_path)
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")


def test_invalid_deepseek_grouping_config():
    with pytest.raises(CheckpointError, match="n_group"):
        MoeConfig.from_dict({"model_type": "deepseek_v3", "hidden_size": 256, "n_routed_experts": 8,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_group": 3})


# ------------------------------------------------------------------------------ reader and generator
def test_bf16_router_weights_are_read(tmp_path):
    vals = np.array([[1.5, -2.0], [0.25, 3.0]], np.float32)
    raw = (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, len(raw)]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + raw)
    got = Checkpoint(str(tmp_path))["w"]
    assert got.dtype == np.float32 and np.array_equal(got, vals)


def test_sharding_does_not_change_tensors(tmp_path):
    kw = dict(DEEPSEEK, layers=1, experts=4, n_group=2, topk_group=1)
    a = Checkpoint(write_checkpoint(str(tmp_path / "a"), **dict(kw, shards=1)))
    b = Checkpoint(write_checkpoint(str(tmp_path / "b"), **dict(kw, shards=3)))
    assert os.path.exists(tmp_path / "b" / "model.safetensors.index.json")
    assert set(a.keys()) == set(b.keys())
    for k in a.keys():
        assert np.array_equal(a[k], b[k]), k
    # Rewriting a sharded directory unsharded must not leave the old index shadowing the new file.
    write_checkpoint(str(tmp_path / "b"), **dict(kw, shards=1, seed=99))
    assert sorted(os.listdir(tmp_path / "b")) == ["config.json", "model.safetensors"]


def test_config_json_uses_hf_names(qwen_dir, deepseek_dir):
    with open(os.path.join(qwen_dir, "config.json")) as f:
        q = json.load(f)
    assert q["architectures"] == ["Qwen3MoeForCausalLM"] and q["num_experts"] == 8
    with open(os.path.join(deepseek_dir, "config.json")) as f:
        d = json.load(f)
    assert d["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (d["n_routed_experts"], d["n_group"], d["topk_group"], d["n_shared_experts"]) == (8, 2, 1, 1)
    assert d["scoring_func"] == "sigmoid"


def test_tool_writes_loadable_checkpoint(tmp_path):
    out = str(tmp_path / "tool")
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_exl3_moe_checkpoint"), "--arch",
                        "deepseek_v3", "--hidden", "128", "--intermediate", "128", "--experts", "4", "--top-k", "2",
                        "--n-group", "2", "--topk-group", "2", "--shared-experts", "2", "--bits", "3",
                        "--codebook", "mcg", "--shards", "2", "--out", out],
                       capture_output=True, text=True, timeout=60, env=python_env())
    assert r.returncode == 0, r.stderr
    block = SparseMoeBlock.from_checkpoint(out, 0, backend="cpu")
    assert block.up[0].bits == 3 and block.up[0].codebook == "mcg"
    assert block.shared["up"].n == 256  # moe_intermediate_size x n_shared_experts
    _check_block(block, _hidden(3, H=128))


def test_tool_rejects_bad_shape(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_exl3_moe_checkpoint"), "--hidden", "200",
                        "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=60,
                       env=python_env())
    assert r.returncode == 2 and "hidden_size=200" in r.stderr


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_write_checkpoint_names_a_bad_seed(tmp_path, seed):
    """(-1 failed in numpy with "expected non-negative integer", naming nothing)"""
    with pytest.raises(ValueError, match=r"seed: expected an integer >= 0, got "):
        write_checkpoint(str(tmp_path / "c"), **dict(QWEN, seed=seed))
    assert not os.path.exists(tmp_path / "c")


def test_deepseek_missing_keys_take_hf_defaults():
    c = MoeConfig.from_dict({"model_type": "deepseek_v3", "hidden_size": 256, "n_routed_experts": 64,
                             "num_experts_per_tok": 8, "moe_intermediate_size": 128})
    assert (c.n_group, c.topk_group, c.routed_scaling_factor, c.n_shared_experts, c.first_k_dense_replace,
            c.norm_topk_prob) == (8, 4, 2.5, 1, 3, True)
    assert not c.is_moe_layer(2) and c.is_moe_layer(3)


@needs_vulkan_ops
def test_exl3_moe_mlp_loads_a_sharded_model_directory(device, deepseek_dir):
    """Exl3MoeMlp.from_safetensors takes the model directory itself (here 2 shards + index): the same experts as
    the checkpoint reader gives, and a forward within tolerance of the float64 reference on them."""
    from vkmoe import Exl3MoeMlp
    from vkmoe.exl3 import load_moe_experts, reference

    prefix = "model.layers.0.mlp"
    assert os.path.exists(os.path.join(deepseek_dir, "model.safetensors.index.json"))
    experts = load_moe_experts(Checkpoint(deepseek_dir), prefix)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, DEEPSEEK["hidden"])).astype(np.float16)
    ids = np.array([[0, 5], [7, 2], [3, 4]], np.int32)
    w = np.array([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5]], np.float32)
    with Exl3MoeMlp.from_safetensors(device, deepseek_dir, prefix, num_experts=DEEPSEEK["experts"]) as moe:
        assert moe.E == DEEPSEEK["experts"]
        y = moe(x, ids, w)
    ref = reference.moe_forward(x, ids, w, experts["gate"], experts["up"], experts["down"], activation="silu")
    assert np.isfinite(y).all()
    assert np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref ** 2)) < 3e-3
    with pytest.raises(CheckpointError, match="not found|no keys"):
        Exl3MoeMlp.from_safetensors(device, deepseek_dir, "model.layers.9.mlp")
