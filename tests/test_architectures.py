"""Every supported MoE architecture end to end: a generated checkpoint through SparseMoeBlock on the CPU tier
and on Vulkan against the float64 block; the sqrtsp / sqrtsp_hash routers (DeepSeek-V4), act_limit, the
shared-expert variants, config errors that name their key, and the refused half-integer bit width."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vkmoe.exl3 import Exl3Tensor
from vkmoe.models import (SPECS, CheckpointError, MissingTensorError, MoeConfig, SparseMoeBlock, sqrt_softplus,
                          sqrtsp_hash, sqrtsp_topk, write_checkpoint)
from vkmoe.models.checkpoint import checkpoint_config
from subproc import python_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H = 256
TOL = 3e-3  # relative RMS vs the float64 block (the bar)

# One small generated checkpoint per architecture. DeepSeek-V4 has two layers: 0 hash-routed, 1 sqrtsp; its
# swiglu_limit of 1.5 clamps a good share of the activations, so a block that ignored it would fail.
ARCHS = {
    "mixtral": dict(experts=4, top_k=2),
    "qwen3_moe": dict(experts=4, top_k=2),
    "qwen3_next": dict(experts=4, top_k=2, shared_intermediate=256),
    "deepseek_v3": dict(experts=8, top_k=2, n_group=2, topk_group=1, shared_experts=1),
    "deepseek_v4": dict(experts=8, top_k=2, layers=2, hash_layers=1, act_limit=1.5, shared_experts=1,
                        routed_scaling_factor=1.5),
    "glm4_moe": dict(experts=8, top_k=2, shared_experts=1, routed_scaling_factor=1.0),
    "dots1": dict(experts=4, top_k=2, shared_experts=2, routed_scaling_factor=1.0),
    "minimax_m2": dict(experts=4, top_k=2, routed_scaling_factor=1.0),
    "nemotron_h": dict(experts=4, top_k=2, shared_intermediate=128),
    # NemotronH LatentMoE: the routed experts at width 128 (hidden 256) behind fc1/fc2_latent_proj.
    "nemotron_h_latent": dict(arch="nemotron_h", experts=4, top_k=2, shared_intermediate=128, latent=128),
    # Step-3.5: per-layer limits (routed 1.5, shared 0.75), both tight enough to clamp.
    "step3p5": dict(experts=4, top_k=2, shared_intermediate=128, act_limit=1.5, routed_scaling_factor=3.0),
    # Laguna: interm_div 128 on the routed experts.
    "laguna": dict(experts=4, top_k=2, shared_intermediate=128, routed_scaling_factor=2.0),
    # Gemma 4: dense MLP of its own width as the shared expert, per_expert_scale, four extra RMSNorms.
    "gemma4": dict(experts=4, top_k=2, shared_intermediate=256),
    "qwen3_vl_moe": dict(experts=4, top_k=2),
    "glm4v_moe": dict(experts=4, top_k=2, shared_experts=1, routed_scaling_factor=2.5),
    # Qwen3.5: Qwen3-Next's gated shared expert under model.language_model.
    "qwen3_5_moe": dict(experts=4, top_k=2, shared_intermediate=128),
    "solar_open": dict(experts=4, top_k=2, shared_experts=1, routed_scaling_factor=2.0),
    "hy_v3": dict(experts=4, top_k=2, shared_experts=1, routed_scaling_factor=2.826),
    # AfMoE: group-limited sigmoid routing (two groups, one kept) and one shared expert.
    "afmoe": dict(experts=8, top_k=2, n_group=2, topk_group=1, shared_experts=1, routed_scaling_factor=1.5),
    "ernie4_5_moe": dict(experts=4, top_k=2, shared_experts=1),
    "lfm2_moe": dict(experts=4, top_k=2, routed_scaling_factor=1.0),
    # Mistral 4: std routing with interm_div 128 and one shared expert.
    "mistral4": dict(experts=4, top_k=2, shared_experts=1),
    "step3p7": dict(experts=4, top_k=2, shared_intermediate=128, act_limit=1.5, routed_scaling_factor=3.0),
}
BLOCKS = [(arch, layer) for arch, kw in ARCHS.items() for layer in range(kw.get("layers", 1))]


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv("VKMOE_BACKEND", raising=False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {name: write_checkpoint(str(root / name), **dict(dict(arch=name, hidden=H, intermediate=128, seed=i),
                                                            **kw))
            for i, (name, kw) in enumerate(ARCHS.items())}


def _rms(a):
    return float(np.sqrt(np.mean(np.square(np.asarray(a, np.float64)))))


def _inputs(block, m=8, seed=0):
    """(hidden, call kwargs): token ids for a hash layer, the residual stream (rms ~3) for Gemma 4."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((m, H)).astype(np.float16)
    kw = {}
    if block.router == "sqrtsp_hash":
        kw["input_ids"] = rng.integers(0, block.config.vocab_size, m)
    if block.norms is not None:
        kw["residual"] = (3 * rng.standard_normal((m, H))).astype(np.float32)
    return hidden, kw


