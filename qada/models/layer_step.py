"""One decode step of one global layer: the one function qada runs, eagerly or compiled.

:func:`layer_step` is a pure function of buffer-shaped tensors (the cache as a buffer whose rows end at ``end``; a
growing cache passes ``end=None``: its rows end at its length) and of the components' per-layer tensors, which it
receives as arguments and updates in place:

1. the moment source's step (:meth:`~qada.moments.MomentSource.step`),
2. the criterion's decision (:meth:`~qada.criteria.HeadCriterion.decide`, with whatever it reads to decide),
3. the group policy (:func:`~qada.attention.group_policy.apply_group_policy`),
4. the step's statistics row (:func:`~qada.models.statistics.step_counts`, ``kv_read`` included),
5. the window gather the executor reuses,
6. where the criterion asks local heads to attend over an extra set of bulk tokens too (the tail-aware criteria's
   exact set with ``attend_exact``, Quest's pages), that set's attention, merged into the window's attention where
   the step computes that for the executor (``attend_window``), else after the executor.

:class:`LayerStep` runs it for a run: compiled by ``torch.compile`` (``fullgraph=True``, static shapes) on a
preallocated cache, once per run and reused by every layer and step (the layer's tensors are arguments, not
constants), or eagerly, the very same function. A part that cannot be compiled (a criterion of a user's that
reads the host) makes the step eager, with one warning that names it and says why.
"""

from __future__ import annotations

import functools
import inspect
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

from qada.attention.group_policy import apply_group_policy
from qada.attention.sdpa import pack_host_plan, skips_on_host
from qada.criteria.base import HeadCriterion
from qada.functional.extra_set import attend_extra, merge_extra, merge_masses
from qada.functional.masses import window_attention
from qada.models.ahead_step import AheadOfTimeStep
from qada.models.dense_step import dense_layer_step, takes_dense_step
from qada.models.fused_step import check_fusable, fused_layer_step, fused_moment_step
from qada.models.step_compile import compile_own, failure_reason
from qada.models.step_parts import LayerStepResult, begin_step, statistics_row
from qada.moments.base import MomentSource
from qada.window import Window

__all__ = ["DENSE_STEP_EAGER", "FUSED_STEP_EAGER", "INTERPRETED_STEP_EAGER", "LayerStep", "compile_layer_step",
           "layer_step"]


