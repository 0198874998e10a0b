"""Prefill once, decode many: the dense prefill of a prompt and greedy decoding from a copy of its cache."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from qada.models.apply import attach
from qada.models.generation import copy_to_cache
from qada.models.prompt_queries import PromptQueries, recording_queries
from qada.models.run import QAdARun

__all__ = ["Prefilled", "decode_greedy", "prefill", "prefill_from_cache"]


@dataclass
class Prefilled:
    """A prompt after the dense prefill: its cache, the logits of its last position, its length, and (when asked
    for) the prompt's last queries per layer, for criteria that read them at the prefill."""

    cache: Any
    last_logits: torch.Tensor
    length: int
    queries: PromptQueries | None = None


@torch.no_grad()
def prefill(model: Any, input_ids: torch.Tensor, keep_queries: int = 0) -> Prefilled:
    """Dense prefill of ``input_ids [1, T]`` with the model as it is (qada not attached), as in the paper.

    ``keep_queries``: also record the prompt's last ``keep_queries`` queries per layer (the tail-aware criteria's
    observation window, :meth:`~qada.criteria.HeadCriterion.prompt_queries`); 0: none. The outputs do not change.
    """
    from transformers import DynamicCache

    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"expected input_ids of shape [1, T] but got {tuple(input_ids.shape)}")
    cache = DynamicCache(config=model.config)
    recording = recording_queries(model, keep_queries) if keep_queries else nullcontext(None)
    with recording as queries:
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return Prefilled(out.past_key_values, out.logits[:, -1].float(), input_ids.shape[1], queries)


@torch.no_grad()
def decode_greedy(
    model: Any,
    prefilled: Prefilled,
    max_new_tokens: int,
    eos_token_ids: Iterable[int] = (),
    run: QAdARun | None = None,
    cache: str = "static",
) -> list[int]:
    """Greedy tokens after the prompt, decoded from a *copy* of the prefilled cache (the original stays intact).

    With ``run``, qada is attached for the decode steps only and removed afterwards; the run's moment source is
    started from the copied cache and the prefill's recorded queries
    (:func:`prefill_from_cache`). Stops after
    ``max_new_tokens`` tokens or at an EOS token (which is included). ``cache``: the copy is a preallocated
    ``static`` cache (default: each step writes one key in place) or a ``dynamic`` one (grows by a copy per step).
    """
    if max_new_tokens < 1:
        raise ValueError(f"expected max_new_tokens >= 1 but got {max_new_tokens}")
    eos = set(eos_token_ids)
    cache = copy_to_cache(model, prefilled.cache, cache, prefilled.length + max_new_tokens)
    token = int(prefilled.last_logits.argmax(-1))
    tokens = [token]
    if run is not None:
        attach(model, run)
    try:
        if run is not None:
            prefill_from_cache(run, cache, queries=prefilled.queries)
        device = prefilled.last_logits.device
        while len(tokens) < max_new_tokens and token not in eos:
            out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
    finally:
        if run is not None:
            run.remove()
    return tokens


def prefill_from_cache(run: QAdARun, cache: Any, start: torch.Tensor | None = None,
                       queries: PromptQueries | None = None) -> None:
    """Start ``run`` decoding from an already prefilled transformers cache (e.g. a copy shared by a sweep).

    Feeds every layer's cached keys ``[b, H_kv, T, d]`` to :meth:`~qada.models.run.QAdARun.prefill`, as a dense
    prefill would have, with ``queries``: the prompt's last queries per layer, recorded by that prefill
    (:func:`~qada.models.prompt_queries.recording_queries`). Raises ``ValueError`` when the criterion needs more
    of them (:meth:`~qada.criteria.HeadCriterion.prompt_queries`) than ``queries`` holds.
    """
    needed = run.criterion.prompt_queries()
    if needed and (queries is None or queries.keep < needed):
        held = "none" if queries is None else f"the last {queries.keep}"
        raise ValueError(
            f"criterion {run.criterion.registry_name or type(run.criterion).__name__!r} reads the prompt's last "
            f"{needed} queries per layer at the prefill, but the shared prefill recorded {held}: prefill with "
            f"qada.eval.decode.prefill(model, ids, keep_queries={needed}) and pass its queries"
        )
    for layer, cache_layer in enumerate(cache.layers):
        if getattr(cache_layer, "is_sliding", False) or (run.layers is not None and run.layers.is_sliding(layer)):
            continue  # a sliding-window layer passes through: no moments, no guard
        keys = cache_layer.keys
        filled = int(cache_layer.get_seq_length())  # a preallocated cache holds fewer tokens than slots
        capacity = None
        if filled < keys.shape[2]:
            keys, capacity = keys[:, :, :filled], keys.shape[2]
        query = None if queries is None else queries.queries.get(layer)
        if needed and query is None:
            raise ValueError(f"layer {layer}: the recorded prompt queries have no entry for this layer")
        run.prefill(layer, keys, start, capacity, query=query, scale=None if query is None else queries.scales[layer])
