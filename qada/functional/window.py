"""The local index set ``I`` and the bulk ``B = [T] \\ I`` (paper §2), per row of a left-padded batch.

Rows may start at different positions (left padding): row ``r`` holds real tokens at ``[start_r, T)``, its
sinks are its first ``T_sink`` *real* tokens and its recent tokens are the last ``T_local - T_sink``.
A row with at most ``T_local`` real tokens has no bulk: every head is trivially local.

On a preallocated cache (``StaticCache``) the buffer has ``T`` slots but row ``r`` holds tokens only up to
``end_r``: every function takes ``end [b]`` (a device tensor, never read on the host), and then row ``r`` is
``[start_r, end_r)``. Shapes depend on ``T`` only, so a decode step keeps its shapes while the cache fills.
"""

from __future__ import annotations

import torch

from qada.window import Window

__all__ = ["bulk_count", "bulk_mask", "gather_window", "local_index_set", "window_indices"]


def _starts(T: int, start: torch.Tensor | None, device: torch.device | str | None) -> torch.Tensor:
    if T < 0:
        raise ValueError(f"expected a sequence length T >= 0 but got {T}")
    if start is None:
        return torch.zeros(1, dtype=torch.long, device=device)
    if start.ndim != 1:
        raise ValueError(f"expected start of shape [batch] but got shape {tuple(start.shape)}")
    return start.to(dtype=torch.long, device=device if device is not None else start.device)


def local_index_set(T: int, t_local: int = 128, t_sink: int = 16) -> torch.Tensor:
    """Sorted indices of ``I`` for one unpadded sequence of length ``T``.

    Returns a LongTensor of ``min(T, T_local)`` indices: ``0 .. T_sink-1`` and ``T-(T_local-T_sink) .. T-1``,
    or all of ``0 .. T-1`` when ``T <= T_local``.
    """
    window = Window(t_local, t_sink)
    if T < 0:
        raise ValueError(f"expected a sequence length T >= 0 but got {T}")
    if T <= window.t_local:
        return torch.arange(T)
    return torch.cat([torch.arange(window.t_sink), torch.arange(T - window.t_recent, T)])


def _ends(T: int, end: torch.Tensor | None, starts: torch.Tensor) -> torch.Tensor | int:
    """``[b, 1]`` row ends (one past each row's last token), or the int ``T`` when every row fills the buffer."""
    if end is None:
        return T
    if end.ndim != 1:
        raise ValueError(f"expected end of shape [batch] but got shape {tuple(end.shape)}")
    return end.to(dtype=torch.long, device=starts.device)[:, None]


def window_indices(
    T: int,
    t_local: int = 128,
    t_sink: int = 16,
    start: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices of the local window for every row.

    Args:
        T: cache length (padding included; the buffer's slots on a preallocated cache).
        start: ``[b]`` index of each row's first real token (left padding); ``None`` means 0 for one row.
        end: ``[b]`` one past each row's last token (a preallocated cache); ``None`` means ``T``.

    Returns:
        ``(index [b, W], valid [b, W])`` with ``W = min(T, T_local)``; ``index`` is clamped into ``[0, T)``
        and ``valid`` marks the slots that hold a distinct real token of the row's local set.
    """
    window = Window(t_local, t_sink)
    starts = _starts(T, start, device if end is None or device is not None else end.device)
    if end is not None and start is None:
        starts = starts.expand(end.shape[0])
    ends = _ends(T, end, starts)
    W = min(T, window.t_local)
    slot = torch.arange(W, device=starts.device)
    n_sink_slots = min(window.t_sink, W)
    is_sink = slot < n_sink_slots
    sink_index = starts[:, None] + slot[None, :]
    recent_index = (ends - (W - slot)[None, :]).expand(starts.shape[0], W)
    index = torch.where(is_sink[None, :], sink_index, recent_index)
    valid_sink = sink_index < ends
    valid_recent = recent_index >= starts[:, None] + window.t_sink
    valid = torch.where(is_sink[None, :], valid_sink, valid_recent) & (index >= starts[:, None])
    return index.clamp(0, max(T - 1, 0)), valid


def bulk_mask(
    T: int,
    t_local: int = 128,
    t_sink: int = 16,
    start: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    end: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[b, T]`` bool, True on the bulk ``[start + T_sink, end - (T_local - T_sink))`` of each row (``end``
    defaults to ``T``)."""
    window = Window(t_local, t_sink)
    starts = _starts(T, start, device if end is None or device is not None else end.device)
    position = torch.arange(T, device=starts.device)[None, :]
    count = bulk_count(T, t_local, t_sink, starts, end=end)
    first = starts[:, None] + window.t_sink
    return (position >= first) & (position < first + count[:, None])


def bulk_count(
    T: int,
    t_local: int = 128,
    t_sink: int = 16,
    start: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    end: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[b]`` LongTensor ``T_bulk = max(0, (end - start) - T_local)`` per row (``end`` defaults to ``T``)."""
    window = Window(t_local, t_sink)
    starts = _starts(T, start, device if end is None or device is not None else end.device)
    ends = _ends(T, end, starts)
    ends = ends if isinstance(ends, int) else ends[:, 0]
    return (ends - starts - window.t_local).clamp(min=0)


def gather_window(
    x: torch.Tensor, t_local: int = 128, t_sink: int = 16, start: torch.Tensor | None = None,
    end: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The local window of ``x [b, H_kv, T, d]`` (keys or values): ``(x_w [b, H_kv, W, d], valid [b, W])``.

    Without padding and with full rows (``start=None``, ``end=None``) the window is two slices, sinks and recent
    tokens, copied with one ``cat`` (much cheaper than a ``gather`` on the CPU); otherwise it is gathered at
    :func:`window_indices` (device indices: no host sync).
    """
    b, H_kv, T, d = x.shape
    if start is None and end is None:
        window = Window(t_local, t_sink)
        W = min(T, window.t_local)
        valid = torch.ones(b, W, dtype=torch.bool, device=x.device)
        if T <= window.t_local:
            return x, valid
        return torch.cat([x[:, :, : window.t_sink], x[:, :, T - window.t_recent :]], dim=2), valid
    if start is None:
        start = torch.zeros(b, dtype=torch.long, device=x.device)
    index, valid = window_indices(T, t_local, t_sink, start, device=x.device, end=end)
    return torch.gather(x, 2, index[:, None, :, None].expand(b, H_kv, index.shape[1], d)), valid
