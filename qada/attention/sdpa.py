"""The ``sdpa`` executor: PyTorch's ``scaled_dot_product_attention`` on the gathered window, plus full
attention only for the KV groups that read their bulk."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qada.attention.base import AttentionExecutor, register_executor
from qada.functional import window_indices
from qada.window import Window

__all__ = ["SDPAExecutor"]


@register_executor("sdpa")
@dataclass
class SDPAExecutor(AttentionExecutor):
    """Window attention for every head (``W = min(T, T_local)`` gathered keys, cheap), full attention only
    for the (row, KV group) pairs with a dense head.

    Full attention runs once over the whole batch (``enable_gqa=True``, no copy of K/V) when every group reads
    its bulk; otherwise the read groups are gathered (a copy of their K/V) and each group's ``G`` query heads
    attend as ``G`` query rows of one head. Choosing the groups needs their number on the host: one sync per
    call (``nonzero``) when ``T > T_local``; the reported sparsities stay on the device.
    """

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        local: torch.Tensor,
        read: torch.Tensor,
        window: Window,
        scale: float,
        start: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        b, H, _, d = query.shape
        H_kv, T = key.shape[1], key.shape[2]
        G = H // H_kv
        index, valid = window_indices(T, window.t_local, window.t_sink, start, device=query.device)  # [b, W]
        if start is None:
            index, valid = index.expand(b, -1), valid.expand(b, -1)
        W = index.shape[1]
        gather = index[:, None, :, None].expand(b, H_kv, W, d)
        out = F.scaled_dot_product_attention(
            query,
            torch.gather(key, 2, gather),
            torch.gather(value, 2, gather),
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        if T <= window.t_local:  # the window is the whole cache: nothing else to read
            return out, None
        real = None if start is None else torch.arange(T, device=query.device)[None, :] >= start[:, None]
        pairs = read.nonzero()  # [n, 2] (row, KV head): host sync
        n = pairs.shape[0]
        if n == 0:
            return out, None
        if n == b * H_kv:
            full = F.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=None if real is None else real[:, None, None, :],
                scale=scale,
                enable_gqa=True,
            )
        else:
            rows, groups = pairs.unbind(1)
            q_sel = query.view(b, H_kv, G, d)[rows, groups][:, None]  # [n, 1, G, d]: G query rows
            mask = None if real is None else real[rows][:, None, None, :]
            full_sel = F.scaled_dot_product_attention(
                q_sel, key[rows, groups][:, None], value[rows, groups][:, None], attn_mask=mask, scale=scale
            )
            full = out.new_zeros(b, H_kv, G, d)
            full[rows, groups] = full_sel[:, 0]
            full = full.view(b, H, 1, d)
        return torch.where(local[:, :, None, None], out, full), None
