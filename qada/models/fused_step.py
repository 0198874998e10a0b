"""The layer step whose decision is made in the attention kernel (the ``triton_fused`` executor).

:func:`fused_layer_step` is :func:`~qada.models.layer_step.layer_step` for a run whose criterion is the plain ``qada``
threshold rule (:class:`~qada.criteria.QAdACriterion`), the tail-aware ``qada_tail`` one
(:class:`~qada.criteria.TailCriterion`: its layer's tail index goes to the kernel, which also updates it), a budget
on either estimate (``qada_budget``, ``qada_tail_budget``: :class:`~qada.criteria.BudgetedQAdACriterion`,
:class:`~qada.criteria.TailBudgetCriterion`) and whose executor fuses the
decision (:class:`~qada.attention.FusedTritonExecutor`): three launches and no other device work, whatever the
decision: the moment source's step (:mod:`qada.attention.moment_step`, which also writes each query head's ``log
E[exp(s)]`` from the new moments, the query side of the lognormal estimate; a source without a kernel steps in torch,
and that estimate is then a launch of its own), the decision with the split-K attention, and the combine, whose last
program also writes the step's statistics row; five for the budget (its scores, then the ranking of each row's heads,
then the ``triton`` split). With ``decide_once`` the plain ``qada`` decision is made by the moment step's launch
(:class:`~qada.attention.moment_step.EstimateDecision`), and the split is the ``triton`` executor's.
It returns the same :class:`~qada.models.step_parts.LayerStepResult` (the window fields ``None``: nothing gathers
the window; a step computes it on demand) with the attention's ``output`` and ``bulk_blocks``, which the run takes
instead of calling the executor.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from qada.criteria.base import HeadCriterion
from qada.models.step_parts import LayerStepResult, advance_moments, new_step, rows_end
from qada.moments.base import MomentSource
from qada.step import BulkMoments, DecodeStep
from qada.window import Window

__all__ = ["advance_after_prefill", "check_fusable", "fused_budget", "fused_layer_step", "fused_moment_step",
           "fused_tail", "has_step_kernel", "held_moments", "is_fusable", "moment_step_rider", "steps_moments_ahead"]


def check_fusable(criterion: HeadCriterion, moments: MomentSource | None, executor: Any) -> None:
    """Raise ``ValueError`` unless ``executor`` can make ``criterion``'s decision with a moment source: the plain
    ``qada`` criterion (not a subclass, which may change the estimate), the budgeted ``qada_budget``
    (:class:`~qada.criteria.BudgetedQAdACriterion`: per head or group, an allocation), or the tail-aware
    ``qada_tail`` (:class:`~qada.criteria.TailCriterion`) or ``qada_tail_budget``
    (:class:`~qada.criteria.TailBudgetCriterion`), not subclasses, with any of their settings (a page hierarchy,
    ``attend_exact``, ``scale_exact``)."""
    from qada.criteria.budgeted import BudgetedQAdACriterion
    from qada.criteria.qada import QAdACriterion
    from qada.criteria.tail import TailBudgetCriterion, TailCriterion

    name = executor if isinstance(executor, str) else getattr(executor, "registry_name", "") or type(executor).__name__
    if type(criterion) not in (QAdACriterion, BudgetedQAdACriterion, TailCriterion, TailBudgetCriterion):
        raise ValueError(
            f"the {name!r} executor makes the decision of the plain 'qada' criterion, or of 'qada_budget', "
            f"'qada_tail' or 'qada_tail_budget', in its kernel, but the run's criterion is "
            f"{criterion.registry_name or type(criterion).__name__!r}: use the 'triton' executor, which attends "
            "for any criterion"
        )
    if moments is None:
        raise ValueError(f"the {name!r} executor needs the run's moment source (the "
                         f"{criterion.registry_name!r} criterion reads moments)")


def is_fusable(criterion: HeadCriterion, moments: MomentSource | None) -> bool:
    """Whether a fused executor can make ``criterion``'s decision with ``moments`` (:func:`check_fusable` passes)."""
    try:
        check_fusable(criterion, moments, "triton_fused")
    except ValueError:
        return False
    return True


def fused_tail(criterion: HeadCriterion, step: DecodeStep) -> Any:
    """The :class:`~qada.attention.fused.FusedTail` of ``step`` (its layer's tail index, passed in by the run) for a
    ``qada_tail`` or ``qada_tail_budget`` criterion, else ``None`` (``qada``, ``qada_budget``)."""
    from qada.attention.fused import FusedTail
    from qada.criteria.tail import TailEstimate

    if not isinstance(criterion, TailEstimate):
        return None
    state = criterion.state(step)
    heavy, pages, super_pages = criterion.read_sizes(step)  # (scale_exact: the sizes of this cache)
    return FusedTail(state["heavy"], state["heavy_valid"], state["member"], state["kmin"], state["kmax"],
                     state["halves"], criterion.page_size, pages, heavy, state.get("super_kmin"),
                     state.get("super_kmax"), state.get("super_halves"), criterion.super_page,
                     super_pages, criterion.attend_exact)


