"""exllamav3-format model directories: a lazy reader (single or sharded safetensors) and a generator of random,
valid EXL3 MoE checkpoints for tests and demos (`tools/make_exl3_moe_checkpoint` is a thin wrapper)."""
from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np

from ..exl3 import save_exl3_tensor
from ..exl3.decode import codebook_table
from ..exl3.synthetic import random_exl3_tensor
from ..exl3.checkpoint_dir import INDEX_NAME, Checkpoint, open_checkpoint  # noqa: F401 (re-exported)
from .config import SPECS, MoeConfig

__all__ = ["Checkpoint", "open_checkpoint", "write_checkpoint", "checkpoint_config"]

# ------------------------------------------------------------------------------------------- generator
_ARCH_CLASS = {s.name: s.hf_classes[0] for s in SPECS.values()}
_NATURAL_ACT = {"nemotron_h": "relu2", "gemma4": "gelu_pytorch_tanh"}  # HF act names; silu elsewhere


def checkpoint_config(arch="qwen3_moe", hidden=256, intermediate=128, experts=8, top_k=2, layers=1, bits=4,
                      codebook="mul1", n_group=1, topk_group=1, shared_experts=None, hidden_act=None,
                      norm_topk_prob=True, routed_scaling_factor=2.5, act_limit=None, hash_layers=None,
                      vocab_size=64, shared_intermediate=None, latent=None) -> dict:
    """The config.json dict write_checkpoint writes (HF names; every key that has an architecture default is
    written explicitly). `shared_experts`: n_shared_experts where the architecture counts them (DeepSeek,
    GLM, dots1; default 1); `shared_intermediate`: the shared MLP's width where it is its own key (Qwen3-Next,
    NemotronH, Step-3.5; default `intermediate`). `act_limit`: DeepSeek-V4 swiglu_limit, or Step-3.5's routed
    limit of every layer, its shared limit being half of it (default 10.0, HF's); `hash_layers`: DeepSeek-V4
    num_hash_layers (default min(1, layers - 1): one hash layer when there are two); `latent`: NemotronH's
    moe_latent_size (LatentMoE: the routed experts at that width behind fc1/fc2_latent_proj; default none)."""
    if arch not in SPECS:
        raise ValueError(f"arch: expected one of {', '.join(SPECS)}, got {arch!r}")
    spec = SPECS[arch]
    if latent is not None and not spec.latent_key:
        raise ValueError(f"latent: {arch} has no latent MoE (only "
                         + ", ".join(s.name for s in SPECS.values() if s.latent_key) + " has)")
    gateless = spec.expert_keys[0] is None
    cfg = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": spec.config_model_type,
        "hidden_size": hidden,
        spec.experts_key: experts,
        spec.intermediate_key: intermediate,
        spec.key("num_experts_per_tok"): top_k,
        "num_hidden_layers": layers,
        "mlp_hidden_act" if gateless else spec.key("hidden_act"): hidden_act or _NATURAL_ACT.get(arch, "silu"),
        spec.key("norm_topk_prob"): bool(norm_topk_prob),
        "vocab_size": vocab_size,
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "exl3", "bits": float(bits), "codebook": codebook,
                                "generated_by": "vkmoe.models.write_checkpoint (random weights)"},
    }
    if spec.intermediate_key != "intermediate_size":
        cfg["intermediate_size"] = intermediate * 4  # the dense layers' width (unused by the MoE block)
    if spec.layer_rule == "sparse_step":
        cfg.update({"decoder_sparse_step": 1, "mlp_only_layers": []})
    if spec.layer_rule == "pattern":
        cfg["hybrid_override_pattern"] = "E" * layers
    if spec.layer_rule == "first_k_dense":
        cfg.update({spec.key("first_k_dense_replace"): 0, spec.key("moe_layer_freq"): 1})
    if spec.layer_rule == "mlp_types":  # Hy3: the per-layer list wins over first_k_dense_replace
        cfg.update({"first_k_dense_replace": 0, "mlp_layer_types": ["sparse"] * layers})
    if spec.bias_flag:
        cfg[spec.bias_flag] = True
    if latent is not None:
        cfg[spec.latent_key] = latent
    if spec.shared == "n_shared":
        cfg[spec.key("n_shared_experts")] = 1 if shared_experts is None else shared_experts
    elif spec.shared:
        cfg[spec.shared] = intermediate if shared_intermediate is None else shared_intermediate
    if spec.layer_rule == "enum":
        # Step-3.5: every layer MoE here; per-layer limits, the shared expert's tighter than the routed ones.
        limit = 10.0 if act_limit is None else float(act_limit)
        cfg.update({"moe_layers_enum": ",".join(str(i) for i in range(layers)),
                    "swiglu_limits": [limit] * layers, "swiglu_limits_shared": [limit / 2] * layers})
    if spec.router == "dots":
        cfg.update({spec.key("scoring_func"): "sigmoid", "topk_method": "noaux_tc",
                    spec.key("routed_scaling_factor"): float(routed_scaling_factor),
                    "n_group": n_group, "topk_group": topk_group})
    if spec.router == "sqrtsp":
        cfg.update({"scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
                    "routed_scaling_factor": float(routed_scaling_factor),
                    "num_hash_layers": min(1, layers - 1) if hash_layers is None else hash_layers,
                    "swiglu_limit": 10.0 if act_limit is None else float(act_limit)})
    if spec.text_config:  # multimodal wrappers: the text model's keys nest under text_config
        outer = ("architectures", "model_type", "torch_dtype", "quantization_config")
        text = {k: v for k, v in cfg.items() if k not in outer}
        cfg = {k: cfg[k] for k in outer}
        cfg["text_config"] = dict(text, rms_norm_eps=1e-6)
        if spec.text_model_type:
            cfg["text_config"]["model_type"] = spec.text_model_type
        if spec.text_moe_flag:
            cfg["text_config"][spec.text_moe_flag] = True
    return cfg


