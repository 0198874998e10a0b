"""One layer's decision on a preallocated buffer as one compiled function (DESIGN §7: few launches).

Eagerly, a QAdA decode step of one layer is some 280 small operations before the attention itself: the moment
source's step, the window gather, eqs. 5-7, the threshold, the group policy and the sparsities, each a few
microseconds of dispatch on the CPU and a kernel launch on a GPU. When the criterion offers its decision as a
pure function (:meth:`~qada.criteria.HeadCriterion.fused_decision`, e.g. ``qada`` with ``compile=True``) and the
moment source its buffer step (:meth:`~qada.moments.MomentSource.fused_step`), :func:`fused_layer_decision`
chains them and ``torch.compile`` (inductor) turns the chain into a few fused kernels, compiled once per run and
shape: every layer and step reuses them, since the state tensors of a layer are arguments, not constants.
The executor then attends with what it computed (the gathered window, the group decision).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from qada.attention.group_policy import apply_group_policy, kv_read
from qada.functional.window import bulk_count, gather_window
from qada.step import BulkMoments

__all__ = ["FusedDecision", "LayerDecision", "fused_layer_decision"]


class LayerDecision(NamedTuple):
    """What :func:`fused_layer_decision` returns for one layer and step.

    Attributes:
        decided: ``[b, H]`` bool, the criterion's decision (True = local).
        local: ``[b, H]`` bool after the group policy; ``read``: ``[b, H_kv]`` bool, the bulks to read.
        window_keys, window_values: ``[b, H_kv, W, d]``; ``window_valid``: ``[b, W]`` bool.
        t_bulk: ``[b]`` bulk sizes; ``moments``: the step's bulk moments.
        counts: ``[5]`` float64: sparsity, kv_sparsity, 1 (a step), the heads forced dense (fail-safe) and
            kv_read, a row of :class:`~qada.models.statistics.DecodeStatistics`.
    """

    decided: torch.Tensor
    local: torch.Tensor
    read: torch.Tensor
    window_keys: torch.Tensor
    window_values: torch.Tensor
    window_valid: torch.Tensor
    t_bulk: torch.Tensor
    moments: BulkMoments
    counts: torch.Tensor


def fused_layer_decision(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor | None,
    end: torch.Tensor,
    scale: float,
    state: tuple[torch.Tensor, ...],
    *,
    moment_step: Callable[..., BulkMoments],
    decide: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    t_local: int,
    t_sink: int,
    policy: str,
) -> LayerDecision:
    """One layer's decode-step decision on a preallocated buffer, a pure function of device tensors.

    Args:
        query: ``[b, H, d]``; ``keys, values``: the whole buffer ``[b, H_kv, C, d]``; ``start``: ``[b]`` first real
            token of each row or ``None``; ``end``: ``[b]`` one past each row's last token.
        state: the moment source's tensors of this layer (:meth:`~qada.moments.MomentSource.fused_state`),
            updated in place by ``moment_step(*state, keys, start, end) -> BulkMoments``.
        decide: ``decide(query, window_keys, window_valid, mean, cov, t_bulk, scale) -> (local, fail_safe)``,
            each ``[b, H]`` bool (e.g. :func:`qada.functional.fused.qada_threshold_decision`, eqs. 2, 5-7).
        policy: the executor's group policy (``exact`` or ``promote``).
    """
    C = keys.shape[2]
    moments = moment_step(*state, keys, start, end)
    window_keys, valid = gather_window(keys, t_local, t_sink, start, end)
    window_values, _ = gather_window(values, t_local, t_sink, start, end)
    t_bulk = bulk_count(C, t_local, t_sink, start, end=end)
    decided, broken = decide(query, window_keys, valid, moments.mean, moments.cov, t_bulk, scale)
    local, read = apply_group_policy(decided, t_bulk > 0, keys.shape[1], policy)
    one = torch.ones_like(t_bulk[0], dtype=torch.float64)
    length = t_bulk + t_local  # the rows' real tokens where they have a bulk; a row without one reads all it has
    counts = torch.stack([local.double().mean(), (~read).double().mean(), one, broken.sum().double(),
                          kv_read(read, length, t_local)])
    return LayerDecision(decided, local, read, window_keys, window_values, valid, t_bulk, moments, counts)


class FusedDecision:
    """:func:`fused_layer_decision` for one run's criterion, moment source, window and group policy, compiled by
    ``torch.compile`` (``dynamic=False``) on first use; see :meth:`for_run` for when a run gets one."""

    def __init__(self, decide: Callable, moment_step: Callable, moment_state: Callable[[int, torch.device], tuple],
                 t_local: int, t_sink: int, policy: str) -> None:
        self.moment_state = moment_state
        self._bound = dict(moment_step=moment_step, decide=decide, t_local=t_local, t_sink=t_sink, policy=policy)
        self._compiled: Any = None

    @classmethod
    def for_run(cls, run: Any) -> FusedDecision | None:
        """A fused decision for ``run`` when its criterion offers a pure decision and its moment source a buffer
        step, else ``None`` (the run decides eagerly)."""
        decide = run.criterion.fused_decision()
        if decide is None or not run.uses_moments:
            return None
        moment_step = run.moments.fused_step(run.window)
        if moment_step is None:
            return None
        policy = getattr(run.executor, "group_policy", "exact")
        return cls(decide, moment_step, run.moments.fused_state, run.window.t_local, run.window.t_sink, policy)

    def __call__(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 start: torch.Tensor | None, end: torch.Tensor, scale: float) -> LayerDecision | None:
        """The decision of ``layer`` (``query [b, H, d]``, the whole buffer ``keys, values``), or ``None`` when the
        moment source holds no buffer state for it (then the run decides eagerly)."""
        state = self.moment_state(layer, keys.device)
        if state is None:
            return None
        if self._compiled is None:
            bound = self._bound

            def step(query, keys, values, start, end, scale, state):
                return fused_layer_decision(query, keys, values, start, end, scale, state, **bound)

            self._compiled = torch.compile(step, dynamic=False)
        return self._compiled(query, keys, values, start, end, float(scale), state)
