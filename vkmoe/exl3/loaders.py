"""safetensors loaders that understand exllamav3's EXL3 tensor names (spec section 1)."""
from __future__ import annotations

import os
import re

import numpy as np

from .errors import CheckpointError, MissingTensorError
from .tensor import Exl3Tensor

__all__ = ["load_exl3_tensor", "load_moe_experts", "count_moe_experts", "save_exl3_tensor", "MUL1_FLAG", "MCG_FLAG", "CheckpointError",
           "MissingTensorError"]


# The flag tensors are presence markers only; these are the values exllamav3 writes (never read back).
MUL1_FLAG = -2082680531  # 0x83DCD12D as int32
MCG_FLAG = -877912083  # 0xCBAC1FED as int32


class _Source:
    """Uniform key lookup over a dict of arrays, a .safetensors file or a model directory (read lazily)."""

    def __init__(self, src):
        self._handle = None
        if isinstance(src, (str, os.PathLike)) and os.path.isdir(src):
            from .checkpoint_dir import Checkpoint  # a model directory, sharded or not

            src = Checkpoint(src)
        if isinstance(src, (str, os.PathLike)):
            from safetensors import safe_open

            from safetensors import SafetensorError

            self.name = os.fspath(src)
            try:
                self._handle = safe_open(self.name, framework="numpy")
                self._keys = set(self._handle.keys())
            except (OSError, SafetensorError) as exc:
                raise CheckpointError(f"{self.name}: cannot read it as a safetensors file ({exc})") from None
        elif isinstance(src, _Source):
            self.__dict__.update(src.__dict__)
        elif hasattr(src, "keys") and hasattr(src, "__getitem__"):
            self.name = getattr(src, "path", "<dict>")
            self._dict = src
            self._keys = set(src.keys())
        else:
            raise TypeError(f"safetensors_file_or_dict: expected a .safetensors file, a model directory or a dict of "
                            f"arrays, got {type(src).__name__}")

    def keys(self):
        return self._keys

    def __contains__(self, key):
        return key in self._keys

    def get(self, key):
        if key not in self._keys:
            raise MissingTensorError(f"{key!r} not found in {self.name}")
        if self._handle is not None:
            from safetensors import SafetensorError

            try:
                return self._handle.get_tensor(key)
            except (OSError, SafetensorError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{self.name}: cannot read tensor {key} ({exc})") from None
        return np.asarray(self._dict[key])


def _signs_from_bits(words: np.ndarray, length: int, key: str) -> np.ndarray:
    w = np.asarray(words)
    if w.dtype not in (np.int16, np.uint16) or w.ndim != 1 or w.shape[0] * 16 != length:
        raise CheckpointError(f"{key}: expected int16 ({length // 16},) sign bitfield, got {w.dtype} {w.shape}")
    bits = (w.view(np.uint16)[:, None] >> np.arange(16, dtype=np.uint16)) & 1
    return np.where(bits.reshape(-1) != 0, -1.0, 1.0).astype(np.float16)


def load_exl3_tensor(safetensors_file_or_dict, key: str) -> Exl3Tensor:
    """Exl3Tensor from `{key}.trellis`, `.suh`/`.svh` (or legacy `.su`/`.sv`), `.mcg`/`.mul1` flags, `.bias`."""
    src = _Source(safetensors_file_or_dict)
    tkey = f"{key}.trellis"
    if tkey not in src:
        raise MissingTensorError(f"{tkey!r} not found in {src.name}: not an EXL3 tensor (or wrong key prefix)")
    trellis = src.get(tkey)
    if trellis.ndim != 3:
        raise CheckpointError(f"{tkey}: expected 3 dimensions, got shape {getattr(trellis, 'shape', None)}")
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    has_mcg, has_mul1 = f"{key}.mcg" in src, f"{key}.mul1" in src
    if has_mcg and has_mul1:
        raise CheckpointError(f"{key}: both {key}.mcg and {key}.mul1 flags are present; a tensor has one codebook")
    codebook = "mcg" if has_mcg else "mul1" if has_mul1 else "3inst"
    scales = []
    for full, legacy, length in (("suh", "su", k), ("svh", "sv", n)):
        if f"{key}.{full}" in src:
            value = np.asarray(src.get(f"{key}.{full}"))
            if value.dtype.kind not in "fiu":
                raise CheckpointError(f"{key}.{full}: expected a float16 vector, got dtype {value.dtype}")
            scales.append(value.astype(np.float16))
        elif f"{key}.{legacy}" in src:
            scales.append(_signs_from_bits(src.get(f"{key}.{legacy}"), length, f"{key}.{legacy}"))
        else:
            raise MissingTensorError(f"{key}.{full!s} (or legacy {key}.{legacy}) not found in {src.name}")
    bias = src.get(f"{key}.bias") if f"{key}.bias" in src else None
    if bias is not None:
        bias = np.asarray(bias)
        if bias.dtype not in (np.float16, np.float32):
            bias = bias.astype(np.float32)
    try:
        return Exl3Tensor(trellis, scales[0], scales[1], codebook=codebook, bias=bias)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{key}: {exc}") from None


def load_moe_experts(safetensors_file_or_dict, prefix: str, num_experts: int | None = None,
                     expert_range: tuple | None = None) -> dict:
    """{'gate': [Exl3Tensor]*E or None, 'up': [...], 'down': [...], 'num_experts', 'codebook', 'bits'}.

    `expert_range` = (first, count): read only those experts' tensors (a shard of the layer, vkmoe.ops.sharded);
    the lists then hold `count` experts and 'num_experts' is still the layer's.

    Experts are `{prefix}.experts.{e}.{gate,up,down}_proj`; E = 1 + the largest index found, and every index
    below it must be complete. No gate_proj keys at all means a gateless (relu2) layer. The file alone cannot
    show that its last experts are missing: pass `num_experts` (from the model's config) and a file with
    another count raises CheckpointError. Unreadable or inconsistent files raise CheckpointError (missing
    tensors MissingTensorError, also a KeyError).
    """
    if num_experts is not None and (isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer))
                                    or num_experts < 1):
        raise TypeError(f"num_experts: expected a positive int or None, got {num_experts!r}")
    src = _Source(safetensors_file_or_dict)
    found = _expert_keys(src, prefix)
    num = 1 + max(max(v) for v in found.values())
    if num_experts is not None and num != num_experts:
        error = MissingTensorError if num < num_experts else CheckpointError
        raise error(f"{src.name}: {prefix} has experts 0..{num - 1}; expected {num_experts} experts")
    first, count = (0, num) if expert_range is None else _check_expert_range(expert_range, num, src.name, prefix)
    result = {"num_experts": num}
    codebooks, bits = set(), {}
    for proj in ("gate", "up", "down"):
        if proj == "gate" and "gate" not in found:
            result["gate"] = None
            continue
        tensors = []
        for e in range(first, first + count):
            key = f"{prefix}.experts.{e}.{proj}_proj"
            if f"{key}.trellis" not in src:
                raise MissingTensorError(f"{key}.trellis not found in {src.name} (expert {e} of {num} is incomplete)")
            t = load_exl3_tensor(src, key)
            if tensors:
                t0 = tensors[0]
                if t.codebook != t0.codebook:
                    raise CheckpointError(f"{key}: codebook {t.codebook!r} differs from expert 0's {t0.codebook!r}")
                if t.bits != t0.bits:
                    raise CheckpointError(f"{key}: {t.bits} bits differs from expert 0's {t0.bits} bits")
                if (t.k, t.n) != (t0.k, t0.n):
                    raise CheckpointError(f"{key}: shape {t.k}x{t.n} differs from expert 0's {t0.k}x{t0.n}")
            tensors.append(t)
        result[proj] = tensors
        codebooks.add(tensors[0].codebook)
        bits[proj] = tensors[0].bits
    if len(codebooks) > 1:
        raise CheckpointError(f"{prefix}: gate/up/down use different codebooks {sorted(codebooks)}")
    result["codebook"] = codebooks.pop()
    result["bits"] = bits
    return result


