"""A dense anchor without transformers' copy of the K/V: the ``dense packed`` rows of the end-to-end section.

At a decode step of a grouped-query model (``H`` query heads over ``H_kv < H`` KV heads) transformers' SDPA function
repeats each layer's whole K/V ``H / H_kv`` times (``repeat_kv``: a copy of the cache, 3x on SmolLM2, 4x on
Llama-3-8B) whenever it attends with a mask, which a static cache always passes: transformers 5.17 does so eagerly
and compiled, 5.23 only when ``torch.compile`` traces the model (eagerly it packs the query heads instead). So
"transformers' compiled dense" writes and reads several copies of the K/V per layer and step, where the attention
itself reads one: a weak anchor for a method that saves K/V reads.

:func:`packed_sdpa_forward` is transformers' SDPA function except at such a step: there the ``G = H / H_kv`` query
heads of each KV group attend as ``G`` query rows of that group's K/V (``[b, H_kv, G, d]`` against ``[b, H_kv, S,
d]``, the mask broadcast over the rows), one ``scaled_dot_product_attention`` call over the cache itself, eager or
compiled, with or without a mask. Everything else (prefill, models without grouped queries, soft caps, sinks) goes to
transformers' own function unchanged. :func:`packed_attention` sets it on a model for the time of a ``with``
block; the end-to-end section decodes its ``dense packed`` rows (the unwrapped model otherwise) inside one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["PACKED_ATTENTION", "packed_attention", "packed_sdpa_forward", "register_packed_attention"]

PACKED_ATTENTION = "sdpa_packed"
"""The name :func:`packed_sdpa_forward` is registered under in transformers' ``AttentionInterface``."""


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query [b, H, q, d]``, ``key, value [b, H_kv, S, d]``, ``attention_mask``
    ``[b or 1, 1 or H, q, >= S]`` (bool or additive) or ``None``. Returns ``([b, q, H, d], None)``.

    One query (a decode step) with ``H_kv < H`` and no soft cap or sink logits: the query heads of each KV group
    as rows of its K/V, no copy of the cache. Anything else: transformers' ``sdpa_attention_forward``."""
    b, H, q_len, d = query.shape
    H_kv = key.shape[1]
    plain = kwargs.get("softcap") is None and kwargs.get("s_aux") is None and kwargs.get("position_bias") is None
    if q_len != 1 or H_kv == H or not plain:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    G = H // H_kv
    rows = query.reshape(b, H_kv, G, d)  # query head h = g_kv * G + i: row i of KV head g_kv (transformers' order)
    mask = attention_mask
    if mask is not None:
        mask = mask[..., : key.shape[2]]
        if mask.shape[1] != 1:  # one mask per query head: rows of their groups
            mask = mask.reshape(mask.shape[0], H_kv, G, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)  # [b, H_kv, G, d]
    return out.reshape(b, 1, H, d), None


def register_packed_attention() -> None:
    """Register :func:`packed_sdpa_forward` (and transformers' SDPA mask) under :data:`PACKED_ATTENTION`;
    idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if AttentionInterface._global_mapping.get(PACKED_ATTENTION) is not packed_sdpa_forward:
        AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_forward)
    if PACKED_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def packed_attention(model: Any) -> Iterator[None]:
    """``model`` attends with :func:`packed_sdpa_forward` inside the block, with its own implementation after it."""
    register_packed_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(PACKED_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
