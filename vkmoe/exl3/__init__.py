"""The EXL3 format: tensors, decoding, safetensors loaders and the numpy reference. No Vulkan here."""
from .decode import (
    CODEBOOKS,
    TENSOR_CORE_PERM,
    codebook_table,
    codebook_values,
    decode_states,
    dequantize,
    state_index_table,
)
from .loaders import CheckpointError, MissingTensorError, load_exl3_tensor, load_moe_experts, save_exl3_tensor
from .tensor import Exl3Tensor
from . import reference

__all__ = [
    "CODEBOOKS",
    "CheckpointError",
    "MissingTensorError",
    "TENSOR_CORE_PERM",
    "Exl3Tensor",
    "codebook_table",
    "codebook_values",
    "decode_states",
    "dequantize",
    "load_exl3_tensor",
    "load_moe_experts",
    "reference",
    "save_exl3_tensor",
    "state_index_table",
]
