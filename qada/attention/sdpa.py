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
    its bulk; otherwise each read (row, group) attends over views of its own K/V (no copy of the cache).
    Choosing the groups needs them on the host: one sync per call (``nonzero``) when ``T > T_local``; the
    reported sparsities stay on the device.
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
            # Each read (row, KV group) attends over views of its own K/V: no copy of the cache.
            full = out.clone()
            for row, group in pairs.tolist():
                heads = slice(group * G, (group + 1) * G)
                full[row : row + 1, heads] = F.scaled_dot_product_attention(
                    query[row : row + 1, heads],
                    key[row : row + 1, group : group + 1],
                    value[row : row + 1, group : group + 1],
                    attn_mask=None if real is None else real[row : row + 1, None, None, :],
                    scale=scale,
                    enable_gqa=True,
                )
        return torch.where(local[:, :, None, None], out, full), None