def _check(block, m=8, seed=0):
    hidden, kw = _inputs(block, m, seed)
    ids32, w32 = block.route(hidden, **kw)
    ids64, w64 = block.route(hidden.astype(np.float64), dtype=np.float64, **kw)
    assert np.array_equal(ids32, ids64), "fp32 routing differs from the float64 reference (no ties in random data)"
    # Gemma 4's router input is rounded to fp16 (as exllamav3 does) in the block, exact in the reference.
    np.testing.assert_allclose(w32, w64, rtol=2e-3 if block.norms is not None else 1e-5, atol=1e-6)
    out = np.full((m, H), np.nan, np.float32)  # poisoned: the block must replace every element
    out[...] = block(hidden, **kw)
    assert np.all(np.isfinite(out))
    want = block.reference(hidden, **kw)
    assert 0.05 < _rms(want) < 4.0, f"generated checkpoint should give outputs of rms O(0.1-1), got {_rms(want)}"
    err = _rms(out - want) / _rms(want)
    assert err < TOL, f"relative RMS error {err:.2e}"
    return out, want


# ------------------------------------------------------------------------------------------- blocks
@pytest.mark.parametrize("arch,layer", BLOCKS)
def test_block_cpu(ckpts, arch, layer):
    block = SparseMoeBlock.from_checkpoint(ckpts[arch], layer, backend="cpu")
    _check(block, seed=layer)
    assert block.last_run["mode"] == "cpu"


@pytest.mark.parametrize("arch,layer", BLOCKS)
def test_block_vulkan(ckpts, arch, layer, device):
    block = SparseMoeBlock.from_checkpoint(ckpts[arch], layer, backend="vulkan", device=device)
    assert block.backend == "vulkan"
    _check(block, m=5, seed=10 + layer)
    if hasattr(block.moe, "close"):
        block.moe.close()


def test_routers_per_architecture(ckpts):
    want = {"mixtral": "std", "qwen3_moe": "std", "qwen3_next": "std", "deepseek_v3": "dots", "glm4_moe": "dots",
            "dots1": "dots", "minimax_m2": "dots", "nemotron_h": "dots", "step3p5": "dots", "gemma4": "std",
            "laguna": "dots", "qwen3_vl_moe": "std", "glm4v_moe": "dots", "qwen3_5_moe": "std", "solar_open": "dots",
            "hy_v3": "dots", "afmoe": "dots", "ernie4_5_moe": "std", "lfm2_moe": "dots", "mistral4": "std",
            "step3p7": "dots"}
    for arch, router in want.items():
        assert SparseMoeBlock.from_checkpoint(ckpts[arch], 0, backend="cpu").router == router, arch
    v4 = [SparseMoeBlock.from_checkpoint(ckpts["deepseek_v4"], i, backend="cpu") for i in (0, 1)]
    assert [b.router for b in v4] == ["sqrtsp_hash", "sqrtsp"]
    assert v4[0].tid2eid is not None and v4[1].e_bias is not None


# ------------------------------------------------------------------------------------------- routers
def test_sqrt_softplus_matches_formula_and_threshold():
    x = np.array([-50.0, -3.0, 0.0, 1.5, 19.5, 20.5, 80.0])
    want = np.sqrt(np.where(x > 20, x, np.log1p(np.exp(x))))
    np.testing.assert_allclose(sqrt_softplus(x), want, rtol=1e-15)
    assert np.all(sqrt_softplus(np.array([-200.0, 800.0], np.float32)) >= 0)  # no overflow, no NaN
    assert np.all(np.isfinite(sqrt_softplus(np.array([-200.0, 800.0], np.float32))))


def test_sqrtsp_bias_selects_but_does_not_weight():
    logits = np.array([[0.5, 0.4, 0.3, 0.2]])
    ids, w = sqrtsp_topk(logits, np.array([0.0, 0.0, 0.0, 1.0]), 2, routed_scaling_factor=1.5)
    assert ids.tolist() == [[3, 0]]
    s = sqrt_softplus(logits[0, [3, 0]])
    np.testing.assert_allclose(w[0], 1.5 * s / s.sum(), rtol=1e-12)
    ids, _ = sqrtsp_topk(logits, None, 2, routed_scaling_factor=1.0)
    assert ids.tolist() == [[0, 1]]


def test_sqrtsp_ties_break_toward_lower_index():
    ids, w = sqrtsp_topk(np.zeros((2, 6)), np.zeros(6), 3, routed_scaling_factor=1.0)
    assert ids.tolist() == [[0, 1, 2]] * 2
    np.testing.assert_allclose(w, 1 / 3, rtol=1e-12)


def test_sqrtsp_hash_takes_ids_in_table_order():
    logits = np.array([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.0, 0.0]])
    table = np.array([[2, 1], [3, 0]])
    ids, w = sqrtsp_hash(logits, table, routed_scaling_factor=2.0)
    assert ids.tolist() == table.tolist()  # no re-sorting by score
    s = sqrt_softplus(logits)
    np.testing.assert_allclose(w[0], 2.0 * s[0, [2, 1]] / s[0, [2, 1]].sum(), rtol=1e-12)
    np.testing.assert_allclose(w.sum(-1), 2.0, rtol=1e-12)


def test_hash_layer_routes_by_token_id(ckpts):
    block = SparseMoeBlock.from_checkpoint(ckpts["deepseek_v4"], 0, backend="cpu")
    hidden = _inputs(block, 4)[0]
    tok = np.array([5, 5, 9, 0])
    ids, _ = block.route(hidden, tok)
    assert ids.tolist() == block.tid2eid[tok].tolist()
    # Same token id, different hidden -> same experts; the gate only sets the weights.
    ids2, _ = block.route(hidden[::-1].copy(), tok)
    assert ids2.tolist() == ids.tolist()


