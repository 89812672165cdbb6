"""The MoE part of a Hugging Face `config.json`, normalised across architectures, plus checkpoint errors.

Each supported architecture is one `ArchSpec` row in `SPECS`: which router family it uses, where its tensors
live and which config keys hold its sizes. `MoeConfig.from_dict` reads a config through its row, applies the
architecture's defaults (Hugging Face's where exllamav3 and HF agree, else exllamav3's, noted per key) and names
the missing or inconsistent key when something is wrong.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from ..exl3.loaders import CheckpointError, MissingTensorError  # defined where tensors are loaded; re-exported

__all__ = ["ARCHITECTURES", "SPECS", "ArchSpec", "CheckpointError", "MissingTensorError", "MoeConfig",
           "ACTIVATION_BY_HF_ACT"]

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

GATED_KEYS = ("gate_proj", "up_proj", "down_proj")   # HF names of (gate, up, down)
NATIVE_KEYS = ("w1", "w3", "w2")                      # Mixtral / MiniMax / DeepSeek native names of the same
GATELESS_KEYS = (None, "up_proj", "down_proj")        # NemotronH: relu2 experts have no gate projection


@dataclass(frozen=True)
class ArchSpec:
    """Where one architecture keeps its MoE block and how it routes. `prefix` is formatted with `layer`."""
    name: str                      # vkmoe's architecture name (the HF model_type)
    hf_classes: tuple              # HF `architectures` entries
    router: str                    # "std" | "dots" | "sqrtsp" (sqrtsp_hash on DeepSeek-V4's hash layers)
    prefix: str                    # tensor prefix of the block
    experts_key: str               # config key holding the routed expert count
    intermediate_key: str          # config key holding the routed experts' intermediate size
    expert_keys: tuple = GATED_KEYS
    shared: str | None = None      # None | "n_shared" (moe_intermediate x n_shared_experts) | a config key
    shared_keys: tuple = GATED_KEYS
    shared_name: str = "shared_experts"
    shared_prefix: str | None = None  # Step-3.5 keeps its shared expert beside the block: a full template
    shared_gate: bool = False      # Qwen3-Next: sigmoid(x · shared_expert_gate) scales the shared output
    bias_keys: tuple = ()          # selection-bias keys under the prefix, first found wins
    bias_required: bool = False
    layer_rule: str = "all"        # "all" | "sparse_step" | "first_k_dense" | "pattern" | "enum" | "mlp_types"
    renames: tuple = ()            # (canonical HF key, this architecture's key) where they differ
    router_key: str = "gate.weight"
    per_expert_scale_key: str | None = None  # Gemma 4: routing weights x this (E,) vector after renormalising
    norm_keys: tuple = ()          # Gemma 4: (role, key) of the block's RMSNorm weights, roles in NORM_ROLES
    text_config: bool = False      # sizes live in config.json's "text_config" (multimodal wrappers)
    interm_div: float = 0.0        # Laguna, Mistral 4: routed ups / this, routing weights x this (fp16 guard)
    model_type: str = ""           # config.json's model_type where it is not `name` (Mistral 4: "mistral3")
    text_model_type: str | None = None  # required text_config.model_type (Mistral 4: the class is shared)
    text_moe_flag: str | None = None    # text_config key that must be true for MoE blocks to exist (Gemma 4)
    asserted: tuple = ()           # (key, the only value exllamav3 accepts), checked where the key is present
    bias_flag: str | None = None   # config key that says whether the selection bias exists
    alt_prefix: str | None = None  # an older HF key style of the same block, used when `prefix` holds no router
    latent_key: str | None = None  # NemotronH: config key of the latent width of the routed experts (LatentMoE)

    def key(self, name: str) -> str:
        """This architecture's config key for the canonical (DeepSeek/Qwen-style) key `name`."""
        return dict(self.renames).get(name, name)

    @property
    def config_model_type(self) -> str:
        return self.model_type or self.name

    def shared_key_prefix(self, layer: int, block_prefix: str | None = None) -> str:
        if self.shared_prefix:
            return self.shared_prefix.format(layer=layer)
        return f"{block_prefix or self.prefix.format(layer=layer)}.{self.shared_name}"


_LM = "model.language_model.layers.{layer}"   # the text model's layers in HF multimodal wrappers
_NORM_TOPK = (("norm_topk_prob", True),)        # exllamav3's std/dots paths always renormalise

