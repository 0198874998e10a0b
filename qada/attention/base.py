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
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from qada.attention.group_policy import apply_group_policy, check_group_policy, head_sparsity, kv_sparsity
from qada.functional.checks import check_float, check_head_mask, check_ndim, group_size
from qada.registry import Component, Registry
from qada.step import DecodeStep
from qada.window import Window

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
    """

    output: torch.Tensor
    local: torch.Tensor
    sparsity: torch.Tensor
    kv_sparsity: torch.Tensor
    bulk_blocks: torch.Tensor | None = None


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

    def __post_init__(self) -> None:
        check_group_policy(self.group_policy)

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
        return ExecutorOutput(output, local, head_sparsity(local), kv_sparsity(read), bulk_blocks)


def check_step_for_attention(step: DecodeStep) -> None:
    """Raise unless ``step`` carries values of the query's dtype and device (what every executor needs)."""
    if step.values is None:
        raise ValueError("expected a decode step with values (DecodeStep(..., values=...)) for attention")
    q, k, v = step.query, step.keys, step.values
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected query, key and value of one dtype but got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"expected query, key and value on one device but got {q.device}, {k.device}, {v.device}")


def decode_attention(
    executor: AttentionExecutor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    local: torch.Tensor,
    window: Window | tuple[int, int] | None = None,
    scale: float | None = None,
    start: torch.Tensor | None = None,
) -> ExecutorOutput:
    """One decode step of ``executor`` on plain tensors (tests, benchmarks, use outside a model).

    Args:
        query: ``[b, H, 1, d]``.
        key, value: ``[b, H_kv, T, d]``, same dtype and device as ``query``.
        local: ``[b, H]`` bool, True = the head attends over the local window only.
        window: a :class:`~qada.window.Window` or ``(t_local, t_sink)``; default ``Window()`` (128, 16).
        scale: score scale, default ``1 / sqrt(d)``.
        start: ``[b]`` integer index of each row's first real token (left padding; tokens
            ``[start_r, T)`` are real, ``0 <= start_r < T``, not checked to avoid a host sync), or ``None``.
    """
    scale = _check_inputs(query, key, value, local, scale, start)
    return executor(DecodeStep.from_attention(query, key, value, window, scale, start), local)


def _check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    local: torch.Tensor,
    scale: float | None,
    start: torch.Tensor | None,
) -> float:
    """Validate shapes, dtypes and devices; return the scale (default ``1 / sqrt(d)``)."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        check_float(name, tensor)
    check_ndim("query", query, 4, "[batch, heads, 1, head_dim]")
    check_ndim("key", key, 4, "[batch, kv_heads, length, head_dim]")
    b, H, q_len, d = query.shape
    if q_len != 1:
        raise ValueError(
            f"expected query of shape [batch, heads, 1, head_dim] (one decode step) but got {tuple(query.shape)}"
        )
    if key.shape[0] != b or key.shape[3] != d or key.shape[2] < 1:
        raise ValueError(
            f"expected key of shape [{b}, kv_heads, length >= 1, {d}] to match query {tuple(query.shape)} "
            f"but got {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"expected value of shape {tuple(key.shape)} like key but got {tuple(value.shape)}")
    group_size(H, key.shape[1])
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"expected query, key and value of one dtype but got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not isinstance(local, torch.Tensor) or local.dtype != torch.bool or tuple(local.shape) != (b, H):
        got = f"{local.dtype} {tuple(local.shape)}" if isinstance(local, torch.Tensor) else type(local).__name__
        raise ValueError(f"expected local to be a bool tensor of shape [{b}, {H}] but got {got}")
    if key.device != query.device or value.device != query.device or local.device != query.device:
        raise ValueError(
            f"expected query, key, value and local on one device but got {query.device}, {key.device}, "
            f"{value.device}, {local.device}"
        )
    if start is not None:
        if not isinstance(start, torch.Tensor) or start.dtype.is_floating_point or start.dtype == torch.bool:
            got = start.dtype if isinstance(start, torch.Tensor) else type(start).__name__
            raise ValueError(f"expected start to be an integer tensor of shape [{b}] but got {got}")
        if tuple(start.shape) != (b,):
            raise ValueError(f"expected start of shape [{b}] but got {tuple(start.shape)}")
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"expected scale to be a finite float > 0 but got {scale!r}")
    return float(scale)


EXECUTORS: Registry[AttentionExecutor] = Registry("executor", AttentionExecutor)
register_executor = EXECUTORS.register
