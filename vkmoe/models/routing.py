"""Routers: router logits -> (expert ids, routing weights), in numpy, one pure function per router family.

Every router is a function of (logits, parameters) only, computed in the logits' dtype (float64 for the
reference, float32 for the block, as exllamav3 selects and normalises in fp32):

    std          softmax_topk        Mixtral, Qwen3-MoE, Qwen3-Next (+ per_expert_scale: Gemma 4)
    dots         sigmoid_group_topk  DeepSeek-V3, GLM-4.5, dots1, MiniMax-M2, NemotronH
    sqrtsp       sqrtsp_topk         DeepSeek-V4
    sqrtsp_hash  sqrtsp_hash         DeepSeek-V4's first num_hash_layers layers (ids from tid2eid[token id])

Tie rule (all families): equal selection scores break toward the LOWER expert index (a stable sort), so
routing is deterministic and always picks `top_k` distinct experts. Slots come out in descending score order,
as torch.topk(sorted=True) gives.
"""
from __future__ import annotations

import numpy as np

from ..layout import SOFTPLUS_THRESHOLD  # torch's softplus threshold (x itself above it), also the device router's

__all__ = ["ROUTERS", "router_logits", "softmax_topk", "sigmoid_group_topk", "sqrtsp_topk", "sqrtsp_hash",
           "sqrt_softplus", "topk_desc"]


def router_logits(hidden, weight, dtype=np.float32) -> np.ndarray:
    """hidden (m, H) @ weight (E, H)^T in `dtype` (HF's nn.Linear router, no bias)."""
    dt = np.dtype(dtype)
    return np.asarray(hidden).astype(dt) @ np.asarray(weight).astype(dt).T


def topk_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, largest first, lower index first among equals. int64 (m, k)."""
    # Stable argsort of the negation keeps equal scores in index order; NaN sorts last: taken only where fewer
    # than k scores are numbers, in index order (the device router does the same: router_select.glsl).
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k].astype(np.int64)


def softmax_topk(logits, top_k: int, norm_topk_prob: bool, per_expert_scale=None):
    """std: softmax over all E logits, top-k, optional renormalisation over the top-k (with renormalisation
    this is exllamav3's "softmax over the top-k logits"); `per_expert_scale` ((E,) or None, Gemma 4) then
    multiplies each weight by its expert's scale."""
    z = np.asarray(logits)
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    ids = topk_desc(p, top_k)
    w = np.take_along_axis(p, ids, axis=-1)
    if norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    if per_expert_scale is not None:
        w = w * np.asarray(per_expert_scale).astype(w.dtype)[ids]
    return ids, w


def _selection(scores, bias):
    return scores if bias is None else scores + np.asarray(bias).astype(scores.dtype)


def _normalised(scores, ids, norm, routed_scaling_factor):
    """Unbiased scores of the chosen experts / (their sum + 1e-20) when `norm`, times routed_scaling_factor."""
    dt = scores.dtype
    w = np.take_along_axis(scores, ids, axis=-1)
    if norm:
        w = w / (w.sum(axis=-1, keepdims=True) + dt.type(1e-20))
    return w * dt.type(routed_scaling_factor)


def sigmoid_group_topk(logits, bias, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                       routed_scaling_factor: float):
    """dots ("noaux_tc"): sigmoid scores; `bias` (e_score_correction_bias, or None) shifts them for selection only.

    Group score = sum of the top-2 biased scores in the group; the best `topk_group` groups stay; top-k among
    their experts. Weights = the unbiased scores of the chosen experts, renormalised when `norm_topk_prob`,
    times `routed_scaling_factor`.
    """
    z = np.asarray(logits)
    with np.errstate(over="ignore"):  # exp overflow for very negative logits gives the right limit, 0
        scores = 1.0 / (1.0 + np.exp(-z))
    choice = _selection(scores, bias)
    m, E = choice.shape
    if n_group > 1:
        per = E // n_group
        grouped = choice.reshape(m, n_group, per)
        top2 = -np.sort(-grouped, axis=-1)[..., :min(2, per)]
        keep = topk_desc(top2.sum(axis=-1), topk_group)
        mask = np.zeros((m, n_group), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        # -inf rather than HF's 0.0 fill: with a negative bias a dropped group's 0.0 could outrank a kept expert.
        choice = np.where(np.repeat(mask, per, axis=-1), choice, -np.inf)
    ids = topk_desc(choice, top_k)
    return ids, _normalised(scores, ids, norm_topk_prob, routed_scaling_factor)


def sqrt_softplus(logits) -> np.ndarray:
    """DeepSeek-V4's activated score sqrt(softplus(x)), softplus = x above SOFTPLUS_THRESHOLD (as torch)."""
    z = np.asarray(logits)
    with np.errstate(over="ignore"):  # exp overflows only where the threshold branch is taken
        sp = np.where(z > SOFTPLUS_THRESHOLD, z, np.log1p(np.exp(np.minimum(z, SOFTPLUS_THRESHOLD))))
    return np.sqrt(sp.astype(z.dtype, copy=False))


def sqrtsp_topk(logits, bias, top_k: int, routed_scaling_factor: float):
    """sqrtsp (DeepSeek-V4, "noaux_tc"): scores = sqrt(softplus(logits)); `bias` (or None) for selection only;
    weights = the chosen experts' unbiased scores normalised over them, times `routed_scaling_factor`."""
    scores = sqrt_softplus(logits)
    ids = topk_desc(_selection(scores, bias), top_k)
    return ids, _normalised(scores, ids, True, routed_scaling_factor)


def sqrtsp_hash(logits, hash_ids, routed_scaling_factor: float):
    """sqrtsp_hash (DeepSeek-V4's hash layers): expert ids are given (`hash_ids` = tid2eid[input_ids], (m, k),
    kept in table order, no selection and no bias); weights = the learned gate's sqrt(softplus) scores of those
    ids, normalised over them, times `routed_scaling_factor`."""
    ids = np.asarray(hash_ids).astype(np.int64)
    return ids, _normalised(sqrt_softplus(logits), ids, True, routed_scaling_factor)


# Router family name -> function, for callers that dispatch on MoeConfig.router_for(layer).
ROUTERS = {"std": softmax_topk, "dots": sigmoid_group_topk, "sqrtsp": sqrtsp_topk, "sqrtsp_hash": sqrtsp_hash}
