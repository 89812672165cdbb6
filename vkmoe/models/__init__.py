"""Model-level blocks built from exllamav3-format checkpoints (config.json + EXL3 safetensors)."""
from .checkpoint import Checkpoint, checkpoint_config, open_checkpoint, write_checkpoint
from .config import ARCHITECTURES, CheckpointError, MissingTensorError, MoeConfig
from .routing import sigmoid_group_topk, softmax_topk
from .sparse_moe import SparseMoeBlock, block_reference, load_block_tensors

__all__ = [
    "ARCHITECTURES",
    "Checkpoint",
    "CheckpointError",
    "MissingTensorError",
    "MoeConfig",
    "SparseMoeBlock",
    "block_reference",
    "checkpoint_config",
    "load_block_tensors",
    "open_checkpoint",
    "sigmoid_group_topk",
    "softmax_topk",
    "write_checkpoint",
]
