""":class:`BudgetCriterion`: per row and step, a target number of heads is local, chosen by a per-head score.

A subclass gives a score per head (higher = more reason to be local); the base keeps the ``k`` best heads of
each row local, with ``k`` spread over the layers so that their mean is ``sparsity * H`` (layer ``l`` gets
``floor(s H (l + 1) + 1/2) - floor(s H l + 1/2)``: a model with 9 heads per layer reaches sparsity 0.85 on
average instead of rounding every layer to 8/9), unless a subclass gives its own count per layer
(:meth:`BudgetCriterion.local_count`). On a hybrid model only the global layers are decided: once the criterion knows
them (:meth:`~qada.criteria.HeadCriterion.bind_layers`, called when a run is bound to a model) the count is spread
over the global layers' ordinals ``0..G-1`` instead of the raw layer indices, so the global layers' mean is the
target. Heads with a non-finite score are never local (fail-safe, counted);
the budget then goes to the best finite heads.
Equal sparsity makes budgeted criteria directly comparable with each other and with static masks.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qada.criteria.base import HeadCriterion
from qada.functional import check_threshold
from qada.functional.checks import check_head_scores
from qada.step import DecodeStep

__all__ = ["BudgetCriterion", "spread_count", "top_k_mask"]


def spread_count(per_layer: float, layer: int | torch.Tensor) -> int | torch.Tensor:
    """Layer ``layer``'s integer share of a fractional count ``per_layer`` (e.g. ``0.85 * 9``): the counts of layers
    ``0..l`` add up to ``floor(per_layer * (l + 1) + 1/2)``, so every prefix of layers is within half a head of
    the target and an integer ``per_layer`` is every layer's count. ``layer`` may be a 0-d integer tensor (then the
    count is one too, computed on its device in float64: the same numbers as on the host)."""
    if isinstance(layer, torch.Tensor):
        ordinal = layer.clamp(min=0).to(torch.float64)
        return (torch.floor(per_layer * (ordinal + 1) + 0.5) - torch.floor(per_layer * ordinal + 0.5)).long()
    layer = max(int(layer), 0)
    return int(math.floor(per_layer * (layer + 1) + 0.5) - math.floor(per_layer * layer + 0.5))


def top_k_mask(score: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """``[b, H]`` bool: True on the ``k`` highest scores of each row (ties: the lower head index first); ``k`` an int
    or a 0-d integer tensor (no host read: the rank of every head is compared with it)."""
    b, H = score.shape
    # a stable descending sort keeps equal scores in head order, so ties are deterministic
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    positions = torch.arange(H, device=score.device).expand(b, H)
    rank = torch.empty_like(order).scatter_(1, order, positions)
    return rank < k


@dataclass
class BudgetCriterion(HeadCriterion):
    """Keeps a fraction ``sparsity`` of the query heads of each row local, those with the highest :meth:`score`.

    Args:
        sparsity: target fraction of local heads per row and step, in ``[0, 1]``.
    """

    sparsity: float = 0.5

    def __post_init__(self) -> None:
        check_threshold("sparsity", self.sparsity)

    def bind_layers(self, global_layers: Sequence[int]) -> None:
        """Spread the per-layer counts over ``global_layers`` (their ordinals) instead of the raw layer indices."""
        self._layer_ordinal = {int(layer): index for index, layer in enumerate(sorted(global_layers))}

    def layer_ordinal(self, layer: int) -> int:
        """The position of ``layer`` among the decided layers (after :meth:`bind_layers`; else ``layer`` itself):
        the index :func:`spread_count` spreads over."""
        ordinals = getattr(self, "_layer_ordinal", None)
        return layer if ordinals is None else ordinals.get(layer, layer)

    def layer_state(self, layer: int, slots: int) -> dict[str, torch.Tensor]:
        """``ordinal``: the layer's :meth:`layer_ordinal` as a 0-d tensor (the step's count is computed from it)."""
        return {"ordinal": torch.tensor(self.layer_ordinal(layer), dtype=torch.long)}

    @abc.abstractmethod
    def score(self, step: DecodeStep) -> torch.Tensor:
        """``[b, H]`` floating score per head: higher = more reason to be local; NaN/inf = never local."""

    def local_count(self, step: DecodeStep) -> torch.Tensor:
        """How many heads of each row are local at this step (0-d tensor): :func:`spread_count` of
        ``sparsity * H`` over the (global) layers (``floor(sparsity * H + 1/2)`` when that is an integer)."""
        return spread_count(self.sparsity * step.num_heads, self.state(step)["ordinal"])

    def checked_score(self, step: DecodeStep) -> torch.Tensor:
        """:meth:`score`, checked to be ``[b, H]`` floating (a clear error names the criterion otherwise)."""
        score = self.score(step)
        try:
            check_head_scores("score", score, step.batch_size, step.num_heads)
        except ValueError as error:
            raise ValueError(f"criterion {self.registry_name or type(self).__name__!r}: {error}") from None
        return score

    def decide(self, step: DecodeStep) -> torch.Tensor:
        score = self.checked_score(step)
        finite = torch.isfinite(score)
        ranked = torch.where(finite, score, torch.full_like(score, float("-inf")))
        local = top_k_mask(ranked, self.local_count(step)) & finite
        step.note_fail_safe(~finite)
        return local
