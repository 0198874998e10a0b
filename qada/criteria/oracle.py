"""The oracle criterion (paper eq. 2): exact local ratio from all scores. An analysis tool, O(T) per head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qada.criteria.base import register_criterion
from qada.criteria.threshold import ThresholdCriterion
from qada.step import DecodeStep

__all__ = ["OracleCriterion"]


@register_criterion("oracle")
@dataclass
class OracleCriterion(ThresholdCriterion):
    """Local when ``A_local / (A_local + A_bulk) >= tau``, with ``A_bulk`` summed over every bulk key.

    Args:
        tau: threshold in ``[0, 1]``; higher means fewer local heads.
    """


    needs_full_scores = True

    def log_bulk(self, step: DecodeStep) -> torch.Tensor:
        return step.log_bulk