def _random_exl3(rng, k, n, bits, codebook, sigma, out_scale):
    """Random trellis with scales giving y rms ≈ out_scale · rms(x) (vkmoe.exl3.synthetic; sigma is implied)."""
    return random_exl3_tensor(k, n, bits, codebook, out_scale, rng=rng)


def _plan(cfg, codebook, bits):
    """[(key, builder)] in file order; builder(rng) -> {name: array}. Each item has its own seed so tensor
    contents do not depend on how the items are split into shards."""
    config = MoeConfig.from_dict(cfg, source="write_checkpoint arguments")
    spec = config.spec
    H, I, E, W = config.hidden_size, config.moe_intermediate_size, config.num_experts, config.expert_size
    sigma = float(codebook_table(codebook).astype(np.float64).std())
    items = []

    def linear(key, k, n, out_scale):
        def build(rng):
            return save_exl3_tensor({}, key, _random_exl3(rng, k, n, bits, codebook, sigma, out_scale))
        return key, build, k * n * bits // 8 + 2 * (k + n)

    def mlp(prefix, names, width, io=H):
        for proj, name, k, n, scale in zip(("gate", "up", "down"), names, (io, io, width), (width, width, io),
                                           (1.0, 1.0, 0.5)):
            if name is not None:
                items.append(linear(f"{prefix}.{name}", k, n, scale))

    for layer in range(config.num_hidden_layers):
        p = spec.prefix.format(layer=layer)
        router = config.router_for(layer)

        def gate(rng, p=p, router=router):
            # std 1/sqrt(H): logits of O(1) for hidden of rms 1, so routing is neither uniform nor one-hot.
            out = {f"{p}.{spec.router_key}": (rng.standard_normal((E, H)) / math.sqrt(H)).astype(np.float16)}
            if router == "sqrtsp_hash":
                # Distinct experts per token id, in no particular order (the table's order is the slot order).
                table = np.argsort(rng.random((config.vocab_size, E)), axis=1)[:, :config.top_k]
                out[f"{p}.gate.tid2eid"] = table.astype(np.int32)
            elif spec.bias_keys:
                out[f"{p}.{spec.bias_keys[0]}"] = (rng.standard_normal(E) * 0.05).astype(np.float32)
            if spec.shared_gate:
                out[f"{p}.shared_expert_gate.weight"] = (rng.standard_normal((1, H)) / math.sqrt(H)).astype(
                    np.float16)
            if spec.per_expert_scale_key:
                out[f"{p}.{spec.per_expert_scale_key}"] = rng.uniform(0.5, 1.5, E).astype(np.float32)
            for _, key in spec.norm_keys:  # RMSNorm weights near 1 with some spread, as trained ones have
                out[f"{p}.{key}"] = rng.normal(1.0, 0.2, H).astype(np.float32)
            return out
        items.append((f"{p}.gate", gate, E * H * 2))
        if config.moe_latent_size:  # LatentMoE: the routed experts at width W = L between these two
            items.append(linear(f"{p}.fc1_latent_proj", H, W, 1.0))
            items.append(linear(f"{p}.fc2_latent_proj", W, H, 1.0))
        for e in range(E):
            mlp(f"{p}.experts.{e}", spec.expert_keys, I, io=W)
        if config.shared_intermediate_size:
            mlp(spec.shared_key_prefix(layer), spec.shared_keys, config.shared_intermediate_size)
    return items


