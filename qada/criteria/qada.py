"""The QAdA criterion (paper eq. 7): the oracle test with the lognormal bulk estimate, O(d^2) per head."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from qada.criteria.base import register_criterion
from qada.criteria.threshold import ThresholdCriterion
from qada.functional.fused import qada_threshold_decision
from qada.step import DecodeStep

__all__ = ["QAdACriterion"]


@register_criterion("qada")
@dataclass
class QAdACriterion(ThresholdCriterion):
    """Local when ``A_local / (A_local + Â_bulk) >= tau`` with ``log Â_bulk = log T_bulk + mu_s + sigma_s^2/2``.

    The estimate needs the bulk key moments of the step (a moment source); a NaN/inf estimate makes the head
    dense and is counted in ``step.fail_safe``.

    Args:
        tau: threshold in ``[0, 1]``; higher means fewer local heads.
        compile: decide with :func:`qada.functional.fused.qada_threshold_decision` compiled by ``torch.compile``
            (inductor): one fused kernel instead of some sixty small operations per layer and step. Its inputs
            keep their shapes while the cache grows, so it compiles once (seconds) per batch size; decisions equal
            the eager ones except where the local ratio lies within float rounding of ``tau``. On a preallocated
            cache (``StaticCache``) the whole decision of a layer is compiled as one function with the moment
            source's step, the window gather, the group policy and the sparsities
            (:class:`qada.models.fused.FusedDecision`).
    """

    compile: bool = False
    needs_moments = True
    static_shapes = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.compile, bool):
            raise ValueError(f"expected compile to be a bool but got {self.compile!r}")
        self._compiled = None

    def log_bulk(self, step: DecodeStep) -> torch.Tensor:
        return step.log_bulk_estimate

    def fused_decision(self):
        """With ``compile=True``: :func:`~qada.functional.fused.qada_threshold_decision` at this ``tau`` (on a
        preallocated buffer the wrapper compiles it with the moment step, the window gather and the group policy:
        :class:`qada.models.fused.FusedDecision`)."""
        if not self.compile:
            return None
        return functools.partial(qada_threshold_decision, log_tau=self._log_tau())

    def _log_tau(self) -> float:
        return math.log(self.tau) if self.tau > 0 else float("-inf")

    def decide(self, step: DecodeStep) -> torch.Tensor:
        if not self.compile:
            return super().decide(step)
        if self._compiled is None:
            self._compiled = torch.compile(qada_threshold_decision, dynamic=False)
        mean, cov = step.bulk_moments
        log_tau = self._log_tau()
        valid = None if step.full_rows else step.window_valid
        local, broken = self._compiled(step.query, step.window_keys, valid, mean, cov, step.t_bulk, float(step.scale),
                                       log_tau)
        step.note_fail_safe(broken)
        return local
