"""The ``sdpa`` executor: PyTorch's ``scaled_dot_product_attention`` on the gathered window, plus full
attention only for the KV groups that read their bulk."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from qada.attention.base import AttentionExecutor, GroupDecision, register_executor
from qada.step import DecodeStep

__all__ = ["SDPAExecutor"]


@register_executor("sdpa")
@dataclass
class SDPAExecutor(AttentionExecutor):
    """Window attention for every head (``W = min(T, T_local)`` gathered keys, cheap), full attention only
    for the (row, KV group) pairs with a dense head.

    The ``G`` query heads of a KV group attend as ``G`` query rows of its single KV head (no repeat of K/V, and
    faster than ``enable_gqa`` on the CPU). Full attention runs once over the whole batch when every group reads
    its bulk; otherwise each read (row, group) attends over views of its own K/V (no copy of the cache). On the
    CPU the window is skipped when no head is local.
    Choosing the groups needs them on the host: one sync per call (``nonzero``) when ``T > T_local``; the
    reported sparsities stay on the device.
    """

    def attend(self, step: DecodeStep, decision: GroupDecision) -> tuple[torch.Tensor, None]:
        local, read = decision
        b, H, d = step.query.shape
        H_kv, T = step.num_kv_heads, step.length
        key, value, scale, start = step.keys, step.values, step.scale, step.start
        # GQA without a repeat of K/V: the G query heads of a group attend as G query rows of its one KV head.
        rows = rearrange(step.query, "b (k g) d -> b k g d", k=H_kv)
        real = step.real
        cpu = step.device.type == "cpu"  # data-dependent shortcuts only where a host sync costs nothing
        out = None
        if not cpu or bool(local.any()):
            valid = step.window_valid
            out = F.scaled_dot_product_attention(
                rows, step.window_keys, step.window_values,
                attn_mask=None if start is None else valid[:, None, None, :], scale=scale,
            ).view(b, H, 1, d)
            if T <= step.window.t_local:  # the window is the whole cache: nothing else to read
                return out, None
        pairs = read.nonzero()  # [n, 2] (row, KV head): host sync
        n = pairs.shape[0]
        if n == 0:
            return out, None
        if n == b * H_kv:
            full = F.scaled_dot_product_attention(
                rows, key, value, attn_mask=None if real is None else real[:, None, None, :], scale=scale
            ).view(b, H, 1, d)
        else:
            # Each read (row, KV group) attends over views of its own K/V: no copy of the cache.
            full = out.clone().view(b, H_kv, H // H_kv, d)
            for row, group in pairs.tolist():
                full[row, group] = F.scaled_dot_product_attention(
                    rows[row : row + 1, group : group + 1],
                    key[row : row + 1, group : group + 1],
                    value[row : row + 1, group : group + 1],
                    attn_mask=None if real is None else real[row : row + 1, None, None, :],
                    scale=scale,
                )[0, 0]
            full = full.view(b, H, 1, d)
        if out is None:
            return full, None
        return torch.where(local[:, :, None, None], out, full), None
