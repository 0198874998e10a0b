"""The QAdA criterion (paper eq. 7): the oracle test with the lognormal bulk estimate, O(d^2) per head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qada.criteria.base import register_criterion
from qada.criteria.threshold import ThresholdCriterion
from qada.step import DecodeStep

__all__ = ["QAdACriterion"]


@register_criterion("qada")
@dataclass
class QAdACriterion(ThresholdCriterion):
    """Local when ``A_local / (A_local + Â_bulk) >= tau`` with ``log Â_bulk = log T_bulk + mu_s + sigma_s^2/2``.

    The estimate needs the bulk key moments of the step (a moment source); a NaN/inf estimate makes the head
    dense and is counted in ``step.fail_safe``. Like every criterion it is compiled with the rest of the layer step
    by the run (``compile=`` of :func:`qada.apply`), not by a parameter of its own.

    Args:
        tau: threshold in ``[0, 1]``; higher means fewer local heads.
    """

    needs_moments = True

    def log_bulk(self, step: DecodeStep) -> torch.Tensor:
        return step.log_bulk_estimate
