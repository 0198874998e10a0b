"""The :class:`AttentionExecutor` interface and the executor registry.

An executor computes one decode step of attention given the per-head decision. It receives the layer's
:class:`~qada.step.DecodeStep` (``query [b, H, d]``, ``keys, values [b, H_kv, T, d]`` with GQA ``H = G * H_kv``
— query heads ``g*G .. g*G+G-1`` share KV head ``g`` —, the window, the scale, ``start [b]`` for left padding,
and the local window already gathered for the criterion) and ``local [b, H]`` bool (True = attend over the
local window only). It returns ``[b, H, 1, d]`` in the query dtype together with what it actually did
(:class:`ExecutorOutput`). :func:`decode_attention` is the same on plain tensors.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import NamedTuple

import torch

from qada.attention.group_policy import apply_group_policy, check_group_policy, head_sparsity, kv_sparsity
from qada.functional.checks import check_head_mask
from qada.registry import Component, Registry
from qada.step import DecodeStep, check_attention_inputs

__all__ = ["EXECUTORS", "AttentionExecutor", "ExecutorOutput", "GroupDecision", "decode_attention",
           "register_executor"]


class ExecutorOutput(NamedTuple):
    """Result of one executor call.

    Attributes:
        output: ``[b, H, 1, d]`` attention output in the query dtype.
        local: ``[b, H]`` bool, the effective local mask after the group policy (rows with at most
            ``T_local`` real tokens count as local: their window is the whole row).
        sparsity: 0-d float tensor, fraction of query heads computed locally.
        kv_sparsity: 0-d float tensor, fraction of (batch, KV head) bulk reads skipped (a row without a bulk
            counts as skipped: nothing beyond the window is read).
        bulk_blocks: 0-d int tensor of bulk KV blocks loaded (fused kernels), else ``None``.
        read: ``[b, H_kv]`` bool, the KV heads whose bulk was read (the group policy's), else ``None``.
    """

    output: torch.Tensor
    local: torch.Tensor
    sparsity: torch.Tensor
    kv_sparsity: torch.Tensor
    bulk_blocks: torch.Tensor | None = None
    read: torch.Tensor | None = None


class GroupDecision(NamedTuple):
    """What an executor must compute, after the group policy.

    Attributes:
        local: ``[b, H]`` bool effective local mask (True for every head of a row without a bulk).
        read: ``[b, H_kv]`` bool, the KV heads whose bulk must be read (exactly those with a dense head).
    """

    local: torch.Tensor
    read: torch.Tensor


@dataclass
class AttentionExecutor(Component, abc.ABC):
    """Computes decided attention; subclasses are dataclasses registered with :func:`register_executor`.

    ``__call__(step, local)`` checks the decision, applies the group policy, computes the reported sparsities
    and calls :meth:`attend`, the one method a subclass implements. Nothing in this plumbing syncs with the host.

    Args:
        group_policy: ``"exact"`` (a local head stays local even when its KV group's bulk is read, the
            paper's semantics) or ``"promote"`` (such a head gets full attention, free in KV bytes).
    """

    group_policy: str = "exact"

    static_shapes = False
    """Attends without host syncs, so a CUDA graph can capture it (every executor attends on steps over a whole
    preallocated buffer, ``step.end``); False by default, set by the built-in executors that keep to it."""

    def __post_init__(self) -> None:
        check_group_policy(self.group_policy)

    def to_device(self, device: torch.device) -> None:
        """Make on ``device`` what the executor's decode steps read besides their inputs. A run calls it at its
        prefill, eagerly, so that no decode step (compiled, or captured in a CUDA graph) creates a tensor from host
        data. Nothing by default."""

    @abc.abstractmethod
    def attend(self, step: DecodeStep, decision: GroupDecision) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(output [b, H, 1, d] in the query dtype, bulk_blocks or None)`` for ``step``.

        ``step.values`` is set; ``step.start`` is ``None`` (no padding) or a long tensor ``[b]`` on the query's
        device; ``step.window_keys`` / ``step.window_values`` give the gathered local window (cached: the
        criterion may already have gathered the keys).
        """

    def __call__(self, step: DecodeStep, local: torch.Tensor) -> ExecutorOutput:
        """One decode step: ``local [b, H]`` bool from the criterion -> :class:`ExecutorOutput`."""
        check_step_for_attention(step)
        check_head_mask("local", local, step.batch_size, step.num_heads, step.device)
        local, read = apply_group_policy(local, step.has_bulk, step.num_kv_heads, self.group_policy)
        output, bulk_blocks = self.attend(step, GroupDecision(local, read))
        return ExecutorOutput(output, local, head_sparsity(local), kv_sparsity(read), bulk_blocks, read)


def check_step_for_attention(step: DecodeStep) -> None:
    """Raise unless ``step`` carries values of the query's dtype and device (what every executor needs)."""
    if step.values is None:
        raise ValueError("expected a decode step with values (DecodeStep(..., values=...)) for attention")
    if step.batch_size == 0 or step.length == 0:
        raise ValueError(
            f"expected at least one row and one key for attention but got batch size {step.batch_size} and "
            f"{step.length} keys"
        )
    check_attention_inputs(step.query[:, :, None], step.keys, step.values)


def decode_attention(executor: AttentionExecutor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     local: torch.Tensor, *args, **kwargs) -> ExecutorOutput:
    """One decode step of ``executor`` on plain tensors (tests, benchmarks, use outside a model).

    ``query [b, H, 1, d]``, ``key, value [b, H_kv, T, d]`` and the optional ``window``, ``scale``, ``start``
    as in :meth:`qada.step.DecodeStep.from_attention`; ``local [b, H]`` bool, True = the head attends over
    the local window only.
    """
    return executor(DecodeStep.from_attention(query, key, value, *args, **kwargs), local)


EXECUTORS: Registry[AttentionExecutor] = Registry("executor", AttentionExecutor)
register_executor = EXECUTORS.register
