"""Scores and log attention masses (paper §2): ``log A_local``, ``log A_bulk`` by logsumexp, in float32+.

Shapes: query ``[b, H, d]``, keys ``[b, H_kv, T, d]`` with ``H = G * H_kv`` (GQA: query heads ``g*G .. g*G+G-1``
share KV head ``g``, the layout of transformers' ``repeat_kv``). Scores are ``s_i = scale * q·k_i``.
"""

from __future__ import annotations

import torch

from qada.functional.checks import accumulation_dtype, check_float, check_ndim, group_size

__all__ = ["full_scores", "log_bulk_mass", "log_local_mass", "window_attention"]


def _grouped_scores(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``[b, H, d] x [b, H_kv, N, d] -> [b, H, N]`` scores in float32+, without repeating the keys."""
    check_float("query", query)
    check_float("keys", keys)
    check_ndim("query", query, 3, "[batch, heads, head_dim]")
    check_ndim("keys", keys, 4, "[batch, kv_heads, length, head_dim]")
    b, H, d = query.shape
    if keys.shape[0] != b or keys.shape[-1] != d:
        raise ValueError(
            f"expected keys of shape [{b}, kv_heads, length, {d}] to match query {tuple(query.shape)} "
            f"but got {tuple(keys.shape)}"
        )
    group_size(H, keys.shape[1])
    return grouped_scores_unchecked(query, keys, scale)


def grouped_scores_unchecked(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`full_scores` without the input checks, for callers that validated the shapes (the decode step)."""
    b, H, d = query.shape
    H_kv = keys.shape[1]
    dtype = accumulation_dtype(query, keys)
    q = query.to(dtype).view(b, H_kv, H // H_kv, d)  # the G query heads of each KV head
    s = torch.einsum("bkgd,bknd->bkgn", q, keys.to(dtype)) * scale
    return s.reshape(b, H, keys.shape[2])


def full_scores(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores ``[b, H, N]`` of one decode query against ``keys [b, H_kv, N, d]``: the whole cache (the oracle)
    or the gathered local window (:func:`qada.functional.gather_window`), without repeating the keys."""
    return _grouped_scores(query, keys, scale)


def _masked_logsumexp(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.ndim == 2:
        mask = mask[:, None, :]
    if mask.shape[-1] != scores.shape[-1]:
        raise ValueError(
            f"expected a mask over {scores.shape[-1]} positions but got mask of shape {tuple(mask.shape)}"
        )
    return torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)  # no host->device copy of a scalar


def log_local_mass(scores: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``log A_local = logsumexp_{i in I} s_i``: scores ``[b, H, N]``, mask ``[b, N]`` or ``[b, H, N]`` -> ``[b, H]``.

    An empty local set gives ``-inf``.
    """
    return _masked_logsumexp(scores, local)


def log_bulk_mass(scores: torch.Tensor, bulk: torch.Tensor) -> torch.Tensor:
    """``log A_bulk = logsumexp_{i in B} s_i`` (``-inf`` for an empty bulk). Same shapes as :func:`log_local_mass`."""
    return _masked_logsumexp(scores, bulk)


def window_attention(scores: torch.Tensor, log_local: torch.Tensor, values: torch.Tensor,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """Each head's softmax attention over the gathered window, from the scores the criterion computed already:
    ``o = sum_{i in I} e^{s_i - log A_local} v_i`` with ``scores [b, H, W]`` (float32, soft-capped where the model
    caps), ``log_local [b, H]`` (``log A_local``, the sink logits included: they take their share of the mass),
    ``values [b, H_kv, W, d]`` (the window's values, GQA without a repeat) and ``valid [b, W]`` (the slots holding
    a token of the row's window; ``None``: all) -> ``[b, H, d]`` in ``values``' dtype. A head without a window token
    gets ``0``."""
    b, H, W = scores.shape
    H_kv, d = values.shape[1], values.shape[3]
    weights = (scores.float() - log_local.float()[..., None]).exp()
    if valid is not None:
        weights = weights.masked_fill(~valid[:, None, :], 0.0)
    dtype = accumulation_dtype(weights, values)
    output = torch.einsum("bkgn,bknd->bkgd", weights.to(dtype).view(b, H_kv, H // H_kv, W), values.to(dtype))
    return output.reshape(b, H, d).to(values.dtype)