def fused_budget(criterion: HeadCriterion, step: DecodeStep) -> Any:
    """The :class:`~qada.attention.fused.FusedBudget` of ``step`` for a ``qada_budget`` or ``qada_tail_budget``
    criterion (its layer's count of local heads or groups, from the criterion's layer state: computed once per layer
    on the host, or, for a criterion never bound to a model, on the device from the layer's ordinal), else
    ``None``."""
    from qada.attention.fused import FusedBudget
    from qada.criteria.budgeted import BudgetedQAdACriterion
    from qada.criteria.tail import TailBudgetCriterion

    if type(criterion) not in (BudgetedQAdACriterion, TailBudgetCriterion):
        return None
    if criterion.per_group:
        return FusedBudget(criterion.group_count(step), True)
    return FusedBudget(criterion.local_count(step), False)


def fused_layer_step(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor | None,
    end: torch.Tensor | None,
    scale: float,
    layer: torch.Tensor,
    moment_state: dict[str, torch.Tensor] | None,
    criterion_states: dict[str, dict[str, torch.Tensor]],
    sink_logits: torch.Tensor | None = None,
    softcap: float | None = None,
    sums: torch.Tensor | None = None,
    *,
    criterion: HeadCriterion,
    moments: MomentSource,
    window: Window,
    policy: str,
    executor: Any,
) -> Any:
    """:func:`~qada.models.layer_step.layer_step` (same arguments) with the moment step, the decision, the attention
    and the statistics row made by the executor's launches (:func:`fused_moment_step`,
    then ``executor.decide_and_attend`` at ``criterion.tau``): ``query [b, H, 1, d]``, ``keys, values [b, H_kv, C,
    d]``. Returns a :class:`~qada.models.step_parts.LayerStepResult` whose ``output [b, H, 1, d]`` is the
    attention. A moment source without a kernel steps in torch (:meth:`~qada.moments.MomentSource.step`)."""
    step = new_step(query, keys, values, start, end, scale, layer, criterion_states, sink_logits, softcap, window)
    tail = fused_tail(criterion, step)  # (None: the plain qada criterion, or qada_budget)
    budget = fused_budget(criterion, step)
    decision = None  # the plain qada decision made once per group: by the moment step's launch
    if budget is None and executor.decides_in_estimate(tail is not None):
        decision = executor.estimate_decision(query[:, :, 0], keys, start, end, sink_logits, criterion.tau, policy,
                                              window)
    # a qada_tail step's page-top programs (if its pages are spread) run in the moment step's launch
    page_tops = None if tail is None else executor.page_tops(step, tail)
    estimate = rider = None  # the estimate computed by the split launch itself (estimate_in_splits), or:
    if not executor.estimates_in_splits(tail, budget):  # by the moment step's launch
        estimate = executor.bulk_estimate(query[:, :, 0], scale, softcap, decision, page_tops)
    elif steps_moments_ahead(criterion, moments, executor, moment_state):  # this step's already (the prefill or the
        # last step's combine stepped them): the next step's in the combine launch
        rider = moment_step_rider(moments, moment_state, keys, start, rows_end(end, layer, keys), window)
    if rider is not None:
        step.moments = held_moments(moment_state)
        bulk = None  # (overwritten by the combine launch: not kept for later readers)
    else:
        bulk = advance_moments(step, keys, start, end, layer, moment_state, moments, window,
                               functools.partial(fused_moment_step, moments, estimate=estimate))
    tau = 0.0 if budget is not None else criterion.tau  # (a budget ranks: no threshold)
    add_to = None if sums is None else (sums, layer)  # the combine launch adds the row to sums[layer]
    launch = executor.decide_and_attend(step, tau, policy, tail, budget, add_to,
                                        log_mean_exp=None if estimate is None else estimate.out,
                                        decision=decision, page_tops=page_tops, moment_rider=rider)
    counts = launch.row
    return LayerStepResult(launch.decided, launch.local, launch.read, counts[None], counts[3], None, None, None,
                           None, None, bulk, step.query, step.start, step.end,
                           output=launch.output, bulk_blocks=launch.bulk_blocks)