def _check_bits(bits):
    if isinstance(bits, bool) or not isinstance(bits, (int, float, np.integer, np.floating)):
        raise TypeError(f"bits: expected a number 1..8, got {bits!r}")
    if bits != int(bits) and bits * 2 == int(bits * 2):
        raise ValueError(f"bits: {bits} is a half-integer EXL3 bit width (trellis last dimension 16*K+8), which "
                         "vkmoe does not support; use an integer 1..8")
    if bits != int(bits) or not 1 <= int(bits) <= 8:
        raise ValueError(f"bits: expected an integer 1..8, got {bits}")


class _Progress:
    def __init__(self, total, enabled, label):
        self.total, self.done, self.enabled, self.label = total, 0, enabled, label
        self._shown = -1

    def step(self, n):
        self.done += n
        if self.enabled:
            frac = self.done / max(1, self.total)
            if int(frac * 200) == self._shown:  # redraw every half percent, not per tensor
                return
            self._shown = int(frac * 200)
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac * 100:5.1f}% {self.done / 2**20:8.1f} MiB")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def write_checkpoint(out, arch="qwen3_moe", hidden=256, intermediate=128, experts=8, top_k=2, layers=1, bits=4,
                     codebook="mul1", n_group=1, topk_group=1, shared_experts=None, seed=0, shards=1,
                     hidden_act=None, norm_topk_prob=True, routed_scaling_factor=2.5, progress=False,
                     omit=(), act_limit=None, hash_layers=None, vocab_size=64, shared_intermediate=None,
                     latent=None) -> str:
    """Write a random, valid exllamav3-format MoE checkpoint (config.json + safetensors) to directory `out`.

    Block outputs have rms O(0.1-1) for hidden states of rms 1 and every fp16 intermediate stays far from
    overflow. `shards` > 1 splits the tensors into that many files plus model.safetensors.index.json.
    `progress`: True = a bar on stderr, None = one when the checkpoint exceeds 64 MiB (the tool's default), False
    (the default) = silent.
    `omit`: keys (exact, or a tensor prefix such as "...experts.3.up_proj") left out, to build broken
    checkpoints for tests.
    Returns `out`.
    """
    from safetensors.numpy import save_file

    _check_bits(bits)
    cfg = checkpoint_config(arch, hidden, intermediate, experts, top_k, layers, bits, codebook, n_group,
                            topk_group, shared_experts, hidden_act, norm_topk_prob, routed_scaling_factor,
                            act_limit, hash_layers, vocab_size, shared_intermediate, latent)
    MoeConfig.from_dict(cfg, source="write_checkpoint arguments")  # the same checks a reader applies
    if codebook not in ("mul1", "mcg", "3inst"):
        raise ValueError(f"codebook: expected mul1, mcg or 3inst, got {codebook!r}")
    if layers < 1 or shards < 1:
        raise ValueError(f"layers and shards must be >= 1, got layers={layers}, shards={shards}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected an integer >= 0, got {seed!r}")  # (numpy: "expected non-negative integer")
    os.makedirs(out, exist_ok=True)
    # A previous run's shards or index would otherwise shadow (index) or duplicate (glob) this run's tensors.
    for name in os.listdir(out):
        if name in (INDEX_NAME, "model.safetensors") or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name):
            os.remove(os.path.join(out, name))
    items = _plan(cfg, codebook, int(bits))
    total = sum(size for _, _, size in items)
    shards = min(shards, len(items))
    # Contiguous split by bytes: shard s gets the items whose start offset falls in [s, s+1)·total/shards.
    bounds, acc = [], 0
    for _, _, size in items:
        bounds.append(min(shards - 1, int(acc * shards / total)))
        acc += size
    bar = _Progress(total, progress if progress is not None else total > 64 * 2**20, f"writing {out}")
    omit = tuple(omit)
    weight_map, total_size = {}, 0
    for s in range(shards):
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for idx, (key, build, size) in enumerate(items):
            if bounds[idx] != s:
                continue
            for name, arr in build(np.random.default_rng([seed, idx])).items():
                if any(name == o or name.startswith(o + ".") for o in omit):
                    continue
                tensors[name] = np.ascontiguousarray(arr)
            bar.step(size)
        save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
        for name, arr in tensors.items():
            weight_map[name] = fname
            total_size += arr.nbytes
    if shards > 1:
        with open(os.path.join(out, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, f,
                      indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out
