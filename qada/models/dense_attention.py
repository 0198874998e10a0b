"""Dense attention for what qada does not decide on: the prompt (prefill) and sliding-window layers.

Plain attention runs transformers' own SDPA function. With sink logits or a soft cap (which SDPA cannot do) it runs
:func:`masked_attention`, the model's eager math: scores, cap, mask, softmax with the sink logits in the
denominator, values.
"""

from __future__ import annotations

from typing import Any

import torch

from qada.functional.capping import soft_cap, softmax_with_sinks
from qada.models.attention_features import PLAIN, AttentionFeatures

__all__ = ["dense_attention", "masked_attention"]

QUERY_CHUNK = 1024
"""Queries per block of :func:`masked_attention` (its scores take ``chunk x T`` floats per head)."""


def dense_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float, kwargs: dict[str, Any],
                    features: AttentionFeatures) -> torch.Tensor:
    """Dense attention of ``query [b, H, q, d]`` over ``key, value [b, H_kv, T, d]`` with the model's mask ->
    ``[b, q, H, d]`` (transformers' layout)."""
    if features.plain:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)[0]
    return masked_attention(query, key, value, attention_mask, scaling, features)


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float, features: AttentionFeatures = PLAIN) -> torch.Tensor:
    """Softmax attention with ``features`` (soft cap, sink logits), ``[b, H, q, d]`` x ``[b, H_kv, T, d]`` ->
    ``[b, q, H, d]``; ``attention_mask`` ``[b, 1, q, T]`` bool (True: attend) or additive, ``None``: causal with
    the queries at the last ``q`` positions. Accumulates in float32 (float64 for float64 inputs)."""
    b, H, q_len, d = query.shape
    H_kv, T = key.shape[1], key.shape[2]
    G = H // H_kv
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    k = key.to(dtype).repeat_interleave(G, dim=1)  # [b, H, T, d]
    v = value.to(dtype).repeat_interleave(G, dim=1)
    sink = None if features.sink_logits is None else features.sink_logits.to(device=query.device, dtype=dtype)
    out = []
    for lo in range(0, q_len, QUERY_CHUNK):
        hi = min(lo + QUERY_CHUNK, q_len)
        scores = soft_cap(query[:, :, lo:hi].to(dtype) @ k.transpose(-1, -2) * scaling, features.softcap)
        if attention_mask is None:
            position = torch.arange(lo, hi, device=query.device)[:, None] + (T - q_len)
            scores = scores.masked_fill(torch.arange(T, device=query.device)[None, :] > position, float("-inf"))
        else:
            mask = attention_mask[:, :, lo:hi, :T]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(dtype)
        probabilities = softmax_with_sinks(scores, sink).nan_to_num(0.0)  # a row with nothing to attend: zeros
        out.append(probabilities @ v)
    joined = out[0] if len(out) == 1 else torch.cat(out, dim=2)  # (one block, a decode step: no copy)
    return joined.transpose(1, 2).to(query.dtype)
