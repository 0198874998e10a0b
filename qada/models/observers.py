"""Observers (Lightning-style callbacks) that see every decode decision of a wrapped model.

Recording is off by default: with no observer the wrapper builds no events. An observer that sets
``wants_oracle = True`` also gets the exact local ratio (full scores) and, where moments exist, the QAdA estimate
for the same query, so sparsity, oracle agreement and the lognormal log-error come from one run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from qada.step import DecodeStep

__all__ = ["DecisionEvent", "DecisionRecorder", "Observer", "ObserverFanout"]


@dataclass
class DecisionEvent:
    """One decode step of one layer.

    Attributes:
        layer, step: layer index and decode step since the last prefill (0-based).
        length: cache length ``T`` (padding included); ``t_bulk [b]`` bulk size per row.
        local: ``[b, H]`` the criterion's decision (True = local).
        effective_local: ``[b, H]`` what the executor did after its group policy.
        sparsity, kv_sparsity: 0-d tensors reported by the executor.
        log_local: ``[b, H]`` ``log A_local``.
        log_bulk: ``[b, H]`` exact ``log A_bulk`` (only for observers with ``wants_oracle``).
        log_bulk_estimate: ``[b, H]`` lognormal estimate (``wants_oracle`` and a moment source), else ``None``.
        score_mean, score_var: ``[b, H]`` ``mu_s`` and ``sigma_s^2`` behind that estimate (same condition).
    """

    layer: int
    step: int
    length: int
    t_bulk: torch.Tensor
    local: torch.Tensor
    effective_local: torch.Tensor
    sparsity: torch.Tensor
    kv_sparsity: torch.Tensor
    log_local: torch.Tensor | None = None
    log_bulk: torch.Tensor | None = None
    log_bulk_estimate: torch.Tensor | None = None
    score_mean: torch.Tensor | None = None
    score_var: torch.Tensor | None = None

    @property
    def oracle_ratio(self) -> torch.Tensor | None:
        """``[b, H]`` exact local ratio ``A_local / (A_local + A_bulk)`` (paper eq. 2), if recorded."""
        if self.log_bulk is None or self.log_local is None:
            return None
        return (self.log_local - torch.logaddexp(self.log_local, self.log_bulk)).exp()


class Observer:
    """Base class: override the hooks you need. ``wants_oracle`` asks for the exact masses (costs O(T))."""

    wants_oracle: bool = False

    def on_prefill(self, layer: int, length: int) -> None:
        """A dense prefill of ``layer`` finished with cache length ``length``."""

    def on_decision(self, event: DecisionEvent) -> None:
        """One decode decision was taken and executed."""


@dataclass
class DecisionRecorder(Observer):
    """Keeps every :class:`DecisionEvent` (tensors moved to the CPU) in ``events``.

    Args:
        wants_oracle: also record the exact bulk mass and the QAdA estimate for each decision.
    """

    wants_oracle: bool = False
    events: list[DecisionEvent] = field(default_factory=list)

    def on_decision(self, event: DecisionEvent) -> None:
        for name in ("t_bulk", "local", "effective_local", "sparsity", "kv_sparsity", "log_local", "log_bulk",
                     "log_bulk_estimate", "score_mean", "score_var"):
            value = getattr(event, name)
            if value is not None:
                setattr(event, name, value.detach().cpu())
        self.events.append(event)

    def clear(self) -> None:
        self.events.clear()


class ObserverFanout:
    """Sends every prefill and decision to a list of observers; builds events only when there is an observer.

    ``seconds``: the wall time spent on decisions' events (the exact masses an observer asks for included) and in
    the observers, so that a decoding rate can leave it out (host time: exact on the CPU; on a GPU the work it
    queues may finish later)."""

    def __init__(self, observers: Sequence[Observer] = ()) -> None:
        self.observers = list(observers)
        self.seconds = 0.0  # wall time spent building events and in the observers since the last reset

    def reset_time(self) -> None:
        self.seconds = 0.0

    def __bool__(self) -> bool:
        return bool(self.observers)

    @property
    def wants_oracle(self) -> bool:
        return any(o.wants_oracle for o in self.observers)

    def prefill(self, layer: int, length: int) -> None:
        for observer in self.observers:
            observer.on_prefill(layer, length)

    def decision(self, step: DecodeStep, local: torch.Tensor, result: Any) -> None:
        """``local`` from the criterion, ``result`` an :class:`~qada.attention.ExecutorOutput` of ``step``."""
        if not self.observers:
            return
        start = time.perf_counter()
        self._decision(step, local, result)
        self.seconds += time.perf_counter() - start

    def _decision(self, step: DecodeStep, local: torch.Tensor, result: Any) -> None:
        wants_oracle = self.wants_oracle
        estimate = score_mean = score_var = None
        if wants_oracle and step.has_moments:
            estimate = step.log_bulk_estimate
            score_mean, score_var = step.score_moments
        event = DecisionEvent(
            layer=step.layer,
            step=step.step,
            length=step.length,
            t_bulk=step.t_bulk,
            local=local,
            effective_local=result.local,
            sparsity=result.sparsity,
            kv_sparsity=result.kv_sparsity,
            log_local=step.log_local if wants_oracle else None,
            log_bulk=step.log_bulk if wants_oracle else None,
            log_bulk_estimate=estimate,
            score_mean=score_mean,
            score_var=score_var,
        )
        for observer in self.observers:
            observer.on_decision(event)
