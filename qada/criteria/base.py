"""The :class:`HeadCriterion` interface and the criterion registry."""

from __future__ import annotations

import abc
from collections.abc import Sequence
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

    :meth:`decide` is the one way to decide, eagerly and inside the run's compiled layer step alike
    (:mod:`qada.models.layer_step`): it reads the step's fixed-shape tensors and the criterion's own per-layer
    tensors (:meth:`layer_state`, read back with :meth:`state`), never the host. A criterion that does not keep to
    that still runs; the run then decides eagerly and says so once, in a warning
    (:func:`qada.testing.check_graph_safe` tells in a test).

    Declared needs (class attributes, read by the wrapper and the command line before any work):

    * ``needs_moments``: reads ``step.log_bulk_estimate`` (bulk key moments, e.g. QAdA): a moment source is
      prepared for it (a stored reference prompt is built or loaded).
    * ``needs_full_scores``: reads ``step.log_bulk`` (all ``T`` scores, e.g. the oracle): an O(T) analysis tool.
    * ``needs_calibration``: its configuration comes from a calibration run or artifact (e.g. a static mask).
    """

    needs_full_scores: ClassVar[bool] = False
    needs_moments: ClassVar[bool] = False
    needs_calibration: ClassVar[bool] = False

    @abc.abstractmethod
    def decide(self, step: DecodeStep) -> torch.Tensor:
        """Return ``[b, H]`` bool, True = local."""

    def children(self) -> list[HeadCriterion]:
        """The criteria this one wraps (composites); none by default."""
        return []

    def needs(self) -> dict[str, bool]:
        """What this criterion needs, by name (composites: what any child needs)."""
        return {"moments": self.needs_moments, "full_scores": self.needs_full_scores,
                "calibration": self.needs_calibration}

    def check_model(self, num_layers: int, num_heads: int) -> None:
        """Raise ``ValueError`` if this criterion cannot serve a model of ``num_layers`` layers with ``num_heads``
        query heads (e.g. an override of a layer it does not have); called once, when a run is bound to a model."""

    def bind_layers(self, global_layers: Sequence[int]) -> None:
        """Learn which layers are decided: the model's global layers, ascending (on a hybrid model the
        sliding-window layers pass through and never reach a criterion); called once, after :meth:`check_model`,
        when a run is bound to a model (e.g. budget criteria spread their per-layer counts over the global layers)."""

    def to_device(self, device: torch.device) -> None:
        """Copy what the criterion reads at every step (masks, corrections) to ``device`` now, before decoding:
        called at the prefill, so that no tensor is first created inside a decode step (a CUDA graph's memory
        pool would own it)."""

    def observe_prefill(self, layer: int, keys: torch.Tensor, queries: torch.Tensor | None, scale: float | None,
                        start: torch.Tensor | None, window: Window, capacity: int | None = None) -> None:
        """After the dense prefill of ``layer``: its keys ``[b, H_kv, T, d]`` and queries ``[b, H, T, d]`` (``None``
        when the cache was prefilled elsewhere), for criteria that keep state per layer (e.g. the tail-aware ones);
        ``capacity``: the slots of a preallocated cache. May read the host."""

    def prompt_queries(self) -> int:
        """How many of the prompt's last queries per layer :meth:`observe_prefill` needs (0: none). A run started
        from a cache prefilled elsewhere (:func:`~qada.eval.decode.prefill_from_cache`) must be given at
        least that many."""
        return 0

    def extra_reads(self, step: DecodeStep) -> torch.Tensor | None:
        """``[b]`` key/value vectors this criterion reads per KV head and step beyond the window and the executor's
        reads (counted in the run's ``kv_read``), e.g. the exact set's keys and the page extrema of the
        tail-aware criteria; ``None``: none."""
        return None

    # --- per-layer tensors ---------------------------------------------------------------------------------
    def layer_state(self, layer: int, slots: int) -> dict[str, torch.Tensor]:
        """The tensors :meth:`decide` reads (and may update in place) for ``layer`` of a cache of ``slots`` slots:
        per-layer constants (a static mask's row, a correction's slope) and state kept between steps (the
        tail-aware page extrema). The run gathers them before a step and passes them in, so one compiled step
        serves every layer; ``{}`` by default. Called outside the step: may allocate, never inside a CUDA graph."""
        return {}

    def state(self, step: DecodeStep) -> dict[str, torch.Tensor]:
        """This criterion's :meth:`layer_state` for ``step``: the tensors the run passed in, or (a step built by
        hand) ``layer_state(step.layer, step.length)`` on the step's device."""
        if step.states is not None:
            return step.states[self.state_key]
        return {name: tensor.to(step.device) for name, tensor in self.layer_state(int(step.layer), step.length).items()}

    @property
    def state_key(self) -> str:
        """Where :meth:`state` finds this criterion's tensors among a step's (set by :meth:`named_criteria`)."""
        return self.__dict__.get("_state_key", "criterion")

    def named_criteria(self, prefix: str = "criterion") -> list[tuple[str, HeadCriterion]]:
        """``(key, criterion)`` for this criterion and every child, depth first; gives each its :attr:`state_key`."""
        self.__dict__["_state_key"] = prefix
        named = [(prefix, self)]
        for index, child in enumerate(self.children()):
            named += child.named_criteria(f"{prefix}.{index}")
        return named

    def layer_states(self, layer: int, slots: int) -> dict[str, dict[str, torch.Tensor]]:
        """:meth:`layer_state` of this criterion and every child, by :attr:`state_key`: what a step reads."""
        return {key: criterion.layer_state(layer, slots) for key, criterion in self.named_criteria()}

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
