"""The :class:`MomentSource` interface and the moment-source registry.

A moment source gives, for one layer and the current decode step, the mean ``mu_K [b, H_kv, d]`` and the
population covariance ``Sigma_K [b, H_kv, d, d]`` of the bulk keys that QAdA's lognormal estimate needs
(paper §3.2). The run calls, per layer:

* :meth:`prefill` once after the dense prefill, with the prefilled keys and the cache's ``capacity`` (its slots
  on a preallocated cache, the filled length on a growing one): the source sets up its per-layer tensors;
* :meth:`step_state` to get those tensors, and :meth:`step` inside every decode step of the layer: the rows of
  the cache (the whole buffer ``[b, H_kv, C, d]``) end at ``end [b]`` (device tensors), the source updates its
  tensors in place and returns the step's moments, without host reads (see :doc:`/howto/compile`);

and :meth:`reset` before a new sequence (a new prefill), :meth:`prepare` once per model before the first
prefill (only sources with ``needs_model`` do anything there). :meth:`append` and :meth:`moments` are the same
source for analysis tools that hold a cache of their own (not the run's decode step).

Keys are the cache's post-RoPE keys ``[b, H_kv, T, d]`` (padding included); ``start [b]`` is each row's first
real token (left padding) or ``None``. Each row's real length is ``n_r = T - start_r``.

:meth:`moments` is self-synchronising: called on a layer that saw no prefill it prefills, called with a longer
cache than the last :meth:`append` it appends, so a wrapper that only calls :meth:`moments` is still correct
(streaming sources then do the update lazily). The returned tensors are float32 on the keys' device and stay
valid until the next call for that layer; rows without a bulk get harmless zeros (QAdA treats them as local).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from qada.registry import Component, Registry
from qada.stable_tensors import write_into
from qada.step import BulkMoments
from qada.window import Window

__all__ = ["MOMENT_SOURCES", "MomentSource", "register_moment_source"]


def arrival_count(count: torch.Tensor) -> torch.Tensor:
    """``[b, H_kv]`` int32 zeros beside a source's ``count [b, H_kv]``: the state the moment step's kernel counts
    its programs of a (row, KV head) in as they finish (one per block pair of the ``d x d`` state; the last then
    updates what the others read, :func:`~qada.attention._moment_kernel.last_to_arrive`), 0 again after every
    launch. Declared with the state it serves (``arrived``); the torch step does not read it."""
    return torch.zeros(count.shape, dtype=torch.int32, device=count.device)


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

    def needs(self) -> dict[str, bool]:
        """What this source needs before decoding, by name (``model``: a run of the model in :meth:`prepare`;
        ``reference_prompt``: a reference prompt built from the tokenizer, unless an artifact is given)."""
        return {"model": self.needs_model,
                "reference_prompt": self.needs_model and getattr(self, "path", None) is None}

    def describe(self) -> dict[str, Any]:
        """What the run's moments come from, for a report: ``name`` and, for sources built from a reference prompt,
        its kind, seed and (once prepared) the file and model fingerprint it was loaded from."""
        return {"name": self.registry_name or type(self).__name__}

    def prepare(self, model: Any, tokenizer: Any = None, window: Window | None = None) -> None:  # noqa: B027
        """Build or load what the source needs for ``model`` (reference keys); a no-op by default.

        ``window`` is the window decoding will use (``bucketed`` precomputes its buckets for it; ``None``
        means the default :class:`~qada.window.Window`).
        """

    # --- per-layer state, declared once ------------------------------------------------------------------
    def set_state(self, layer: int, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Declare ``layer``'s state at its prefill: the tensors :meth:`step` reads and updates in place, by name.

        Where the layer already holds tensors of the same names, shapes, dtypes and devices (an earlier sequence),
        the new values are written into them instead of replacing them: a captured CUDA graph keeps updating the
        tensors it recorded. Returns the layer's state (what :meth:`step_state` gives)."""
        kept = self._kept_state().get(layer)
        if kept is None or write_into(kept, tensors) is not kept:  # nothing of this layout to write into
            kept = {name: value.clone() for name, value in tensors.items()}
            self._kept_state()[layer] = kept
        self._live_layers().add(layer)
        return kept

    def clear_state(self) -> None:
        """Forget which layers hold a sequence's state (their tensors are kept, to be rewritten in place)."""
        self._live_layers().clear()

    def has_state(self, layer: int) -> bool:
        """Whether ``layer`` holds the state of the current sequence (a prefill declared it)."""
        return layer in self._live_layers()

    def step_state(self, layer: int) -> dict[str, torch.Tensor]:
        """The tensors :meth:`step` reads and updates in place for ``layer`` (declared by :meth:`set_state` at its
        prefill), passed to the run's layer step as arguments so that one compiled step serves every layer. A
        source that declares none gets the layer's index, for :meth:`step`'s eager fallback."""
        if self.has_state(layer):
            return self._kept_state()[layer]
        if self._kept_state():
            raise RuntimeError(f"layer {layer} has no {self.registry_name or type(self).__name__} state: call prefill "
                               "first")
        return {"layer": torch.tensor(layer)}

    def _kept_state(self) -> dict[int, dict[str, torch.Tensor]]:
        return self.__dict__.setdefault("_declared_state", {})

    def _live_layers(self) -> set[int]:
        return self.__dict__.setdefault("_live_state_layers", set())

    def step(self, state: dict[str, torch.Tensor], keys: torch.Tensor, start: torch.Tensor | None,
             end: torch.Tensor, window: Window) -> BulkMoments:
        """One decode step: the rows of ``keys [b, H_kv, C, d]`` now end at ``end [b]`` (each grew by one key);
        update ``state`` (:meth:`step_state`) in place and return the step's bulk moments. A built-in source does it
        on the device without host reads. The default reads the layer's index on the host and calls
        :meth:`append` and :meth:`moments` (the run then steps eagerly and says so)."""
        layer = int(state["layer"])
        self.append(layer, keys, start, window, end=end)
        return self.moments(layer, keys, start, window, end=end)

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
