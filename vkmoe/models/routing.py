"""Routers: token -> (expert ids, routing weights), as Hugging Face computes them, in numpy.

Ties break toward the lower expert index (a stable sort), so routing is deterministic and always picks
`top_k` distinct experts. Slots come out in descending score order, as torch.topk(sorted=True) gives.
"""
from __future__ import annotations

import numpy as np

__all__ = ["router_logits", "softmax_topk", "sigmoid_group_topk", "topk_desc"]


def router_logits(hidden, weight, dtype=np.float32) -> np.ndarray:
    """hidden (m, H) @ weight (E, H)^T in `dtype` (HF's nn.Linear router, no bias)."""
    dt = np.dtype(dtype)
    return np.asarray(hidden).astype(dt) @ np.asarray(weight).astype(dt).T


def topk_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, largest first, lower index first among equals. int64 (m, k)."""
    # Stable argsort of the negation keeps equal scores in index order; NaN would sort last, never selected.
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k].astype(np.int64)


def softmax_topk(logits, top_k: int, norm_topk_prob: bool):
    """Qwen3-MoE / Mixtral: softmax over all E logits, top-k, optional renormalisation over the top-k."""
    z = np.asarray(logits)
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    ids = topk_desc(p, top_k)
    w = np.take_along_axis(p, ids, axis=-1)
    if norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w


def sigmoid_group_topk(logits, bias, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                       routed_scaling_factor: float):
    """DeepSeek-V3 ("noaux_tc"): sigmoid scores; `bias` (e_score_correction_bias) shifts them for selection only.

    Group score = sum of the top-2 biased scores in the group; the best `topk_group` groups stay; top-k among
    their experts. Weights = the unbiased scores of the chosen experts, renormalised when `norm_topk_prob`,
    times `routed_scaling_factor`.
    """
    z = np.asarray(logits)
    dt = z.dtype
    with np.errstate(over="ignore"):  # exp overflow for very negative logits gives the right limit, 0
        scores = 1.0 / (1.0 + np.exp(-z))
    choice = scores + (np.zeros(z.shape[-1], dt) if bias is None else np.asarray(bias).astype(dt))
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
    w = np.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        w = w / (w.sum(axis=-1, keepdims=True) + dt.type(1e-20))
    return ids, w * dt.type(routed_scaling_factor)