def test_hash_layer_needs_input_ids(ckpts):
    block = SparseMoeBlock.from_checkpoint(ckpts["deepseek_v4"], 0, backend="cpu")
    hidden = _inputs(block, 3)[0]
    with pytest.raises(ValueError, match="input_ids.*hash"):
        block(hidden)
    with pytest.raises(ValueError, match=r"input_ids: expected shape \(3,\)"):
        block(hidden, input_ids=np.zeros(2, np.int64))
    with pytest.raises(ValueError, match=r"input_ids: expected token ids in \[0, 64\)"):
        block(hidden, input_ids=np.array([0, 1, 64]))
    with pytest.raises(TypeError, match="input_ids: expected an integer array"):
        block(hidden, input_ids=np.zeros(3, np.float32))


def test_missing_tid2eid_names_key(tmp_path):
    d = write_checkpoint(str(tmp_path / "c"), arch="deepseek_v4", hidden=128, intermediate=128, experts=4, top_k=2,
                         layers=2, hash_layers=1, omit=["layers.0.ffn.gate.tid2eid"])
    with pytest.raises(MissingTensorError, match=r"layers\.0\.ffn\.gate\.tid2eid.*num_hash_layers"):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")
    SparseMoeBlock.from_checkpoint(d, 1, backend="cpu")  # the normal layer does not need it


# --------------------------------------------------------------------------- act_limit and shared variants
def test_act_limit_reaches_routed_and_shared_experts(ckpts):
    block = SparseMoeBlock.from_checkpoint(ckpts["deepseek_v4"], 1, backend="cpu")
    assert block.act_limit == 1.5 and block.moe.act_limit == 1.5
    hidden, kw = _inputs(block, 8)
    limited = block.reference(hidden, **kw)
    block.act_limit = block.shared_act_limit = 0.0
    unlimited = block.reference(hidden, **kw)
    assert _rms(limited - unlimited) / _rms(unlimited) > 0.02, "swiglu_limit 1.5 should clamp these activations"


def test_step3p5_per_layer_limits(ckpts, tmp_path):
    block = SparseMoeBlock.from_checkpoint(ckpts["step3p5"], 0, backend="cpu")
    assert (block.act_limit, block.shared_act_limit, block.moe.act_limit) == (1.5, 0.75, 1.5)
    hidden = _inputs(block, 8)[0]
    both = block.reference(hidden)
    block.shared_act_limit = 0.0
    routed_only = block.reference(hidden)
    assert _rms(both - routed_only) / _rms(both) > 0.01, "the shared expert's own limit should clamp"
    # Per layer: a config with different limits per layer gives each layer its own.
    cfg = dict(checkpoint_config("step3p5", layers=3), swiglu_limits=[0, 7, None], swiglu_limits_shared=[1, 2, 3])
    c = MoeConfig.from_dict(cfg)
    assert [c.act_limits_for(i) for i in range(3)] == [(0.0, 1.0), (7.0, 2.0), (0.0, 3.0)]
    with pytest.raises(CheckpointError, match="swiglu_limits_shared has 2 entries but num_hidden_layers=3"):
        MoeConfig.from_dict(dict(cfg, swiglu_limits_shared=[1, 2]))
    with pytest.raises(CheckpointError, match="missing 'swiglu_limits'"):
        MoeConfig.from_dict({k: v for k, v in cfg.items() if k != "swiglu_limits"})
    c = MoeConfig.from_dict(dict(cfg, moe_layers_enum="1,2"))
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_shared_expert_gate_scales_shared_output(ckpts):
    block = SparseMoeBlock.from_checkpoint(ckpts["qwen3_next"], 0, backend="cpu")
    assert block.shared_gate_weight.shape == (1, H) and block.shared["gate"] is not None
    hidden = _inputs(block, 6)[0]
    gated = block(hidden)
    w = block.shared_gate_weight
    block.shared_gate_weight = None
    ungated = block(hidden)
    assert _rms(gated - ungated) / _rms(ungated) > 0.05
    block.shared_gate_weight = w  # the gate restored gives the gated output again
    assert _rms(block(hidden) - gated) == 0.0


def test_nemotron_h_gateless_relu2(ckpts):
    block = SparseMoeBlock.from_checkpoint(ckpts["nemotron_h"], 0, backend="cpu")
    assert block.gate is None and block.activation == "relu2"
    assert block.shared["gate"] is None and block.shared["up"].n == 128
    assert set(block.shared_ops) == {"up", "down"}


def test_gemma4_norms_per_expert_scale_and_residual(ckpts):
    block = SparseMoeBlock.from_checkpoint(ckpts["gemma4"], 0, backend="cpu")
    assert block.activation == "gelu" and block.shared["up"].n == 256 and block.per_expert_scale.shape == (4,)
    hidden, kw = _inputs(block, 6)
    ids, w = block.route(hidden, **kw)
    scale = block.per_expert_scale
    np.testing.assert_allclose((w / scale[ids]).sum(-1), 1.0, rtol=1e-5)  # renormalised, then scaled per expert
    # The routed experts read the residual, not hidden: changing only the residual changes the routed part.
    out = block(hidden, **kw)
    out2 = block(hidden, residual=kw["residual"][::-1].copy())
    assert _rms(out - out2) > 0.1
    # Both halves are RMS-normalised before the sum: each contributes rms ~ |norm weight| ~ 1.
    assert 1.0 < _rms(out) < 2.0
    with pytest.raises(ValueError, match="residual: gemma4 routes"):
        block(hidden)
    with pytest.raises(ValueError, match=r"residual: expected a float array of the hidden's shape \(6, 256\)"):
        block(hidden, residual=np.zeros((6, 128), np.float32))


