"""The state of one wrapped model: its components and three small parts with one job each.

* :class:`~qada.models.guards.CacheGuard`: the cache grows by one key per step, rows keep their order;
* :class:`~qada.models.statistics.DecodeStatistics`: sparsity and fail-safe sums, on the device;
* :class:`~qada.models.observers.ObserverFanout`: events for observers.

:meth:`QAdARun.decode` builds the layer's :class:`~qada.step.DecodeStep` and passes it to the criterion
and the executor. On a preallocated cache (transformers' ``StaticCache``) whose parts all declare
``static_shapes``, :meth:`QAdARun.decode_buffer` does the same over the whole buffer with the rows' ends as device
tensors: no host round trip, fixed shapes, state updated in place (DESIGN §7), so the step can be compiled and
replayed from a CUDA graph.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from qada.attention.base import AttentionExecutor, ExecutorOutput, GroupDecision
from qada.attention.group_policy import kv_read
from qada.criteria.base import HeadCriterion
from qada.models.fused import FusedDecision
from qada.models.guards import (
    CacheGuard,
    StaleStateError,
    UnsupportedModelError,
    mask_filled_length,
    row_bounds,
    row_starts,
)
from qada.models.layer_types import LayerTypes
from qada.models.observers import Observer, ObserverFanout
from qada.models.prompt_queries import PromptQueries
from qada.models.statistics import DecodeStatistics
from qada.moments.base import MomentSource
from qada.step import DecodeStep
from qada.window import Window

__all__ = ["QAdARun", "StaleStateError", "UnsupportedModelError", "all_layer_sparsity", "row_starts"]


def all_layer_sparsity(summary: dict[str, Any], layers: LayerTypes) -> dict[str, Any]:
    """``sparsity_all_layers`` / ``kv_sparsity_all_layers``: the per-layer means of ``summary`` (global layers)
    averaged with 1.0 for every sliding-window layer (all of its heads are local), plus ``global_layers`` and
    ``sliding_layers``. ``None`` where no global layer decoded (and the model has global layers)."""
    result: dict[str, Any] = {"global_layers": layers.global_layers, "sliding_layers": layers.sliding}
    for name in ("sparsity", "kv_sparsity"):
        per_layer = summary.get(f"{name}_per_layer") or {}
        decided = [per_layer[layer] for layer in layers.global_layers if layer in per_layer]
        if layers.global_layers and not decided:
            result[f"{name}_all_layers"] = None
            continue
        result[f"{name}_all_layers"] = (sum(decided) + len(layers.sliding)) / (len(decided) + len(layers.sliding))
    return result


class QAdARun:
    """Everything qada keeps for one model while it is wrapped (see :func:`qada.apply`).

    Attributes:
        criterion, moments, executor, window: the components.
        observers: callbacks that see every decision (none by default: recording costs nothing when off).
        stats: the run's :class:`~qada.models.statistics.DecodeStatistics` (global layers only).
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
    ) -> None:
        self.criterion = criterion
        self.moments = moments
        self.executor = executor
        self.window = window
        self.fanout = ObserverFanout(observers)
        self.stats = DecodeStatistics()
        self.guard = CacheGuard(track_row_order=self.uses_moments and self.moments.per_row_state)
        self.layers: LayerTypes | None = None
        self._remove: Any = None
        self._mask_cache: dict[str, tuple[Any, tuple, Any]] = {}
        self._first_layer: int | None = None  # the first global layer prefilled: it checks the rows' growth
        self._last_layer: int | None = None  # the last one: its step drops the per-step mask cache
        self._static_shapes: bool | None = None
        self._fused: FusedDecision | None | object = _UNSET

    @property
    def static_shapes(self) -> bool:
        """Whether every part decodes on a preallocated buffer without host syncs (``static_shapes`` of the
        criterion, the executor and, if fed, the moment source, whose methods must also take the buffer's
        ``capacity`` / ``end`` arguments, e.g. not a subclass overriding them with the older signature): then steps
        on a ``StaticCache`` take :meth:`decode_buffer`; otherwise each step slices the filled part of the cache.
        Decided once per run."""
        if self._static_shapes is None:
            parts = [self.criterion, self.executor] + ([self.moments] if self.uses_moments else [])
            static = all(getattr(part, "static_shapes", False) for part in parts)
            if static and self.uses_moments:
                source = self.moments
                static = (_takes(source.prefill, "capacity") and _takes(source.append, "end")
                          and _takes(source.moments, "end"))
            self._static_shapes = static
        return self._static_shapes

    @property
    def observers(self) -> list[Observer]:
        return self.fanout.observers

    @property
    def uses_moments(self) -> bool:
        """Whether the moment source is fed: the criterion needs moments or an observer wants the estimate."""
        return self.moments is not None and (self.criterion.needs_moments or self.fanout.wants_oracle)

    def reset_stats(self) -> None:
        """Forget the accumulated statistics and the cache bookkeeping (a new prefill follows)."""
        self.stats.reset()
        self.guard.reset()
        self._first_layer = self._last_layer = None
        self._mask_cache.clear()

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

    def starts(self, attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
        """Each row's first real token from the 4D mask ``[b, 1, q, >= length]`` (only its first ``length`` keys
        count), derived once per forward: the layers share the mask."""
        return self._per_mask("starts", attention_mask, length,
                              lambda: row_starts(None if attention_mask is None else attention_mask[..., :length],
                                                 length))

    def filled_length(self, layer: int, q_len: int, attention_mask: torch.Tensor | None, key_len: int) -> int:
        """How many of the ``key_len`` cache slots of ``layer`` hold tokens (see
        :meth:`~qada.models.guards.CacheGuard.filled_length`: ``key_len`` for a growing cache, less for a
        preallocated one)."""
        return self.guard.filled_length(
            layer, q_len, key_len, lambda: self._per_mask("filled", attention_mask, key_len,
                                                          lambda: mask_filled_length(attention_mask))
        )

    def bounds(self, attention_mask: torch.Tensor | None, length: int,
               position_ids: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """``(start [b] or None, end [b])`` of each row's tokens in a preallocated cache of ``length`` slots, as
        device tensors (:func:`~qada.models.guards.row_bounds`), derived once per forward."""
        return self._per_mask("bounds", attention_mask, length,
                              lambda: row_bounds(attention_mask, length, position_ids), also=position_ids)

    def _per_mask(self, what: str, attention_mask: torch.Tensor | None, length: int, compute, also=None):
        """``compute()`` once per mask object (and ``also``, another per-forward tensor): the layers share it."""
        key = (what, length, _version(attention_mask), _version(also))
        cached = self._mask_cache.get(what)
        if cached is not None and cached[0] is attention_mask and cached[1] is also and cached[2] == key:
            return cached[3]
        value = compute()
        self._mask_cache[what] = (attention_mask, also, key, value)
        return value

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
        self._last_layer = max(self._last_layer, layer)
        self.guard.prefill(layer, key)
        buffered = capacity is not None and self.static_shapes
        if capacity is not None:
            self.guard.note_capacity(layer, capacity)
            if layer == self._first_layer:
                self.guard.start_buffer(torch.full((key.shape[0],), key.shape[2], dtype=torch.long,
                                                   device=key.device))
        if self.uses_moments:
            if buffered:
                self.moments.prefill(layer, key, start, self.window, capacity=capacity)
            else:
                self.moments.prefill(layer, key, start, self.window)
        self.criterion.observe_prefill(layer, key, query, scale, start, self.window, capacity)
        self.fanout.prefill(layer, key.shape[2])

    def prefill_from_cache(self, cache: Any, start: torch.Tensor | None = None,
                           queries: PromptQueries | None = None) -> None:
        """Start decoding from an already prefilled transformers cache (e.g. a copy shared by a sweep).

        Feeds every layer's cached keys ``[b, H_kv, T, d]`` to :meth:`prefill`, as a dense prefill would have, with
        ``queries``: the prompt's last queries per layer, recorded by that prefill
        (:func:`~qada.models.prompt_queries.recording_queries`). Raises ``ValueError`` when the criterion needs more
        of them (:meth:`~qada.criteria.HeadCriterion.prompt_queries`) than ``queries`` holds.
        """
        needed = self.criterion.prompt_queries()
        if needed and (queries is None or queries.keep < needed):
            held = "none" if queries is None else f"the last {queries.keep}"
            raise ValueError(
                f"criterion {self.criterion.registry_name or type(self.criterion).__name__!r} reads the prompt's last "
                f"{needed} queries per layer at the prefill, but the shared prefill recorded {held}: prefill with "
                f"qada.eval.decode.prefill(model, ids, keep_queries={needed}) and pass its queries"
            )
        for layer, cache_layer in enumerate(cache.layers):
            if getattr(cache_layer, "is_sliding", False) or (self.layers is not None and
                                                              self.layers.is_sliding(layer)):
                continue  # a sliding-window layer passes through: no moments, no guard
            keys = cache_layer.keys
            filled = int(cache_layer.get_seq_length())  # a preallocated cache holds fewer tokens than slots
            capacity = None
            if filled < keys.shape[2]:
                keys, capacity = keys[:, :, :filled], keys.shape[2]
            query = None if queries is None else queries.queries.get(layer)
            if needed and query is None:
                raise ValueError(f"layer {layer}: the recorded prompt queries have no entry for this layer")
            self.prefill(layer, keys, start, capacity, query=query,
                         scale=None if query is None else queries.scales[layer])

    def decode(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        start: torch.Tensor | None,
    ) -> torch.Tensor:
        """One decode step of ``layer`` on its filled cache ``key, value [b, H_kv, T, d]``: ``query [b, H, 1, d]``
        -> output ``[b, H, 1, d]``."""
        step_index = self.guard.decode(layer, key)
        return self._decide_and_attend(layer, query, key, value, scale, start, None, step_index)

    def uses_buffer(self, layer: int, key_len: int) -> bool:
        """Whether a decode step of ``layer`` over ``key_len`` slots runs on the whole preallocated buffer."""
        return self.guard.buffer_capacity(layer) == key_len and self.static_shapes

    def decode_buffer(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step of ``layer`` over the whole preallocated buffer ``key, value [b, H_kv, C, d]``: the
        rows' bounds come from the mask (or the positions) as device tensors. No host sync, no shape that depends
        on data: a pure function of device tensors and of state updated in place."""
        bounds = self.bounds(attention_mask, key.shape[2], position_ids)
        if bounds is None:
            raise UnsupportedModelError(
                "a decode step on a preallocated cache came without an attention mask and without position_ids: "
                "qada cannot tell where the rows end"
            )
        start, end = bounds
        step_index = self.guard.decode_buffer(layer, end, first_layer=layer == self._first_layer)
        if layer == self._last_layer:  # the step's bounds die with it: under CUDA graphs no tensor made in a
            self._mask_cache.clear()  # captured step may outlive it (the graph pool would hold it)
        return self._decide_and_attend(layer, query, key, value, scale, start, end, step_index)

    def _decide_and_attend(self, layer, query, key, value, scale, start, end, step_index) -> torch.Tensor:
        if end is not None and self.fused is not None:
            decision = self.fused(layer, query[:, :, 0], key, value, start, end, scale)
            if decision is not None:
                return self._attend_fused(layer, query, key, value, scale, start, end, step_index, decision)
        moments = None
        if self.uses_moments:
            source, window = self.moments, self.window
            if end is None:
                source.append(layer, key, start, window)
                moments = lambda: source.moments(layer, key, start, window)  # noqa: E731 - lazy
            else:
                source.append(layer, key, start, window, end=end)
                moments = lambda: source.moments(layer, key, start, window, end=end)  # noqa: E731 - lazy
        self.criterion.observe_append(layer, key, end)
        step = DecodeStep(query[:, :, 0], key, scale, self.window, layer=layer, step=step_index, start=start,
                          end=end, moments=moments, values=value)
        local = self.criterion(step)
        result = self.executor(step, local)
        self.stats.update(layer, result.sparsity, result.kv_sparsity, step.fail_safe, self._kv_read(step, result))
        self.fanout.decision(step, local, result)
        return result.output

    def _kv_read(self, step: DecodeStep, result: ExecutorOutput) -> torch.Tensor:
        """What the step read, as a fraction of dense attention's K/V (:func:`~qada.attention.group_policy.kv_read`):
        the executor's bulks and windows and the criterion's extra reads."""
        return kv_read(result.read, step.t_bulk + self.window.t_local, self.window.t_local,
                       self.criterion.extra_reads(step))

    def _attend_fused(self, layer, query, key, value, scale, start, end, step_index, decision) -> torch.Tensor:
        """The executor on a step whose decision :attr:`fused` computed (window, bulk sizes shared with it)."""
        self.criterion.observe_append(layer, key, end)
        step = DecodeStep(query[:, :, 0], key, scale, self.window, layer=layer, step=step_index, start=start,
                          end=end, moments=decision.moments, values=value)
        step.share(window_keys=decision.window_keys, window_valid=decision.window_valid,
                   window_values=decision.window_values, t_bulk=decision.t_bulk)
        step.fail_safe = decision.counts[3]
        output, bulk_blocks = self.executor.attend(step, GroupDecision(decision.local, decision.read))
        self.stats.add(layer, decision.counts)
        if self.fanout.observers:
            result = ExecutorOutput(output, decision.local, decision.counts[0].float(), decision.counts[1].float(),
                                    bulk_blocks, decision.read)
            self.fanout.decision(step, decision.decided, result)
        return output

    @property
    def fused(self) -> FusedDecision | None:
        """The run's :class:`~qada.models.fused.FusedDecision` (one compiled function for the moment step and the
        decision of a buffer step) when its criterion and moment source offer one, else ``None``; built once."""
        if self._fused is _UNSET:
            self._fused = FusedDecision.for_run(self)
        return self._fused

    def remove(self) -> None:
        """Unwrap the model (restore its previous attention implementation)."""
        if self._remove is not None:
            self._remove()
            self._remove = None


_UNSET = object()


def _version(tensor: torch.Tensor | None) -> int | None:
    """The in-place version counter of ``tensor`` (``None`` for none, or an inference tensor, which has none)."""
    if tensor is None or torch.compiler.is_compiling() or tensor.is_inference():
        return None
    return tensor._version


def _takes(method, name: str) -> bool:
    """Whether ``method`` accepts the keyword argument ``name`` (by name or ``**kwargs``)."""
    parameters = inspect.signature(method).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
