"""The MoE part of a Hugging Face `config.json`, normalised across architectures, plus checkpoint errors."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..exl3.loaders import CheckpointError, MissingTensorError  # defined where tensors are loaded; re-exported

__all__ = ["ARCHITECTURES", "CheckpointError", "MissingTensorError", "MoeConfig", "ACTIVATION_BY_HF_ACT"]

# HF `architectures` entry -> vkmoe's architecture name (the HF model_type).
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

# HF hidden_act -> the op's activation name. gelu_pytorch_tanh and HF "gelu_new" are the tanh form the CUDA
# arm computes; plain HF "gelu" is the erf form.
ACTIVATION_BY_HF_ACT = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu",
    "gelu_new": "gelu",
    "gelu_fast": "gelu",
    "gelu": "gelu_erf",
    "relu2": "relu2",
}


@dataclass
class MoeConfig:
    arch: str                      # "qwen3_moe" | "deepseek_v3"
    hidden_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    hidden_act: str = "silu"
    norm_topk_prob: bool = True
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    num_hidden_layers: int = 0
    source: str = "<dict>"

    @property
    def activation(self) -> str:
        return ACTIVATION_BY_HF_ACT[self.hidden_act]

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "<dict>") -> "MoeConfig":
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
        try:
            return cls._from_dict(cfg, source)
        except CheckpointError:
            raise
        except (TypeError, ValueError, AttributeError) as exc:  # e.g. "hidden_size": "abc" or a list
            raise CheckpointError(f"{source}: a value has the wrong type ({exc})") from None

    @classmethod
    def _from_dict(cls, cfg: dict, source: str) -> "MoeConfig":
        def need(*names):
            for n in names:
                if n in cfg and cfg[n] is not None:
                    return cfg[n]
            raise CheckpointError(f"{source}: missing {' or '.join(repr(n) for n in names)}")

        def opt(name, hf_default, if_null):
            # Absent keys take transformers' config-class default; an explicit null means "feature off".
            v = cfg.get(name, hf_default)
            return if_null if v is None else v

        arch = cfg.get("model_type")
        if arch not in ARCHITECTURES.values():
            archs = [ARCHITECTURES[a] for a in cfg.get("architectures") or () if a in ARCHITECTURES]
            if not archs:
                raise CheckpointError(
                    f"{source}: unsupported architecture (model_type={cfg.get('model_type')!r}, "
                    f"architectures={cfg.get('architectures')!r}); supported: "
                    + ", ".join(f"{k} ({v})" for k, v in ARCHITECTURES.items()))
            arch = archs[0]
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act not in ACTIVATION_BY_HF_ACT:
            raise CheckpointError(f"{source}: hidden_act={hidden_act!r} is not supported; supported: "
                                  + ", ".join(ACTIVATION_BY_HF_ACT))
        if arch == "qwen3_moe":
            c = cls(arch=arch, hidden_size=int(need("hidden_size")), num_experts=int(need("num_experts")),
                    top_k=int(need("num_experts_per_tok")),
                    moe_intermediate_size=int(need("moe_intermediate_size")), hidden_act=hidden_act,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), scoring_func="softmax",
                    decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
                    mlp_only_layers=list(cfg.get("mlp_only_layers") or ()),
                    num_hidden_layers=int(cfg.get("num_hidden_layers", 0) or 0), source=source)
        else:  # deepseek_v3
            c = cls(arch=arch, hidden_size=int(need("hidden_size")), num_experts=int(need("n_routed_experts")),
                    top_k=int(need("num_experts_per_tok")),
                    moe_intermediate_size=int(need("moe_intermediate_size")), hidden_act=hidden_act,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    n_shared_experts=int(opt("n_shared_experts", 1, 0)),
                    scoring_func=cfg.get("scoring_func", "sigmoid"), n_group=int(opt("n_group", 8, 1)),
                    topk_group=int(opt("topk_group", 4, 1)),
                    routed_scaling_factor=float(opt("routed_scaling_factor", 2.5, 1.0)),
                    first_k_dense_replace=int(opt("first_k_dense_replace", 3, 0)),
                    moe_layer_freq=int(opt("moe_layer_freq", 1, 1)),
                    num_hidden_layers=int(cfg.get("num_hidden_layers", 0) or 0), source=source)
        c.validate()
        return c

    @classmethod
    def from_file(cls, path) -> "MoeConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: not found (a model directory needs config.json)") from None
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot read it ({exc})") from None
        return cls.from_dict(cfg, source=path)

    def validate(self) -> None:
        src = self.source
        if self.hidden_size <= 0 or self.hidden_size % 128:
            raise CheckpointError(f"{src}: hidden_size={self.hidden_size} is not a positive multiple of 128 "
                                  "(EXL3 applies its Hadamard transform per 128 channels)")
        if self.moe_intermediate_size <= 0 or self.moe_intermediate_size % 128:
            raise CheckpointError(f"{src}: moe_intermediate_size={self.moe_intermediate_size} is not a positive "
                                  "multiple of 128")
        if self.num_experts < 1:
            raise CheckpointError(f"{src}: num_experts={self.num_experts} must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise CheckpointError(f"{src}: num_experts_per_tok={self.top_k} must be in 1..num_experts="
                                  f"{self.num_experts}")
        if self.arch == "deepseek_v3":
            if self.scoring_func != "sigmoid":
                raise CheckpointError(f"{src}: scoring_func={self.scoring_func!r}; deepseek_v3 supports 'sigmoid'")
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise CheckpointError(f"{src}: n_routed_experts={self.num_experts} is not divisible by "
                                      f"n_group={self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise CheckpointError(f"{src}: topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
            if self.top_k > self.topk_group * (self.num_experts // self.n_group):
                raise CheckpointError(
                    f"{src}: num_experts_per_tok={self.top_k} exceeds the experts in topk_group={self.topk_group} "
                    f"groups of {self.num_experts // self.n_group}")
            if self.n_shared_experts < 0:
                raise CheckpointError(f"{src}: n_shared_experts={self.n_shared_experts} must be >= 0")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse MoE block (HF's per-architecture rule)."""
        if self.arch == "qwen3_moe":
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0
