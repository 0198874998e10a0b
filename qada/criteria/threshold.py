""":class:`ThresholdCriterion`: local when the local share of the attention mass reaches ``tau`` (paper eq. 2).

A subclass gives one number per head, its (exact or estimated) ``log A_bulk``; the base does the rest once:
the threshold test in log space, the no-bulk rule (a row with at most ``T_local`` real tokens is local), the
fail-safe (a non-finite value where a bulk exists makes the head dense and is counted), shape/dtype checks.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from qada.criteria.base import HeadCriterion
from qada.functional import check_threshold, finite_threshold_decision
from qada.functional.checks import check_head_scores
from qada.step import DecodeStep

__all__ = ["ThresholdCriterion"]


@dataclass
class ThresholdCriterion(HeadCriterion):
    """Local when ``A_local / (A_local + A_bulk) >= tau``; subclasses implement :meth:`log_bulk`.

    .. math:: \\text{local} \\iff \\log A_\\text{local} - \\operatorname{logaddexp}(\\log A_\\text{local},
        \\log A_\\text{bulk}) \\ge \\log \\tau

    Args:
        tau: threshold in ``[0, 1]``; higher means fewer local heads.
    """

    tau: float = 0.6

    def __post_init__(self) -> None:
        check_threshold("tau", self.tau)

    @abc.abstractmethod
    def log_bulk(self, step: DecodeStep) -> torch.Tensor:
        """``[b, H]`` floating ``log A_bulk`` of each head (exact or estimated); NaN/inf means "do not trust"."""

    def log_local(self, step: DecodeStep) -> torch.Tensor:
        """``[b, H]`` ``log A_local``: the exact mass of the local window unless a subclass says otherwise."""
        return step.log_local

    def decide(self, step: DecodeStep) -> torch.Tensor:
        log_bulk = self.log_bulk(step)
        log_local = self.log_local(step)
        name = self.registry_name or type(self).__name__
        for what, value in (("log_bulk", log_bulk), ("log_local", log_local)):
            try:
                check_head_scores(what, value, step.batch_size, step.num_heads)
            except ValueError as error:
                raise ValueError(f"criterion {name!r}: {error}") from None
        local, broken = finite_threshold_decision(log_local, log_bulk, self.tau, step.has_bulk)
        step.note_fail_safe(broken)
        return local
