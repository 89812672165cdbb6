"""Random EXL3 tensors, MoE layers and routings on the host: the one generator behind the demo, the quick start,
the device-filled benchmark layers (vkmoe.ops.synthetic) and the tests. No Vulkan here.

Every uint16 bit pattern is a valid EXL3 trellis, so the weights are uniform random words; the scales are chosen
so that every stage stays O(1) in fp16 (random_scales).

    t = random_exl3_tensor(2048, 768, bits=4, seed=0)               # an Exl3Tensor
    gate, up, down = random_moe_layer(2048, 768, experts=16, seed=0)  # lists of Exl3Tensor, one per expert
    ids, weights = random_routing(m=4, experts=16, top_k=8, seed=1)   # int32 / float32 (m, top_k)
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from .decode import CODEBOOKS, codebook_table
from .tensor import Exl3Tensor

__all__ = ["random_scales", "random_exl3_tensor", "random_moe_layer", "random_routing"]

# Gateless activations (no gate projection); the others need gate, up and down.
GATELESS_ACTIVATIONS = ("relu2",)
# Output scale of each expert's down projection: a routed sum stays O(0.1-1) for unit-RMS input.
DOWN_OUT_SCALE = 0.5

Bits = Union[int, Sequence[int]]


def _positive_multiple_of_128(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0 or value % 128:
        raise ValueError(f"{name}: expected a positive multiple of 128, got {value!r}")
    return int(value)


def _check_bits(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= 8:
        raise ValueError(f"{name}: expected an integer bit width in 1..8, got {value!r}")
    return int(value)


def _check_codebook(codebook) -> str:
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook: expected one of {', '.join(map(repr, CODEBOOKS))}, got {codebook!r}")
    return codebook


def _rng(seed, rng) -> np.random.Generator:
    return np.random.default_rng(seed) if rng is None else rng


def random_scales(rng: np.random.Generator, k: int, n: int, codebook: str = "mul1", out_scale: float = 1.0,
                  batch: Tuple[int, ...] = ()) -> Tuple[np.ndarray, np.ndarray]:
    """(suh, svh) float16 of shapes batch + (k,) and batch + (n,): random signs times magnitudes near 1.

    y = ((x⊙suh)·Hk·Ŵ)·Hn⊙svh with orthonormal Hadamards and Ŵ entries of std sigma (the codebook's) has
    rms |suh|·|svh|·sigma·sqrt(k)·rms(x), so |suh| ≈ 1/(sigma·sqrt(k)) keeps the fp16 GEMM result near 1 and
    |svh| ≈ out_scale sets the output scale."""
    sigma = float(codebook_table(_check_codebook(codebook)).astype(np.float64).std())
    batch = tuple(batch)

    def sign(shape):
        return np.where(rng.random(shape) < 0.5, -1.0, 1.0)

    suh = sign(batch + (k,)) * np.abs(rng.normal(1.0, 0.1, batch + (k,))) / (sigma * math.sqrt(k))
    svh = sign(batch + (n,)) * np.abs(rng.normal(1.0, 0.1, batch + (n,))) * out_scale
    return suh.astype(np.float16), svh.astype(np.float16)


def random_exl3_tensor(k: int, n: int, bits: int = 4, codebook: str = "mul1", out_scale: float = 1.0,
                       seed: Optional[int] = 0, rng: Optional[np.random.Generator] = None) -> Exl3Tensor:
    """A random k -> n Exl3Tensor (k, n multiples of 128; bits 1..8) whose output rms is about
    out_scale · rms(input). `rng` (a numpy Generator) wins over `seed`."""
    k, n = _positive_multiple_of_128("k", k), _positive_multiple_of_128("n", n)
    bits = _check_bits("bits", bits)
    rng = _rng(seed, rng)
    trellis = rng.integers(0, 1 << 16, size=(k // 16, n // 16, 16 * bits), dtype=np.uint16)
    suh, svh = random_scales(rng, k, n, codebook, out_scale)
    return Exl3Tensor(trellis, suh, svh, codebook=codebook)


def random_moe_layer(hidden: int, intermediate: int, experts: int, bits: Bits = 4, codebook: str = "mul1",
                     activation: str = "silu", seed: Optional[int] = 0, rng: Optional[np.random.Generator] = None
                     ) -> Tuple[Optional[List[Exl3Tensor]], List[Exl3Tensor], List[Exl3Tensor]]:
    """(gate, up, down): lists of `experts` random Exl3Tensor, gate/up hidden -> intermediate, down
    intermediate -> hidden (gate None for a gateless activation such as "relu2"). `bits` is one width or a
    (gate, up, down) triple. Pass them to vkmoe.Exl3MoeMlp, vkmoe.cpu.moe_forward or the numpy reference."""
    hidden = _positive_multiple_of_128("hidden", hidden)
    intermediate = _positive_multiple_of_128("intermediate", intermediate)
    if isinstance(experts, bool) or not isinstance(experts, (int, np.integer)) or experts < 1:
        raise ValueError(f"experts: expected a positive integer, got {experts!r}")
    if isinstance(bits, (int, np.integer)) and not isinstance(bits, bool):
        gate_bits = up_bits = down_bits = bits
    elif isinstance(bits, (tuple, list)) and len(bits) == 3:
        gate_bits, up_bits, down_bits = bits
    else:
        raise ValueError(f"bits: expected an integer or a (gate, up, down) triple, got {bits!r}")
    rng = _rng(seed, rng)

    def projection(k, n, b, out_scale=1.0):
        return [random_exl3_tensor(k, n, b, codebook, out_scale, rng=rng) for _ in range(int(experts))]

    gate = None if activation in GATELESS_ACTIVATIONS else projection(hidden, intermediate, gate_bits)
    up = projection(hidden, intermediate, up_bits)
    down = projection(intermediate, hidden, down_bits, DOWN_OUT_SCALE)
    return gate, up, down


def random_routing(m: int, experts: int, top_k: int, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """(ids (m, top_k) int32, distinct per row, in [0, experts); weights (m, top_k) float32, a softmax over
    random logits, each row summing to 1). The same seed gives the same routing."""
    for name, value in (("m", m), ("experts", experts), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < (0 if name == "m" else 1):
            raise ValueError(f"{name}: expected a {'non-negative' if name == 'm' else 'positive'} integer, "
                             f"got {value!r}")
    if top_k > experts:
        raise ValueError(f"top_k: expected at most experts={experts}, got {top_k}")
    rng = np.random.default_rng([int(seed), int(m), int(experts), int(top_k)])
    ids = np.argsort(rng.random((m, experts)), axis=1)[:, :top_k].astype(np.int32)
    logits = rng.normal(0.0, 1.0, (m, top_k))
    w = np.exp(logits - logits.max(axis=1, keepdims=True, initial=-np.inf))
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
