"""qada's decode step inside a compiled model's graph: the layer step traced inline, the executor one operator.

When ``torch.compile`` traces a wrapped model on the CPU and the run asks for it (``run.inline = True``,
:meth:`~qada.models.run.QAdARun.inlines`), a global layer's decode step on a preallocated cache is
traced as (1) the rows' bounds from the mask and the growth check (tensor operations), (2) the run's
:func:`~qada.models.layer_step.layer_step` itself (the moment step, the decision, the group policy, the
statistics, the window gather), inline in the model's graph, and (3) one call of the custom operator
``qada::attend_step`` (:func:`attend_op`), which runs the executor on what the step decided: on the CPU it reads the
decision on the host to skip the bulk of local KV groups, which no compiled graph can do. Compared with the whole
step as one opaque operator (:mod:`qada.models.compiled`, the route on other devices and for CUDA graphs), the
decision's kernels join the model's graph: no compiled function of its own to enter per layer (its guards, its
wrappers), which on a 2-core CPU cost more than its kernels. The price: the compiler compiles every layer's copy
of the step (minutes for a 30-layer model, against seconds for the one shared compiled step).

The operator is registered when a run is attached (:func:`register_attend_op`, called by
:func:`~qada.models.apply.attach`; no global side effect at import).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from qada.models.compiled import run_named, unaliased
from qada.models.guards import buffer_row_bounds
from qada.models.step_parts import LayerStepResult
from qada.step import BulkMoments

__all__ = ["attend_op", "flatten_result", "inline_decode", "register_attend_op", "unflatten_result"]

_TENSOR_FIELDS = [name for name in LayerStepResult._fields if name != "moments"]
_COUNT, _MOMENTS = len(_TENSOR_FIELDS), LayerStepResult._fields.index("moments")


def flatten_result(result: LayerStepResult) -> list[torch.Tensor | None]:
    """The step's tensors in a fixed order (the moments as their mean and covariance), for the operator."""
    moments = result.moments
    return [getattr(result, name) for name in _TENSOR_FIELDS] + (
        [None, None] if moments is None else [moments.mean, moments.cov])


def unflatten_result(parts: list[torch.Tensor | None]) -> LayerStepResult:
    """The inverse of :func:`flatten_result`."""
    mean, cov = parts[_COUNT], parts[_COUNT + 1]
    values = list(parts[:_COUNT])
    values.insert(_MOMENTS, None if mean is None else BulkMoments(mean, cov))
    return LayerStepResult._make(values)  # positional: this is on every compiled call's path


def inline_decode(run: Any, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float, position_ids: torch.Tensor | None,
                  sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`~qada.models.run.QAdARun.decode` as ``torch.compile`` traces it: ``query [b, H, 1, d]``, ``key,
    value [b, H_kv, C, d]`` (the whole buffer) -> ``[b, H, 1, d]``; a model without a logit soft cap
    (:meth:`~qada.models.run.QAdARun.inlines`)."""
    C = key.shape[2]
    start, end = buffer_row_bounds(attention_mask, C, position_ids)  # per layer: two reductions, no state
    run.guard.check_buffer_growth(layer, end, first_layer=layer == run._first_layer)
    inputs = run._layer_inputs(layer, C, key.device)
    result = run.layer_step.eager(query, key, value, start, end, float(scaling), *inputs, sink_logits, None,
                                  run.stats.sums)
    return attend_op(run, layer, query, key, value, result, scaling, sink_logits)


def attend_op(run: Any, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              result: LayerStepResult, scaling: float, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """The run's executor on ``result`` through the ``qada::attend_step`` operator -> ``[b, H, 1, d]`` (a model
    without a logit soft cap, as :func:`inline_decode`)."""
    return torch.ops.qada.attend_step(query, key, value, flatten_result(result), run.op_number, layer, float(scaling),
                                      sink_logits)


@functools.cache
def register_attend_op() -> Any:
    """Register ``qada::attend_step`` (once; eagerly, when a run is attached, never while ``torch.compile`` traces)
    and return it."""

    @torch.library.custom_op("qada::attend_step", mutates_args=())
    def attend_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, parts: list[torch.Tensor | None],
                    run_id: int, layer: int, scaling: float, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        run = run_named(run_id)
        result = unflatten_result(parts)
        step_index = run.guard.count_step(layer)
        output = run._attend(layer, step_index, query, key, value, scaling, result.start, result.end, result,
                             sink_logits, None, True)
        return unaliased(output, (query, key, value, *parts))

    @attend_step.register_fake
    def _(query, key, value, parts, run_id, layer, scaling, sink_logits=None):
        return torch.empty_like(query)

    return attend_step