def has_step_kernel(moments: MomentSource | None, state: dict[str, torch.Tensor] | None) -> bool:
    """Whether ``moments`` steps ``state`` (its :meth:`~qada.moments.MomentSource.step_state`) in a kernel of its
    own (:mod:`qada.attention.moment_step`): the plain ``current`` source stepping every key (not frozen, not in
    blocks), the plain ``stored`` one."""
    from qada.moments.current import CurrentMoments
    from qada.moments.stored import StoredMoments

    if state is None:
        return False
    if type(moments) is CurrentMoments:
        return "m2" in state and not moments.freeze
    return type(moments) is StoredMoments and "s2" in state


def steps_moments_ahead(criterion: HeadCriterion, moments: MomentSource | None, executor: Any,
                        state: dict[str, torch.Tensor] | None) -> bool:
    """Whether a run's fused layer step keeps ``moments`` (``state``, a layer's) one decode step ahead: the plain
    ``qada`` criterion on an executor whose splits compute the estimate (``estimate_in_splits``) from a source with
    a step kernel (:func:`has_step_kernel`). Each step's combine launch then steps them for the next
    (:func:`moment_step_rider`), and the prefill for the first (:func:`advance_after_prefill`)."""
    from qada.criteria.qada import QAdACriterion

    return (getattr(executor, "fuses_decision", False) and type(criterion) is QAdACriterion
            and executor.estimates_in_splits() and has_step_kernel(moments, state))


def advance_after_prefill(moments: MomentSource, state: dict[str, torch.Tensor], keys: torch.Tensor,
                          start: torch.Tensor | None, window: Window) -> None:
    """Step a layer's prefilled moment ``state`` to the first decode step's (rows of ``keys [b, H_kv, T, d]``, the
    prompt, then ending at ``T + 1``) with the source's own step, in torch (no kernel at the prefill: the moment
    kernels' state equals it to float64 rounding): for a run that steps its moments ahead
    (:func:`steps_moments_ahead`)."""
    end = torch.full((keys.shape[0],), keys.shape[2] + 1, dtype=torch.long, device=keys.device)
    moments.step(state, keys, start, end, window)


def moment_step_rider(moments: MomentSource, state: dict[str, torch.Tensor], keys: torch.Tensor,
                      start: torch.Tensor | None, end: torch.Tensor, window: Window) -> Any:
    """The :class:`~qada.attention.moment_step.MomentRider` stepping ``state`` to the next decode step's (rows ending
    one key past ``end``) in the combine launch, for a source with a step kernel (:func:`has_step_kernel`)."""
    from qada.attention.moment_step import current_step_rider, stored_step_rider
    from qada.moments.current import CurrentMoments

    if type(moments) is CurrentMoments:
        return current_step_rider(state, keys, start, end, window.t_local, window.t_recent)
    return stored_step_rider(state, start, end, t_local=window.t_local, offset=moments.offset,
                             first=moments.first(window), min_bulk_keys=moments.min_bulk_keys)


def held_moments(state: dict[str, torch.Tensor]) -> BulkMoments:
    """The float32 moments a source's step ``state`` holds: ``current``'s ``out_mean, out_cov``, ``stored``'s
    ``mean, cov``."""
    if "out_cov" in state:
        return BulkMoments(state["out_mean"], state["out_cov"])
    return BulkMoments(state["mean"], state["cov"])


def fused_moment_step(moments: MomentSource, state: dict[str, torch.Tensor], keys: torch.Tensor,
                      start: torch.Tensor | None, end: torch.Tensor, window: Window,
                      estimate: Any = None) -> BulkMoments:
    """The moment source's step in one launch where it has a kernel (:mod:`qada.attention.moment_step`: the plain
    ``current`` source stepping every key, none when frozen; the plain ``stored`` one), else its own (torch) step:
    a subclass (which may change the step), ``bucketed``, ``current`` with ``update_every > 1``, a user's. With
    ``estimate`` (a :class:`~qada.attention.moment_step.BulkEstimate`) its ``out`` is written from the new moments:
    by the same launch, or by :func:`~qada.attention.moment_step.estimate_launch` after a torch step or none."""
    from qada.attention.moment_step import current_step_launch, estimate_launch, stored_step_launch
    from qada.moments.current import CurrentMoments
    from qada.moments.stored import StoredMoments

    if type(moments) is CurrentMoments and "m2" in state and not moments.freeze:
        return current_step_launch(state, keys, start, end, window.t_local, window.t_recent, estimate)
    if type(moments) is StoredMoments and "s2" in state:
        return stored_step_launch(state, start, end, t_local=window.t_local, offset=moments.offset,
                                  first=moments.first(window), min_bulk_keys=moments.min_bulk_keys,
                                  estimate=estimate)
    if type(moments) is CurrentMoments and "m2" in state:  # frozen: the moments of the prefill
        bulk = held_moments(state)
    else:
        bulk = moments.step(state, keys, start, end, window)
    if estimate is not None:
        estimate_launch(estimate, bulk)
    return bulk