def test_gemma4_config_errors():
    cfg = checkpoint_config("gemma4")
    cfg["text_config"]["enable_moe_block"] = False
    with pytest.raises(CheckpointError, match="enable_moe_block is not true"):
        MoeConfig.from_dict(cfg)
    with pytest.raises(CheckpointError, match="missing 'text_config'"):
        MoeConfig.from_dict({k: v for k, v in cfg.items() if k != "text_config"})


def _load_without(tmp_path, arch, key, why, experts, top_k):
    """A checkpoint of `arch` written without tensor `key` fails to load with an error naming the key and `why`."""
    d = write_checkpoint(str(tmp_path / arch), arch=arch, hidden=128, intermediate=128, experts=experts,
                         top_k=top_k, omit=[key])
    with pytest.raises(MissingTensorError, match=key.replace(".", r"\.") + ".*" + why):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")


def test_gemma4_missing_norm_names_key(tmp_path):
    _load_without(tmp_path, "gemma4", "model.language_model.layers.0.post_feedforward_layernorm_1.weight",
                  "shared_out RMSNorm", experts=2, top_k=1)


def test_laguna_interm_div_is_exact(ckpts):
    from vkmoe.models import Checkpoint, load_block_tensors
    c = MoeConfig.from_file(ckpts["laguna"])
    assert c.interm_div == 128.0 and c.mlp_only_layers == []  # the writer says so explicitly (default [0])
    tensors = load_block_tensors(Checkpoint(ckpts["laguna"]), c, 0)
    block = SparseMoeBlock(c, layer_index=0, backend="cpu", **tensors)
    for e, t in enumerate(tensors["up"]):
        assert np.array_equal(block.up[e].svh.astype(np.float32) * 128, t.svh.astype(np.float32))
    c.interm_div = 0.0
    plain = SparseMoeBlock(c, layer_index=0, backend="cpu", **tensors)
    hidden = _inputs(block, 6)[0]
    divided, undivided = block.reference(hidden), plain.reference(hidden)
    assert _rms(divided - undivided) / _rms(undivided) < 1e-12  # the same function in exact arithmetic
    assert _rms(block(hidden) - undivided) / _rms(undivided) < TOL
    assert MoeConfig.from_dict({k: v for k, v in checkpoint_config("laguna", layers=2).items()
                                if k != "mlp_only_layers"}).is_moe_layer(0) is False


def test_deepseek_v4_uses_native_names(ckpts):
    keys = set(json.load(open(os.path.join(ckpts["deepseek_v4"], "config.json"))))
    assert {"swiglu_limit", "num_hash_layers", "n_routed_experts", "vocab_size"} <= keys
    from vkmoe.models import Checkpoint
    k = set(Checkpoint(ckpts["deepseek_v4"]).keys())
    assert {"layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias", "layers.1.ffn.experts.0.w1.trellis",
            "layers.1.ffn.shared_experts.w2.trellis"} <= k
    assert "layers.0.ffn.gate.bias" not in k


# Tensor keys each architecture's block is read from, as exllamav3 names them (one layer-0 sample per role).
NEW_KEYS = {
    "qwen3_vl_moe": ["model.language_model.layers.0.mlp.gate.weight",
                     "model.language_model.layers.0.mlp.experts.3.down_proj.trellis"],
    "glm4v_moe": ["model.language_model.layers.0.mlp.gate.e_score_correction_bias",
                  "model.language_model.layers.0.mlp.shared_experts.up_proj.trellis"],
    "qwen3_5_moe": ["model.language_model.layers.0.mlp.shared_expert_gate.weight",
                    "model.language_model.layers.0.mlp.shared_expert.gate_proj.trellis"],
    "solar_open": ["model.layers.0.mlp.gate.e_score_correction_bias",
                   "model.layers.0.mlp.shared_experts.down_proj.suh"],
    "hy_v3": ["model.layers.0.mlp.router.gate.weight", "model.layers.0.mlp.expert_bias",
              "model.layers.0.mlp.shared_mlp.down_proj.trellis"],
    "afmoe": ["model.layers.0.mlp.router.gate.weight", "model.layers.0.mlp.expert_bias",
              "model.layers.0.mlp.shared_experts.gate_proj.trellis"],
    "ernie4_5_moe": ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_experts.up_proj.trellis"],
    "lfm2_moe": ["model.layers.0.feed_forward.gate.weight", "model.layers.0.feed_forward.expert_bias",
                 "model.layers.0.feed_forward.experts.0.w1.trellis"],
    "mistral4": ["model.language_model.layers.0.mlp.gate.weight",
                 "model.language_model.layers.0.mlp.shared_experts.down_proj.trellis"],
    "step3p7": ["model.layers.0.moe.router_bias", "model.layers.0.share_expert.gate_proj.trellis"],
}


