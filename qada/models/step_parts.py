"""The parts every route of a layer step shares (:func:`~qada.models.layer_step.layer_step`, the fused step of
:mod:`qada.models.fused_step`, the dense one of :mod:`qada.models.dense_step`): what a step returns
(:class:`LayerStepResult`), the :class:`~qada.step.DecodeStep` it begins with, the moment source's step, the rows'
ends and the statistics row."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from qada.criteria.base import HeadCriterion
from qada.models.statistics import step_row
from qada.moments.base import MomentSource
from qada.step import BulkMoments, DecodeStep
from qada.window import Window

__all__ = ["LayerStepResult", "advance_moments", "begin_step", "new_step", "rows_end", "statistics_row"]


class LayerStepResult(NamedTuple):
    """What :func:`~qada.models.layer_step.layer_step` returns.

    Attributes:
        decided: ``[b, H]`` bool, the criterion's decision (True = local).
        local: ``[b, H]`` bool after the group policy; ``read``: ``[b, H_kv]`` bool, the bulks to read. All three
            ``None`` from the ``dense`` criterion's step (:func:`~qada.models.dense_step.dense_layer_step`), which
            computes no decision.
        counts: ``[1, 5]`` float64, the step's row of :class:`~qada.models.statistics.DecodeStatistics`.
        fail_safe: 0-d, the heads the criterion forced dense (non-finite values).
        window_keys, window_values: ``[b, H_kv, W, d]``; ``window_valid``: ``[b, W]`` bool.
        t_bulk: ``[b]`` bulk sizes (``None`` from a fused step: computed on demand); ``real``: ``[b, C]`` bool, the
            slots holding a row's tokens, where the step computed it (:attr:`~qada.step.DecodeStep.real_if_computed`;
            ``None``: the executor computes it where it needs it, :attr:`~qada.step.DecodeStep.real`; the ``sdpa``
            executor needs it only for rows of unequal bounds; a mask of every slot cost ~35 us of a ~355 us step in a
            loop over one layer's arguments at 7.68k).
        moments: the step's bulk moments (``None`` without a moment source).
        query, start, end: the step's ``[b, H, d]`` query and its rows' bounds as the step checked them.
        extra_output, log_extra, log_local: where the criterion asked local heads to attend over an extra set too
            (:meth:`~qada.step.DecodeStep.attend_also`): that set's attention ``[b, H, d]`` and mass ``[b, H]``, and
            the window's mass (sink logits included) to merge them with the executor's output
            (:func:`~qada.functional.extra_set.merge_extra`); else ``None``, also where the step merged them into
            ``window_output`` already.
        output, bulk_blocks: where the executor made the decision in its kernel
            (:meth:`~qada.models.layer_step.LayerStep.fuse`): the attention ``[b, H, 1, d]`` and its 0-d bulk-only
            block count; the window fields are then ``None``; else ``None``.
        window_output: ``[b, H, d]`` every head's attention over its window, from the criterion's window scores
            (:func:`~qada.functional.masses.window_attention`), where the executor uses it (``attend_window``);
            with an extra set, over ``window ∪ E`` (:func:`~qada.functional.extra_set.merge_masses`: what a local
            head attends to, so the executor's output needs no merge); else ``None``.
        host_plan: the ``int64`` vector the host-skipping executor reads (:func:`~qada.attention.sdpa.pack_host_plan`:
            ``read``, ``local``, ``end``, ``start``), where it asks for it (``host_plan``); else ``None``.
    """

    decided: torch.Tensor | None
    local: torch.Tensor | None
    read: torch.Tensor | None
    counts: torch.Tensor
    fail_safe: torch.Tensor
    window_keys: torch.Tensor
    window_values: torch.Tensor
    window_valid: torch.Tensor
    t_bulk: torch.Tensor | None
    real: torch.Tensor | None
    moments: BulkMoments | None
    query: torch.Tensor
    start: torch.Tensor | None
    end: torch.Tensor | None
    extra_output: torch.Tensor | None = None
    log_extra: torch.Tensor | None = None
    log_local: torch.Tensor | None = None
    output: torch.Tensor | None = None
    bulk_blocks: torch.Tensor | None = None
    window_output: torch.Tensor | None = None
    host_plan: torch.Tensor | None = None


def begin_step(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor | None,
               end: torch.Tensor | None, scale: float, layer: torch.Tensor,
               moment_state: dict[str, torch.Tensor] | None, criterion_states: dict[str, dict[str, torch.Tensor]],
               sink_logits: torch.Tensor | None, softcap: float | None, moments: MomentSource | None,
               window: Window, step_moments: Any = None) -> tuple[DecodeStep, BulkMoments | None]:
    """The moment source's step (rows ending at ``end``, or at ``C``; ``step_moments``, with the arguments of
    :meth:`~qada.moments.MomentSource.step`, instead of it where given) and the :class:`~qada.step.DecodeStep` of
    :func:`~qada.models.layer_step.layer_step`'s arguments: ``(step, bulk moments or None)``: :func:`new_step`, then
    :func:`advance_moments`."""
    step = new_step(query, keys, values, start, end, scale, layer, criterion_states, sink_logits, softcap, window)
    return step, advance_moments(step, keys, start, end, layer, moment_state, moments, window, step_moments)


def new_step(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor | None,
             end: torch.Tensor | None, scale: float, layer: torch.Tensor,
             criterion_states: dict[str, dict[str, torch.Tensor]], sink_logits: torch.Tensor | None,
             softcap: float | None, window: Window) -> DecodeStep:
    """The :class:`~qada.step.DecodeStep` of :func:`~qada.models.layer_step.layer_step`'s arguments, its moments not
    stepped yet (:func:`advance_moments` sets them)."""
    return DecodeStep(query[:, :, 0], keys, scale, window, layer=layer, start=start, end=end, values=values,
                      states=criterion_states, sink_logits=sink_logits, softcap=softcap)


def advance_moments(step: DecodeStep, keys: torch.Tensor, start: torch.Tensor | None, end: torch.Tensor | None,
                    layer: torch.Tensor, moment_state: dict[str, torch.Tensor] | None, moments: MomentSource | None,
                    window: Window, step_with: Any = None) -> BulkMoments | None:
    """The moment source's step for ``step`` (rows ending at ``end``, or at ``C``; ``step_with``, with the arguments
    of :meth:`~qada.moments.MomentSource.step`, instead of it where given), the step's moments set to the result:
    the bulk moments, or ``None`` without a source."""
    bulk = None
    if moments is not None:
        # (an explicit None test: torch 2.11's dynamo cannot take the truth value of a functools.partial)
        moment_step = step_with if step_with is not None else moments.step
        bulk = moment_step(moment_state, keys, start, rows_end(end, layer, keys), window)
    step.moments = bulk
    return bulk


def rows_end(end: torch.Tensor | None, layer: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The rows' ends ``[b]`` a moment step takes: ``end``, or, on a cache whose rows all end at its length ``C``
    (``keys [b, H_kv, C, d]``), ``C`` for each row (a device value made from the layer's index tensor ``layer``: no
    host data in a compiled step)."""
    return end if end is not None else torch.full_like(layer, keys.shape[2]).expand(keys.shape[0])


def statistics_row(step: DecodeStep, local: torch.Tensor, read: torch.Tensor, forced: torch.Tensor | None,
                   criterion: HeadCriterion) -> torch.Tensor:
    """The step's ``[5]`` statistics (:func:`~qada.models.statistics.step_row`), ``forced [b, H]`` the heads forced
    dense (:attr:`~qada.step.DecodeStep.forced_heads`), ``kv_read`` counting the bulks ``read [b, H_kv]`` reads and
    the criterion's :meth:`~qada.criteria.HeadCriterion.extra_reads`."""
    window = step.window
    return step_row(local, read, step.t_bulk + window.t_local, window.t_local, criterion.extra_reads(step), forced)
