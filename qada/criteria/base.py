"""The :class:`HeadCriterion` interface and the criterion registry."""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from qada.criteria.context import StepContext
from qada.registry import Component, Registry

__all__ = ["CRITERIA", "HeadCriterion", "register_criterion"]


class HeadCriterion(Component, abc.ABC):
    """Decides, per row and query head, whether a decode step may use the local window.

    Subclasses are dataclasses (their fields are their configuration) that implement :meth:`decide`.
    Capability flags tell the wrapper what to provide lazily:

    * ``needs_full_scores``: the criterion reads ``ctx.log_bulk`` (all ``T`` scores, e.g. the oracle);
    * ``needs_moments``: the criterion reads ``ctx.log_bulk_estimate`` (bulk key moments, e.g. QAdA).
    """

    needs_full_scores: ClassVar[bool] = False
    needs_moments: ClassVar[bool] = False

    @abc.abstractmethod
    def decide(self, ctx: StepContext) -> torch.Tensor:
        """Return ``[b, H]`` bool, True = local."""

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        local = self.decide(ctx)
        expected = (ctx.batch_size, ctx.num_heads)
        if not isinstance(local, torch.Tensor) or local.dtype != torch.bool or tuple(local.shape) != expected:
            got = f"{local.dtype} {tuple(local.shape)}" if isinstance(local, torch.Tensor) else type(local).__name__
            raise ValueError(
                f"criterion {self.registry_name or type(self).__name__!r} must return a bool tensor of shape "
                f"{list(expected)} but returned {got}"
            )
        return local


CRITERIA: Registry[HeadCriterion] = Registry("criterion", HeadCriterion)
register_criterion = CRITERIA.register