def _expert_keys(src, prefix):
    """{projection: set of expert indices} of the `{prefix}.experts.{e}.{proj}_proj.*` keys (a key scan only)."""
    pat = re.compile(re.escape(prefix) + r"\.experts\.(\d+)\.(gate|up|down)_proj\.")
    found = {}
    for key in src.keys():
        mt = pat.match(key)
        if mt:
            found.setdefault(mt.group(2), set()).add(int(mt.group(1)))
    if not found:
        raise MissingTensorError(f"no keys '{prefix}.experts.<e>.<gate|up|down>_proj.*' found in {src.name}")
    return found


def count_moe_experts(safetensors_file_or_dict, prefix: str) -> int:
    """How many experts a layer has in a file, directory or dict (1 + the largest index; reads no tensor)."""
    return 1 + max(max(v) for v in _expert_keys(_Source(safetensors_file_or_dict), prefix).values())


def _check_expert_range(expert_range, num, name, prefix):
    try:
        first, count = (int(v) for v in expert_range)
    except (TypeError, ValueError):
        raise TypeError(f"expert_range: expected a (first, count) pair of ints, got {expert_range!r}") from None
    if count < 1 or first < 0 or first + count > num:
        raise ValueError(f"expert_range={expert_range!r}: {name} has experts 0..{num - 1} under {prefix}")
    return first, count


def save_exl3_tensor(dict_out: dict, key: str, tensor: Exl3Tensor, legacy_signs: bool = False) -> dict:
    """Write `tensor` into `dict_out` under exllamav3 names (for safetensors.numpy.save_file).

    legacy_signs=True writes `.su`/`.sv` sign bitfields instead of `.suh`/`.svh` (only valid for ±1 scales).
    """
    dict_out[f"{key}.trellis"] = tensor.trellis.view(np.int16)
    if legacy_signs:
        for name, s in (("su", tensor.suh), ("sv", tensor.svh)):
            if not np.all(np.abs(s.astype(np.float32)) == 1.0):
                raise ValueError(f"{key}.{name}: legacy sign bitfields can only hold ±1 scales")
            bits = (s.astype(np.float32) < 0).reshape(-1, 16).astype(np.uint32)
            words = (bits << np.arange(16, dtype=np.uint32)).sum(axis=1).astype(np.uint16)
            dict_out[f"{key}.{name}"] = words.view(np.int16)
    else:
        dict_out[f"{key}.suh"] = tensor.suh
        dict_out[f"{key}.svh"] = tensor.svh
    if tensor.codebook == "mul1":
        dict_out[f"{key}.mul1"] = np.array(MUL1_FLAG, dtype=np.int32)
    elif tensor.codebook == "mcg":
        dict_out[f"{key}.mcg"] = np.array(MCG_FLAG, dtype=np.int32)
    if tensor.bias is not None:
        dict_out[f"{key}.bias"] = tensor.bias
    return dict_out
