"""The :class:`MomentSource` interface and the moment-source registry.

A moment source gives, for one layer and the current decode step, the mean ``mu_K [b, H_kv, d]`` and the
population covariance ``Sigma_K [b, H_kv, d, d]`` of the bulk keys that QAdA's lognormal estimate needs
(paper §3.2). The wrapper calls, per layer:

* :meth:`prefill` once after the dense prefill, with the whole prefilled cache;
* :meth:`append` on every decode step, after the new key was appended (the cache grew by exactly one);
* :meth:`moments` when a criterion asks for them at that step.

and :meth:`reset` before a new sequence (a new prefill), :meth:`prepare` once per model before the first
prefill (only sources with ``needs_model`` do anything there).

On a preallocated cache a source with ``static_shapes`` gets ``prefill(..., capacity=C)`` and then
``append(..., end=end)`` / ``moments(..., end=end)`` with ``keys`` the whole buffer ``[b, H_kv, C, d]`` and
``end [b]`` each row's filled length (a device tensor): it must not read the host there, and keeps its state in
tensors allocated at the prefill and updated in place (see :doc:`/howto/compile`).

Keys are the cache's post-RoPE keys ``[b, H_kv, T, d]`` (padding included); ``start [b]`` is each row's first
real token (left padding) or ``None``. Each row's real length is ``n_r = T - start_r``.

:meth:`moments` is self-synchronising: called on a layer that saw no prefill it prefills, called with a longer
cache than the last :meth:`append` it appends, so a wrapper that only calls :meth:`moments` is still correct
(streaming sources then do the update lazily). The returned tensors are float32 on the keys' device and stay
valid until the next call for that layer; rows without a bulk get harmless zeros (QAdA treats them as local).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from qada.registry import Component, Registry
from qada.step import BulkMoments
from qada.window import Window

__all__ = ["MOMENT_SOURCES", "MomentSource", "register_moment_source"]


class MomentSource(Component, abc.ABC):
    """Where ``mu_K`` and ``Sigma_K`` come from. Subclasses are dataclasses; state lives in private attrs.

    Capability flags:

    * ``needs_model``: :meth:`prepare` must run the model once (stored reference prompts) before decoding.
    * ``per_row_state``: the state follows the rows of the cache (the wrapper refuses reordered rows).
    * ``layer_state``: the names of what the source keeps per layer between steps (empty: a stateless lookup),
      so that a wrapper knows what a new prefill or a cache copy must reset.
    """

    needs_model: ClassVar[bool] = False
    per_row_state: ClassVar[bool] = False
    layer_state: ClassVar[tuple[str, ...]] = ()
    static_shapes: ClassVar[bool] = False
    """Follows a preallocated buffer: ``prefill(..., capacity=C)`` then ``append``/``moments`` with ``end=[b]``
    (device tensors) without host syncs, state updated in place (see
    :attr:`qada.criteria.HeadCriterion.static_shapes`); False by default."""

    def needs(self) -> dict[str, bool]:
        """What this source needs before decoding, by name (``model``: a run of the model in :meth:`prepare`;
        ``reference_prompt``: a reference prompt built from the tokenizer, unless an artifact is given)."""
        return {"model": self.needs_model,
                "reference_prompt": self.needs_model and getattr(self, "path", None) is None}

    def prepare(self, model: Any, tokenizer: Any = None, window: Window | None = None) -> None:  # noqa: B027
        """Build or load what the source needs for ``model`` (reference keys); a no-op by default.

        ``window`` is the window decoding will use (``bucketed`` precomputes its buckets for it; ``None``
        means the default :class:`~qada.window.Window`).
        """

    def fused_step(self, window: Window) -> Callable[..., BulkMoments] | None:
        """The buffer step (:meth:`append` + :meth:`moments` with ``end``) as a pure function
        ``f(*fused_state(layer), keys [b, H_kv, C, d], start [b] or None, end [b]) -> BulkMoments`` that updates
        the state in place, for the wrapper to compile with the criterion's decision
        (:class:`qada.models.fused.FusedDecision`); the same function for every layer. ``None`` (the default):
        the source is stepped through :meth:`append` and :meth:`moments`."""
        return None

    def fused_state(self, layer: int, device: torch.device) -> tuple[torch.Tensor, ...] | None:
        """The tensors :meth:`fused_step`'s function reads and updates for ``layer`` (``None``: no buffer state)."""
        return None

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget all per-sequence state (a new prefill follows)."""

    @abc.abstractmethod
    def prefill(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window) -> None:
        """Initialise ``layer`` from the prefilled cache ``keys [b, H_kv, T, d]``."""

    @abc.abstractmethod
    def append(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window) -> None:
        """One decode step of ``layer``: ``keys [b, H_kv, T+1, d]`` is the cache after appending one key."""

    @abc.abstractmethod
    def moments(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window) -> BulkMoments:
        """Bulk moments for the current step of ``layer``: mean ``[b, H_kv, d]``, cov ``[b, H_kv, d, d]``."""


MOMENT_SOURCES: Registry[MomentSource] = Registry("moment source", MomentSource)
register_moment_source = MOMENT_SOURCES.register
