"""Budgeted QAdA: per row and step, the ``sparsity`` fraction of heads that QAdA estimates most local are local.

QAdA (paper eq. 7) tests each head against a threshold, so how many heads are local varies with the prompt.
Ranking the same estimate instead and keeping a fixed number of heads local gives a criterion at a chosen
sparsity, directly comparable with a static mask of equal sparsity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from qada.criteria.base import register_criterion
from qada.criteria.budget import BudgetCriterion, spread_count, top_k_mask
from qada.functional import check_threshold
from qada.functional.static import allocate_local_counts
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

    With ``allocation`` (a static calibration artifact's oracle local frequencies, from other prompts) the budget is
    spread over the layers by that calibration instead of evenly: layer ``l`` keeps the number of its heads (groups)
    among the ``round(sparsity L H)`` most frequently local ones of the model
    (:func:`~qada.functional.static.allocate_local_counts`), so layers whose heads often need the bulk get more dense
    heads and the mean sparsity is the same. The score still picks which heads, per query.

    Args:
        sparsity: fraction of the query heads (or, with ``per_group``, of the KV groups) local per row and step,
            in ``[0, 1]``.
        per_group: decide per KV group instead of per query head.
        allocation: path of a static calibration artifact (``qada calibrate``) that allocates the budget over the
            layers; ``None``: the same fraction in every layer.
        allocation_weight: with ``allocation``, how far the calibration moves each layer's count from the even
            spread, in ``[0, 1]`` (1: the calibrated counts; 0.5: halfway).
    """

    per_group: bool = False
    allocation: str | None = None
    allocation_weight: float = 1.0
    needs_moments = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.per_group, bool):
            raise ValueError(f"expected per_group to be a bool but got {self.per_group!r}")
        self._frequency = None
        check_threshold("allocation_weight", self.allocation_weight)
        if self.allocation is not None:
            if not isinstance(self.allocation, (str, os.PathLike)):
                raise ValueError(f"expected allocation to be the path of a calibration artifact but got "
                                 f"{self.allocation!r}")
            from qada.criteria.hybrid import load_local_frequency

            self.allocation = os.fspath(self.allocation)
            self._frequency = load_local_frequency(self.allocation)

    def check_model(self, num_layers: int, num_heads: int) -> None:
        if self._frequency is not None and tuple(self._frequency.shape) != (num_layers, num_heads):
            raise ValueError(f"expected the allocation {self.allocation!r} of shape [{num_layers}, {num_heads}] for "
                             f"this model but got {list(self._frequency.shape)}")
        super().check_model(num_layers, num_heads)
        self._num_heads = num_heads

    def layer_state(self, layer: int, slots: int) -> dict[str, torch.Tensor]:
        """Besides the base's ``ordinal``, the layer's local ``count`` of heads, or with :attr:`per_group` its
        ``group_count_<G>`` of KV groups for every group size ``G`` dividing ``H`` (0-d each; the step picks its
        own): the :attr:`allocation`'s, else :func:`~qada.criteria.budget.spread_count`'s, computed here on the host
        once the model's ``H`` is known (:meth:`check_model`), so that a step reads them instead of computing them."""
        state = super().layer_state(layer, slots)
        if self._frequency is None:
            H = self.__dict__.get("_num_heads")
            if H is None:
                return state
            ordinal = self.layer_ordinal(layer)
            if not self.per_group:
                return {**state, "count": torch.tensor(spread_count(self.sparsity * H, ordinal))}
            return {**state, **{f"group_count_{g}": torch.tensor(spread_count(self.sparsity * (H // g), ordinal))
                                for g in range(1, H + 1) if H % g == 0}}
        L, H = self._frequency.shape
        if not 0 <= layer < L:
            raise ValueError(f"allocation of {L} layers does not fit layer {layer}")
        counts = self.__dict__.setdefault("_counts", {})
        sizes = [g for g in range(1, H + 1) if H % g == 0] if self.per_group else [1]
        for g in sizes:
            if g not in counts:
                counts[g] = allocate_local_counts(self._frequency, self.sparsity, g, self.allocation_weight)
        if not self.per_group:
            return {**state, "count": counts[1][layer].clone()}
        return {**state, **{f"group_count_{g}": counts[g][layer].clone() for g in sizes}}

    def local_count(self, step: DecodeStep) -> torch.Tensor:
        state = self.state(step)
        return state["count"] if "count" in state else super().local_count(step)

    def score(self, step: DecodeStep) -> torch.Tensor:
        return step.log_local - step.log_bulk_estimate

    def group_count(self, step: DecodeStep) -> torch.Tensor:
        """How many KV groups of each row are local with ``per_group``: ``sparsity * H_kv`` spread over the (global)
        layers (:func:`~qada.criteria.budget.spread_count`, :meth:`layer_ordinal`), or the allocation's count."""
        state = self.state(step)
        if f"group_count_{step.group_size}" in state:
            return state[f"group_count_{step.group_size}"]
        return spread_count(self.sparsity * step.num_kv_heads, state["ordinal"])

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