@pytest.mark.parametrize("arch", sorted(NEW_KEYS))
def test_tensor_keys_as_exllamav3_names_them(ckpts, arch):
    from vkmoe.models import Checkpoint
    keys = set(Checkpoint(ckpts[arch]).keys())
    assert set(NEW_KEYS[arch]) <= keys, sorted(set(NEW_KEYS[arch]) - keys)
    block = SparseMoeBlock.from_checkpoint(ckpts[arch], 0, backend="cpu")
    assert (block.e_bias is not None) == bool(SPECS[arch].bias_keys)
    assert block.config.shared_intermediate_size == (0 if arch in ("qwen3_vl_moe", "lfm2_moe") else 128)
    assert (block.shared is not None) == bool(block.config.shared_intermediate_size)


def test_mistral4_interm_div_and_text_model_type(ckpts):
    c = MoeConfig.from_file(ckpts["mistral4"])
    assert (c.interm_div, c.spec.router, c.shared_intermediate_size) == (128.0, "std", 128)
    cfg = json.load(open(os.path.join(ckpts["mistral4"], "config.json")))
    assert (cfg["model_type"], cfg["text_config"]["model_type"]) == ("mistral3", "mistral4")
    # The same class with a dense text model is refused by name, naming the text model_type.
    dense = dict(cfg, text_config=dict(cfg["text_config"], model_type="ministral3"))
    with pytest.raises(CheckpointError, match=r"unsupported architecture.*'ministral3'.*only the MoE text model "
                                              r"text_config.model_type='mistral4'"):
        MoeConfig.from_dict(dense)


def test_mistral4_older_key_style(ckpts, tmp_path):
    from safetensors.numpy import load_file, save_file
    src = ckpts["mistral4"]
    d = str(tmp_path / "old")
    os.makedirs(d)
    t = load_file(os.path.join(src, "model.safetensors"))
    save_file({k.replace("model.language_model.", "language_model.model."): v for k, v in t.items()},
              os.path.join(d, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(d, "config.json"), "w") as g:
        g.write(f.read())
    new, old = (SparseMoeBlock.from_checkpoint(x, 0, backend="cpu") for x in (src, d))
    hidden = _inputs(new, 4)[0]
    assert old.config.shared_intermediate_size == 128 and np.array_equal(old.reference(hidden), new.reference(hidden))
    os.remove(os.path.join(d, "model.safetensors"))
    save_file({"unrelated.weight": np.zeros(2, np.float16)}, os.path.join(d, "model.safetensors"))
    with pytest.raises(MissingTensorError, match=r"model\.language_model\.layers\.0\.mlp\.gate\.weight"):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")  # neither style: the current one is named


@pytest.mark.parametrize("arch,key,value", [
    ("mistral4", "routed_scaling_factor", 2.0), ("mistral4", "n_group", 4), ("qwen3_5_moe", "norm_topk_prob", False),
    ("ernie4_5_moe", "moe_layer_interval", 2), ("ernie4_5_moe", "moe_gate_act", "sigmoid"),
    ("step3p7", "use_moe_router_bias", False), ("lfm2_moe", "norm_topk_prob", False)])
def test_values_exllamav3_asserts_are_checked(arch, key, value):
    cfg = checkpoint_config(arch)
    (cfg["text_config"] if SPECS[arch].text_config else cfg)[key] = value
    with pytest.raises(CheckpointError, match=f"{key}={value!r}: {arch} supports only {key}="):
        MoeConfig.from_dict(cfg)


def test_renamed_keys_and_defaults():
    base = {"hidden_size": 256, "moe_intermediate_size": 128}
    af = MoeConfig.from_dict(dict(base, model_type="afmoe", num_experts=8, num_experts_per_tok=2, num_dense_layers=2,
                                  route_scale=2.5, num_shared_experts=2, num_hidden_layers=4))
    assert (af.routed_scaling_factor, af.shared_intermediate_size, af.first_k_dense_replace) == (2.5, 256, 2)
    assert [af.is_moe_layer(i) for i in range(4)] == [False, False, True, True]
    assert MoeConfig.from_dict(dict(base, model_type="afmoe", num_experts=8,
                                    num_experts_per_tok=2)).shared_intermediate_size == 0
    with pytest.raises(CheckpointError, match="score_func='softmax'; afmoe supports 'sigmoid'"):
        MoeConfig.from_dict(dict(base, model_type="afmoe", num_experts=8, num_experts_per_tok=2, score_func="softmax"))
    er = MoeConfig.from_dict(dict(base, model_type="ernie4_5_moe", moe_num_experts=8, moe_k=2,
                                  moe_num_shared_experts=2, moe_layer_start_index=1, num_hidden_layers=3))
    assert (er.top_k, er.shared_intermediate_size, [er.is_moe_layer(i) for i in range(3)]) == (2, 256,
                                                                                              [False, True, True])
    so = MoeConfig.from_dict(dict(base, model_type="solar_open", n_routed_experts=8, num_experts_per_tok=2))
    gv = MoeConfig.from_dict({"model_type": "glm4v_moe", "text_config": dict(base, n_routed_experts=8,
                                                                              num_experts_per_tok=2)})
    assert (so.routed_scaling_factor, so.first_k_dense_replace) == (2.0, 0)
    assert (gv.routed_scaling_factor, gv.first_k_dense_replace, gv.shared_intermediate_size) == (2.5, 3, 128)
    q35 = MoeConfig.from_dict({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                               "text_config": dict(base, num_experts=8, num_experts_per_tok=2)})
    assert (q35.arch, q35.shared_intermediate_size) == ("qwen3_5_moe", 512)
    lf = MoeConfig.from_dict(dict(base, model_type="lfm2_moe", num_experts=8, num_experts_per_tok=2))
    assert (lf.shared_intermediate_size, lf.routed_scaling_factor) == (0, 1.0)


def test_hy_v3_layer_types():
    base = {"model_type": "hy_v3", "hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8,
            "num_experts_per_tok": 2, "num_hidden_layers": 3}
    c = MoeConfig.from_dict(base)
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]  # first_k_dense_replace defaults to 1
    assert (c.routed_scaling_factor, c.shared_intermediate_size, c.norm_topk_prob) == (2.826, 128, True)
    c = MoeConfig.from_dict(dict(base, mlp_layer_types=["sparse", "dense", "sparse"]))
    assert [c.is_moe_layer(i) for i in range(3)] == [True, False, True]
    with pytest.raises(CheckpointError, match=r"mlp_layer_types=\['sparse', 'moe', 'dense'\]: expected one"):
        MoeConfig.from_dict(dict(base, mlp_layer_types=["sparse", "moe", "dense"]))
    with pytest.raises(CheckpointError, match="mlp_layer_types=.*num_hidden_layers=3"):
        MoeConfig.from_dict(dict(base, mlp_layer_types=["sparse"]))


