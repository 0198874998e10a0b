"""qada's decode step as one opaque operator for ``torch.compile`` (and CUDA graphs).

When ``torch.compile`` traces a model that qada wraps, the decode step of a global layer on a preallocated cache
becomes one call of the custom operator ``qada::decode_buffer`` (:func:`decode_op`): the compiler never traces
qada's Python (its registries, dataclasses and state), so the model's step compiles with ``fullgraph=True``.
At run time the operator runs :meth:`~qada.models.run.QAdARun.decode`, which on a preallocated cache is a pure
function of device tensors and of state updated in place (no host read, fixed shapes): recorded into a CUDA graph
(``mode="reduce-overhead"``), its kernels replay with the state they update.

The operator is registered on first use (no global side effect at import).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any

import torch

__all__ = ["decode_op", "register_run", "run_named", "unaliased"]

# number -> run, for the operator's integer argument (a run is not a tensor); weak: runs are not kept alive.
_RUNS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


def register_run(run: Any) -> int:
    """The number that names ``run`` in the operator's calls (given once, when the run is attached: eagerly,
    never while ``torch.compile`` traces)."""
    _operator()  # the operator is registered eagerly too, never while tracing
    number = getattr(run, "op_number", None)
    if number is None or _RUNS.get(number) is not run:
        number = next(_NUMBERS)
        _RUNS[number] = run
        run.op_number = number
    return number


def run_named(run_id: int) -> Any:
    """The run that :func:`register_run` numbered ``run_id`` (what an operator's call names); an error once it is
    gone."""
    run = _RUNS.get(run_id)
    if run is None:
        raise RuntimeError("the qada run of this compiled model was removed: compile the model again")
    return run


def unaliased(output: torch.Tensor, inputs: tuple = ()) -> torch.Tensor:
    """``output``, copied where it is a view or shares the storage of a tensor among ``inputs`` (an operator's output
    must not alias its inputs; e.g. the window's attention a layer step handed to the executor, returned as is where
    every head is local)."""
    if output._base is not None:
        return output.clone()
    storage = output.untyped_storage().data_ptr()
    shared = any(isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == storage for x in inputs)
    return output.clone() if shared else output


_SCHEMA = ("decode_buffer(Tensor query, Tensor key, Tensor value, Tensor? attention_mask, Tensor? position_ids, "
           "int run_id, int layer, float scaling, Tensor? sink_logits=None, float? softcap=None) -> Tensor")


@functools.cache
def _operator() -> torch.library.Library:
    """Register ``qada::decode_buffer`` (once; the library is kept alive by the cache): a functional schema, one
    kernel for every device (``CompositeExplicitAutograd``: a decode step computes no gradients), a fake kernel for
    the compiler. Defined on a :class:`torch.library.Library` rather than by ``torch.library.custom_op``, whose
    Python autograd wrapper runs on every call: 11 against 29 us a call on a 2-core CPU (30 calls a decode step of
    the embedded model)."""
    library = torch.library.Library("qada", "FRAGMENT")
    library.define(_SCHEMA)

    def decode_buffer(query, key, value, attention_mask, position_ids, run_id, layer, scaling, sink_logits=None,
                      softcap=None):  # noqa: ANN001, ANN202 - the schema above types them
        output = run_named(run_id).decode(layer, query, key, value, scaling, attention_mask, position_ids,
                                          sink_logits, softcap)
        return unaliased(output)

    def fake(query, key, value, attention_mask, position_ids, run_id, layer, scaling, sink_logits=None,
             softcap=None):  # noqa: ANN001, ANN202
        return torch.empty_like(query)  # [b, H, 1, d]

    library.impl("decode_buffer", decode_buffer, "CompositeExplicitAutograd")
    torch.library.register_fake("qada::decode_buffer", fake, lib=library)
    return library


def decode_op(run: Any, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float,
              position_ids: torch.Tensor | None, sink_logits: torch.Tensor | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """``run.decode(...)`` through the ``qada::decode_buffer`` operator: ``query [b, H, 1, d]``,
    ``key, value [b, H_kv, C, d]`` (the whole buffer) -> ``[b, H, 1, d]``."""
    return torch.ops.qada.decode_buffer(query, key, value, attention_mask, position_ids, run.op_number, layer,
                                        float(scaling), sink_logits, softcap)
