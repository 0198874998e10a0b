"""What a model's attention passes to the attention function beyond query, key, value and mask, and what qada does
with it: implement it, ignore it (it does not change a decode step's math), or refuse it with a clear error.

transformers' attention modules call the registered function as ``attention_interface(self, q, k, v, mask,
dropout=..., scaling=..., **extra)``; the ``extra`` keywords differ per family. qada implements two that change the
softmax: learned sink logits (``s_aux``, gpt-oss) and logit soft-capping (``softcap``, Gemma-2)
(:mod:`qada.functional.capping`). Anything else that would change the math is refused, twice over:

* at :func:`qada.apply`, from the attention module's source (:func:`check_attention_source`): the keywords its
  ``forward`` passes to the attention function, and how many times it calls it per layer;
* at every call (:func:`attention_features`): a keyword qada does not know, with a value, is an error, never
  silently dropped.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

import torch

from qada.models.guards import UnsupportedModelError

__all__ = ["IMPLEMENTED", "NO_EFFECT", "PLAIN", "AttentionFeatures", "attention_features", "check_attention_source"]

IMPLEMENTED = {"s_aux": "learned attention sinks", "softcap": "logit soft-capping"}
"""Keywords qada implements in every criterion and executor, and what they are."""

NO_EFFECT = frozenset({
    "dropout", "scaling",  # the function's own parameters
    "sliding_window",  # a sliding layer passes through untouched (qada.models.layer_types)
    "position_ids", "cache_position", "position_embeddings", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "past_key_values", "past_key_value", "is_causal", "layer_idx",
    "num_items_in_batch", "token_type_ids", "logits_to_keep",
})
"""Keywords that do not change the math of a decode step (one query attending over the whole cache)."""

KNOWN_UNSUPPORTED = {
    "indices": "sparse attention over indexed keys (a DeepSeek-style indexer)",
    "block_indices": "block-sparse attention",
    "sinks": "attention sinks in a form other than gpt-oss's s_aux",
    "position_bias": "an additive position bias",
    "head_mask": "a head mask",
    "cu_seq_lens_q": "packed sequences", "cu_seq_lens_k": "packed sequences",
    "max_length_q": "packed sequences", "max_length_k": "packed sequences",
    "cache": "a paged cache (continuous batching)",
    "deterministic": "a kernel option of flash attention",
}
"""Keywords qada recognises and does not implement (refused when they carry a value), with what they are."""


_PARAMETERS = frozenset({"module", "query", "key", "value", "attention_mask"})  # passed by name by some families


def _meaning(name: str) -> str:
    return KNOWN_UNSUPPORTED.get(name, "an attention argument qada does not know")


@dataclass(frozen=True)
class AttentionFeatures:
    """The softmax features of one attention call that qada implements.

    Attributes:
        sink_logits: ``[H]`` learned sink logit per query head, or ``None``.
        softcap: the logit soft-cap ``c``, or ``None``.
    """

    sink_logits: torch.Tensor | None = None
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        """Whether the call is plain scaled dot-product attention (neither feature)."""
        return self.sink_logits is None and self.softcap is None


PLAIN = AttentionFeatures()
"""Plain scaled dot-product attention."""


def attention_features(module: Any, kwargs: dict[str, Any], dropout: float = 0.0) -> AttentionFeatures:
    """The :class:`AttentionFeatures` of one call of the attention function with ``kwargs``; raise
    :class:`~qada.models.guards.UnsupportedModelError` for a keyword that changes the math and that qada does not
    implement (a value other than ``None``/``False`` on a keyword it does not know) and for dropout (training)."""
    for name, value in kwargs.items():
        if name in NO_EFFECT or name in IMPLEMENTED or value is None or value is False:
            continue
        raise UnsupportedModelError(
            f"{type(module).__name__} passes {name}=... to its attention function ({_meaning(name)}); qada does "
            "not implement it, and decoding without it would silently differ from the model"
        )
    if dropout:
        raise UnsupportedModelError(f"{type(module).__name__} attends with dropout {dropout} (a model in training "
                                    "mode): qada decodes models in eval mode only; call model.eval()")
    sink = kwargs.get("s_aux")
    if sink is not None:
        if not isinstance(sink, torch.Tensor) or sink.dim() != 1:
            got = tuple(sink.shape) if isinstance(sink, torch.Tensor) else type(sink).__name__
            raise UnsupportedModelError(f"{type(module).__name__} passes s_aux of shape {got}; qada implements "
                                        "one sink logit per query head, shape [heads]")
        sink = sink.detach()
    softcap = kwargs.get("softcap")
    if softcap is not None:
        softcap = float(softcap)
    return AttentionFeatures(sink, softcap)


def _attention_calls(cls: type) -> list[ast.Call] | None:
    """The calls of the attention function in ``cls.forward``'s source (``None``: no source to read)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None
    calls = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name == "attention_interface":
                calls.append(node)
    return calls


def check_attention_source(model: Any, modules: list[Any]) -> None:
    """Raise :class:`~qada.models.guards.UnsupportedModelError` at :func:`qada.apply` when an attention module's
    ``forward`` passes a keyword that changes the math and that qada does not implement (unless its value is
    literally ``None``), a mask other than the model's (``attention_mask``), or calls the attention function more
    than once per layer (differential attention): the error names the model family and the feature."""
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    for cls in {type(module) for module in modules}:
        calls = _attention_calls(cls)
        if not calls:
            continue
        if len(calls) > 1:
            raise UnsupportedModelError(
                f"{family}: {cls.__name__} calls the attention function {len(calls)} times per layer (e.g. "
                "differential attention); qada decides on one softmax per layer and cannot serve it"
            )
        mask = [k.value for k in calls[0].keywords if k.arg == "attention_mask"] + calls[0].args[4:5]
        if mask and not (isinstance(mask[0], ast.Name) and mask[0].id == "attention_mask"
                         or isinstance(mask[0], ast.Constant) and mask[0].value is None):
            raise UnsupportedModelError(
                f"{family}: {cls.__name__} attends with a mask of its own ({ast.unparse(mask[0])}, e.g. dynamic mask "
                "attention), not the model's causal mask; qada attends over every token of a row and cannot serve it"
            )
        for keyword in calls[0].keywords:
            name = keyword.arg
            if name is None or name in NO_EFFECT or name in IMPLEMENTED or name in _PARAMETERS:
                continue
            if isinstance(keyword.value, ast.Constant) and keyword.value.value in (None, False):
                continue
            raise UnsupportedModelError(
                f"{family}: {cls.__name__} passes {name}= to its attention function ({_meaning(name)}), which qada "
                "does not implement; decoding without it would differ from the model"
            )
