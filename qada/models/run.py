"""The state of one wrapped model: its components and small parts with one job each.

* :class:`~qada.models.guards.CacheGuard`: the cache grows by one key per step, rows keep their order;
* :class:`~qada.models.masks.RowBounds`: each row's bounds, derived once per forward from the mask;
* :class:`~qada.models.layer_step.LayerStep`: the one decode step of a global layer (moment step, decision, group
  policy, statistics, window gather), compiled on a preallocated cache;
* :class:`~qada.models.statistics.DecodeStatistics`: sparsity, kv_read and fail-safe sums, on the device;
* :class:`~qada.models.observers.ObserverFanout`: events for observers.

Every decode step of a global layer takes one route, :meth:`QAdARun.decode`: the cache as a buffer (a
``StaticCache``'s every slot with each row's ``start``/``end`` as device tensors; a ``DynamicCache``'s filled keys,
whose rows end at its length), the layer step, then the executor on what the step decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qada.attention.base import AttentionExecutor, ExecutorOutput, GroupDecision
from qada.criteria.base import HeadCriterion
from qada.functional.capping import hermite_rule
from qada.models.dense_step import dense_decision, takes_dense_step
from qada.models.guards import CacheGuard, StaleStateError, UnsupportedModelError
from qada.models.layer_step import LayerStep
from qada.models.layer_types import LayerTypes
from qada.models.masks import RowBounds
from qada.models.observers import Observer, ObserverFanout
from qada.models.statistics import DecodeStatistics, all_layer_sparsity
from qada.models.step_compile import resolve_compile
from qada.models.step_parts import LayerStepResult
from qada.moments.base import MomentSource
from qada.registry import is_built_in
from qada.stable_tensors import write_into
from qada.step import DecodeStep
from qada.window import Window

__all__ = ["QAdARun", "StaleStateError", "UnsupportedModelError"]


class QAdARun:
    """Everything qada keeps for one model while it is wrapped (see :func:`qada.apply`).

    Attributes:
        criterion, moments, executor, window: the components.
        observers: callbacks that see every decision (none by default: recording costs nothing when off).
        stats: the run's :class:`~qada.models.statistics.DecodeStatistics` (global layers only).
        inline: whether a model that ``torch.compile`` traces may take the run's layer step into its graph where
            :meth:`inlines` allows (default ``False``: one opaque operator per layer and step; ``True`` decodes
            faster on the CPU but compiles each layer's copy: minutes for 30 layers instead of seconds).
        layers: the model's :class:`~qada.models.layer_types.LayerTypes`, set when the run is attached
            (``None`` before): sliding-window layers pass through and are counted as local in the all-layer
            summary.
    """

    def __init__(
        self,
        criterion: HeadCriterion,
        moments: MomentSource | None,
        executor: AttentionExecutor,
        window: Window,
        observers: Sequence[Observer] = (),
        compile: bool | str | None = None,
    ) -> None:
        self.criterion = criterion
        self.moments = moments
        self.executor = executor
        self.window = window
        self.fanout = ObserverFanout(observers)
        self.stats = DecodeStatistics()
        self.guard = CacheGuard(track_row_order=self.uses_moments and self.moments.per_row_state)
        self.rows = RowBounds()
        self.layers: LayerTypes | None = None
        self.backend = resolve_compile(compile)
        self._remove: Any = None
        self._first_layer: int | None = None  # the first global layer prefilled: it checks the rows' growth
        self._last_layer: int | None = None  # the last one: its step drops the per-step bounds
        self._step: LayerStep | None = None
        self._inputs: dict[int, tuple] = {}  # layer -> (slots, the layer step's per-layer arguments)
        self._kept_inputs: dict[int, tuple] = {}  # layer -> the last arguments, kept across sequences
        self.inline = False  # see inlines(); True: a traced model on the CPU takes the layer step into its graph
        self.executor_choice: str | None = None  # why an ``auto`` executor became run.executor (resolve_executor)
        if getattr(executor, "fuses_decision", False) and not takes_dense_step(criterion, self.fed_moments, executor):
            from qada.models.fused_step import check_fusable  # the decision is made in the executor's kernel: said now

            check_fusable(criterion, moments, executor)

    def resolve_executor(self, device: torch.device, dtype: torch.dtype) -> None:
        """Replace an ``auto`` executor (:class:`~qada.attention.AutoExecutor`) by the one it picks for a model on
        ``device`` in ``dtype`` and this run's criterion (``triton_fused`` where the kernels decide, ``triton``, or
        ``sdpa``); :attr:`executor_choice` says why. Any other executor stays. Called by
        :func:`~qada.models.apply.attach` (the model's weights) and at a prefill (its keys), before any decode step."""
        from qada.attention.auto import AutoExecutor

        if not isinstance(self.executor, AutoExecutor):
            return
        from qada.models.fused_step import is_fusable

        fusable = is_fusable(self.criterion, self.fed_moments)
        self.executor, reason = self.executor.choose(device, dtype, fusable)
        self.executor_choice = f"auto chose {self.executor.registry_name}: {reason}"
        self._step = None  # built for the chosen executor on first use

    @property
    def layer_step(self) -> LayerStep:
        """The run's :class:`~qada.models.layer_step.LayerStep` (built on first use)."""
        if self._step is None:
            moments = self.fed_moments
            policy = getattr(self.executor, "group_policy", "exact")
            attend_window = getattr(self.executor, "uses_window_output", False)
            host_plan = getattr(self.executor, "host_plan", False)
            moment_launch = getattr(self.executor, "moment_launch", False)
            hermite = self.executor.hermite_rule if moment_launch else None  # (a soft cap's estimate in the launch)
            self._step = LayerStep(self.criterion, moments, self.window, policy, self.backend, attend_window,
                                   host_plan, moment_launch, hermite)
            if takes_dense_step(self.criterion, moments, self.executor):
                self._step.take_dense_step(self.executor)
            elif getattr(self.executor, "fuses_decision", False):
                self._step.fuse(self.executor)
        return self._step

    @property
    def observers(self) -> list[Observer]:
        return self.fanout.observers

    @property
    def uses_moments(self) -> bool:
        """Whether the moment source is fed: the criterion needs moments or an observer wants the estimate."""
        return self.moments is not None and (self.criterion.needs_moments or self.fanout.wants_oracle)

    @property
    def fed_moments(self) -> MomentSource | None:
        """The moment source where it is fed (:attr:`uses_moments`), else ``None``: what the layer step steps."""
        return self.moments if self.uses_moments else None

    def reset_stats(self) -> None:
        """Forget the accumulated statistics and the cache bookkeeping (a new prefill follows)."""
        self.stats.reset()
        self.fanout.reset_time()
        self.guard.reset()
        self._first_layer = self._last_layer = None
        self.rows.clear()
        self._inputs.clear()

    def check(self) -> None:
        """Raise :class:`StaleStateError` if a decode step on a preallocated buffer saw a row that did not grow by
        one key (checked on the device during decoding, read here: a host sync)."""
        self.guard.check()

    def summary(self) -> dict[str, Any]:
        """Decode statistics: mean ``sparsity`` and ``kv_sparsity`` over the decoded (layer, step) pairs of the
        global layers (the ones qada decides on), per layer, the fail-safe count, and (once attached) the same
        two means over all layers, ``sparsity_all_layers`` and ``kv_sparsity_all_layers``, where a sliding-window
        layer of a hybrid model counts as local (every head reads at most its window), with the layer lists
        ``global_layers`` and ``sliding_layers`` (equal to the global-layer means without sliding layers).
        """
        self.check()
        summary = self.stats.compute()
        if self.layers is None:
            return summary
        return {**summary, **all_layer_sparsity(summary, self.layers)}

    def describe(self) -> dict[str, Any]:
        """The run's components as configured, for a report: ``criterion`` and ``executor`` (their configs), and
        ``moments`` (:meth:`~qada.moments.MomentSource.describe`: the stored reference's file and model fingerprint
        once prepared; ``None`` when the criterion reads no moments); ``executor_choice`` where an ``auto``
        executor picked the executor (:meth:`resolve_executor`)."""
        described = {"criterion": self.criterion.to_config(), "executor": self.executor.to_config(),
                     "moments": self.moments.describe() if self.uses_moments else None}
        if self.executor_choice is not None:
            described["executor_choice"] = self.executor_choice
        return described

    def filled_length(self, layer: int, q_len: int, attention_mask: torch.Tensor | None, key_len: int) -> int:
        """How many of the ``key_len`` cache slots of ``layer`` hold tokens (see
        :meth:`~qada.models.guards.CacheGuard.filled_length`: ``key_len`` for a growing cache, less for a
        preallocated one)."""
        return self.guard.filled_length(layer, q_len, key_len, lambda: self.rows.filled(attention_mask, key_len))

    def inlines(self, device: torch.device, softcap: float | None = None) -> bool:
        """Whether ``torch.compile`` traces this run's decode step on a preallocated cache into the model's graph
        (:mod:`qada.models.inline_step`) rather than as one opaque operator (:mod:`qada.models.compiled`): on the
        CPU, where entering a compiled layer step of its own costs more than its kernels, when :attr:`inline` asks
        for it, the layer step compiles (``compile`` not off, no fused executor) and every component is one of qada's
        own (a user's may read the host, which a traced model cannot), for a model without a logit soft cap."""
        if not self.inline or device.type != "cpu" or softcap is not None:
            return False
        step = self.layer_step
        if not step.compiled or step.fused is not None:
            return False
        parts = [criterion for _, criterion in self.criterion.named_criteria()]
        parts += [self.moments] if self.uses_moments else []
        return all(is_built_in(part) for part in parts)

    def shares_bounds(self, layer: int) -> bool:
        """Whether a decode step of ``layer`` on a preallocated cache can take its rows' bounds from an earlier global
        layer of the same forward (every global layer after the first prefilled one, with a buffer of the same size):
        a compiled model's opaque step then passes it no mask and no positions
        (:func:`~qada.models.attention_function.decode_step`), which Inductor would otherwise copy for each layer's
        call and which would derive the bounds again in each."""
        first = self._first_layer
        return first is not None and layer > first and \
            self.guard.buffer_capacity(layer) == self.guard.buffer_capacity(first)

    def on_buffer(self, layer: int, key_len: int) -> bool:
        """Whether a decode step of ``layer`` over ``key_len`` slots is on the whole preallocated buffer."""
        return self.guard.buffer_capacity(layer) == key_len

    # --- the two phases ----------------------------------------------------------------------------------
    def prefill(self, layer: int, key: torch.Tensor, start: torch.Tensor | None, capacity: int | None = None,
                query: torch.Tensor | None = None, scale: float | None = None) -> None:
        """After the dense prefill of ``layer`` (its cache holds ``key [b, H_kv, T, d]``; ``capacity``: the slots
        of a preallocated cache, ``None`` for a growing one; ``query [b, H, T, d]`` and ``scale``: the prompt's
        queries, for criteria that keep state, else ``None``). May read the host: prefill is not a decode step."""
        if self._first_layer is None or layer <= self._first_layer:  # a new sequence starts at the first layer
            self._first_layer = self._last_layer = layer
            self.stats.prepare(self.layers.num_layers if self.layers is not None else layer + 1, key.device)
            self.criterion.to_device(key.device)
            self.resolve_executor(key.device, key.dtype)  # a run attached by attach() has resolved it already
            self.executor.to_device(key.device)
        self._last_layer = max(self._last_layer, layer)
        self.guard.prefill(layer, key)
        self._inputs.pop(layer, None)
        if capacity is not None:
            self.guard.note_capacity(layer, capacity)
            if layer == self._first_layer:
                self.guard.start_buffer(torch.full((key.shape[0],), key.shape[2], dtype=torch.long,
                                                   device=key.device))
        if self.uses_moments:  # a growing cache is a buffer whose capacity is its length
            self.moments.prefill(layer, key, start, self.window, capacity=capacity or key.shape[2])
            self._step_moments_ahead(layer, key, start)
        self.criterion.observe_prefill(layer, key, query, scale, start, self.window, capacity)
        self._layer_inputs(layer, capacity or key.shape[2], key.device)  # made now, never inside a decode step
        self.fanout.prefill(layer, key.shape[2])

    def _step_moments_ahead(self, layer: int, key: torch.Tensor, start: torch.Tensor | None) -> None:
        """Where the fused layer step keeps the moments one decode step ahead (``estimate_in_splits`` on a source with
        a step kernel: :func:`~qada.models.fused_step.steps_moments_ahead`), step ``layer``'s prefilled moments to the
        first decode step's."""
        from qada.models.fused_step import advance_after_prefill, steps_moments_ahead

        state = self.moments.step_state(layer) if self.moments.has_state(layer) else None
        if steps_moments_ahead(self.criterion, self.moments, self.executor, state):
            advance_after_prefill(self.moments, state, key, start, self.window)

    def decode(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None,
               sink_logits: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """One decode step of ``layer``: ``query [b, H, 1, d]`` against the cache ``key, value [b, H_kv, S, d]`` ->
        ``[b, H, 1, d]``. On a preallocated cache (``S`` its capacity) the rows' bounds come from the mask (or the
        positions) as device tensors: no host read, fixed shapes, the compiled layer step; on a growing cache
        (``S`` its length) every row ends at ``S``. ``sink_logits [H]`` and ``softcap``: the model's softmax features
        (:mod:`qada.functional.capping`), ``None`` when it has none."""
        if softcap is not None:
            hermite_rule()  # the quadrature of the capped estimate, made eagerly: the compiled step reads constants
        buffered = self.on_buffer(layer, key.shape[2])
        if buffered:
            start, end = self.rows.bounds(attention_mask, key.shape[2], position_ids)
            step_index = self.guard.decode_buffer(layer, end, first_layer=layer == self._first_layer)
        else:
            start, end = self.rows.starts(attention_mask, key.shape[2]), None
            step_index = self.guard.decode(layer, key)
        if layer == self._last_layer:  # the step's bounds die with it: under CUDA graphs no tensor made in a
            self.rows.clear()  # captured step may outlive it (the graph pool would hold it)
        result = self.layer_step(buffered, query, key, value, start, end, float(scale),
                                 *self._layer_inputs(layer, key.shape[2], key.device), sink_logits, softcap,
                                 self.stats.sums)  # the step adds its statistics row to the sums
        return self._attend(layer, step_index, query, key, value, scale, start, end, result, sink_logits, softcap,
                            buffered)

    def _layer_inputs(self, layer: int, slots: int, device: torch.device) -> tuple:
        """``(layer index [0-d], moment state, criterion states)`` of ``layer`` on a cache of ``slots`` slots, on
        ``device``: gathered at the prefill (again only when a growing cache outgrows them)."""
        cached = self._inputs.get(layer)
        if cached is not None and cached[0] == slots:
            return cached[1]
        moments = self.layer_step.moments
        moment_state = None if moments is None else _on(moments.step_state(layer), device)
        states = {name: _on(state, device) for name, state in self.criterion.layer_states(layer, slots).items()}
        # an earlier sequence's tensors keep their addresses (new values written in): a CUDA graph reads them
        inputs = write_into(self._kept_inputs.get(layer), (torch.tensor(layer, device=device), moment_state, states))
        self._kept_inputs[layer] = inputs
        self._inputs[layer] = (slots, inputs)
        return inputs

    def _attend(self, layer: int, step_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scale: float, start: torch.Tensor | None, end: torch.Tensor | None,
                result: LayerStepResult, sink_logits: torch.Tensor | None = None,
                softcap: float | None = None, buffered: bool = False) -> torch.Tensor:
        """The executor on what the layer step decided and gathered (which added its statistics row); observers."""
        step = DecodeStep.checked_already(result.query, key, scale, self.window, layer, step_index, result.start,
                                          result.end, result.moments, value, sink_logits, softcap)
        step.share(window_keys=result.window_keys, window_valid=result.window_valid,
                   window_values=result.window_values, t_bulk=result.t_bulk, real=result.real,
                   window_output=result.window_output, host_plan=result.host_plan)
        step.fail_safe = result.fail_safe
        if result.output is not None:  # the layer step attended already (an executor that fuses the decision)
            output, bulk_blocks = result.output, result.bulk_blocks
        else:
            output, bulk_blocks = self.executor.attend(step, GroupDecision(result.local, result.read))
        output = self.layer_step.merge(buffered, output, result)  # local heads: window ∪ the criterion's extra set
        if self.fanout.observers and result.decided is None:  # the dense step: its decision made for them only
            decided, local, read = dense_decision(self.criterion, step, getattr(self.executor, "group_policy", "exact"))
            result = result._replace(decided=decided, local=local, read=read)
        if self.fanout.observers:
            executed = ExecutorOutput(output, result.local, result.counts[0, 0].float(), result.counts[0, 1].float(),
                                      bulk_blocks, result.read)
            self.fanout.decision(step, result.decided, executed)
        return output

    def remove(self) -> None:
        """Unwrap the model (restore its previous attention implementation)."""
        if self._remove is not None:
            self._remove()
            self._remove = None



def _on(state: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``state``'s tensors on ``device`` (moved once, when a layer's inputs are gathered)."""
    return {name: tensor.to(device) for name, tensor in state.items()}
