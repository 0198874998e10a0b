"""Cache and position guards: the moment state of a run follows a cache that grows by one key per decode step.

:class:`CacheGuard` refuses what it cannot follow, with a message that names it: a decode step without a
prefill seen by qada, a cache that was cropped or grew by more than one key (assisted decoding), rows that were
reordered between steps (beam search) while a moment source keeps per-row state.
"""

from __future__ import annotations

import torch

__all__ = ["CacheGuard", "StaleStateError", "UnsupportedModelError", "row_starts"]


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


class CacheGuard:
    """Per-layer cache length and decode-step counter, and (optionally) a check that rows keep their order.

    Args:
        track_row_order: remember the newest key of the first layer and compare it at the next step (one host
            sync per decode step; only needed when a moment source keeps per-row state and batch > 1).
    """

    def __init__(self, track_row_order: bool = False) -> None:
        self.track_row_order = track_row_order
        self.reset()

    def reset(self) -> None:
        self._length: dict[int, int] = {}
        self._step: dict[int, int] = {}
        self._newest_key: dict[int, torch.Tensor] = {}

    def prefill(self, layer: int, key: torch.Tensor) -> None:
        """``layer`` was prefilled: its cache is ``key [b, H_kv, T, d]``."""
        self._length[layer] = key.shape[2]
        self._step[layer] = 0
        self._remember_newest_key(layer, key)

    def decode(self, layer: int, key: torch.Tensor) -> int:
        """Check one decode step of ``layer`` (cache ``key [b, H_kv, T, d]``); return its step index."""
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
        return step

    def _remember_newest_key(self, layer: int, key: torch.Tensor) -> None:
        self._newest_key.pop(layer, None)
        if self.track_row_order and key.shape[0] > 1 and layer == min(self._length):
            self._newest_key[layer] = key[:, :, -1].clone()

    def _check_row_order(self, layer: int, key: torch.Tensor) -> None:
        previous = self._newest_key.get(layer)
        if previous is not None and not torch.equal(key[:, :, -2], previous):
            raise StaleStateError(
                "the rows of the cache were reordered between decode steps (beam search?); qada's per-row moment "
                "state (the 'current' source) cannot follow that: use greedy or sampling, or a stored moment source"
            )
        self._remember_newest_key(layer, key)
