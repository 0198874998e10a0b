"""Generation helpers: the KV cache to decode with, and decode-only timing (prefill timed apart).

A preallocated cache (transformers' ``StaticCache``) writes each new key in place; a ``DynamicCache`` grows by
``torch.cat``, which copies the whole K/V of every layer at every decode step. On the CPU that copy costs as much
as dense attention itself (``benchmarks/results/profile-cpu.md``), so qada decodes with a static cache by
default and the wrapper supports both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from qada.artifacts import text_config

__all__ = [
    "CACHE_KINDS",
    "DecodeTimer",
    "GenerationTiming",
    "check_generation_length",
    "copy_to_cache",
    "generate_timed",
    "make_cache",
]

CACHE_KINDS = ("static", "dynamic")


def _check_kind(kind: str) -> None:
    if kind not in CACHE_KINDS:
        raise ValueError(f"expected a cache kind in {CACHE_KINDS} but got {kind!r}")


def check_generation_length(model: Any, prompt_tokens: int, max_new_tokens: int) -> None:
    """Raise ``ValueError`` before any work when a prompt of ``prompt_tokens`` plus ``max_new_tokens`` does not fit.

    Refused: an empty prompt; more tokens than the model's maximum positions (``max_position_embeddings``).
    Sliding-window layers set no limit: qada passes them through.
    """
    if prompt_tokens < 1:
        raise ValueError("expected a prompt of at least one token but got an empty prompt")
    total = prompt_tokens + max_new_tokens
    config = text_config(model.config)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and total > limit:
        raise ValueError(
            f"expected prompt + new tokens <= the model's {limit} positions (max_position_embeddings) but got "
            f"{prompt_tokens} + {max_new_tokens} = {total}"
        )


def make_cache(model: Any, kind: str = "static", capacity: int | None = None) -> Any:
    """An empty cache for ``model``: ``static`` with ``capacity`` slots (prompt + new tokens), or ``dynamic``."""
    from transformers import DynamicCache, StaticCache

    _check_kind(kind)
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if capacity is None or capacity < 1:
        raise ValueError(f"expected a capacity >= 1 (prompt + new tokens) for a static cache but got {capacity!r}")
    return StaticCache(config=model.config, max_cache_len=capacity)


def copy_to_cache(model: Any, source: Any, kind: str = "static", capacity: int | None = None) -> Any:
    """A new cache of ``kind`` holding a copy of ``source``'s filled K/V (``source`` stays intact).

    A sliding-window layer (hybrid models) keeps only its last keys; its copy keeps them too and continues from
    the true sequence length (:func:`_copy_sliding_layer`).
    """
    layers = []
    for layer in source.layers:
        filled = int(layer.get_seq_length())
        held = min(filled, layer.keys.shape[2]) if layer.is_initialized else 0  # a sliding layer holds fewer
        sliding = bool(getattr(layer, "is_sliding", False))
        layers.append((layer.keys[:, :, :held], layer.values[:, :, :held], filled, sliding))
    length = max((filled for *_, filled, _ in layers), default=0)
    cache = make_cache(model, kind, capacity if capacity is not None else length)
    if capacity is not None and capacity < length:
        raise ValueError(f"expected a capacity >= the cached length {length} but got {capacity}")
    for index, (keys, values, filled, sliding) in enumerate(layers):
        if kind == "dynamic":
            keys, values = keys.clone(), values.clone()
        if sliding or getattr(cache.layers[index], "is_sliding", False):
            _copy_sliding_layer(cache.layers[index], keys, values, filled)
        else:
            cache.update(keys, values, index)
    return cache


def _copy_sliding_layer(target: Any, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
    """Fill a fresh sliding-window cache layer from the last ``keys/values [b, H_kv, n, d]`` of a sequence of
    ``filled`` tokens, so that its next update continues the sequence exactly as the original would.

    A dynamic layer keeps the last ``window - 1`` keys; a static one a buffer of ``M = min(window, capacity)``
    slots that, once full, rolls left by one at every decode step, so before a step its slots ``1..M-1`` must
    hold the last ``M - 1`` keys (slot 0 is rolled out unread).
    """
    size = getattr(target, "max_cache_len", None)
    if size is None or filled < size:  # a dynamic layer, or a static one not yet full: the plain update
        if keys.shape[2]:
            target.update(keys, values)
        if hasattr(target, "cumulative_length") and isinstance(target.cumulative_length, int):
            target.cumulative_length = filled
        return
    if keys.shape[2] < size - 1:
        raise ValueError(f"a sliding-window layer of {size} slots needs the last {size - 1} keys but the source "
                         f"holds {keys.shape[2]}")
    if keys.shape[2] < size:  # pad slot 0 (never read) with a copy of the oldest key
        keys, values = torch.cat([keys[:, :, :1], keys], 2), torch.cat([values[:, :, :1], values], 2)
    target.update(keys[:, :, -size:], values[:, :, -size:])
    target.cumulative_length_int = filled


@dataclass
class DecodeTimer:
    """A logits processor that only records when it is called: once per generated token, right after the forward
    that produced it. The first call closes the prefill; the later ones time the decode steps."""

    times: list[float] = field(default_factory=list)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


@dataclass
class GenerationTiming:
    """Seconds of the prefill (up to the first new token) and of the decode steps after it."""

    prefill_s: float
    decode_s: float
    decode_tokens: int

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second of the decode steps alone (``None`` when only one token was generated)."""
        return self.decode_tokens / self.decode_s if self.decode_tokens and self.decode_s > 0 else None


def generate_timed(model: Any, input_ids: torch.Tensor, max_new_tokens: int, cache: str = "static",
                   **generate_kwargs: Any) -> tuple[torch.Tensor, GenerationTiming]:
    """``model.generate`` with the chosen cache kind, timing the prefill and the decode steps apart."""
    from transformers import LogitsProcessorList

    _check_kind(cache)
    if input_ids.ndim != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"expected input_ids of shape [batch >= 1, tokens] but got {tuple(input_ids.shape)}")
    check_generation_length(model, input_ids.shape[1], max_new_tokens)
    timer = DecodeTimer()
    processors = LogitsProcessorList([*generate_kwargs.pop("logits_processor", []), timer])
    past = make_cache(model, cache, input_ids.shape[1] + max_new_tokens)
    start = time.perf_counter()
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=max_new_tokens, past_key_values=past,
                                logits_processor=processors, **generate_kwargs)
    end = time.perf_counter()
    first = timer.times[0] if timer.times else end
    # the last decode step ends when its logits are processed; generate's own bookkeeping after it is not decode
    last = timer.times[-1] if timer.times else end
    return output, GenerationTiming(first - start, last - first, max(len(timer.times) - 1, 0))
