"""Tensors that keep their addresses from one sequence to the next: what a recorded CUDA graph reads.

A model compiled with ``torch.compile(mode="reduce-overhead")`` records qada's decode step into a CUDA graph, which
replays its kernels on the addresses it recorded. Besides its arguments the step reads a run's per-layer tensors (the
layer's index, the criterion's constants and state, the moment source's state). When the run starts a new sequence
(a new prefill), those tensors must stay where the graph recorded them: the new values are written into them
(:func:`write_into`) instead of replacing them. A replaced tensor would be freed, and the replayed graph would read
whatever the memory holds next (a wrong answer, or a device-side assert).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["same_layout", "write_into"]


def same_layout(kept: Any, new: Any) -> bool:
    """Whether ``kept`` and ``new`` (tensors, ``None``, or dicts / tuples / lists of them, nested) have the same
    structure and every pair of tensors the same shape, dtype and device."""
    if isinstance(kept, torch.Tensor) or isinstance(new, torch.Tensor):
        return (isinstance(kept, torch.Tensor) and isinstance(new, torch.Tensor) and kept.shape == new.shape
                and kept.dtype == new.dtype and kept.device == new.device)  # fmt: skip
    if isinstance(kept, dict) or isinstance(new, dict):
        return (isinstance(kept, dict) and isinstance(new, dict) and kept.keys() == new.keys()
                and all(same_layout(kept[name], new[name]) for name in kept))  # fmt: skip
    if isinstance(kept, (tuple, list)) or isinstance(new, (tuple, list)):
        return (type(kept) is type(new) and len(kept) == len(new)
                and all(same_layout(a, b) for a, b in zip(kept, new, strict=True)))  # fmt: skip
    return kept is None and new is None


def write_into(kept: Any, new: Any) -> Any:
    """``new``'s values in ``kept``'s tensors, returned as ``kept``, where both have the same layout
    (:func:`same_layout`); else ``new`` itself (nothing to keep: a first sequence, or other shapes). Memory that
    ``kept`` and ``new`` share (the same tensor, or views of it) is left as it is."""
    if kept is None or not same_layout(kept, new):
        return new
    _copy(kept, new)
    return kept


def _copy(kept: Any, new: Any) -> None:
    if isinstance(kept, torch.Tensor):
        if kept.data_ptr() != new.data_ptr() or kept.stride() != new.stride():  # else: the same memory already
            kept.copy_(new)
    elif isinstance(kept, dict):
        for name in kept:
            _copy(kept[name], new[name])
    elif isinstance(kept, (tuple, list)):
        for a, b in zip(kept, new, strict=True):
            _copy(a, b)
