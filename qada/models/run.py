"""The state of one wrapped model: criterion + moment source + executor, per-layer bookkeeping, statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qada.attention.base import AttentionExecutor
from qada.criteria.base import HeadCriterion
from qada.criteria.context import StepContext
from qada.models.observers import DecisionEvent, Observer
from qada.moments.base import MomentSource
from qada.window import Window

__all__ = ["QAdARun", "StaleStateError", "UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model (or this use of it) is outside what the wrapper supports; the message names the problem."""


class StaleStateError(RuntimeError):
    """The cache changed in a way the moment state cannot follow (cropping, reordering, multi-token decode)."""


def row_starts(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """``[b]`` index of each row's first attended key from a 4D mask ``[b, 1, q, T]`` (bool or additive)."""
    if attention_mask is None:
        return None
    if attention_mask.ndim != 4 or attention_mask.shape[-1] != length:
        raise UnsupportedModelError(
            f"expected a 4D attention mask [batch, 1, q, {length}] but got shape {tuple(attention_mask.shape)}"
        )
    last_query = attention_mask[:, 0, -1, :]
    allowed = last_query if last_query.dtype == torch.bool else last_query == 0
    return allowed.to(torch.int8).argmax(-1)


class QAdARun:
    """Everything qada keeps for one model while it is wrapped (see :func:`qada.apply`).

    Attributes:
        criterion, moments, executor, window: the components.
        observers: callbacks that see every decision (none by default: recording costs nothing when off).
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
        self.observers = list(observers)
        self._remove: Any = None
        self.reset_stats()

    # --- statistics --------------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Forget the accumulated sparsity statistics and fail-safe counts."""
        self._sparsity: dict[int, torch.Tensor] = {}
        self._kv_sparsity: dict[int, torch.Tensor] = {}
        self._decode_steps: dict[int, int] = {}
        self._fail_safe: torch.Tensor | None = None
        self._length: dict[int, int] = {}
        self._step: dict[int, int] = {}
        self._newest_key: dict[int, torch.Tensor] = {}

    @property
    def uses_moments(self) -> bool:
        wants = self.criterion.needs_moments or any(o.wants_oracle for o in self.observers)
        return self.moments is not None and wants

    def summary(self) -> dict[str, Any]:
        """Mean sparsity and kv_sparsity over all decoded (layer, step) pairs, per layer, and fail-safe count."""
        layers = sorted(self._decode_steps)
        per_layer = {
            layer: (self._sparsity[layer] / self._decode_steps[layer]).item() for layer in layers
        }
        per_layer_kv = {
            layer: (self._kv_sparsity[layer] / self._decode_steps[layer]).item() for layer in layers
        }
        steps = sum(self._decode_steps.values())
        return {
            "decode_steps": max(self._decode_steps.values(), default=0),
            "sparsity": sum(self._sparsity[layer].item() for layer in layers) / steps if steps else float("nan"),
            "kv_sparsity": sum(self._kv_sparsity[layer].item() for layer in layers) / steps if steps else float("nan"),
            "sparsity_per_layer": per_layer,
            "kv_sparsity_per_layer": per_layer_kv,
            "fail_safe": int(self._fail_safe.item()) if self._fail_safe is not None else 0,
        }

    # --- the two phases ----------------------------------------------------------------------------------
    def prefill(self, layer: int, key: torch.Tensor, start: torch.Tensor | None) -> None:
        """After the dense prefill of ``layer`` (its cache is ``key [b, H_kv, T, d]``)."""
        self._length[layer] = key.shape[2]
        self._step[layer] = 0
        self._remember_newest_key(layer, key)
        if self.uses_moments:
            self.moments.prefill(layer, key, start, self.window)
        for observer in self.observers:
            observer.on_prefill(layer, key.shape[2])

    def prefill_from_cache(self, cache: Any, start: torch.Tensor | None = None) -> None:
        """Start decoding from an already prefilled transformers cache (e.g. a copy shared by a sweep).

        Feeds every layer's cached keys ``[b, H_kv, T, d]`` to :meth:`prefill`, as a dense prefill would have.
        """
        for layer, cache_layer in enumerate(cache.layers):
            self.prefill(layer, cache_layer.keys, start)

    def decode(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        start: torch.Tensor | None,
    ) -> torch.Tensor:
        """One decode step of ``layer``: ``query [b, H, 1, d]`` -> output ``[b, H, 1, d]``."""
        T = key.shape[2]
        previous = self._length.get(layer)
        if previous is None:
            raise StaleStateError(
                f"layer {layer} decodes without a prefill seen by qada: enable qada before the prompt is processed"
            )
        if T != previous + 1:
            raise StaleStateError(
                f"layer {layer}: the cache went from {previous} to {T} keys in one decode step; qada's moment state "
                "follows a cache that grows by one key per step (cache cropping, e.g. assisted decoding, is not "
                "supported)"
            )
        self._check_row_order(layer, key)
        self._length[layer] = T
        step = self._step[layer]
        self._step[layer] = step + 1
        moments = None
        if self.uses_moments:
            self.moments.append(layer, key, start, self.window)
            source = self.moments
            moments = lambda: source.moments(layer, key, start, self.window)  # noqa: E731 - lazy
        ctx = StepContext(query[:, :, 0], key, scale, self.window, layer=layer, step=step, start=start, moments=moments)
        local = self.criterion(ctx)
        result = self.executor(query, key, value, local, self.window, scale, start)
        self._accumulate(layer, result.sparsity, result.kv_sparsity, ctx.fail_safe)
        if self.observers:
            self._notify(ctx, local, result)
        return result.output

    @property
    def _tracks_row_order(self) -> bool:
        return self.uses_moments and self.moments.per_row_state

    def _remember_newest_key(self, layer: int, key: torch.Tensor) -> None:
        self._newest_key.pop(layer, None)
        if self._tracks_row_order and key.shape[0] > 1 and layer == min(self._length):
            self._newest_key[layer] = key[:, :, -1].clone()

    def _check_row_order(self, layer: int, key: torch.Tensor) -> None:
        """Per-row moment state follows cache rows: refuse a cache whose rows were reordered (beam search).

        Checked on the first layer only, by comparing the previous step's newest key with the same position now
        (one host sync per decode step, only with per-row moment state and batch > 1).
        """
        previous = self._newest_key.get(layer)
        if previous is not None and not torch.equal(key[:, :, -2], previous):
            raise StaleStateError(
                "the rows of the cache were reordered between decode steps (beam search?); qada's per-row moment "
                "state (the 'current' source) cannot follow that: use greedy or sampling, or a stored moment source"
            )
        self._remember_newest_key(layer, key)

    def _accumulate(self, layer: int, sparsity, kv_sparsity, fail_safe) -> None:
        sparsity = sparsity.detach().float()
        kv_sparsity = kv_sparsity.detach().float()
        if layer in self._sparsity:
            self._sparsity[layer] = self._sparsity[layer] + sparsity
            self._kv_sparsity[layer] = self._kv_sparsity[layer] + kv_sparsity
        else:
            self._sparsity[layer], self._kv_sparsity[layer] = sparsity, kv_sparsity
        self._decode_steps[layer] = self._decode_steps.get(layer, 0) + 1
        if fail_safe is not None:
            self._fail_safe = fail_safe if self._fail_safe is None else self._fail_safe + fail_safe.to(self._fail_safe)

    def _notify(self, ctx: StepContext, local: torch.Tensor, result) -> None:
        wants_oracle = any(o.wants_oracle for o in self.observers)
        estimate = score_mean = score_var = None
        if wants_oracle and ctx.moments is not None:
            estimate = ctx.log_bulk_estimate
            score_mean, score_var = ctx.score_moments
        event = DecisionEvent(
            layer=ctx.layer,
            step=ctx.step,
            length=ctx.length,
            t_bulk=ctx.t_bulk,
            local=local,
            effective_local=result.local,
            sparsity=result.sparsity,
            kv_sparsity=result.kv_sparsity,
            log_local=ctx.log_local if wants_oracle else None,
            log_bulk=ctx.log_bulk if wants_oracle else None,
            log_bulk_estimate=estimate,
            score_mean=score_mean,
            score_var=score_var,
        )
        for observer in self.observers:
            observer.on_decision(event)

    def remove(self) -> None:
        """Unwrap the model (restore its previous attention implementation)."""
        if self._remove is not None:
            self._remove()
            self._remove = None
