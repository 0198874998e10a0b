"""The heavy tail of the bulk, counted exactly (issue 23): eq. 7 plus an exact set ``E`` of bulk tokens.

Eq. 7 summarises the bulk by the mean and covariance of its keys; where a few bulk tokens hold most of the bulk
mass (a needle) a lognormal fitted to the whole bulk cannot see them. The tail-aware estimate scores a small set
``E`` of bulk tokens exactly and the rest with eq. 7:

.. math:: \\hat A_\\text{bulk} = \\sum_{i \\in E} e^{s_i} + (T_\\text{bulk} - |E|)\\, e^{\\mu_s + \\sigma_s^2 / 2}

``E`` is the union of a *heavy set* (per KV head, the bulk tokens the prompt's last queries attend to most,
chosen once at the prefill, as SnapKV does) and, per query, the tokens of the *pages* (blocks of ``P`` slots)
whose upper bound ``sum_d max(q_d kmin_d, q_d kmax_d)`` on a score is highest (as Quest does). With ``E`` empty
the estimate is eq. 7 bit for bit; with ``E`` the whole bulk it is the exact bulk mass (the oracle's).
"""

from __future__ import annotations

import torch

from qada.functional.capping import log_mean_exp_score

__all__ = [
    "EXTREMA_DTYPES",
    "bounds_from_halves",
    "extrema_dtype",
    "heavy_votes",
    "page_bounds",
    "page_extrema",
    "page_halves",
    "page_slots",
    "tail_log_bulk",
    "tail_log_rest",
    "top_pages",
    "top_pages_hierarchical",
    "update_page_extrema",
]


def tail_log_bulk(
    log_exact: torch.Tensor, n_exact: torch.Tensor, mu_s: torch.Tensor, var_s: torch.Tensor, t_bulk: torch.Tensor,
    softcap: float | None = None,
) -> torch.Tensor:
    """``log Â_bulk = logaddexp(log A_E, log(T_bulk - |E|) + mu_s + sigma_s^2 / 2)``, ``[b, H]``.

    Args:
        log_exact: ``[b, H]`` ``log sum_{i in E} exp(s_i)`` (``-inf`` for an empty ``E``).
        n_exact, mu_s, var_s, t_bulk, softcap: as for :func:`tail_log_rest`; ``log_exact`` must come from capped
            scores where there is a ``softcap``.
    """
    return torch.logaddexp(log_exact.to(mu_s.dtype), tail_log_rest(n_exact, mu_s, var_s, t_bulk, softcap))


def tail_log_rest(n_exact: torch.Tensor, mu_s: torch.Tensor, var_s: torch.Tensor, t_bulk: torch.Tensor,
                  softcap: float | None = None) -> torch.Tensor:
    """``log Â_rest = log(T_bulk - |E|) + mu_s + sigma_s^2 / 2``, ``[b, H]``: eq. 7 on the bulk tokens outside ``E``.

    Args:
        n_exact: ``[b, H]`` ``|E|``, the bulk tokens scored exactly (at most ``T_bulk``).
        mu_s, var_s: ``[b, H]`` score moments of the bulk (eq. 5-6, :func:`~qada.functional.lognormal_score_moments`).
        t_bulk: ``[b]`` bulk sizes; the rest ``T_bulk - |E|`` at 0 contributes nothing (``-inf``).
        softcap: a logit soft-cap ``c``: the rest's mean is then ``E[exp(c tanh(s / c))]``
            (:func:`~qada.functional.capping.log_mean_exp_score`).
    """
    rest = (t_bulk.to(device=mu_s.device)[:, None] - n_exact.to(mu_s.device)).to(mu_s.dtype)
    log_rest = torch.log(rest) + log_mean_exp_score(mu_s, var_s, softcap)  # the operations of eq. 7, on the rest
    return log_rest.masked_fill(rest <= 0, float("-inf"))