def layer_step(
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
    moments: MomentSource | None,
    window: Window,
    policy: str,
    attend_window: bool = False,
    host_plan: bool | None = False,
    moment_launch: bool = False,
    hermite: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> LayerStepResult:
    """The decision of one decode step of one layer, and what the executor reuses.

    Args:
        query: ``[b, H, 1, d]``; ``keys, values``: ``[b, H_kv, C, d]`` the layer's cache (a preallocated buffer's
            every slot, or a growing cache).
        start: ``[b]`` each row's first real token or ``None``; ``end``: ``[b]`` one past each row's last token
            (``None``: every row ends at ``C``).
        layer: 0-d long tensor, the layer's index (a tensor, so that a compiled step serves every layer).
        moment_state: the source's :meth:`~qada.moments.MomentSource.step_state` (``None``: no moments).
        criterion_states: :meth:`~qada.criteria.HeadCriterion.layer_states` of the criterion.
        sink_logits: ``[H]`` the model's learned sink logits, ``softcap``: its logit soft-cap (``None``: none).
        sums: ``[L, 5]`` float64, the run's :attr:`~qada.models.statistics.DecodeStatistics.sums`: the step's
            statistics row is added to ``sums[layer]`` in place (``None``: not added).
        criterion, moments, window, policy: the run's components and the executor's group policy.
        attend_window: also every head's attention over its window (``window_output``), from the window scores the
            criterion computed (an executor that ``uses_window_output``: one small product in the compiled step
            instead of an attention call of its own), merged with the extra set's where there is one.
        host_plan: also what a host-skipping executor reads of the decision, packed into one tensor (``True``: on
            every device; ``None``: where the query is on the CPU; ``False``: never): its host read is then one call.
        moment_launch: the moment source's step as one Triton launch where the source has one
            (:func:`~qada.models.fused_step.fused_moment_step`: the plain ``stored`` and ``current`` sources), for an
            executor on a GPU (:attr:`~qada.attention.TritonExecutor.moment_launch`): compiled for a GPU, the
            source's torch step was several kernels of Inductor's. The same launch also writes each head's ``log
            E[exp(s)]`` (:class:`~qada.attention.moment_step.BulkEstimate`), which eq. 7 then reads
            (:meth:`~qada.step.DecodeStep.take_log_mean_exp`): the kernels of the score moments fewer. Under a soft
            cap that estimate sums over the Gauss-Hermite rule ``hermite(device)`` gives (the executor's held one,
            :meth:`~qada.attention.TritonExecutor.hermite_rule`); without ``hermite`` the step computes it in torch.
            The same moments and estimate up to float rounding.
        hermite: with ``moment_launch``, the Gauss-Hermite nodes and log weights (``[n]`` float32 each) on a
            device, for a soft cap's estimate in the launch (``None``: none).
    """
    step_moments = estimate = None
    if moment_launch and moments is not None:
        from qada.attention.moment_step import BulkEstimate

        if softcap is None:
            estimate = BulkEstimate.uncapped(query[:, :, 0], scale)
        elif hermite is not None:  # (under a cap the estimate sums over the Gauss-Hermite rule; without, torch)
            estimate = BulkEstimate.capped(query[:, :, 0], scale, softcap, *hermite(query.device))
        step_moments = functools.partial(fused_moment_step, moments, estimate=estimate)
    step, bulk = begin_step(query, keys, values, start, end, scale, layer, moment_state, criterion_states,
                            sink_logits, softcap, moments, window, step_moments)
    if estimate is not None:  # log E[exp(s)] written by the same launch: eq. 7 needs no score moments
        step.take_log_mean_exp(estimate.out)
    decided = criterion(step)
    local, read = apply_group_policy(decided, step.has_bulk, step.num_kv_heads, policy)
    counts = statistics_row(step, local, read, step.forced_heads, criterion)
    if sums is not None:
        sums.index_add_(0, layer.reshape(1), counts[None])
    extra = step.extra_set
    extra_output = log_extra = log_local = None
    if extra is not None:  # local heads attend over window ∪ E: E's part now, merged below or after the executor
        extra_output, log_extra = attend_extra(values, *extra)
        log_local = step.log_local
    window_output = None
    if attend_window:
        valid = None if step.full_rows else step.window_valid
        window_output = window_attention(step.local_scores, step.log_local, step.window_values, valid)
        if extra_output is not None:  # window ∪ E here, the local heads' output as is: nothing to merge after
            window_output = merge_masses(window_output, log_local, extra_output, log_extra).to(window_output.dtype)
            extra_output = log_extra = log_local = None
    plan = None
    if skips_on_host(host_plan, query.device):
        plan = pack_host_plan(local, read, step.start, step.end)
    return LayerStepResult(decided, local, read, counts[None], counts[3], step.window_keys, step.window_values,
                           step.window_valid, step.t_bulk, step.real_if_computed, bulk, step.query, step.start,
                           step.end, extra_output, log_extra, log_local, window_output=window_output, host_plan=plan)


FUSED_STEP_EAGER = "the fused layer step runs eagerly (the executor's compile_step is False)"
"""The :attr:`LayerStep.eager_reason` of a ``triton_fused`` run whose executor does not compile its step (the
default): by choice, not a fallback."""

INTERPRETED_STEP_EAGER = "the fused kernels run in Triton's interpreter, which torch.compile does not trace"
"""The :attr:`LayerStep.eager_reason` of a ``triton_fused`` run under Triton's interpreter (no GPU): expected."""


DENSE_STEP_EAGER = "the dense criterion's layer step is the executor's two launches, run eagerly"
"""The :attr:`LayerStep.eager_reason` of a run on the ``dense`` criterion whose executor attends densely in its own
launches (:mod:`qada.models.dense_step`): by choice, not a fallback."""


class LayerStep:
    """:func:`layer_step` bound to a run's components: compiled once (``backend``; ``None``: eager) and reused by
    every layer and step of a preallocated cache; a growing cache's steps (new shapes every step) run eagerly.

    Attributes:
        eager_reason: why the step runs eagerly although compiling was asked for (``None``: it compiles).
        ahead: with the inductor backend, the step compiled ahead of time that serves compiled calls on the CPU
            (:class:`~qada.models.ahead_step.AheadOfTimeStep`; where it declines, ``torch.compile``'s step serves
            them); ``None``: none (another backend, a fused executor, or set so to turn it off).
    """

    def __init__(self, criterion: HeadCriterion, moments: MomentSource | None, window: Window, policy: str,
                 backend: str | None, attend_window: bool = False, host_plan: bool | None = False,
                 moment_launch: bool = False,
                 hermite: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.criterion, self.moments, self.backend = criterion, moments, backend
        bound = dict(criterion=criterion, moments=moments, window=window, policy=policy, attend_window=attend_window,
                     host_plan=host_plan, moment_launch=moment_launch, hermite=hermite)
        self._bound = bound
        self.eager = functools.partial(layer_step, **bound)
        self.eager_reason: str | None = None
        self.fused: Any = None  # the executor whose launches are the step (fuse, take_dense_step), else None
        self._compiled: Any = None
        self._merge: Any = None
        self.ahead: Any = None  # the CPU's ahead-of-time step (qada.models.ahead_step), inductor only
        if backend is not None:
            self._compiled = compile_layer_step(bound, backend)
            self._merge = compile_own(merge_extra, "qada_merge_extra", backend)
        if backend == "inductor":
            parts = [part for _, part in criterion.named_criteria()] + [moments, window]
            self.ahead = AheadOfTimeStep(layer_step, bound, [part for part in parts if part is not None])

    @property
    def compiled(self) -> bool:
        """Whether steps on a preallocated cache run compiled."""
        return self._compiled is not None and self.eager_reason is None

    def fuse(self, executor: Any) -> None:
        """Make the decision with ``executor`` (one that ``fuses_decision``, e.g. ``triton_fused``): every step is
        then :func:`~qada.models.fused_step.fused_layer_step`, whose result carries the attention ``output`` (the run
        does not call the executor again). Raises ``ValueError`` unless the criterion is one the executor fuses
        (:func:`~qada.models.fused_step.check_fusable`: plain ``qada``, ``qada_tail`` or ``qada_tail_budget``, with
        any of their settings) with a moment source. Under Triton's interpreter the step runs eagerly
        (``torch.compile`` does not trace the interpreter); on a GPU it is compiled with the kernels' launches where
        the executor's ``compile_step`` says so (:attr:`~qada.attention.FusedTritonExecutor.compile_step`), else
        eagerly."""
        check_fusable(self.criterion, self.moments, executor)
        bound = self._run_on(executor, fused_layer_step)
        if self.backend is not None:
            from qada.attention import _triton_kernel

            if _triton_kernel.INTERPRETED:
                self.eager_reason = INTERPRETED_STEP_EAGER
            elif not getattr(executor, "compile_step", True):
                self.eager_reason = FUSED_STEP_EAGER
            else:
                self._compiled = compile_layer_step(bound, self.backend, fused_layer_step)

    def take_dense_step(self, executor: Any) -> None:
        """Make every step :func:`~qada.models.dense_step.dense_layer_step` on ``executor`` (the ``dense`` criterion
        on an executor that attends densely in its own launches, :func:`~qada.models.dense_step.takes_dense_step`):
        two launches, run eagerly (inside a model's CUDA graph as they are; nothing to compile around them). Raises
        ``ValueError`` for another criterion, a moment source, or an executor without ``attend_dense``."""
        if not takes_dense_step(self.criterion, self.moments, executor):
            raise ValueError(f"the dense layer step takes the plain 'dense' criterion without a moment source on an "
                             f"executor with attend_dense, not {self.criterion.registry_name!r} on {executor!r}")
        self._run_on(executor, dense_layer_step)
        self.eager_reason = None if self.backend is None else DENSE_STEP_EAGER

    def _run_on(self, executor: Any, function: Any) -> dict[str, Any]:
        """Make every step ``function`` (:func:`~qada.models.fused_step.fused_layer_step` or
        :func:`~qada.models.dense_step.dense_layer_step`: the executor's launches), eager until the caller compiles
        it; returns its keyword arguments (the components and ``executor``)."""
        # the executor attends over the window itself, without a host read: the step takes the components only
        self._bound = {name: value for name, value in self._bound.items()
                       if name not in ("attend_window", "host_plan", "moment_launch", "hermite")}
        bound = dict(self._bound, executor=executor)
        self.fused = executor
        self.eager = functools.partial(function, **bound)
        self._compiled, self.eager_reason, self.ahead = None, None, None
        return bound

    def __call__(self, buffered: bool, *args: Any) -> LayerStepResult:
        """:func:`layer_step` on ``args``; compiled when ``buffered`` (fixed shapes) and :attr:`compiled`."""
        if not (buffered and self.compiled):
            return self.eager(*args)
        if self.ahead is not None:  # on the CPU: the step compiled ahead of time, called without guards
            result = self.ahead(args)
            if result is not None:
                return result
        try:
            return self._compiled(*args)
        except Exception as error:  # noqa: BLE001 - decided below: an error of the part itself, or of compiling
            result = self.eager(*args)  # raises the part's own error, if it is one
            self.eager_reason = failure_reason(error)
            warnings.warn(f"qada: {self._culprit(error)} cannot be compiled into the layer step, so every decode "
                          f"step of this run runs eagerly (slower; compile=False silences this): {self.eager_reason}",
                          RuntimeWarning, stacklevel=4)
            return result

    def merge(self, buffered: bool, output: torch.Tensor, result: LayerStepResult) -> torch.Tensor:
        """The executor's ``output [b, H, 1, d]`` with the local heads' extra set merged in
        (:func:`~qada.functional.extra_set.merge_extra`, compiled alike), where the step asked for one."""
        if result.extra_output is None:
            return output
        merge = self._merge if buffered and self.compiled else merge_extra
        return merge(output, result.log_local, result.extra_output, result.log_extra, result.local)

    def _culprit(self, error: Exception) -> str:
        """The part (a criterion or the moment source) whose source file the error's trace names last (the deepest
        frame); the run's criterion when it names none."""
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        parts = [("criterion", c) for _, c in self.criterion.named_criteria()]
        parts += [("moment source", self.moments)] if self.moments is not None else []

        def position(part: Any) -> int:
            try:
                return text.rfind(inspect.getsourcefile(type(part)) or "\0")
            except (TypeError, OSError):  # a class without a source file
                return -1

        kind, part = max(parts, key=lambda item: position(item[1]))
        return f"{kind} {part.registry_name or type(part).__name__!r}"


def compile_layer_step(bound: dict[str, Any], backend: Any, function: Any = None) -> Any:
    """:func:`layer_step` (or ``function``, with its arguments) with the keyword arguments ``bound`` (the
    components), compiled by ``torch.compile`` (``fullgraph=True``) with ``backend``: static shapes for the first
    cache size, symbolic ones from the second on.

    The function compiled has a code object of its own: ``torch.compile`` keeps its cache (and its recompile limit,
    8) per code object, so each run's step is compiled for that run's components and never evicts another's (a
    ``functools.partial`` or a plain closure would share one code object across runs)."""

    chosen = layer_step if function is None else function

    def step(query, keys, values, start, end, scale, layer, moment_state, criterion_states,  # noqa: ANN001
             sink_logits=None, softcap=None, sums=None):
        return chosen(query, keys, values, start, end, scale, layer, moment_state, criterion_states, sink_logits,
                      softcap, sums, **bound)

    return compile_own(step, "qada_layer_step", backend)
