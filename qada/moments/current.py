"""Current-prompt moments (paper Option 1), streamed: O(d²) per decode step and KV head, constant in ``T``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qada.functional import bulk_count, bulk_mask
from qada.moments.base import MomentSource, arrival_count, register_moment_source
from qada.moments.math import MomentState, add_key, block_moments, merge_moments, to_bulk_moments
from qada.step import BulkMoments
from qada.window import Window

__all__ = ["CurrentMoments", "current_buffer_step"]


@register_moment_source("current")
@dataclass
class CurrentMoments(MomentSource):
    """Mean and population covariance of each row's bulk keys ``[start + T_sink, T - (T_local - T_sink))``.

    :meth:`prefill` computes them from the prefilled cache; each decode step adds the one key that leaves the
    recent window, the key at index ``T - (T_local - T_sink)`` when the cache grows from ``T`` to ``T + 1``
    (only once the row holds more than ``T_local`` real tokens). The state is float64 and updated by Welford's
    rank-1 rule, so the streamed moments equal a fresh recomputation after any number of steps.

    Args:
        freeze: keep the moments of the prefill (the paper's setting for short answers) instead of streaming.
        update_every: merge the keys that entered the bulk every ``k`` steps as one block (Chan's rule), exact
            at the end of each block; decisions inside a block use moments at most ``k - 1`` steps old. ``1``
            (default) is the per-step reference.
    """

    freeze: bool = False
    update_every: int = 1
    per_row_state = True
    layer_state = ("float64 count, mean and co-moment of each row's bulk keys", "the cache length they cover")

    def __post_init__(self) -> None:
        if not isinstance(self.freeze, bool):
            raise ValueError(f"expected freeze to be a bool but got {self.freeze!r}")
        if isinstance(self.update_every, bool) or not isinstance(self.update_every, int) or self.update_every < 1:
            raise ValueError(f"expected update_every to be an int >= 1 but got {self.update_every!r}")
        self._states: dict[int, MomentState] = {}
        self._lengths: dict[int, int] = {}
        self._cached: dict[int, BulkMoments] = {}

    def reset(self) -> None:
        self._states.clear()
        self._lengths.clear()
        self._cached.clear()
        self.clear_state()

    def state(self, layer: int) -> MomentState:
        """The float64 :class:`MomentState` ``[b, H_kv]`` of ``layer`` (count = ``T_bulk`` per row)."""
        if layer not in self._states:
            raise RuntimeError(f"layer {layer} has no moments yet: call prefill first")
        return self._states[layer]

    def prefill(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window,
                capacity: int | None = None) -> None:
        """Moments of the prefilled cache ``keys [b, H_kv, T, d]``, declared as the layer's state
        (:meth:`~qada.moments.MomentSource.set_state`) that the decode steps update in place, sync-free; and kept for
        the analysis path (:meth:`append` / :meth:`moments` on a cache of the caller's)."""
        b, _, T, _ = keys.shape
        starts = _row_starts(start, b, keys.device)
        mask = bulk_mask(T, window.t_local, window.t_sink, starts)  # [b, T]
        state = block_moments(keys, mask[:, None, :])
        self._states[layer] = state
        self._lengths[layer] = T
        self._cached.pop(layer, None)
        if self.freeze or self.update_every == 1:  # blocks of update_every > 1 step on the host path
            moments = to_bulk_moments(state)
            self.set_state(layer, count=state.count, mean=state.mean, m2=state.m2, out_mean=moments.mean,
                           out_cov=moments.cov, arrived=arrival_count(state.count))

    def step_state(self, layer: int) -> dict[str, torch.Tensor]:
        """The float64 Welford state ``count, mean, m2``, the float32 moments ``out_mean, out_cov`` and the moment
        kernel's ``arrived`` (:func:`~qada.moments.base.arrival_count`) of ``layer`` (blocks of ``update_every >
        1``: the layer's index, stepped on the host)."""
        if self.update_every > 1 and not self.freeze:
            return {"layer": torch.tensor(layer)}
        return super().step_state(layer)

    def step(self, state: dict[str, torch.Tensor], keys: torch.Tensor, start: torch.Tensor | None,
             end: torch.Tensor, window: Window) -> BulkMoments:
        """:func:`current_buffer_step` (frozen: the prefill's moments; blocks: the host path)."""
        if "layer" in state:  # blocks: their size depends on how many keys entered, so on the host
            layer, filled = int(state["layer"]), int(end.max())
            self.append(layer, keys[:, :, :filled], start, window)
            return self.moments(layer, keys[:, :, :filled], start, window)
        if self.freeze:
            return BulkMoments(state["out_mean"], state["out_cov"])
        return current_buffer_step(state["count"], state["mean"], state["m2"], state["out_mean"], state["out_cov"],
                                   keys, start, end, t_local=window.t_local, t_recent=window.t_recent)

    def append(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window,
               end: torch.Tensor | None = None) -> None:
        if end is not None and self.has_state(layer):  # a decode step on the declared state, in place, sync-free
            if not self.freeze:
                self.step(self.step_state(layer), keys, start, end, window)
            return
        if layer not in self._states:
            raise RuntimeError(f"append on layer {layer} before prefill: call prefill on the prefilled cache")
        old, new = self._lengths[layer], keys.shape[2]
        if new < old:
            raise ValueError(f"expected the cache of layer {layer} to grow from {old} but got length {new}")
        if new == old or (not self.freeze and new - old < self.update_every):
            return  # nothing new, or a block still filling up (update_every > 1)
        self._lengths[layer] = new
        if self.freeze:
            return
        b = keys.shape[0]
        starts = _row_starts(start, b, keys.device)
        before = bulk_count(old, window.t_local, window.t_sink, starts)
        after = bulk_count(new, window.t_local, window.t_sink, starts)
        state = self._states[layer]
        if new == old + 1:
            # The key at old - T_recent enters the bulk of the rows whose bulk grew.
            entering = keys[:, :, old - window.t_recent] if old >= window.t_recent else keys[:, :, 0]
            weight = (after > before).to(torch.float64)[:, None]
            self._states[layer] = add_key(state, entering, weight)
        else:
            # Keys entering a row's bulk lie in [start + T_sink + before, start + T_sink + after); every such
            # index is >= old - T_recent (a row without a bulk before has start >= old - T_local), so only that
            # slice of the cache is read: O((new - old) d^2), not O(T d^2).
            lo = max(0, old - window.t_recent)
            hi = max(lo, new - window.t_recent)
            first = starts + window.t_sink + before
            position = torch.arange(lo, hi, device=keys.device)[None, :]
            mask = (position >= first[:, None]) & (position < (starts + window.t_sink + after)[:, None])
            self._states[layer] = merge_moments(state, block_moments(keys[:, :, lo:hi], mask[:, None, :]))
        self._cached.pop(layer, None)

    def moments(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window,
                end: torch.Tensor | None = None) -> BulkMoments:
        if end is not None and self.has_state(layer):
            state = self.step_state(layer)  # brought up to date by append(..., end=...)
            return BulkMoments(state["out_mean"], state["out_cov"])
        if layer not in self._states:
            self.prefill(layer, keys, start, window)
        elif keys.shape[2] != self._lengths[layer]:
            self.append(layer, keys, start, window)
        if layer not in self._cached:
            mean, cov = to_bulk_moments(self._states[layer])
            self._cached[layer] = BulkMoments(mean.to(keys.device), cov.to(keys.device))
        return self._cached[layer]


def current_buffer_step(
    count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, out_mean: torch.Tensor, out_cov: torch.Tensor,
    keys: torch.Tensor, start: torch.Tensor | None, end: torch.Tensor, *, t_local: int, t_recent: int,
) -> BulkMoments:
    """One decode step of the current-prompt moments on a buffer ``keys [b, H_kv, C, d]`` whose rows now end at
    ``end [b]`` (each grew by one key): the key at ``end - 1 - T_recent`` enters the bulk of the rows whose bulk
    grew (Welford's rank-1 update of the float64 ``count [b, H_kv]``, ``mean [b, H_kv, d]``,
    ``m2 [b, H_kv, d, d]``), written in place with the float32 moments ``out_mean``, ``out_cov`` handed to
    criteria, which are returned. A pure function of device tensors."""
    b, H_kv, _, d = keys.shape
    starts = _row_starts(start, b, keys.device)
    index = (end - 1 - t_recent).clamp(min=0)  # [b]
    entering = keys.gather(2, index[:, None, None, None].expand(b, H_kv, 1, d))[:, :, 0]  # [b, H_kv, d]
    before = (end - 1 - starts - t_local).clamp(min=0)
    weight = (end - starts - t_local > before).to(torch.float64)[:, None]
    state = MomentState(count, mean, m2)
    new = add_key(state, entering, weight)
    for target, value in zip(state, new, strict=True):
        target.copy_(value)
    moments = to_bulk_moments(new)
    out_mean.copy_(moments.mean)
    out_cov.copy_(moments.cov)
    return BulkMoments(out_mean, out_cov)


def _row_starts(start: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    if start is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    if start.shape != (batch,):
        raise ValueError(f"expected start of shape [{batch}] but got {tuple(start.shape)}")
    return start.to(device=device, dtype=torch.long)