EXTREMA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes page extrema are kept in (:func:`extrema_dtype`)."""


def extrema_dtype(keys_dtype: torch.dtype) -> torch.dtype:
    """The dtype to keep the page extrema of keys of ``keys_dtype`` in: a 16-bit float dtype itself (each extremum is
    one of the keys, so nothing is rounded, and a step's bounds read half the bytes), else float32."""
    return keys_dtype if keys_dtype in EXTREMA_DTYPES else torch.float32


def page_extrema(keys: torch.Tensor, page_size: int, filled: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise ``(kmin, kmax)`` of the keys of every page of ``page_size`` slots: ``keys [b, H_kv, C, d]`` ->
    two ``[b, H_kv, ceil(C / P), d]`` float32 tensors. Only the first ``filled`` slots count (default all); a page
    with none holds ``+inf`` / ``-inf``."""
    b, H_kv, C, d = keys.shape
    filled = C if filled is None else filled
    n_pages = -(-C // page_size)
    k = keys.float()
    low = torch.full((b, H_kv, n_pages * page_size, d), float("inf"), device=keys.device)
    high = torch.full_like(low, float("-inf"))
    low[:, :, :filled] = k[:, :, :filled]
    high[:, :, :filled] = k[:, :, :filled]
    return (low.view(b, H_kv, n_pages, page_size, d).amin(3), high.view(b, H_kv, n_pages, page_size, d).amax(3))


def update_page_extrema(kmin: torch.Tensor, kmax: torch.Tensor, key: torch.Tensor, slot: torch.Tensor,
                        page_size: int, halves: torch.Tensor | None = None) -> None:
    """In place: the key ``[b, H_kv, d]`` written at ``slot [b]`` joins its page's extrema (the first slot of a page
    starts it afresh), and ``halves`` (:func:`page_halves`), if given, follows. Device tensors only: no host
    sync."""
    b, H_kv, n_pages, d = kmin.shape
    page = (slot // page_size).clamp(max=n_pages - 1)
    rows = torch.arange(b, device=kmin.device)[:, None]
    heads = torch.arange(H_kv, device=kmin.device)[None, :]
    at = (rows, heads, page[:, None].expand(b, H_kv))  # one page per (row, KV head)
    fresh = (slot % page_size == 0).view(b, 1, 1)
    k = key.float()
    low = torch.where(fresh, k, torch.minimum(kmin[at], k))  # [b, H_kv, d]
    high = torch.where(fresh, k, torch.maximum(kmax[at], k))
    # index_put_ (not scatter_): the compiled step then writes the one page in place, not a copy of the arrays
    kmin.index_put_(at, low.to(kmin.dtype))  # (exact in the extrema's dtype: each is one of the keys)
    kmax.index_put_(at, high.to(kmax.dtype))
    if halves is not None:
        halves.index_put_(at, page_halves(low, high))


def page_halves(kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """``[..., 2d]``: each page's centre ``(kmin + kmax) / 2`` and radius ``(kmax - kmin) / 2`` side by side, what
    :func:`page_bounds` multiplies the query with (kept with the extrema: a step then reads it once). float32,
    computed in float32 whatever the extrema's dtype."""
    kmin, kmax = kmin.float(), kmax.float()
    return torch.cat([(kmin + kmax) * 0.5, (kmax - kmin) * 0.5], -1)


def page_bounds(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float) -> torch.Tensor:
    """Upper bounds ``scale * sum_d max(q_d kmin_d, q_d kmax_d)`` on the score of any key of each page, ``[b, H, n]``.

    ``max(a, b) = (a + b)/2 + |a - b|/2`` makes it one product: ``[q, |q|] . [c, r]`` with the page's centre
    ``c = (kmin + kmax)/2`` and radius ``r = (kmax - kmin)/2`` (:func:`bounds_from_halves`). ``query [b, H, d]``,
    ``kmin/kmax [b, H_kv, n, d]``.
    """
    return bounds_from_halves(query, page_halves(kmin, kmax), scale)


def bounds_from_halves(query: torch.Tensor, halves: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`page_bounds` from the pages' ``halves [b, H_kv, n, 2d]`` (:func:`page_halves`): ``[b, H, n]``."""
    b, H, d = query.shape
    H_kv, n = halves.shape[1], halves.shape[2]
    q = query.float().reshape(b, H_kv, H // H_kv, d)
    bound = torch.cat([q, q.abs()], -1) @ halves.transpose(-1, -2)  # [b, H_kv, G, n]
    return (scale * bound).reshape(b, H, n)


def _page_range_valid(n: int, size: int, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``[b, n]``: which of ``n`` blocks of ``size`` slots overlap the bulk ``[first, last)`` (``first/last [b]``)."""
    low = torch.arange(n, device=first.device) * size
    return (low[None, :] + size > first[:, None]) & (low[None, :] < last[:, None])


def top_pages(query: torch.Tensor, halves: torch.Tensor, scale: float, first: torch.Tensor, last: torch.Tensor,
              page_size: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query head the ``m`` pages overlapping the bulk ``[first, last)`` with the highest bound (one level: every
    page's bound is computed). ``query [b, H, d]``, ``halves [b, H_kv, n, 2d]``; returns ``(bounds, pages)``, each
    ``[b, H, m]`` (``-inf`` bounds: fewer than ``m`` pages overlap the bulk)."""
    n = halves.shape[2]
    bounds = bounds_from_halves(query, halves, scale)  # [b, H, n]
    valid = _page_range_valid(n, page_size, first, last)
    return bounds.masked_fill(~valid[:, None, :], float("-inf")).topk(min(m, n), dim=-1)


def top_pages_hierarchical(
    query: torch.Tensor, halves: torch.Tensor, super_halves: torch.Tensor, scale: float, first: torch.Tensor,
    last: torch.Tensor, page_size: int, super_page: int, super_pages: int, m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_pages` through a two-level hierarchy: per KV group the ``super_pages`` super-pages (``S =
    super_page`` pages each) with the highest bound over the group's query heads, then per query head the ``m``
    best pages inside them. A super-page's bound bounds every page in it (its extrema enclose theirs), so the pages
    left out of the second level are those of super-pages whose bound — and so every page bound in them — ranks
    below the kept ones' for every head of the group.

    Reads ``2 n_super + 2 super_pages S`` extrema per KV group instead of ``2 n`` (:func:`top_pages`).

    Args:
        query: ``[b, H, d]``; ``halves``: ``[b, H_kv, n, 2d]`` the pages'; ``super_halves``: ``[b, H_kv, n_s, 2d]``
            the super-pages' (:func:`page_halves`); ``first, last``: ``[b]`` the bulk ``[first, last)``.

    Returns:
        ``(bounds, pages)``, each ``[b, H, min(m, super_pages S)]``; ``-inf`` bounds mark pages outside the bulk.
    """
    b, H = query.shape[:2]
    H_kv, n, n_super = halves.shape[1], halves.shape[2], super_halves.shape[2]
    G = H // H_kv
    super_bounds = bounds_from_halves(query, super_halves, scale).reshape(b, H_kv, G, n_super).amax(2)
    super_valid = _page_range_valid(n_super, super_page * page_size, first, last)  # [b, n_super]
    _, supers = super_bounds.masked_fill(~super_valid[:, None, :], float("-inf")).topk(
        min(super_pages, n_super), dim=-1)  # [b, H_kv, s]
    candidates = page_slots(supers, super_page)  # [b, H_kv, s S] page numbers
    clamped = candidates.clamp(max=n - 1)
    chosen = halves.gather(2, clamped[..., None].expand(*clamped.shape, halves.shape[-1]))  # [b, H_kv, s S, 2d]
    bounds = bounds_from_halves(query, chosen, scale).reshape(b, H_kv, G, -1)  # [b, H_kv, G, s S]
    low, size = clamped * page_size, page_size
    valid = ((candidates < n) & (low + size > first[:, None, None]) & (low < last[:, None, None]))[:, :, None]
    top, at = bounds.masked_fill(~valid, float("-inf")).topk(min(m, candidates.shape[-1]), dim=-1)  # [b, H_kv, G, m]
    pages = clamped[:, :, None, :].expand(b, H_kv, G, clamped.shape[-1]).gather(-1, at)
    return top.reshape(b, H, -1), pages.reshape(b, H, -1)


def page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The slots of ``pages [..., m]``: ``[..., m * P]`` (page ``p`` holds slots ``p*P .. p*P + P - 1``)."""
    offsets = torch.arange(page_size, device=pages.device)
    return (pages[..., None] * page_size + offsets).flatten(-2)


def heavy_votes(queries: torch.Tensor, keys: torch.Tensor, scale: float, positions: torch.Tensor,
                start: torch.Tensor | None = None) -> torch.Tensor:
    """SnapKV's votes: the attention of the observation queries on every key, summed over them and over the query
    heads of each KV group, ``[b, H_kv, T]``.

    Args:
        queries: ``[b, H, w, d]`` the prompt's last ``w`` queries; ``keys``: ``[b, H_kv, T, d]``.
        positions: ``[w]`` the slot of each observation query (causal: query ``j`` sees keys ``<= positions[j]``).
        start: ``[b]`` each row's first real token (left padding: earlier keys are not attended), or ``None``.
    """
    b, H, w, d = queries.shape
    H_kv, T = keys.shape[1], keys.shape[2]
    q = queries.float().reshape(b, H_kv, (H // H_kv) * w, d)
    scores = scale * (q @ keys.float().transpose(-1, -2))  # [b, H_kv, G*w, T]
    slot = torch.arange(T, device=keys.device)
    seen = slot[None, :] <= positions[:, None].to(keys.device)  # [w, T]
    seen = seen.repeat(H // H_kv, 1)[None, None]  # [1, 1, G*w, T], rows in the order of q (g major, then w)
    if start is not None:
        seen = seen & (slot[None, None, None, :] >= start.to(keys.device)[:, None, None, None])
    probabilities = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return probabilities.nan_to_num(0.0).sum(2)