SPECS = {s.name: s for s in (
    ArchSpec("mixtral", ("MixtralForCausalLM",), "std", "model.layers.{layer}.block_sparse_moe",
             "num_local_experts", "intermediate_size", expert_keys=NATIVE_KEYS),
    ArchSpec("qwen3_moe", ("Qwen3MoeForCausalLM",), "std", "model.layers.{layer}.mlp", "num_experts",
             "moe_intermediate_size", layer_rule="sparse_step"),
    ArchSpec("qwen3_next", ("Qwen3NextForCausalLM",), "std", "model.layers.{layer}.mlp", "num_experts",
             "moe_intermediate_size", shared="shared_expert_intermediate_size", shared_name="shared_expert",
             shared_gate=True, layer_rule="sparse_step"),
    ArchSpec("deepseek_v3", ("DeepseekV3ForCausalLM",), "dots", "model.layers.{layer}.mlp", "n_routed_experts",
             "moe_intermediate_size", shared="n_shared", bias_keys=("gate.e_score_correction_bias",),
             bias_required=True, layer_rule="first_k_dense"),
    ArchSpec("deepseek_v4", ("DeepseekV4ForCausalLM",), "sqrtsp", "layers.{layer}.ffn", "n_routed_experts",
             "moe_intermediate_size", expert_keys=NATIVE_KEYS, shared="n_shared", shared_keys=NATIVE_KEYS,
             bias_keys=("gate.bias", "gate.e_score_correction_bias")),
    ArchSpec("glm4_moe", ("Glm4MoeForCausalLM",), "dots", "model.layers.{layer}.mlp", "n_routed_experts",
             "moe_intermediate_size", shared="n_shared", bias_keys=("gate.e_score_correction_bias",),
             bias_required=True, layer_rule="first_k_dense"),
    ArchSpec("dots1", ("Dots1ForCausalLM",), "dots", "model.layers.{layer}.mlp", "n_routed_experts",
             "moe_intermediate_size", shared="n_shared", bias_keys=("gate.e_score_correction_bias",),
             bias_required=True, layer_rule="first_k_dense"),
    ArchSpec("minimax_m2", ("MiniMaxM2ForCausalLM",), "dots", "model.layers.{layer}.block_sparse_moe",
             "num_local_experts", "intermediate_size", expert_keys=NATIVE_KEYS,
             bias_flag="use_routing_bias", bias_keys=("gate.e_score_correction_bias",), bias_required=True),
    ArchSpec("nemotron_h", ("NemotronHForCausalLM",), "dots", "backbone.layers.{layer}.mixer", "n_routed_experts",
             "moe_intermediate_size", expert_keys=GATELESS_KEYS, shared="moe_shared_expert_intermediate_size",
             shared_keys=GATELESS_KEYS, bias_keys=("gate.e_score_correction_bias",), bias_required=True,
             layer_rule="pattern", latent_key="moe_latent_size"),
    # model_type "step3p5" and Step3p5ForCausalLM: exllamav3's arch string and published configs agree.
    ArchSpec("step3p5", ("Step3p5ForCausalLM",), "dots", "model.layers.{layer}.moe", "moe_num_experts",
             "moe_intermediate_size", shared="share_expert_dim", shared_prefix="model.layers.{layer}.share_expert",
             bias_keys=("router_bias",), bias_required=True, layer_rule="enum",
             renames=(("num_experts_per_tok", "moe_top_k"), ("routed_scaling_factor", "moe_router_scaling_factor"),
                      ("norm_topk_prob", "norm_expert_weight"))),
    ArchSpec("laguna", ("LagunaForCausalLM",), "dots", "model.layers.{layer}.mlp", "num_experts",
             "moe_intermediate_size", shared="shared_expert_intermediate_size", shared_name="shared_expert",
             bias_keys=("experts.e_score_correction_bias",), bias_required=True, layer_rule="sparse_step",
             renames=(("routed_scaling_factor", "moe_routed_scaling_factor"),), interm_div=128.0),
    ArchSpec("gemma4", ("Gemma4ForConditionalGeneration",), "std", "model.language_model.layers.{layer}",
             "num_experts", "moe_intermediate_size", shared="intermediate_size",
             shared_prefix="model.language_model.layers.{layer}.mlp", router_key="router.proj.weight",
             per_expert_scale_key="router.per_expert_scale", text_config=True,
             norm_keys=(("router", "router.scale"), ("routed_in", "pre_feedforward_layernorm_2.weight"),
                        ("routed_out", "post_feedforward_layernorm_2.weight"),
                        ("shared_out", "post_feedforward_layernorm_1.weight")),
             renames=(("num_experts_per_tok", "top_k_experts"), ("hidden_act", "hidden_activation")),
             text_moe_flag="enable_moe_block"),
    # The multimodal wrappers of Qwen3-MoE and GLM-4.5: the same block under model.language_model.
    ArchSpec("qwen3_vl_moe", ("Qwen3VLMoeForConditionalGeneration",), "std", _LM + ".mlp", "num_experts",
             "moe_intermediate_size", layer_rule="sparse_step", text_config=True, asserted=_NORM_TOPK),
    ArchSpec("glm4v_moe", ("Glm4vMoeForConditionalGeneration",), "dots", _LM + ".mlp", "n_routed_experts",
             "moe_intermediate_size", shared="n_shared", bias_keys=("gate.e_score_correction_bias",),
             bias_required=True, layer_rule="first_k_dense", text_config=True, asserted=_NORM_TOPK),
    # Qwen3.5 MoE: Qwen3-Next's block (gated shared expert) in a multimodal wrapper.
    ArchSpec("qwen3_5_moe", ("Qwen3_5MoeForConditionalGeneration",), "std", _LM + ".mlp", "num_experts",
             "moe_intermediate_size", shared="shared_expert_intermediate_size", shared_name="shared_expert",
             shared_gate=True, text_config=True, asserted=_NORM_TOPK),
    # Solar Open: exllamav3 loads it as GLM-4.5 with two other defaults.
    ArchSpec("solar_open", ("SolarOpenForCausalLM",), "dots", "model.layers.{layer}.mlp", "n_routed_experts",
             "moe_intermediate_size", shared="n_shared", bias_keys=("gate.e_score_correction_bias",),
             bias_required=True, layer_rule="first_k_dense"),
    # Hy3: router under router.gate, selection bias `expert_bias`, shared MLP `shared_mlp` (exllamav3's MTP
    # layer and HF's key renames). Its main-model file was not among the sources read: the config keys are HF's.
    ArchSpec("hy_v3", ("HYV3ForCausalLM",), "dots", "model.layers.{layer}.mlp", "num_experts",
             "moe_intermediate_size", shared="n_shared", shared_name="shared_mlp", bias_keys=("expert_bias",),
             bias_flag="moe_router_enable_expert_bias", router_key="router.gate.weight", layer_rule="mlp_types",
             renames=(("n_shared_experts", "num_shared_experts"), ("routed_scaling_factor", "router_scaling_factor"),
                      ("norm_topk_prob", "route_norm"))),
    ArchSpec("afmoe", ("AfmoeForCausalLM",), "dots", "model.layers.{layer}.mlp", "num_experts",
             "moe_intermediate_size", shared="n_shared", bias_keys=("expert_bias",), router_key="router.gate.weight",
             layer_rule="first_k_dense",
             renames=(("n_shared_experts", "num_shared_experts"), ("routed_scaling_factor", "route_scale"),
                      ("norm_topk_prob", "route_norm"), ("scoring_func", "score_func"),
                      ("first_k_dense_replace", "num_dense_layers"))),
    # ERNIE 4.5: exllamav3's std router never reads gate.e_score_correction_bias (HF adds it for selection).
    ArchSpec("ernie4_5_moe", ("Ernie4_5_MoeForCausalLM",), "std", "model.layers.{layer}.mlp", "moe_num_experts",
             "moe_intermediate_size", shared="n_shared", layer_rule="first_k_dense",
             renames=(("num_experts_per_tok", "moe_k"), ("n_shared_experts", "moe_num_shared_experts"),
                      ("first_k_dense_replace", "moe_layer_start_index"), ("moe_layer_freq", "moe_layer_interval")),
             asserted=(("moe_layer_interval", 1), ("moe_gate_act", "softmax"))),
    ArchSpec("lfm2_moe", ("Lfm2MoeForCausalLM",), "dots", "model.layers.{layer}.feed_forward", "num_experts",
             "moe_intermediate_size", expert_keys=NATIVE_KEYS, bias_flag="use_expert_bias", bias_keys=("expert_bias",),
             layer_rule="first_k_dense",
             renames=(("first_k_dense_replace", "num_dense_layers"),), asserted=_NORM_TOPK),
    # Mistral Small 4: Mistral3ForConditionalGeneration whose text model is "mistral4" (the class alone also
    # names dense Mistral 3 models). Tensors in the current HF key style or, as exllamav3 also accepts, the
    # older language_model.model.* one.
    ArchSpec("mistral4", ("Mistral3ForConditionalGeneration",), "std", _LM + ".mlp", "n_routed_experts",
             "moe_intermediate_size", shared="n_shared", layer_rule="first_k_dense", text_config=True,
             model_type="mistral3", text_model_type="mistral4", interm_div=128.0,
             alt_prefix="language_model.model.layers.{layer}.mlp",
             asserted=_NORM_TOPK + (("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0))),
    # Step 3.7 (model_type "step3p7"): Step-3.5's text model under text_config (whose model_type is "step3p5");
    # exllamav3 reads its tensors under Step-3.5's names.
    ArchSpec("step3p7", ("Step3p7ForConditionalGeneration",), "dots", "model.layers.{layer}.moe", "moe_num_experts",
             "moe_intermediate_size", shared="share_expert_dim", shared_prefix="model.layers.{layer}.share_expert",
             bias_flag="use_moe_router_bias", bias_keys=("router_bias",), bias_required=True, layer_rule="enum",
             text_config=True,
             renames=(("num_experts_per_tok", "moe_top_k"), ("routed_scaling_factor", "moe_router_scaling_factor"),
                      ("norm_topk_prob", "norm_expert_weight")),
             asserted=(("norm_expert_weight", True), ("use_moe_router_bias", True))),
)}

# Gemma 4's extra RMSNorms around its MoE block (all read the residual stream or an output, never `hidden`):
# router = the router's pre-norm (times hidden_size**-0.5), routed_in = the routed experts' input,
# routed_out / shared_out = post-norms of the routed sum and of the dense MLP, applied before they are added.
NORM_ROLES = ("router", "routed_in", "routed_out", "shared_out")

# Per architecture: defaults for keys a config may leave out, as {key: value}. Where exllamav3 and HF differ,
# the comment says whose default this is; a checkpoint writer should write these keys explicitly.
_DEFAULTS = {
    "mixtral": {"hidden_act": "silu"},
    "qwen3_moe": {"norm_topk_prob": False, "decoder_sparse_step": 1},  # HF; exllamav3 asserts True
    "qwen3_next": {"norm_topk_prob": True, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 512},
    "deepseek_v3": {"norm_topk_prob": True, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,  # HF
                    "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "moe_layer_freq": 1},
    "deepseek_v4": {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_hash_layers": 3,  # exllamav3
                    "swiglu_limit": 10.0},
    "glm4_moe": {"norm_topk_prob": True, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "moe_layer_freq": 1},
    "dots1": {"norm_topk_prob": True, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
              "routed_scaling_factor": 1.0, "first_k_dense_replace": 0, "moe_layer_freq": 1},
    "minimax_m2": {"norm_topk_prob": True, "routed_scaling_factor": 1.0},
    "nemotron_h": {"norm_topk_prob": True, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
                   "mlp_hidden_act": "relu2"},
    "step3p5": {"norm_expert_weight": True, "moe_router_scaling_factor": 3.0},  # exllamav3
    "laguna": {"norm_topk_prob": True, "moe_routed_scaling_factor": 1.0, "decoder_sparse_step": 1,
               "mlp_only_layers": [0]},  # exllamav3: layer 0 is dense unless the config says otherwise
    "gemma4": {"norm_topk_prob": True, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6},
    "qwen3_vl_moe": {"norm_topk_prob": True, "decoder_sparse_step": 1},  # exllamav3 asserts True
    "glm4v_moe": {"norm_topk_prob": True, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,  # exllamav3
                  "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "moe_layer_freq": 1},
    "qwen3_5_moe": {"norm_topk_prob": True, "shared_expert_intermediate_size": 512},  # exllamav3
    "solar_open": {"norm_topk_prob": True, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,  # exllamav3
                   "routed_scaling_factor": 2.0, "first_k_dense_replace": 0, "moe_layer_freq": 1},
    # Hy3: HF's HYV3Config (factor 2.826, one shared expert, layer 0 dense when mlp_layer_types is absent);
    # exllamav3's hy_v3.py was not among the sources read. route_norm: exllamav3's dots router always renormalises.
    "hy_v3": {"route_norm": True, "router_scaling_factor": 2.826, "num_shared_experts": 1, "n_group": 1,
              "topk_group": 1, "first_k_dense_replace": 1},
    "afmoe": {"route_norm": True, "route_scale": 1.0, "score_func": "sigmoid", "n_group": 1, "topk_group": 1,
              "num_shared_experts": 0, "num_dense_layers": 0, "moe_layer_freq": 1},  # exllamav3
    "ernie4_5_moe": {"norm_topk_prob": True, "moe_num_shared_experts": 0, "moe_layer_start_index": 0,
                     "moe_layer_interval": 1},  # exllamav3
    "lfm2_moe": {"norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                 "num_dense_layers": 0, "moe_layer_freq": 1},  # exllamav3
    "mistral4": {"norm_topk_prob": True, "n_shared_experts": 1, "first_k_dense_replace": 0,
                 "moe_layer_freq": 1},  # exllamav3
    "step3p7": {"norm_expert_weight": True, "moe_router_scaling_factor": 3.0},  # exllamav3
}

# HF `architectures` entry -> vkmoe's architecture name.
ARCHITECTURES = {cls: s.name for s in SPECS.values() for cls in s.hf_classes}


def _refuse(cfg: dict, source: str, why: str = ""):
    text = cfg.get("text_config")
    inner = f", text_config.model_type={text.get('model_type')!r}" if isinstance(text, dict) else ""
    raise CheckpointError(
        f"{source}: unsupported architecture (model_type={cfg.get('model_type')!r}{inner}, "
        f"architectures={cfg.get('architectures')!r}){why}; supported: "
        + ", ".join(f"{s.name} ({', '.join(s.hf_classes)})" for s in SPECS.values()))


def _find_spec(cfg: dict, source: str) -> ArchSpec:
    """The row of a config.json dict: by model_type, else by its `architectures` class names."""
    found = [s for s in SPECS.values() if s.config_model_type == cfg.get("model_type")]
    found += [SPECS[ARCHITECTURES[a]] for a in cfg.get("architectures") or () if a in ARCHITECTURES]
    if not found:
        _refuse(cfg, source)
    spec = found[0]
    if spec.text_model_type:
        text = cfg.get("text_config")
        if not isinstance(text, dict) or text.get("model_type") != spec.text_model_type:
            _refuse(cfg, source, f": of {', '.join(spec.hf_classes)} only the MoE text model "
                                 f"text_config.model_type={spec.text_model_type!r} is covered")
    return spec


def _resolve_architecture(cfg: dict, source: str):
    """(arch, its ArchSpec, its defaults, the config with a text_config merged in) for a config.json dict;
    architectures the block does not cover are refused by name."""
    spec = _find_spec(cfg, source)
    arch, defaults = spec.name, _DEFAULTS[spec.name]
    if spec.text_config:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{source}: missing 'text_config' (required by {arch}: it holds the sizes)")
        if spec.text_moe_flag and not text.get(spec.text_moe_flag, False):
            raise CheckpointError(f"{source}: text_config.{spec.text_moe_flag} is not true: this {arch} model has "
                                  "no MoE blocks")
        cfg = {**cfg, **text}
    for key, want in spec.asserted:
        if cfg.get(key) is not None and cfg[key] != want:
            raise CheckpointError(f"{source}: {key}={cfg[key]!r}: {arch} supports only {key}={want!r} "
                                  "(exllamav3 asserts it)")
    return arch, spec, defaults, cfg


@dataclass
class MoeConfig:
    arch: str
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
    shared_intermediate_size: int = 0  # 0 = no shared expert
    act_limit: float = 0.0             # swiglu_limit (DeepSeek-V4), on routed and shared experts; 0 = none
    num_hash_layers: int = 0           # DeepSeek-V4: layers < this route by token id (tid2eid)
    vocab_size: int = 0                # rows of DeepSeek-V4's tid2eid table
    hybrid_override_pattern: str = ""  # NemotronH: 'E' marks the MoE layers
    mlp_layer_types: tuple = ()        # Hy3: "dense" / "sparse" per layer; () = first_k_dense_replace decides
    moe_layers: tuple = ()             # Step-3.5: the MoE layers (moe_layers_enum)
    act_limits: tuple = ()             # Step-3.5: per-layer limits of the routed experts (swiglu_limits) ...
    shared_act_limits: tuple = ()      # ... and of the shared expert (swiglu_limits_shared); 0/null = none
    rms_norm_eps: float = 1e-6         # Gemma 4's block norms
    interm_div: float = 0.0            # Laguna: see ArchSpec.interm_div; 0 = none
    use_bias: bool | None = None       # the architecture's bias_flag: True = required, False = unused, None = if stored
    # NemotronH LatentMoE (Nemotron 3 Super/Ultra): the routed experts run at this width between
    # fc1_latent_proj (H -> L) and fc2_latent_proj (L -> H); router and shared expert see H. 0 = none (exllamav3
    # reads a null or absent moe_latent_size, and 0, as "no latent projections").
    moe_latent_size: int = 0
    source: str = "<dict>"

    @property
    def spec(self) -> ArchSpec:
        return SPECS[self.arch]

    @property
    def expert_size(self) -> int:
        """The routed experts' input and output width: the latent width, else hidden_size."""
        return self.moe_latent_size or self.hidden_size

    @property
    def activation(self) -> str:
        return ACTIVATION_BY_HF_ACT[self.hidden_act]

    def router_for(self, layer) -> str:
        """The router family of decoder layer `layer` ("sqrtsp_hash" on DeepSeek-V4's first layers)."""
        r = self.spec.router
        if r == "sqrtsp" and layer is not None and layer < self.num_hash_layers:
            return "sqrtsp_hash"
        return r

    def act_limits_for(self, layer) -> tuple:
        """(routed, shared) act_limit of decoder layer `layer`: per-layer lists where the architecture has
        them (Step-3.5), else the one swiglu_limit for both (DeepSeek-V4); 0.0 = no clamp."""
        if self.act_limits and layer is not None:
            return self.act_limits[layer], self.shared_act_limits[layer]
        return self.act_limit, self.act_limit

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
        arch, spec, defaults, cfg = _resolve_architecture(cfg, source)

        def need(name):
            if cfg.get(name) is None:
                raise CheckpointError(f"{source}: missing {name!r} (required by {arch})")
            return cfg[name]

        def opt(name, if_null=None):
            # Absent keys take the architecture's default; an explicit null means "feature off".
            name = spec.key(name)
            v = cfg.get(name, defaults.get(name))
            return if_null if v is None else v

        def limits(name):
            v = cfg.get(name)
            if v is None:
                raise CheckpointError(f"{source}: missing {name!r} (required by {arch}: one limit per layer)")
            try:
                out = tuple(0.0 if x is None else float(x) for x in v)
            except (TypeError, ValueError):
                raise CheckpointError(f"{source}: {name}={v!r} is not a list of numbers") from None
            if any(not x >= 0 or x == float("inf") for x in out):
                raise CheckpointError(f"{source}: {name}={v!r}: every limit must be finite and >= 0")
            return out

        def as_int(name, v):
            # A JSON integer (or a float with an integral value, as some writers emit): "8", 2.5 and true were
            # taken as 8, 2 and 1.
            if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
                return int(v)
            if isinstance(v, (float, np.floating)) and math.isfinite(v) and v == int(v):
                return int(v)
            raise CheckpointError(f"{source}: {name}={v!r} is not an integer")

        def as_float(name, v, positive=False):
            # A finite JSON number ("abc" raised a bare float() error; true was 1.0, NaN and Infinity were taken).
            ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
            if not ok or not math.isfinite(v) or (positive and not v > 0) or (not positive and v < 0):
                raise CheckpointError(f"{source}: {name}={v!r} must be a finite number "
                                      + ("> 0" if positive else ">= 0"))
            return float(v)

        def as_bool(name, v):
            # true / false (or 0 / 1): "yes" and 2 were taken as true.
            if isinstance(v, (bool, np.bool_)) or (isinstance(v, (int, np.integer)) and v in (0, 1)):
                return bool(v)
            raise CheckpointError(f"{source}: {name}={v!r} is not true or false")

        def layer_count(v):
            # absent or null: unknown (0); present: at least one layer (0 let layer 0 load)
            if v is None:
                return 0
            n = as_int("num_hidden_layers", v)
            if n < 1:
                raise CheckpointError(f"{source}: num_hidden_layers={v!r} must be >= 1")
            return n

        act_key = "mlp_hidden_act" if arch == "nemotron_h" else spec.key("hidden_act")
        hidden_act = cfg.get(act_key, defaults.get(act_key)) or "silu"
        if hidden_act not in ACTIVATION_BY_HF_ACT:
            raise CheckpointError(f"{source}: {act_key}={hidden_act!r} is not supported; supported: "
                                  + ", ".join(ACTIVATION_BY_HF_ACT))
        I = as_int(spec.intermediate_key, need(spec.intermediate_key))
        n_shared = as_int("n_shared_experts", opt("n_shared_experts", 0)) if spec.shared == "n_shared" else 0
        if spec.shared is None:
            shared_i = 0
        elif spec.shared == "n_shared":
            shared_i = I * n_shared
        else:
            shared_i = as_int(spec.shared, opt(spec.shared, 0))
        scoring = {"std": "softmax", "dots": "sigmoid", "sqrtsp": "sqrtsoftplus"}[spec.router]
        c = cls(arch=arch, hidden_size=as_int("hidden_size", need("hidden_size")),
                num_experts=as_int(spec.experts_key, need(spec.experts_key)),
                top_k=as_int(spec.key("num_experts_per_tok"), need(spec.key("num_experts_per_tok"))),
                moe_intermediate_size=I,
                hidden_act=hidden_act, norm_topk_prob=as_bool(spec.key("norm_topk_prob"), opt("norm_topk_prob", True)),
                n_shared_experts=n_shared, scoring_func=cfg.get(spec.key("scoring_func")) or scoring,
                n_group=as_int("n_group", opt("n_group", 1)), topk_group=as_int("topk_group", opt("topk_group", 1)),
                routed_scaling_factor=as_float(spec.key("routed_scaling_factor"), opt("routed_scaling_factor", 1.0),
                                               positive=True),
                first_k_dense_replace=as_int("first_k_dense_replace", opt("first_k_dense_replace", 0)),
                moe_layer_freq=as_int("moe_layer_freq", opt("moe_layer_freq", 1)),
                decoder_sparse_step=as_int("decoder_sparse_step", opt("decoder_sparse_step", 1) or 1),
                mlp_only_layers=list(opt("mlp_only_layers", ())),
                num_hidden_layers=layer_count(cfg.get("num_hidden_layers")),
                shared_intermediate_size=shared_i, act_limit=as_float("swiglu_limit", opt("swiglu_limit", 0.0)),
                num_hash_layers=as_int("num_hash_layers", opt("num_hash_layers", 0)),
                vocab_size=as_int("vocab_size", cfg.get("vocab_size") or 0),
                hybrid_override_pattern=str(cfg.get("hybrid_override_pattern") or ""),
                mlp_layer_types=tuple(cfg.get("mlp_layer_types") or ()),
                rms_norm_eps=as_float("rms_norm_eps", opt("rms_norm_eps", 1e-6), positive=True),
                interm_div=spec.interm_div, source=source,
                use_bias=None if cfg.get(spec.bias_flag or "") is None else as_bool(spec.bias_flag, cfg[spec.bias_flag]),
                moe_latent_size=as_int(spec.latent_key, cfg.get(spec.latent_key) or 0) if spec.latent_key else 0)
        if spec.layer_rule == "enum":
            enum = need("moe_layers_enum")
            try:
                c.moe_layers = tuple(int(x) for x in str(enum).split(",") if x.strip())
            except ValueError:
                raise CheckpointError(f"{source}: moe_layers_enum={enum!r} is not a comma-separated list of layer "
                                      "indices") from None
            c.act_limits, c.shared_act_limits = limits("swiglu_limits"), limits("swiglu_limits_shared")
        if spec.layer_rule == "pattern" and not c.hybrid_override_pattern:
            raise CheckpointError(f"{source}: missing 'hybrid_override_pattern' (required by {arch}: 'E' marks "
                                  "the MoE layers)")
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
        src, spec = self.source, self.spec
        if self.hidden_size <= 0 or self.hidden_size % 128:
            raise CheckpointError(f"{src}: hidden_size={self.hidden_size} is not a positive multiple of 128 "
                                  "(EXL3 applies its Hadamard transform per 128 channels)")
        if self.moe_intermediate_size <= 0 or self.moe_intermediate_size % 128:
            raise CheckpointError(f"{src}: {spec.intermediate_key}={self.moe_intermediate_size} is not a positive "
                                  "multiple of 128")
        if self.moe_latent_size < 0 or self.moe_latent_size % 128:
            raise CheckpointError(f"{src}: {spec.latent_key}={self.moe_latent_size} is not a positive multiple of "
                                  "128 (the routed experts' width: EXL3 applies its Hadamard transform per 128 "
                                  "channels)")
        if self.moe_latent_size and not spec.latent_key:
            raise CheckpointError(f"{src}: moe_latent_size={self.moe_latent_size}: {self.arch} has no latent MoE")
        if self.shared_intermediate_size < 0 or self.shared_intermediate_size % 128:
            raise CheckpointError(f"{src}: shared expert intermediate size {self.shared_intermediate_size} "
                                  f"(from {spec.shared}) is not a multiple of 128")
        if self.n_shared_experts < 0:
            raise CheckpointError(f"{src}: n_shared_experts={self.n_shared_experts} must be >= 0")
        if self.num_experts < 1:
            raise CheckpointError(f"{src}: {spec.experts_key}={self.num_experts} must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise CheckpointError(f"{src}: {spec.key('num_experts_per_tok')}={self.top_k} must be in "
                                  f"1..{spec.experts_key}={self.num_experts}")
        expected = {"std": "softmax", "dots": "sigmoid", "sqrtsp": "sqrtsoftplus"}[spec.router]
        if spec.router != "std" and self.scoring_func not in (expected, "noaux_tc"):
            raise CheckpointError(f"{src}: {spec.key('scoring_func')}={self.scoring_func!r}; {self.arch} supports "
                                  f"{expected!r}")
        if (self.activation == "relu2") != (spec.expert_keys[0] is None):
            raise CheckpointError(f"{src}: activation {self.hidden_act!r} does not fit {self.arch}, whose experts "
                                  + ("are gateless relu2" if spec.expert_keys[0] is None else "are gated"))
        if self.act_limit < 0 or self.act_limit != self.act_limit:
            raise CheckpointError(f"{src}: swiglu_limit={self.act_limit} must be >= 0")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise CheckpointError(f"{src}: {spec.experts_key}={self.num_experts} is not divisible by "
                                  f"n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise CheckpointError(f"{src}: topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise CheckpointError(
                f"{src}: num_experts_per_tok={self.top_k} exceeds the experts in topk_group={self.topk_group} "
                f"groups of {self.num_experts // self.n_group}")
        if self.num_hash_layers < 0:  # (a negative count meant "no hash layer" without a word)
            raise CheckpointError(f"{src}: num_hash_layers={self.num_hash_layers} must be >= 0")
        if self.num_hash_layers and self.vocab_size < 1:
            raise CheckpointError(f"{src}: num_hash_layers={self.num_hash_layers} needs 'vocab_size' (the rows "
                                  "of the tid2eid table)")
        L = self.num_hidden_layers
        for name, lst in (("swiglu_limits", self.act_limits), ("swiglu_limits_shared", self.shared_act_limits)):
            if lst and len(lst) < max(L, max(self.moe_layers, default=-1) + 1):
                raise CheckpointError(f"{src}: {name} has {len(lst)} entries but num_hidden_layers={L}")
        if set(self.mlp_layer_types) - {"dense", "sparse"} or (L and self.mlp_layer_types
                                                               and len(self.mlp_layer_types) != L):
            raise CheckpointError(f"{src}: mlp_layer_types={list(self.mlp_layer_types)!r}: expected one 'dense' or "
                                  f"'sparse' per layer (num_hidden_layers={L})")
        if self.hybrid_override_pattern and L and len(self.hybrid_override_pattern) != L:
            raise CheckpointError(f"{src}: hybrid_override_pattern has {len(self.hybrid_override_pattern)} "
                                  f"entries but num_hidden_layers={L}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse MoE block (HF's per-architecture rule)."""
        rule = self.spec.layer_rule
        if rule == "sparse_step":
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        if rule == "first_k_dense":
            return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0
        if rule == "pattern":
            p = self.hybrid_override_pattern
            return layer < len(p) and p[layer] == "E"
        if rule == "enum":
            return layer in self.moe_layers
        if rule == "mlp_types":
            if self.mlp_layer_types:
                return layer < len(self.mlp_layer_types) and self.mlp_layer_types[layer] == "sparse"
            return layer >= self.first_k_dense_replace
        return True