def test_stacked_gate_up_source_layout_refused_by_name(tmp_path):
    from safetensors.numpy import load_file, save_file
    d = write_checkpoint(str(tmp_path / "g"), arch="gemma4", hidden=128, intermediate=128, experts=2, top_k=1)
    path = os.path.join(d, "model.safetensors")
    p = "model.language_model.layers.0.experts"
    t = {k: v for k, v in load_file(path).items() if not k.startswith(p + ".")}
    t[p + ".gate_up_proj"] = np.zeros((2, 256, 128), np.float16)  # HF's (E, 2I, H) stack
    save_file(t, path)
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj is a stacked expert tensor.*experts\.<e>\."
                                              r"up_proj\.trellis"):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")


def test_bias_flag_turns_the_selection_bias_on_and_off(tmp_path):
    from vkmoe.models.routing import router_logits
    d = write_checkpoint(str(tmp_path / "lf"), arch="lfm2_moe", hidden=128, intermediate=128, experts=8, top_k=2)
    assert SparseMoeBlock.from_checkpoint(d, 0, backend="cpu").e_bias is not None
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump(dict(cfg, use_expert_bias=False), open(cfg_path, "w"))
    block = SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")
    assert block.e_bias is None  # stored, but the config says the model does not use it (exllamav3 too)
    hidden = _inputs(block, 6)[0][:, :128].copy()
    ids, _ = block.route(hidden)
    logits = router_logits(hidden.astype(np.float64), block.router_weight.astype(np.float64), np.float64)
    assert np.array_equal(np.sort(ids, -1), np.sort(np.argsort(-logits, -1)[:, :2], -1))  # raw scores select
    _load_without(tmp_path, "hy_v3", "model.layers.0.mlp.expert_bias", "moe_router_enable_expert_bias=true",
                  experts=4, top_k=2)


def test_step3p7_reads_text_config(ckpts):
    c = MoeConfig.from_file(ckpts["step3p7"])
    assert (c.arch, c.act_limits_for(0), c.routed_scaling_factor) == ("step3p7", (1.5, 0.75), 3.0)
    cfg = json.load(open(os.path.join(ckpts["step3p7"], "config.json")))
    assert cfg["model_type"] == "step3p7" and "moe_layers_enum" in cfg["text_config"]


# ------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("arch", sorted(SPECS))
def test_config_names_missing_expert_count(arch):
    cfg = checkpoint_config(arch)
    keys = cfg["text_config"] if SPECS[arch].text_config else cfg
    del keys[SPECS[arch].experts_key]
    with pytest.raises(CheckpointError, match=f"missing '{SPECS[arch].experts_key}'.*{arch}"):
        MoeConfig.from_dict(cfg)
    cfg = checkpoint_config(arch)
    keys = cfg["text_config"] if SPECS[arch].text_config else cfg
    del keys[SPECS[arch].key("num_experts_per_tok")]
    with pytest.raises(CheckpointError, match=f"missing '{SPECS[arch].key('num_experts_per_tok')}'"):
        MoeConfig.from_dict(cfg)


def test_dots_configs_differ_only_in_defaults():
    base = {"hidden_size": 256, "num_experts_per_tok": 2, "moe_intermediate_size": 128}
    glm = MoeConfig.from_dict(dict(base, model_type="glm4_moe", n_routed_experts=8))
    dots = MoeConfig.from_dict(dict(base, model_type="dots1", n_routed_experts=8))
    mm = MoeConfig.from_dict({"model_type": "minimax_m2", "hidden_size": 256, "num_experts_per_tok": 2,
                              "num_local_experts": 8, "intermediate_size": 128})
    assert (glm.first_k_dense_replace, glm.routed_scaling_factor, glm.shared_intermediate_size) == (1, 1.0, 128)
    assert (dots.first_k_dense_replace, dots.n_group) == (0, 1)
    assert (mm.shared_intermediate_size, mm.routed_scaling_factor, mm.moe_intermediate_size) == (0, 1.0, 128)
    assert {c.spec.router for c in (glm, dots, mm)} == {"dots"}


