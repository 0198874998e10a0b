"""Budgeted QAdA: per row and step, the ``sparsity`` fraction of heads that QAdA estimates most local are local.

QAdA (paper eq. 7) tests each head against a threshold, so how many heads are local varies with the prompt.
Ranking the same estimate instead and keeping a fixed number of heads local gives a criterion at a chosen
sparsity, directly comparable with a static mask of equal sparsity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qada.criteria.base import register_criterion
from qada.criteria.budget import BudgetCriterion, spread_count, top_k_mask
from qada.step import DecodeStep

__all__ = ["BudgetedQAdACriterion"]


@register_criterion("qada_budget")
@dataclass
class BudgetedQAdACriterion(BudgetCriterion):
    """Per row and step, the ``sparsity * H`` heads (spread over layers) with the highest estimated local share are
    local.

    The score of a head is QAdA's estimate of how local it is,

    .. math:: \\text{score} = \\log A_\\text{local} - \\log \\hat A_\\text{bulk}, \\qquad
        \\log \\hat A_\\text{bulk} = \\log T_\\text{bulk} + \\mu_s + \\sigma_s^2 / 2,

    a monotone function of QAdA's local ratio ``A_local / (A_local + Â_bulk)``: the heads QAdA would call local
    at some ``tau`` are the best-ranked ones here. Ties go to the lower head index. A head with a non-finite
    score is never local and is counted in ``step.fail_safe``; the budget then goes to the best finite heads.
    A row with no bulk (at most ``T_local`` real tokens) is entirely local, as for
    :class:`~qada.criteria.ThresholdCriterion`: the window is its whole context.

    With ``per_group=True`` the decision is made per KV group: a group's score is the minimum of its query heads'
    scores (the group is local only if all its heads can be), and the ``round(sparsity * H_kv)`` best groups are
    local, all their heads. Whole groups skip their bulk reads, so ``kv_sparsity`` equals the sparsity instead of
    about ``sparsity ** G`` (the concepts page, "GQA and bytes"). A group with a non-finite head score is never
    local; ``step.fail_safe`` counts the non-finite heads themselves, as in the per-head mode.

    Args:
        sparsity: fraction of the query heads (or, with ``per_group``, of the KV groups) local per row and step,
            in ``[0, 1]``.
        per_group: decide per KV group instead of per query head.
    """

    per_group: bool = False
    needs_moments = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.per_group, bool):
            raise ValueError(f"expected per_group to be a bool but got {self.per_group!r}")

    def score(self, step: DecodeStep) -> torch.Tensor:
        return step.log_local - step.log_bulk_estimate

    def group_count(self, step: DecodeStep) -> torch.Tensor:
        """How many KV groups of each row are local with ``per_group``: ``sparsity * H_kv`` spread over the (global)
        layers (:func:`~qada.criteria.budget.spread_count`, :meth:`layer_ordinal`)."""
        return spread_count(self.sparsity * step.num_kv_heads, self.state(step)["ordinal"])

    def decide(self, step: DecodeStep) -> torch.Tensor:
        score = self.checked_score(step)
        no_bulk = ~step.has_bulk.to(score.device)[:, None]  # [b, 1]: such rows are local whatever the score
        finite = torch.isfinite(score)
        if self.per_group:
            b, H_kv, G = step.batch_size, step.num_kv_heads, step.group_size
            group_finite = finite.view(b, H_kv, G).all(-1)
            group_score = torch.where(finite, score, torch.full_like(score, float("-inf"))).view(b, H_kv, G)
            group_score = torch.where(group_finite, group_score.amin(-1), float("-inf"))
            local_groups = top_k_mask(group_score, self.group_count(step)) & group_finite
            local = local_groups.repeat_interleave(G, dim=1)
        else:
            ranked = torch.where(finite, score, torch.full_like(score, float("-inf")))
            local = top_k_mask(ranked, self.local_count(step)) & finite
        step.note_fail_safe(~finite & ~no_bulk)
        return local | no_bulk
