"""The one function qada registers with transformers' ``AttentionInterface`` (under the name ``"qada"``).

It only routes: a sliding-window layer (hybrid models) runs dense attention untouched; on a global layer, prefill
(more than one query) runs dense attention and feeds the moment source, and a decode step (one query) goes to the
run's criterion and executor. Dense attention is transformers' SDPA function, or the model's math where the call
carries sink logits or a soft cap (:mod:`qada.models.dense_attention`). A keyword argument that would change
the math and that qada does not implement is an error (:mod:`qada.models.attention_features`). The run of a module
is looked up in a weak map filled by :func:`qada.apply`; no model class is patched.
"""

from __future__ import annotations

import weakref

import torch

from qada.models.attention_features import PLAIN, AttentionFeatures, attention_features
from qada.models.dense_attention import dense_attention
from qada.models.guards import UnsupportedModelError
from qada.models.run import QAdARun

__all__ = ["ATTENTION_NAME", "RUN_NUMBER", "active_runs", "qada_attention_forward", "traced_run_number"]

ATTENTION_NAME = "qada"

# attention module -> the run that wraps it; filled and emptied by qada.apply / enable.
active_runs: weakref.WeakKeyDictionary[torch.nn.Module, QAdARun] = weakref.WeakKeyDictionary()

# the attribute of a wrapped attention module that holds its run's number (qada.models.compiled.register_run)
RUN_NUMBER = "qada_run_number"


def traced_run_number(module: torch.nn.Module, run: QAdARun) -> int:
    """While ``torch.compile`` traces ``module``: the number of its run, read from the module's attribute and
    checked against ``run.op_number`` (the number the graph's operator calls the run by).

    Read from the module, the value is guarded: another model's modules (a second model compiled side by side) or a
    run attached later have another number, fail the guard and compile a graph of their own. The run found by the
    weak map is not guarded (dynamo reuses one graph for every instance of a module class), so without this read
    they would call this run."""
    number = getattr(module, RUN_NUMBER, None)
    if number != run.op_number:
        raise RuntimeError(f"the module's run number {number!r} is not its run's ({run.op_number!r}): attach the "
                           "run with qada.apply or qada.enable")
    return number


def qada_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query [b, H, q, d]``, ``key/value [b, H_kv, T, d]``.

    Returns ``([b, q, H, d], None)``.
    """
    run = active_runs.get(module)
    if run is None:
        raise UnsupportedModelError(
            f"attention implementation {ATTENTION_NAME!r} is set but qada is not active on this module; "
            "use qada.apply(model, ...) or qada.enable(model, ...)"
        )
    if torch.compiler.is_compiling():
        traced_run_number(module, run)
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise UnsupportedModelError(f"{type(module).__name__} has no layer_idx: qada needs one per attention layer")
    features = attention_features(module, kwargs, dropout)  # refuses what would change the math unnoticed
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if run.layers.is_sliding(layer):  # a sliding-window layer is already local: its own mask and cache (the run
        # knows the model's layers once attached, which is when it is found here)
        return dense_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs, features), None
    if query.shape[2] == 1 and run.on_buffer(layer, key.shape[2]):
        # A decode step on a preallocated cache: the whole buffer, the rows' ends as device tensors, no sync.
        output = decode_step(run, layer, query, key, value, attention_mask, scaling, kwargs.get("position_ids"),
                             features, buffered=True)
        return output.transpose(1, 2), None
    T = run.filled_length(layer, query.shape[2], attention_mask, key.shape[2])
    capacity = None
    if T < key.shape[2]:  # a preallocated cache (StaticCache) at its prefill: only its first T slots hold tokens
        capacity = key.shape[2]
        key, value = key[:, :, :T], value[:, :, :T]
    q_len = query.shape[2]
    if q_len > 1 or T == q_len:  # prefill (a 1-token prompt included, or a resumed chunk): dense, as in the paper
        mask = None if attention_mask is None else attention_mask[..., :T]
        run.rows.check_contiguous(mask, T)
        output = dense_attention(module, query, key, value, mask, scaling, dropout, kwargs, features)
        run.prefill(layer, key, run.rows.starts(attention_mask, T), capacity, query=query, scale=scaling)
        return output, None
    output = decode_step(run, layer, query, key, value, attention_mask, scaling, kwargs.get("position_ids"), features)
    return output.transpose(1, 2), None


def decode_step(run: QAdARun, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float, position_ids: torch.Tensor | None,
                features: AttentionFeatures = PLAIN, buffered: bool = False) -> torch.Tensor:
    """:meth:`QAdARun.decode`; when ``torch.compile`` traces the model, a step on a preallocated cache
    (``buffered``) that the run traces inline (:meth:`QAdARun.inlines`: the CPU, built-in components) is the layer
    step in the model's graph and the executor as one operator (:mod:`qada.models.inline_step`); any other is one
    opaque operator (:mod:`qada.models.compiled`): the compiler sees one call without host syncs, not qada's
    Python."""
    if torch.compiler.is_compiling():
        if buffered and run.inlines(key.device, features.softcap):
            from qada.models.inline_step import inline_decode

            return inline_decode(run, layer, query, key, value, attention_mask, scaling, position_ids,
                                 features.sink_logits)
        from qada.models.compiled import decode_op

        if buffered and run.shares_bounds(layer):  # the step's first global layer derived the rows' bounds
            attention_mask = position_ids = None
        return decode_op(run, layer, query, key, value, attention_mask, scaling, position_ids, features.sink_logits,
                         features.softcap)
    return run.decode(layer, query, key, value, scaling, attention_mask, position_ids, features.sink_logits,
                      features.softcap)
