"""The layer step of a run whose criterion is ``dense``, on an executor that attends densely on its own.

The ``dense`` criterion decides nothing: every head attends over its whole row (a row with no more tokens than the
window is all local, as the group policy makes it). On an executor with ``attend_dense`` :func:`dense_layer_step` is
that step's whole work:

* ``triton`` (:class:`~qada.attention.TritonExecutor`, and ``triton_fused``, which has no decision to fuse for it):
  two launches, the split kernel reading every block of each row and the combine kernel, whose last program also
  writes the step's statistics row (added to the run's sums) from the rows' bounds. The general
  :func:`~qada.models.layer_step.layer_step` made the same decision in eight kernels of its own before those two,
  compiled for a GPU (the decision, the group policy, the statistics, the window gather): qada's all-dense path, the
  dense anchor of a GPU benchmark, launches what a dense decode needs and no more.
* ``sdpa`` (:class:`~qada.attention.SDPAExecutor`): on the CPU the rows' bounds are its one host read and every row
  attends as the executor attends a read group (qada's streamed kernel, in float32), the statistics row made on the
  host; the general step's decision, window attention and host plan (a compiled step of its own) are not computed.

It returns a :class:`~qada.models.step_parts.LayerStepResult` with the attention's ``output``; its ``decided``,
``local`` and ``read`` are ``None`` (nothing computes them: :func:`dense_decision` makes them where an observer asks).
"""

from __future__ import annotations

from typing import Any

import torch

from qada.attention.group_policy import apply_group_policy
from qada.criteria.base import HeadCriterion
from qada.models.step_parts import LayerStepResult, new_step
from qada.moments.base import MomentSource
from qada.step import DecodeStep
from qada.window import Window

__all__ = ["dense_decision", "dense_layer_step", "takes_dense_step"]


def takes_dense_step(criterion: HeadCriterion, moments: MomentSource | None, executor: Any) -> bool:
    """Whether a run's layer step is :func:`dense_layer_step`: the plain ``dense`` criterion (not a subclass, which
    may decide otherwise), no moment source fed (an observer that wants the estimate feeds it) and an executor that
    attends densely on its own (``attend_dense``: ``triton``, ``triton_fused``, which has no decision to fuse here,
    and ``sdpa``) and attends as that method does (a subclass that overrides ``attend`` but not ``attend_dense``
    keeps the general step, so that its own ``attend`` runs)."""
    from qada.criteria.baselines import DenseCriterion

    if type(criterion) is not DenseCriterion or moments is not None:
        return False
    if not callable(getattr(executor, "attend_dense", None)):
        return False
    return _defined_together(type(executor), "attend_dense", "attend")


def _defined_together(cls: type, method: str, other: str) -> bool:
    """Whether the class of ``cls``'s MRO that defines ``method`` also defines ``other`` or inherits it (``other`` is
    not overridden below it); ``False`` where no class defines ``method``."""
    owner = next((c for c in cls.__mro__ if method in c.__dict__), None)
    other_owner = next((c for c in cls.__mro__ if other in c.__dict__), object)
    return owner is not None and issubclass(owner, other_owner)


def dense_layer_step(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor | None,
    end: torch.Tensor | None,
    scale: float,
    layer: torch.Tensor,
    moment_state: dict[str, torch.Tensor] | None,
    criterion_states: dict[str, dict[str, torch.Tensor]],
    sink_logits: torch.Tensor | None = None,
    softcap: float | None = None,
    sums: torch.Tensor | None = None,
    *,
    criterion: HeadCriterion,
    moments: MomentSource | None,
    window: Window,
    policy: str,
    executor: Any,
) -> Any:
    """:func:`~qada.models.layer_step.layer_step` (same arguments) for the ``dense`` criterion: the executor's
    ``attend_dense`` (``query [b, H, 1, d]``, ``keys, values [b, H_kv, C, d]``), its statistics row added to
    ``sums[layer]``. Returns a :class:`~qada.models.step_parts.LayerStepResult` whose ``output [b, H, 1, d]`` is the
    attention and whose ``decided``, ``local``, ``read`` are ``None``."""
    step = new_step(query, keys, values, start, end, scale, layer, criterion_states, sink_logits, softcap, window)
    add_to = None if sums is None else (sums, layer)
    output, bulk_blocks, row = executor.attend_dense(step, add_to)
    return LayerStepResult(None, None, None, row[None], row[3], None, None, None, None, None, None, step.query,
                           step.start, step.end, output=output, bulk_blocks=bulk_blocks)


def dense_decision(criterion: HeadCriterion, step: DecodeStep,
                   policy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(decided [b, H], local [b, H], read [b, H_kv])``: the ``dense`` ``criterion``'s decision on ``step`` and the
    group ``policy``'s result (rows without a bulk all local), as :func:`~qada.models.layer_step.layer_step` makes
    them."""
    decided = criterion(step)
    local, read = apply_group_policy(decided, step.has_bulk, step.num_kv_heads, policy)
    return decided, local, read
