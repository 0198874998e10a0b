"""The ``reference`` executor: eager masked softmax over all ``T`` scores, the ground truth for tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from qada.attention.base import AttentionExecutor, GroupDecision, register_executor
from qada.functional.capping import softmax_with_sinks
from qada.functional.checks import accumulation_dtype
from qada.step import DecodeStep

__all__ = ["ReferenceExecutor"]


@register_executor("reference")
@dataclass
class ReferenceExecutor(AttentionExecutor):
    """Softmax over the local set (real tokens outside the bulk) for local heads, over all real tokens else (the
    step's soft cap applied to the scores and its sink logits in the denominator).

    Computes every score ``[b, H, T]`` in float32 (float64 for float64 inputs): O(T) per head, never cheap.
    """

    static_shapes = True

    def attend(self, step: DecodeStep, decision: GroupDecision) -> tuple[torch.Tensor, None]:
        real = _real(step)  # [b, T]
        allowed = torch.where(
            decision.local[:, :, None], (~step.bulk_mask & real)[:, None, :], real[:, None, :]
        )  # [b, H, T]
        scores = step.scores.masked_fill(~allowed, float("-inf"))  # [b, H, T] (soft-capped by the step)
        probs = softmax_with_sinks(scores, step.sink_logits)
        probs = rearrange(probs, "b (k g) t -> b k g t", g=step.group_size)
        dtype = accumulation_dtype(step.query, step.values)
        out = torch.einsum("bkgt,bktd->bkgd", probs.to(dtype), step.values.to(dtype))
        return rearrange(out, "b k g d -> b (k g) 1 d").to(step.query.dtype), None


def _real(step: DecodeStep) -> torch.Tensor:
    """``[b, T]`` bool: real (not padding) tokens."""
    if step.real is None:
        return torch.ones(step.batch_size, step.length, dtype=torch.bool, device=step.device)
    return step.real