def test_deepseek_v4_defaults():
    c = MoeConfig.from_dict({"model_type": "deepseek_v4", "hidden_size": 256, "n_routed_experts": 8,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 128, "vocab_size": 100})
    assert (c.num_hash_layers, c.act_limit, c.routed_scaling_factor, c.shared_intermediate_size) == (3, 10.0, 1.0, 128)
    assert [c.router_for(i) for i in (0, 2, 3)] == ["sqrtsp_hash", "sqrtsp_hash", "sqrtsp"]
    with pytest.raises(CheckpointError, match="num_hash_layers=3 needs 'vocab_size'"):
        MoeConfig.from_dict({"model_type": "deepseek_v4", "hidden_size": 256, "n_routed_experts": 8,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 128})
    with pytest.raises(CheckpointError, match="num_hash_layers=-1 must be >= 0"):
        MoeConfig.from_dict({"model_type": "deepseek_v4", "hidden_size": 256, "n_routed_experts": 8,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 128, "num_hash_layers": -1})


def test_nemotron_pattern_selects_moe_layers():
    cfg = dict(checkpoint_config("nemotron_h", layers=4), hybrid_override_pattern="M*EE")
    c = MoeConfig.from_dict(cfg)
    assert [c.is_moe_layer(i) for i in range(4)] == [False, False, True, True]
    with pytest.raises(CheckpointError, match="hybrid_override_pattern has 3 entries but num_hidden_layers=4"):
        MoeConfig.from_dict(dict(cfg, hybrid_override_pattern="MEE"))
    with pytest.raises(CheckpointError, match="missing 'hybrid_override_pattern'"):
        MoeConfig.from_dict({k: v for k, v in cfg.items() if k != "hybrid_override_pattern"})


def test_nemotron_latent_moe(ckpts):
    """LatentMoE: experts at width L between fc1 (H -> L) and fc2 (L -> H); router and shared expert at H. The
    routed part is not negligible next to the shared one (a block that skipped it would fail _check)."""
    block = SparseMoeBlock.from_checkpoint(ckpts["nemotron_h_latent"], 0, backend="cpu")
    assert block.config.moe_latent_size == 128 and block.config.expert_size == 128
    assert (block.latent["in"].k, block.latent["in"].n, block.latent["out"].k, block.latent["out"].n) == (H, 128,
                                                                                                        128, H)
    assert (block.up[0].k, block.down[0].n, block.shared["up"].k, block.router_weight.shape[1]) == (128, 128, H, H)
    assert "latent=128" in repr(block)
    hidden, _ = _inputs(block, 6)
    full = block.reference(hidden)
    saved, block.shared = block.shared, None
    routed = block.reference(hidden)
    block.shared = saved
    assert _rms(routed) > 0.2 * _rms(full)


@pytest.mark.parametrize("value,match", [(64, "moe_latent_size=64 is not a positive multiple of 128"),
                                         (-128, "moe_latent_size=-128 is not a positive multiple of 128"),
                                         ("x", "moe_latent_size='x' is not an integer")])
def test_nemotron_bad_latent_size(value, match):
    with pytest.raises(CheckpointError, match=match):
        MoeConfig.from_dict(dict(checkpoint_config("nemotron_h"), moe_latent_size=value))
    assert MoeConfig.from_dict(dict(checkpoint_config("nemotron_h"), moe_latent_size=None)).moe_latent_size == 0


def test_nemotron_latent_arguments_checked(ckpts):
    """SparseMoeBlock built from arrays: the latent projections are required with moe_latent_size, refused without
    it, and their shapes are checked (naming the role and both sizes)."""
    latent = MoeConfig.from_file(ckpts["nemotron_h_latent"])
    plain = MoeConfig.from_file(ckpts["nemotron_h"])
    t = SparseMoeBlock.from_checkpoint(ckpts["nemotron_h_latent"], 0, backend="cpu")
    args = dict(router_weight=t.router_weight, gate=None, up=t.up, down=t.down, e_score_correction_bias=t.e_bias,
                backend="cpu")
    with pytest.raises(CheckpointError, match="latent: moe_latent_size=128 needs"):
        SparseMoeBlock(latent, **args)
    with pytest.raises(CheckpointError, match=r"latent\['out'\]: expected an Exl3Tensor of 128x256 .*got 256x128"):
        SparseMoeBlock(latent, latent={"in": t.latent["in"], "out": t.latent["in"]}, **args)
    with pytest.raises(CheckpointError, match="latent: nemotron_h config has no moe_latent_size"):
        SparseMoeBlock(plain, latent=t.latent, **args)
    block = SparseMoeBlock(latent, latent=t.latent, **args)
    hidden, _ = _inputs(block, 4)
    assert _rms(block(hidden) - block.reference(hidden)) < TOL * _rms(block.reference(hidden))


