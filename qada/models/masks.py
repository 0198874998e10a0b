"""What the layers of one forward share about its rows, derived once from the attention mask.

Every global layer of a forward receives the same 4D mask (and position ids); :class:`RowBounds` derives each row's
``start`` / ``end`` (:func:`~qada.models.guards.row_bounds`, :func:`~qada.models.guards.row_starts`) and the filled
length of a preallocated cache once per mask object, for all layers (a compiled step gives the mask to its first
global layer only: the later ones reuse that layer's bounds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qada.models.guards import buffer_row_bounds, check_contiguous_rows, mask_filled_length, row_starts

__all__ = ["RowBounds"]


class RowBounds:
    """Per-forward values derived from the attention mask, computed once and shared by the layers."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[Any, Any, tuple, Any]] = {}

    def clear(self) -> None:
        """Forget them (the last layer of a step calls it: under CUDA graphs no tensor made in a captured step may
        outlive it)."""
        self._cache.clear()

    def starts(self, attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
        """Each row's first real token from the 4D mask ``[b, 1, q, >= length]`` (only its first ``length`` keys
        count)."""
        return self._once("starts", attention_mask, length,
                          lambda: row_starts(None if attention_mask is None else attention_mask[..., :length], length))

    def filled(self, attention_mask: torch.Tensor | None, length: int) -> int | None:
        """How many slots the mask lets the last query see (:func:`~qada.models.guards.mask_filled_length`)."""
        return self._once("filled", attention_mask, length, lambda: mask_filled_length(attention_mask))

    def check_contiguous(self, attention_mask: torch.Tensor | None, length: int) -> None:
        """Raise where a row's tokens are not one run (:func:`~qada.models.guards.check_contiguous_rows`); once per
        mask."""
        self._once("contiguous", attention_mask, length, lambda: check_contiguous_rows(attention_mask, length))

    def bounds(self, attention_mask: torch.Tensor | None, length: int,
               position_ids: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(start [b] or None, end [b])`` of each row's tokens in a preallocated cache of ``length`` slots, as
        device tensors (:func:`~qada.models.guards.buffer_row_bounds`: an error without a mask and positions).
        Neither given: the bounds an earlier layer of this forward derived (a compiled step hands the mask to its
        first global layer only, :meth:`~qada.models.run.QAdARun.shares_bounds`), else that error."""
        if attention_mask is None and position_ids is None:
            cached = self._cache.get("bounds")
            if cached is not None and cached[2][0] == length:
                return cached[3]
        return self._once("bounds", attention_mask, length,
                          lambda: buffer_row_bounds(attention_mask, length, position_ids), also=position_ids)

    def _once(self, what: str, attention_mask: torch.Tensor | None, length: int, compute: Callable[[], Any],
              also: torch.Tensor | None = None) -> Any:
        key = (length, _version(attention_mask), _version(also))
        cached = self._cache.get(what)
        if cached is not None and cached[0] is attention_mask and cached[1] is also and cached[2] == key:
            return cached[3]
        value = compute()
        self._cache[what] = (attention_mask, also, key, value)
        return value


def _version(tensor: torch.Tensor | None) -> int | None:
    """The in-place version counter of ``tensor`` (``None`` for none, or an inference tensor, which has none)."""
    if tensor is None or torch.compiler.is_compiling() or tensor.is_inference():
        return None
    return tensor._version
