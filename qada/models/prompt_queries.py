"""The prompt's last queries per layer, recorded during a dense prefill run *without* qada (issue 23).

Criteria with per-layer state (the tail-aware ones choose their heavy set with the prompt's last ``observe``
queries) normally see the queries when qada is attached during the prefill. The evaluator, sweeps and ``qada
analyze`` instead prefill once, densely, and decode every configuration from a copy of that cache
(:mod:`qada.eval.decode`); :func:`recording_queries` keeps the last ``keep`` queries of every attention layer of
that prefill so that :func:`~qada.eval.decode.prefill_from_cache` can hand them to the criterion, as a
prefill with qada attached would have.

The recording routes the model's attention through a registered function (``"qada_record"``) that calls the
model's own attention implementation and copies ``query[:, :, -keep:]``: the prefill's outputs are unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PromptQueries", "RECORD_ATTENTION_NAME", "recording_queries"]

RECORD_ATTENTION_NAME = "qada_record"


@dataclass
class PromptQueries:
    """Per layer: ``queries[layer] [b, H, min(keep, T), d]`` (the prompt's last queries, after the position
    embedding) and ``scales[layer]`` (the softmax scale the layer used)."""

    keep: int
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    scales: dict[int, float] = field(default_factory=dict)


_recording: dict[str, Any] = {}  # the recording in progress (one at a time): "queries", "inner"


def _record_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs: Any):
    """transformers' attention signature; records ``query [b, H, q, d]``'s last rows, then calls the model's own
    implementation unchanged."""
    recording: PromptQueries | None = _recording.get("queries")
    layer = getattr(module, "layer_idx", None)
    if recording is not None and layer is not None:
        recording.queries[layer] = query[:, :, -recording.keep:].detach().clone()
        recording.scales[layer] = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    return _inner_attention(module, _recording["inner"])(module, query, key, value, attention_mask,
                                                         scaling=scaling, **kwargs)


def _inner_attention(module: torch.nn.Module, name: str):
    from transformers import AttentionInterface

    if name == "eager":  # transformers keeps each model's eager function in the model's own module
        function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if function is None:
            raise RuntimeError(f"cannot record the queries of {type(module).__name__}: no eager_attention_forward")
        return function
    return AttentionInterface._global_mapping[name]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if AttentionInterface._global_mapping.get(RECORD_ATTENTION_NAME) is not _record_attention_forward:
        AttentionInterface.register(RECORD_ATTENTION_NAME, _record_attention_forward)
    if RECORD_ATTENTION_NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        ALL_MASK_ATTENTION_FUNCTIONS.register(RECORD_ATTENTION_NAME, sdpa_mask)


@contextmanager
def recording_queries(model: Any, keep: int) -> Iterator[PromptQueries]:
    """``with recording_queries(model, keep) as recorded: model(...)``: ``recorded`` holds the last ``keep``
    queries of every attention layer of the forward passes inside the block (the last pass wins).

    Only models whose previous attention implementation is ``sdpa``, ``eager`` or another registered function can be
    recorded (the implementation is restored on exit, also after an exception)."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"expected keep to be an int >= 1 but got {keep!r}")
    if _recording:
        raise RuntimeError("a query recording is already in progress (recordings do not nest)")
    from transformers import AttentionInterface

    previous = model.config._attn_implementation
    if previous != "eager" and previous not in AttentionInterface._global_mapping:
        raise RuntimeError(f"cannot record the queries of a model whose attention implementation is {previous!r}")
    _register()
    recorded = PromptQueries(keep)
    _recording.update(queries=recorded, inner=previous)
    model.set_attn_implementation(RECORD_ATTENTION_NAME)
    try:
        yield recorded
    finally:
        _recording.clear()
        model.set_attn_implementation(previous)
