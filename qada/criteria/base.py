"""The :class:`HeadCriterion` interface and the criterion registry."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from qada.functional.checks import check_head_mask
from qada.registry import Component, Registry
from qada.step import DecodeStep
from qada.window import Window

__all__ = ["CRITERIA", "HeadCriterion", "register_criterion"]


class HeadCriterion(Component, abc.ABC):
    """Decides, per row and query head, whether a decode step may use the local window.

    Subclasses are dataclasses (their fields are their configuration) that implement :meth:`decide`; most
    derive from a middle class instead, which does the plumbing once:
    :class:`~qada.criteria.ThresholdCriterion` (give a per-head log bulk mass, the base applies ``tau``) or
    :class:`~qada.criteria.BudgetCriterion` (give a per-head score, the base keeps a fraction of heads local).

    Declared needs (class attributes, read by the wrapper and the command line before any work):

    * ``needs_moments``: reads ``step.log_bulk_estimate`` (bulk key moments, e.g. QAdA): a moment source is
      prepared for it (a stored reference prompt is built or loaded).
    * ``needs_full_scores``: reads ``step.log_bulk`` (all ``T`` scores, e.g. the oracle): an O(T) analysis tool.
    * ``needs_calibration``: its configuration comes from a calibration run or artifact (e.g. a static mask).
    * ``static_shapes``: decides on a step over a whole preallocated buffer (``step.end``, see
      :class:`~qada.step.DecodeStep`) without host syncs, so the wrapper may run it on ``StaticCache`` buffers
      and inside CUDA graphs. False by default: a criterion that does not say so gets the filled part of the
      cache, sliced on the host. Every built-in criterion sets it.
    """

    needs_full_scores: ClassVar[bool] = False
    needs_moments: ClassVar[bool] = False
    needs_calibration: ClassVar[bool] = False
    static_shapes: ClassVar[bool] = False

    @abc.abstractmethod
    def decide(self, step: DecodeStep) -> torch.Tensor:
        """Return ``[b, H]`` bool, True = local."""

    def needs(self) -> dict[str, bool]:
        """What this criterion needs, by name (composites: what any child needs)."""
        return {"moments": self.needs_moments, "full_scores": self.needs_full_scores,
                "calibration": self.needs_calibration}

    def check_model(self, num_layers: int, num_heads: int) -> None:
        """Raise ``ValueError`` if this criterion cannot serve a model of ``num_layers`` layers with ``num_heads``
        query heads (e.g. an override of a layer it does not have); called once, when a run is bound to a model."""

    def to_device(self, device: torch.device) -> None:
        """Copy what the criterion reads at every step (masks, corrections) to ``device`` now, before decoding:
        called at the prefill, so that no tensor is first created inside a decode step (a CUDA graph's memory
        pool would own it). The default does nothing itself and passes the call to ``children()``, if any."""
        children = getattr(self, "children", None)
        for child in children() if callable(children) else ():
            child.to_device(device)

    def observe_prefill(self, layer: int, keys: torch.Tensor, queries: torch.Tensor | None, scale: float | None,
                        start: torch.Tensor | None, window: Window, capacity: int | None = None) -> None:
        """After the dense prefill of ``layer``: its keys ``[b, H_kv, T, d]`` and queries ``[b, H, T, d]`` (``None``
        when the cache was prefilled elsewhere), for criteria that keep state per layer (e.g. the tail-aware ones);
        ``capacity``: the slots of a preallocated cache. May read the host. The default does nothing itself and
        passes the call to ``children()``, if any."""
        children = getattr(self, "children", None)
        for child in children() if callable(children) else ():
            child.observe_prefill(layer, keys, queries, scale, start, window, capacity)

    def observe_append(self, layer: int, keys: torch.Tensor, end: torch.Tensor | None) -> None:
        """Before deciding a decode step of ``layer``: its cache ``keys [b, H_kv, T, d]`` holds the step's key at
        ``end - 1`` (``T - 1`` without ``end``). Inside a decode step: device work only, state updated in place.
        The default does nothing itself and passes the call to ``children()``, if any."""
        children = getattr(self, "children", None)
        for child in children() if callable(children) else ():
            child.observe_append(layer, keys, end)

    def bind_layers(self, global_layers: Sequence[int]) -> None:
        """Learn which layers are decided: the model's global layers, ascending (on a hybrid model the
        sliding-window layers pass through and never reach a criterion); called once, after :meth:`check_model`,
        when a run is bound to a model. The default does nothing itself and passes the call to the criterion's
        ``children()``, if it has any (composites); e.g. budget criteria spread their per-layer counts over the
        global layers only."""
        children = getattr(self, "children", None)
        for child in children() if callable(children) else ():
            child.bind_layers(global_layers)

    def prompt_queries(self) -> int:
        """How many of the prompt's last queries per layer :meth:`observe_prefill` needs (0: none). A run started
        from a cache prefilled elsewhere (:meth:`~qada.models.run.QAdARun.prefill_from_cache`) must be given at
        least that many. The default is the largest of ``children()``, if any, else 0."""
        children = getattr(self, "children", None)
        return max((child.prompt_queries() for child in (children() if callable(children) else ())), default=0)

    def extra_reads(self, step: DecodeStep) -> torch.Tensor | None:
        """``[b]`` key/value vectors this criterion reads per KV head and step beyond the window and the executor's
        reads (counted in the run's ``kv_read``), e.g. the exact set's keys and the page extrema of the
        tail-aware criteria; ``None``: none. The default sums those of ``children()``, if any."""
        children = getattr(self, "children", None)
        total = None
        for child in children() if callable(children) else ():
            extra = child.extra_reads(step)
            if extra is not None:
                total = extra if total is None else total + extra
        return total

    def fused_decision(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
        """The decision as a pure function of fixed-shape tensors,
        ``f(query [b, H, d], window_keys [b, H_kv, W, d], window_valid [b, W], mean, cov, t_bulk [b], scale)
        -> (local [b, H], fail_safe [b, H])``, that the wrapper may compile together with the moment source's step
        (:class:`qada.models.fused.FusedDecision`) on a preallocated buffer; ``None`` (the default): the criterion
        decides through :meth:`decide`. The fused step counts no :meth:`extra_reads`: a criterion that reads more
        than the window to decide keeps to :meth:`decide`."""
        return None

    def __call__(self, step: DecodeStep) -> torch.Tensor:
        local = self.decide(step)
        try:
            check_head_mask("local", local, step.batch_size, step.num_heads)
        except ValueError:
            expected = [step.batch_size, step.num_heads]
            got = f"{local.dtype} {tuple(local.shape)}" if isinstance(local, torch.Tensor) else type(local).__name__
            raise ValueError(
                f"criterion {self.registry_name or type(self).__name__!r} must return a bool tensor of shape "
                f"{expected} but returned {got}"
            ) from None
        return local


CRITERIA: Registry[HeadCriterion] = Registry("criterion", HeadCriterion)
register_criterion = CRITERIA.register
