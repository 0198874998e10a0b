"""The ``reference`` executor: eager masked softmax over all ``T`` scores, the ground truth for tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qada.attention.base import AttentionExecutor, register_executor
from qada.functional import bulk_mask, full_scores
from qada.functional.checks import accumulation_dtype
from qada.window import Window

__all__ = ["ReferenceExecutor"]


@register_executor("reference")
@dataclass
class ReferenceExecutor(AttentionExecutor):
    """Softmax over the local set (real tokens outside the bulk) for local heads, over all real tokens else.

    Computes every score ``[b, H, T]`` in float32 (float64 for float64 inputs): O(T) per head, never cheap.
    """

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        local: torch.Tensor,
        read: torch.Tensor,
        window: Window,
        scale: float,
        start: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        b, H, _, d = query.shape
        H_kv, T = key.shape[1], key.shape[2]
        starts = start if start is not None else torch.zeros(b, dtype=torch.long, device=query.device)
        real = torch.arange(T, device=query.device)[None, :] >= starts[:, None]  # [b, T]
        in_window = real & ~bulk_mask(T, window.t_local, window.t_sink, starts)  # [b, T]
        allowed = torch.where(local[:, :, None], in_window[:, None, :], real[:, None, :])  # [b, H, T]
        scores = full_scores(query[:, :, 0], key, scale)  # [b, H, T]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(b, H_kv, H // H_kv, T)
        dtype = accumulation_dtype(query, value)
        out = torch.einsum("bkgt,bktd->bkgd", probs.to(dtype), value.to(dtype))
        return out.reshape(b, H, 1, d).to(query.dtype), None