@pytest.mark.parametrize("key", ["fc1_latent_proj", "fc2_latent_proj"])
def test_nemotron_missing_latent_tensor(tmp_path, key):
    path = write_checkpoint(str(tmp_path / "l"), arch="nemotron_h", hidden=H, intermediate=128, experts=4, top_k=2,
                            latent=128, omit=(f"backbone.layers.0.mixer.{key}",))
    with pytest.raises(MissingTensorError, match=f"backbone.layers.0.mixer.{key}.*LatentMoE projection"):
        SparseMoeBlock.from_checkpoint(path, 0, backend="cpu")


def test_nemotron_latent_shape_mismatch(tmp_path):
    """A config whose moe_latent_size disagrees with the stored tensors names the tensor and the key; latent
    projections given to a block without moe_latent_size, or to another architecture, are refused."""
    path = write_checkpoint(str(tmp_path / "l"), arch="nemotron_h", hidden=H, intermediate=128, experts=4, top_k=2,
                            latent=128)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump(dict(cfg, moe_latent_size=256), open(cfg_path, "w"))
    with pytest.raises(CheckpointError, match="fc1_latent_proj: shape 256x128 .* 256x256 .*moe_latent_size=256"):
        SparseMoeBlock.from_checkpoint(path, 0, backend="cpu")
    json.dump(dict(cfg, moe_latent_size=None), open(cfg_path, "w"))
    with pytest.raises(CheckpointError, match="up_proj: shape 128x128 .* 256x128"):  # experts at L, config says H
        SparseMoeBlock.from_checkpoint(path, 0, backend="cpu")
    with pytest.raises(ValueError, match="latent: qwen3_moe has no latent MoE"):
        checkpoint_config("qwen3_moe", latent=128)


def test_nemotron_gated_activation_is_inconsistent():
    with pytest.raises(CheckpointError, match="'silu' does not fit nemotron_h, whose experts are gateless"):
        MoeConfig.from_dict(dict(checkpoint_config("nemotron_h"), mlp_hidden_act="silu"))


@pytest.mark.parametrize("cls", ["GptOssForCausalLM", "Mistral3ForConditionalGeneration", "LlamaForCausalLM",
                                 "Qwen3_5MoeForCausalLM"])
def test_uncovered_architecture_refused_by_name(cls):
    with pytest.raises(CheckpointError, match=f"unsupported architecture.*{cls}"):
        MoeConfig.from_dict({"architectures": [cls], "model_type": "x", "hidden_size": 256})


# ------------------------------------------------------------------------------- half-integer bit widths
def test_half_integer_trellis_refused_naming_the_format():
    with pytest.raises(ValueError, match=r"16\*K\+8 is the half-integer EXL3 bit width \(4.5 bits"):
        Exl3Tensor(np.zeros((8, 8, 72), np.uint16), np.ones(128, np.float16), np.ones(128, np.float16))


def test_half_integer_checkpoint_refused_naming_key(tmp_path):
    from safetensors.numpy import load_file, save_file
    d = write_checkpoint(str(tmp_path / "c"), arch="mixtral", hidden=128, intermediate=128, experts=2, top_k=1)
    path = os.path.join(d, "model.safetensors")
    t = load_file(path)
    key = "model.layers.0.block_sparse_moe.experts.1.w3.trellis"
    t[key] = np.zeros(t[key].shape[:2] + (16 * 3 + 8,), np.int16)
    save_file(t, path)
    with pytest.raises(CheckpointError, match=r"experts\.1\.w3.*half-integer EXL3 bit width \(3.5"):
        SparseMoeBlock.from_checkpoint(d, 0, backend="cpu")


def test_half_integer_bits_refused_by_writer_and_tool(tmp_path):
    with pytest.raises(ValueError, match="bits: 4.5 is a half-integer EXL3 bit width"):
        write_checkpoint(str(tmp_path / "w"), bits=4.5)
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_exl3_moe_checkpoint"), "--bits", "2.5",
                        "--out", str(tmp_path / "t")], capture_output=True, text=True, timeout=60,
                       env=python_env())
    assert r.returncode == 2 and "half-integer" in r.stderr


# ------------------------------------------------------------------------------------------- tool
@pytest.mark.parametrize("arch", sorted(SPECS))
def test_tool_writes_every_architecture(tmp_path, arch):
    out = str(tmp_path / arch)
    args = ["--arch", arch, "--hidden", "128", "--intermediate", "128", "--experts", "4", "--top-k", "2",
            "--bits", "2", "--out", out]
    if arch == "deepseek_v4":
        args += ["--layers", "2", "--hash-layers", "1", "--act-limit", "4"]
    if arch == "nemotron_h":
        args += ["--hidden", "256", "--latent", "128"]
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_exl3_moe_checkpoint")] + args,
                       capture_output=True, text=True, timeout=60, env=python_env())
    assert r.returncode == 0, r.stderr
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["model_type"] == SPECS[arch].config_model_type
    assert cfg["architectures"] == list(SPECS[arch].hf_classes[:1])
    layers = (cfg["text_config"] if SPECS[arch].text_config else cfg)["num_hidden_layers"]
    block = SparseMoeBlock.from_checkpoint(out, layers - 1, backend="cpu")
    assert block.up[0].bits == 2
    if arch == "nemotron_h":
        assert block.config.moe_latent_size == 128 and block.latent["out"].n == 256
    if arch == "deepseek_v4":
        assert block.act_limit == 4.0 and SparseMoeBlock.from_checkpoint(out, 0, backend="cpu").router == "sqrtsp_hash"
