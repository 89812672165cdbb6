"""Model-level blocks built from exllamav3-format checkpoints (config.json + EXL3 safetensors)."""
from .checkpoint import Checkpoint, checkpoint_config, open_checkpoint, write_checkpoint
from .config import ARCHITECTURES, SPECS, ArchSpec, CheckpointError, MissingTensorError, MoeConfig
from .routing import ROUTERS, sigmoid_group_topk, softmax_topk, sqrt_softplus, sqrtsp_hash, sqrtsp_topk
from .sparse_moe import SparseMoeBlock, block_reference, load_block_tensors

__all__ = [
    "ARCHITECTURES",
    "ArchSpec",
    "Checkpoint",
    "CheckpointError",
    "MissingTensorError",
    "MoeConfig",
    "ROUTERS",
    "SPECS",
    "SparseMoeBlock",
    "block_reference",
    "checkpoint_config",
    "load_block_tensors",
    "open_checkpoint",
    "sigmoid_group_topk",
    "softmax_topk",
    "sqrt_softplus",
    "sqrtsp_hash",
    "sqrtsp_topk",
    "write_checkpoint",
]
