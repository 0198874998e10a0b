"""Helpers for the tests of qada's users: is my criterion graph-safe?

:func:`check_graph_safe` answers in one line what the run would find out while decoding: whether a criterion's
decision compiles, as one graph (``fullgraph=True``), into the run's layer step, and whether it reads the host::

    from qada.testing import check_graph_safe

    def test_my_criterion_is_graph_safe():
        check_graph_safe({"name": "topk", "sparsity": 0.8})

What keeps a criterion graph-safe: decide on the step's tensors and on the tensors of :meth:`layer_state`, never
on Python values derived from tensors (no ``.item()``, ``.tolist()``, ``bool(t)``, ``if t.any():``, ``nonzero``),
no shapes that depend on data, and per-layer data from :meth:`~qada.criteria.HeadCriterion.layer_state` rather than
a Python lookup by ``step.layer``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["GraphSafetyError", "check_graph_safe", "no_host_reads"]

HOST_READS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")


class GraphSafetyError(AssertionError):
    """A criterion is not graph-safe; the message says why."""


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Make every host read of a tensor (``item``, ``tolist``, ``nonzero``, ``bool``, ``int``, ``float``,
    ``index``) raise :class:`GraphSafetyError` inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def refuse(name: str):
        def read(*args: Any, **kwargs: Any):
            raise GraphSafetyError(f"a host read (Tensor.{name}) inside the decision")
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.Tensor, name, function)


def check_graph_safe(criterion: Any, *, heads: int = 8, kv_heads: int = 2, head_dim: int = 16, slots: int = 300,
                     filled: int = 260, window: Any = None, num_layers: int = 2) -> None:
    """Raise :class:`GraphSafetyError` unless ``criterion`` (an object, a registry name or a config) decides one
    decode step of a synthetic layer (``heads`` query heads on ``kv_heads``, a buffer of ``slots`` slots whose rows
    hold ``filled`` tokens, bulk moments when it needs them, a prefill seen) compiled as one graph
    (``torch.compile(fullgraph=True)``, eager backend: only tracing is checked) and eagerly without a host read, with
    the same decision both ways."""
    from qada.criteria import CRITERIA
    from qada.models.layer_step import compile_layer_step, layer_step
    from qada.moments.base import MomentSource
    from qada.step import BulkMoments
    from qada.window import Window

    criterion = CRITERIA.build(criterion)
    window = Window(16, 4) if window is None else window
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, kv_heads, slots, head_dim, generator=generator)
    values = torch.randn(1, kv_heads, slots, head_dim, generator=generator)
    queries = torch.randn(1, heads, filled, head_dim, generator=generator)
    scale = head_dim ** -0.5
    criterion.check_model(num_layers, heads)
    criterion.bind_layers(list(range(num_layers)))
    criterion.observe_prefill(0, keys[:, :, :filled], queries, scale, None, window, slots)
    moments = _FixedMoments(BulkMoments(keys.mean(2), torch.eye(head_dim).expand(1, kv_heads, head_dim, head_dim)))
    source: MomentSource | None = moments if criterion.needs_moments else None
    end = torch.tensor([filled + 1])
    layer = torch.tensor(0)
    bound = dict(criterion=criterion, moments=source, window=window, policy="exact")

    def arguments():  # fresh state each time: a step updates it in place
        return (torch.randn(1, heads, 1, head_dim, generator=torch.Generator().manual_seed(1)), keys, values, None, end,
                scale, layer, None if source is None else {}, criterion.layer_states(0, slots))

    try:
        compiled = compile_layer_step(bound, "eager")(*arguments())
    except Exception as error:  # noqa: BLE001 - any failure to trace is the answer
        first = " ".join(line.strip() for line in str(error).splitlines()[:3] if line.strip())
        raise GraphSafetyError(f"criterion {criterion.registry_name or type(criterion).__name__!r} does not compile "
                               f"as one graph: {first}") from error
    with no_host_reads():
        eager = layer_step(*arguments(), **bound)
    if not torch.equal(compiled.decided, eager.decided):
        raise GraphSafetyError("the compiled decision differs from the eager one")


class _FixedMoments:
    """A moment source stand-in: the same bulk moments at every step (what :func:`check_graph_safe` decides on)."""

    needs_model = False
    per_row_state = False

    def __init__(self, moments: Any) -> None:
        self._moments = moments

    def step(self, state, keys, start, end, window):  # noqa: ANN001 - the MomentSource.step signature
        return self._moments
