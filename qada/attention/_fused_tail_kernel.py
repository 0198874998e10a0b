"""The split kernel of the ``triton_fused`` executor for the tail-aware ``qada_tail`` criterion: the step's key joins
its page, the exact set ``E`` (heavy set and top pages), the decision and split-K decode in one launch. Imported
lazily: importing it imports triton. Its splits are merged by the ``triton`` executor's combine kernel.

What it computes is :class:`~qada.criteria.TailCriterion`'s decision, for one (row, KV head) and its ``G`` query
heads, with any of its settings: one-level pages or a page hierarchy (``super_page``), window-only local heads or
``window ∪ E`` (``attend_exact``), and sizes grown with the context (``scale_exact``: the launcher passes the step's
``n_heavy``, ``TOP`` and ``SUPER_TOP``):

* the step's key (slot ``end - 1``, ``C - 1`` without ``END``) joins its page's extrema
  (:func:`~qada.criteria.tail_index.append_step_key`): ``low = key`` on a page's first slot, else ``min(kmin, key)``
  (``high`` alike) and the page's halves ``((low + high) / 2, (high - low) / 2)``; split 0 writes them back;
  with a hierarchy the key joins its super-page's extrema and halves too;
* the heavy set: the KV head's heavy slots that are valid and inside the bulk, scored by every query head;
* per query head the ``TOP`` pages overlapping the bulk with the highest bound ``scale [q, |q|]·halves`` (the halves
  made from the extrema, which a 16-bit cache keeps in its own dtype: half the bytes of the float32 halves)
  (:func:`~qada.functional.tail.top_pages`; a NaN bound ranks first and marks its page invalid, as ``topk`` does),
  kept in a running list over tiles of ``BLOCK_P`` pages, where a tile's page enters only if it beats the list's
  worst (:func:`insert_top`), and their tokens inside the bulk that are not heavy (``MEMBER``), ``ENTRIES`` pages of
  a head at a time; with a hierarchy only the pages inside each head's ``SUPER_TOP`` best super-pages compete
  (:func:`hierarchical_top`, as :func:`~qada.functional.tail.top_pages_hierarchical`);
* ``log A_E = logsumexp`` of those (soft-capped) scores, ``|E|`` their count, ``log Â_rest = log(T_bulk - |E|) +
  LME`` (each head's ``log E[exp(s)]``, made once per step by the moment launch; ``-inf`` when nothing is left) and
  ``log Â_bulk = logaddexp(log A_E, log Â_rest)``;
* the threshold decision of :mod:`qada.attention._fused_kernel` with ``log A_local`` the window's mass (sink logit
  included), then the group's split of the attention; with ``attend_exact`` the local mass is ``logaddexp(log
  A_local, log A_E)`` against ``log Â_rest``, and split 0 also writes each head's attention over ``E`` (its values
  accumulated while ``E`` is scored), which the combine launch merges into the local heads' output as one more split.

Every split computes the decision (its block list depends on it) and the step key's page extrema; split 0 writes
them back before it decides, so that they hold no registers through the decision. The update is idempotent (a split
that reads the page after split 0 wrote it computes the same extrema), and every split bounds that page with the new
extrema from its registers, never with the stored ones it may race with.

Where the decision is a launch of its own over a long row, :func:`qada_tail_page_top_kernel` first spreads the page
bounds over programs of a stretch of pages each (their top pages per head, read-only), and the decision merges those
lists in page order (``CANDIDATES``) instead of bounding every page itself. The budget rule (``qada_tail_budget``)
uses the score mode (``SCORE``): the heads' ``log A_local - log Â_bulk``, ranked by the next launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qada.attention._fused_kernel import (
    cap,
    head_query,
    logaddexp,
    threshold_decision,
    window_log_local,
)
from qada.attention._group_decision import store_decision
from qada.attention._triton_kernel import (
    as_float32,
    attend_split,
    key_scores,
    let_next_start,
    row_range,
    through_memory,
    wait_for_previous,
)


@triton.jit
def fold_scores(m, total, count, bad, s, valid):
    """Fold scores ``s [BLOCK_G, n]`` (``valid [BLOCK_G, n]``) into a running ``logsumexp`` ``(m, total)`` per
    head, their count and whether a valid one is NaN or ``+inf`` (the eager logsumexp is then not finite):
    ``(m, total, count, bad, p, alpha)`` with the tile's weights ``p = exp(s - m) [BLOCK_G, n]`` (0 where not
    valid) and ``alpha [BLOCK_G]`` the factor the running sums were rescaled by (what a running weighted sum of the
    values takes too)."""
    broken = (s != s) | (s == float("inf"))
    bad += tl.max(tl.where(valid & broken, 1, 0), axis=1)
    count += tl.sum(tl.where(valid, 1, 0), axis=1)
    s = tl.where(valid & (broken == 0), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    return m_new, total, count, bad, p, alpha


@triton.jit
def insert_top(vals, ids, oks, rank, page_ids, page_ok, TOP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The ``TOP`` best of a running list ``vals, ids, oks [BLOCK_G, BLOCK_M]`` (rank, page, valid; entries from
    ``TOP`` on stay ``-inf``; in no particular order) and a tile ``rank, page_ok [BLOCK_G, n]`` of pages ``page_ids``
    (``[1, n]`` for all heads, or ``[BLOCK_G, n]``: another list; each page at most once per head): while some
    head's tile holds an entry above its list's worst, that head's best such entry (ties: the lower page) replaces
    its worst (ties: the higher page), so a tile ties with the list in the list's favour, as one pass over the pages
    in order ranks them. One round per entry inserted into the head that takes the most, usually none: not ``TOP``
    rounds per tile."""
    offs_m = tl.arange(0, BLOCK_M)
    slot = (offs_m < TOP)[None, :]
    worst = tl.min(tl.where(slot, vals, float("inf")), axis=1)  # [BLOCK_G]
    pending = tl.max(tl.where(rank > worst[:, None], 1, 0))
    while pending > 0:
        best = tl.max(rank, axis=1)
        take = best > worst  # [BLOCK_G]
        top = rank == best[:, None]
        page = tl.min(tl.where(top, page_ids, 2147483647), axis=1)
        hit = top & (page_ids == page[:, None]) & take[:, None]
        ok = tl.max(tl.where(hit, page_ok, 0), axis=1)
        at_worst = slot & (vals == worst[:, None])
        out_page = tl.max(tl.where(at_worst, ids, -1), axis=1)
        out_pos = tl.max(tl.where(at_worst & (ids == out_page[:, None]), offs_m[None, :], -1), axis=1)
        put = (offs_m[None, :] == out_pos[:, None]) & take[:, None]
        vals = tl.where(put, best[:, None], vals)
        ids = tl.where(put, page[:, None], ids)
        oks = tl.where(put, ok[:, None], oks)
        rank = tl.where(hit, float("-inf"), rank)  # taken: never again
        worst = tl.min(tl.where(slot, vals, float("inf")), axis=1)
        pending = tl.max(tl.where(rank > worst[:, None], 1, 0))
    return vals, ids, oks


@triton.jit
def step_key_page(KMIN, KMAX, END, row, row64, kv64, k_base, stride_kt, stride_kd, stride_eb, stride_eh, stride_ep,
                  stride_ed, C, n_pages, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                  HAS_END: tl.constexpr):  # fmt: skip
    """The step's key joins its page (:func:`~qada.criteria.tail_index.append_step_key`), in registers: ``(page,
    low, high)`` float32 (nothing is written: :func:`store_step_key_page` does, from the same values)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if HAS_END:
        slot = tl.maximum(tl.load(END + row).to(tl.int32) - 1, 0)
    else:
        slot = tl.full([], 0, dtype=tl.int32) + C - 1
    new_page = tl.minimum(slot // PAGE, n_pages - 1)
    fresh = (slot % PAGE) == 0
    key = tl.load(k_base + slot.to(tl.int64) * stride_kt + offs_d * stride_kd, mask=d_ok, other=0.0).to(tl.float32)
    extrema = row64 * stride_eb + kv64 * stride_eh + new_page.to(tl.int64) * stride_ep + offs_d * stride_ed
    low = tl.where(fresh, key, tl.minimum(tl.load(KMIN + extrema, mask=d_ok, other=0.0).to(tl.float32), key))
    high = tl.where(fresh, key, tl.maximum(tl.load(KMAX + extrema, mask=d_ok, other=0.0).to(tl.float32), key))
    return new_page, low, high


@triton.jit
def store_step_key_page(KMIN, KMAX, HALVES, END, row, row64, kv64, low, high, stride_eb, stride_eh, stride_ep,
                        stride_ed, stride_fb, stride_fh, stride_fp, stride_fx, C, n_pages, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, PAGE: tl.constexpr, HAS_END: tl.constexpr):  # fmt: skip
    """Write what :func:`step_key_page` computed: the page's extrema ``low, high`` into ``KMIN, KMAX`` (exactly in a
    16-bit cache's dtype: each is one of the page's keys) and its halves ``((low + high) / 2, (high - low) / 2)``
    into ``HALVES`` (:func:`~qada.functional.tail.page_halves`). The page is found again from ``END`` here, not
    taken from :func:`step_key_page`'s result: torch.compile's analysis of which tensors a kernel writes follows a
    store's address back through the arguments of every call it comes from, so an address computed from a call's
    result would mark that call's inputs (the keys, ``END``) written and have them copied before every launch."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if HAS_END:
        slot = tl.maximum(tl.load(END + row).to(tl.int32) - 1, 0)
    else:
        slot = tl.full([], 0, dtype=tl.int32) + C - 1
    page64 = tl.minimum(slot // PAGE, n_pages - 1).to(tl.int64)
    extrema = row64 * stride_eb + kv64 * stride_eh + page64 * stride_ep + offs_d * stride_ed
    tl.store(KMIN + extrema, low, mask=d_ok)
    tl.store(KMAX + extrema, high, mask=d_ok)
    halves = HALVES + row64 * stride_fb + kv64 * stride_fh + page64 * stride_fp
    tl.store(halves + offs_d * stride_fx, (low + high) * 0.5, mask=d_ok)
    tl.store(halves + (D + offs_d) * stride_fx, (high - low) * 0.5, mask=d_ok)


@triton.jit
def empty_top(BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr):
    """An empty running list of :func:`insert_top`: ``(vals, ids, oks) [BLOCK_G, BLOCK_M]`` (``-inf``, 0, 0)."""
    vals = tl.full([BLOCK_G, BLOCK_M], float("-inf"), dtype=tl.float32)
    ids = tl.zeros([BLOCK_G, BLOCK_M], dtype=tl.int32)
    oks = tl.zeros([BLOCK_G, BLOCK_M], dtype=tl.int32)
    return vals, ids, oks


@triton.jit
def tile_extrema(kmin_base, kmax_base, stride_ep, stride_ed, p0, p_end, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_P: tl.constexpr):  # fmt: skip
    """The stored extrema ``(low, high) [BLOCK_P, BLOCK_D]`` (their dtype) of the pages ``p0 + [0, BLOCK_P)`` below
    ``p_end`` at ``kmin_base`` / ``kmax_base`` (one page ``stride_ep`` apart; 0 elsewhere): one tile's loads, issued
    a tile ahead of their use by the loops that bound pages (:func:`page_top`, :func:`super_top`)."""
    pages = p0 + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    at = pages[:, None].to(tl.int64) * stride_ep + offs_d[None, :] * stride_ed
    both = (pages < p_end)[:, None] & (offs_d < D)[None, :]
    return tl.load(kmin_base + at, mask=both, other=0.0), tl.load(kmax_base + at, mask=both, other=0.0)


@triton.jit
def tile_bounds(q_head, stride_qh, stride_qd, low, high, pages, new_page, low_new, high_new, scale, G: tl.constexpr,
                D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Each query head's bound ``scale [q, |q|]·[c, r]`` on the scores of the pages ``pages [BLOCK_P]`` whose stored
    extrema are ``low, high [BLOCK_P, BLOCK_D]`` (:func:`tile_extrema`): ``[BLOCK_G, BLOCK_P]`` float32
    (:func:`~qada.functional.tail.page_bounds`; the step key's page with its new extrema ``low_new, high_new`` from
    registers). ``q_head``: the group's first query head (the others ``stride_qh`` apart), read one head at a time.
    The centre ``c = (kmin + kmax) / 2`` and radius ``r = (kmax - kmin) / 2`` are made in float32 from the extrema,
    as :func:`~qada.functional.tail.page_halves` makes the float32 halves the eager criterion reads: the same
    values, from half their bytes in a 16-bit cache's dtype. The bounds are float32 sums, one query head at a time
    (not a float32 ``ieee`` dot: that holds whole rows of both tiles per thread, hundreds of registers on a GPU)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    is_new = (pages == new_page)[:, None]  # the step key's page: its new extrema, from registers
    low = tl.where(is_new, low_new[None, :], low.to(tl.float32))
    high = tl.where(is_new, high_new[None, :], high.to(tl.float32))
    bound = tl.zeros([BLOCK_G, pages.shape[0]], dtype=tl.float32)
    for g in tl.static_range(G):
        is_g = offs_g == g
        q_g = head_query(q_head, g, stride_qh, stride_qd, offs_d, d_ok)
        bound_g = (tl.sum((low + high) * 0.5 * q_g[None, :], axis=1)
                   + tl.sum((high - low) * 0.5 * tl.abs(q_g)[None, :], axis=1))  # fmt: skip
        bound = tl.where(is_g[:, None], bound_g[None, :], bound)
    return bound * scale


@triton.jit
def page_top(vals, ids, oks, q_head, stride_qh, stride_qd, kmin_base, kmax_base, stride_ep, stride_ed, p_begin,
             p_end, new_page, low_new, high_new, scale, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, TOP: tl.constexpr, BLOCK_M: tl.constexpr,
             AHEAD: tl.constexpr):  # fmt: skip
    """Each query head's running list ``(vals, ids, oks) [BLOCK_G, BLOCK_M]`` of its ``TOP`` best pages with the
    pages of ``[p_begin, p_end)`` inserted by bound (:func:`tile_bounds`, by tiles of ``BLOCK_P``;
    :func:`insert_top`; a NaN bound ranks first and marks its page invalid, as ``topk`` does). With ``AHEAD`` each
    tile's extrema load while the tile before is bounded and inserted (twice a tile's registers)."""
    offs_g = tl.arange(0, BLOCK_G)
    if AHEAD:
        low_next, high_next = tile_extrema(kmin_base, kmax_base, stride_ep, stride_ed, p_begin, p_end, D, BLOCK_D,
                                           BLOCK_P)  # fmt: skip
    for p0 in range(p_begin, p_end, BLOCK_P):
        pages = p0 + tl.arange(0, BLOCK_P)
        p_ok = pages < p_end
        if AHEAD:  # the next tile's loads, in flight while this tile is bounded and inserted (Triton pipelines no
            # loop with a loop inside: each tile would wait one memory round trip)
            low, high = low_next, high_next
            low_next, high_next = tile_extrema(kmin_base, kmax_base, stride_ep, stride_ed, p0 + BLOCK_P, p_end, D,
                                               BLOCK_D, BLOCK_P)  # fmt: skip
        else:
            low, high = tile_extrema(kmin_base, kmax_base, stride_ep, stride_ed, p0, p_end, D, BLOCK_D, BLOCK_P)
        bound = tile_bounds(q_head, stride_qh, stride_qd, low, high, pages, new_page, low_new, high_new, scale, G, D,
                            BLOCK_G, BLOCK_D)  # [BLOCK_G, BLOCK_P]
        rank = tl.where(p_ok[None, :] & (offs_g < G)[:, None], tl.where(bound != bound, float("inf"), bound),
                        float("-inf"))  # (padding heads rank nothing: no insertion rounds of their own)
        page_ok = tl.where(p_ok[None, :] & (tl.abs(bound) < float("inf")), 1, 0)
        vals, ids, oks = insert_top(vals, ids, oks, rank, pages[None, :], page_ok, TOP, BLOCK_M)
    return vals, ids, oks


@triton.jit
def super_top(q_head, stride_qh, stride_qd, smin_base, smax_base, stride_sp, stride_sd, s_begin, s_end, new_super,
              low_new, high_new, scale, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, TOP: tl.constexpr, BLOCK_M: tl.constexpr,
              AHEAD: tl.constexpr):  # fmt: skip
    """The first level of :func:`~qada.functional.tail.top_pages_hierarchical`: the KV group's ``TOP`` super-pages
    of ``[s_begin, s_end)`` by their bound's maximum over the group's query heads (a NaN bound of any head ranks
    the super-page first, as ``amax`` then ``topk`` do), from the super-pages' extrema (:func:`tile_bounds`; the
    step key's super-page from registers): ``(vals, ids) [BLOCK_G, BLOCK_M]``, every row the group's list
    (``-inf``: an empty entry)."""
    offs_g = tl.arange(0, BLOCK_G)
    vals, ids, oks = empty_top(BLOCK_G, BLOCK_M)
    if AHEAD:
        low_next, high_next = tile_extrema(smin_base, smax_base, stride_sp, stride_sd, s_begin, s_end, D, BLOCK_D,
                                           BLOCK_P)  # fmt: skip
    for p0 in range(s_begin, s_end, BLOCK_P):
        pages = p0 + tl.arange(0, BLOCK_P)
        p_ok = pages < s_end
        if AHEAD:  # (a tile ahead, as page_top)
            low, high = low_next, high_next
            low_next, high_next = tile_extrema(smin_base, smax_base, stride_sp, stride_sd, p0 + BLOCK_P, s_end, D,
                                               BLOCK_D, BLOCK_P)  # fmt: skip
        else:
            low, high = tile_extrema(smin_base, smax_base, stride_sp, stride_sd, p0, s_end, D, BLOCK_D, BLOCK_P)
        bound = tile_bounds(q_head, stride_qh, stride_qd, low, high, pages, new_super, low_new, high_new, scale, G,
                            D, BLOCK_G, BLOCK_D)  # fmt: skip
        rank = tl.where((offs_g < G)[:, None], tl.where(bound != bound, float("inf"), bound), float("-inf"))
        group = tl.where(p_ok, tl.max(rank, axis=0), float("-inf"))  # [BLOCK_P]
        rank = tl.zeros([BLOCK_G, BLOCK_P], dtype=tl.float32) + group[None, :]
        page_ok = tl.where(rank > float("-inf"), 1, 0)
        vals, ids, oks = insert_top(vals, ids, oks, rank, pages[None, :], page_ok, TOP, BLOCK_M)
    return vals, ids


@triton.jit
def hierarchical_top(q_head, stride_qh, stride_qd, kmin_base, kmax_base, stride_ep, stride_ed, smin_base, smax_base,
                     stride_sp, stride_sd, p_lo, p_hi, new_page, low, high, new_super, super_low, super_high, scale,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_P: tl.constexpr, TOP: tl.constexpr, BLOCK_M: tl.constexpr, SUPER: tl.constexpr,
                     SUPER_TOP: tl.constexpr, BLOCK_SM: tl.constexpr, AHEAD: tl.constexpr):  # fmt: skip
    """Each query head's ``TOP`` pages of the bulk's pages ``[p_lo, p_hi)`` through a hierarchy of ``SUPER`` pages
    per super-page (:func:`~qada.functional.tail.top_pages_hierarchical`): the group's ``SUPER_TOP`` best
    super-pages (:func:`super_top`), then the pages of the bulk inside them (:func:`page_top`), one super-page
    after the other: ``(vals, ids, oks) [BLOCK_G, BLOCK_M]``. ``AHEAD``: as :func:`page_top`'s."""
    s_lo = p_lo // SUPER
    s_hi = tl.where(p_hi > p_lo, tl.cdiv(p_hi, SUPER), s_lo)
    s_vals, s_ids = super_top(q_head, stride_qh, stride_qd, smin_base, smax_base, stride_sp, stride_sd, s_lo, s_hi,
                              new_super, super_low, super_high, scale, G, D, BLOCK_G, BLOCK_D, BLOCK_P, SUPER_TOP,
                              BLOCK_SM, AHEAD)  # fmt: skip
    offs_g = tl.arange(0, BLOCK_G)
    offs_sm = tl.arange(0, BLOCK_SM)
    vals, ids, oks = empty_top(BLOCK_G, BLOCK_M)
    for j in range(SUPER_TOP):
        pick = (offs_g == 0)[:, None] & (offs_sm == j)[None, :]  # (every row holds the group's list)
        chosen = tl.max(tl.max(tl.where(pick, s_vals, float("-inf")), axis=1), axis=0) > float("-inf")
        first_page = tl.sum(tl.sum(tl.where(pick, s_ids, 0), axis=1), axis=0) * SUPER
        begin = tl.maximum(first_page, p_lo)
        end = tl.where(chosen, tl.maximum(tl.minimum(first_page + SUPER, p_hi), begin), begin)
        vals, ids, oks = page_top(vals, ids, oks, q_head, stride_qh, stride_qd, kmin_base, kmax_base, stride_ep,
                                  stride_ed, begin, end, new_page, low, high, scale, G, D, BLOCK_G, BLOCK_D, BLOCK_P,
                                  TOP, BLOCK_M, AHEAD)  # fmt: skip
    return vals, ids, oks


@triton.jit
def list_chunk(i, ids, oks, bulk_lo, bulk_hi, CHUNKS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_S: tl.constexpr, ENTRIES: tl.constexpr, PAGE: tl.constexpr, TOP: tl.constexpr):  # fmt: skip
    """Chunk ``i`` of the loop over each query head's top pages, ``CHUNKS`` chunks of ``ENTRIES`` pages per head:
    ``(g, slots, valid)``, the head ``g = i // CHUNKS`` and the slots ``[ENTRIES * BLOCK_S]`` (entry-major) of its
    list's pages ``(i % CHUNKS) * ENTRIES, ...`` in ``ids, oks [BLOCK_G, BLOCK_M]``, valid where the page is and the
    slot lies in the bulk ``[bulk_lo, bulk_hi)``. Past the last head nothing is valid."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_m = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, ENTRIES * BLOCK_S)  # [entry, slot] flattened
    j_slot = offs_j % BLOCK_S
    g = i // CHUNKS
    is_g = offs_g == g
    ids_g = tl.sum(tl.where(is_g[:, None], ids, 0), axis=0)  # [BLOCK_M]: head g's list
    oks_g = tl.max(tl.where(is_g[:, None], oks, 0), axis=0)
    entry = (i % CHUNKS) * ENTRIES + offs_j // BLOCK_S
    pick = offs_m[None, :] == entry[:, None]  # [ENTRIES * BLOCK_S, BLOCK_M]
    page = tl.sum(tl.where(pick, ids_g[None, :], 0), axis=1)
    ok = tl.max(tl.where(pick, oks_g[None, :], 0), axis=1) != 0
    slots = page * PAGE + j_slot
    valid = ok & (entry < TOP) & (j_slot < PAGE) & (slots >= bulk_lo) & (slots < bulk_hi)
    return g, slots, valid


@triton.jit
def page_range(bulk_lo, bulk_hi, has_bulk, PAGE: tl.constexpr):
    """``(p_lo, p_hi)``: the pages overlapping the row's bulk ``[bulk_lo, bulk_hi)`` (:func:`row_range`)."""
    p_lo = bulk_lo // PAGE
    p_hi = tl.where(has_bulk, tl.cdiv(bulk_hi, PAGE), p_lo)
    return p_lo, p_hi


@triton.jit
def page_top_program(
    Q, K, START, END, KMIN, KMAX, CAND_VALS, CAND_IDS, CAND_OKS,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_eb, stride_eh, stride_ep, stride_ed,
    C, H_KV, t_sink, t_local, scale, n_pages, pages_per_program, n_stretches, pair, stretch,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    PAGE: tl.constexpr, TOP: tl.constexpr, BLOCK_M: tl.constexpr, HAS_START: tl.constexpr, HAS_END: tl.constexpr,
):  # fmt: skip
    """The page-top work of one (row, KV head) ``pair`` and one ``stretch`` (of ``n_stretches``) of
    ``pages_per_program`` of the pages overlapping the row's bulk: each query head's ``TOP`` pages of the stretch by
    bound (:func:`page_top`, the step key's page with its new halves), stored at ``CAND_VALS, CAND_IDS, CAND_OKS
    [pairs, n_stretches, BLOCK_G, BLOCK_M]`` (float32, int32, int32) for the decision to merge in stretch order.
    Reads only (the decision writes the page). A program of :func:`qada_tail_page_top_kernel`, or one a moment
    step's launch carries besides its own (:mod:`qada.attention.page_tops`)."""
    scale = as_float32(scale)  # (fp64 where torch.compile launches)
    row = pair // H_KV
    kv_head = pair % H_KV
    offs_g = tl.arange(0, BLOCK_G)
    row64 = row.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    k_base = K + row64 * stride_kb + kv64 * stride_kh
    q_head = Q + row64 * stride_qb + (kv64 * G) * stride_qh  # the group's first query head
    first, last, t_bulk, bulk_lo, bulk_hi = row_range(START, END, row, C, t_sink, t_local, HAS_START, HAS_END)
    p_lo, p_hi = page_range(bulk_lo, bulk_hi, t_bulk > 0, PAGE)
    new_page, low, high = step_key_page(
        KMIN, KMAX, END, row, row64, kv64, k_base, stride_kt, stride_kd, stride_eb, stride_eh, stride_ep, stride_ed,
        C, n_pages, D, BLOCK_D, PAGE, HAS_END)  # fmt: skip
    p_begin = tl.minimum(p_lo + stretch * pages_per_program, p_hi)
    p_end = tl.minimum(p_begin + pages_per_program, p_hi)
    extrema = row64 * stride_eb + kv64 * stride_eh
    vals, ids, oks = empty_top(BLOCK_G, BLOCK_M)
    vals, ids, oks = page_top(vals, ids, oks, q_head, stride_qh, stride_qd, KMIN + extrema, KMAX + extrema, stride_ep,
                              stride_ed, p_begin, p_end, new_page, low, high, scale, G, D, BLOCK_G, BLOCK_D, BLOCK_P,
                              TOP, BLOCK_M, True)  # fmt: skip
    at = ((pair.to(tl.int64) * n_stretches + stretch) * BLOCK_G + offs_g[:, None]) * BLOCK_M \
        + tl.arange(0, BLOCK_M)[None, :]
    tl.store(CAND_VALS + at, vals)
    tl.store(CAND_IDS + at, ids)
    tl.store(CAND_OKS + at, oks)


@triton.jit
def qada_tail_page_top_kernel(
    Q, K, START, END, KMIN, KMAX, CAND_VALS, CAND_IDS, CAND_OKS,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_eb, stride_eh, stride_ep, stride_ed,
    C, H_KV, t_sink, t_local, scale, n_pages, pages_per_program, n_stretches,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    PAGE: tl.constexpr, TOP: tl.constexpr, BLOCK_M: tl.constexpr, HAS_START: tl.constexpr, HAS_END: tl.constexpr,
):  # fmt: skip
    """One program = one (row, KV head) and one of its ``n_stretches`` stretches of pages (grid ``(pairs,
    n_stretches)``): :func:`page_top_program`. The launch of its own, for a step whose ``log E[exp(s)]`` launch
    does not carry these programs."""
    page_top_program(Q, K, START, END, KMIN, KMAX, CAND_VALS, CAND_IDS, CAND_OKS, stride_qb, stride_qh, stride_qd,
                     stride_kb, stride_kh, stride_kt, stride_kd, stride_eb, stride_eh, stride_ep, stride_ed, C, H_KV,
                     t_sink, t_local, scale, n_pages, pages_per_program, n_stretches, tl.program_id(0),
                     tl.program_id(1), G, D, BLOCK_G, BLOCK_D, BLOCK_P, PAGE, TOP, BLOCK_M, HAS_START,
                     HAS_END)  # fmt: skip


@triton.jit
def qada_tail_fused_split_kernel(
    Q, K, V, LME, START, END, SINKS,
    HEAVY, HEAVY_VALID, MEMBER, KMIN, KMAX, HALVES, CAND_VALS, CAND_IDS, CAND_OKS,
    SUPER_KMIN, SUPER_KMAX, SUPER_HALVES,
    ACC, M, L, COUNTS, DECIDED, LOCAL, READ, BROKEN, LOG_RATIO, N_EXACT, EXTRA_M, EXTRA_L, EXTRA_ACC,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_hb, stride_hh, stride_hk,
    stride_ub, stride_uh, stride_ut,
    stride_eb, stride_eh, stride_ep, stride_ed,
    stride_fb, stride_fh, stride_fp, stride_fx,
    stride_sb, stride_sh, stride_sp, stride_sd,
    stride_tb, stride_th, stride_tp, stride_tx,
    C, H_KV, t_sink, t_local, num_splits, scale, qk_scale, softcap, log_tau, n_heavy, n_pages, n_stretches, n_super,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_S: tl.constexpr, TOP: tl.constexpr, BLOCK_M: tl.constexpr, ENTRIES: tl.constexpr,
    SUPER: tl.constexpr, SUPER_TOP: tl.constexpr, BLOCK_SM: tl.constexpr, EXACT: tl.constexpr,
    TOKEN_STAGES: tl.constexpr,
    HAS_START: tl.constexpr, HAS_END: tl.constexpr, HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
    ATTEND: tl.constexpr, SCORE: tl.constexpr, CANDIDATES: tl.constexpr, PDL: tl.constexpr,
    HEADS_APART: tl.constexpr,
):  # fmt: skip
    """One program = one (row, KV head) and one split: the step's key joins its page, the group's ``qada_tail``
    decision (module docstring), then its split of the attention. With ``SCORE`` (and neither ``ATTEND`` nor more
    than one split): no decision, ``LOG_RATIO`` gets the budget's score ``log A_local - log Â_bulk`` (NaN where an
    input is, for the fail-safe) for the ``triton`` split launch to rank (:mod:`qada.attention._budget_rank`). With
    ``CANDIDATES`` each head's top pages are merged from the ``n_stretches`` lists
    :func:`qada_tail_page_top_kernel` wrote (``CAND_*``) instead of bounding every page here.

    Reads, besides what :func:`~qada.attention._fused_kernel.qada_fused_split_kernel` reads, the layer's tail index
    (:class:`~qada.criteria.tail_index.LayerTail`): ``HEAVY [b, H_kv, k]`` int64 slots (``n_heavy = k``),
    ``HEAVY_VALID [b, H_kv, k]`` bool (same strides as ``HEAVY``), ``MEMBER [b, H_kv, C']`` bool (``C' >= C``),
    ``KMIN, KMAX [b, H_kv, n_pages, d]`` float32 or the cache's 16-bit dtype (same strides; the bounds read them) and
    ``HALVES [b, H_kv, n_pages, 2d]`` float32 (only the step key's page is written); pages
    of ``PAGE`` slots, ``TOP`` pages per query head. Writes (split 0) the step key's page of ``KMIN, KMAX, HALVES``,
    ``DECIDED, LOCAL, BROKEN [b, H]`` and ``READ [b, H_kv]`` (bool), ``LOG_RATIO [b, H]`` float32 (``log A_local -
    logaddexp(log A_local, log Â_bulk)``) and ``N_EXACT [b, H]`` int32 (``|E|``), and as every split ``ACC, M, L,
    COUNTS``.
    ``BLOCK_H``: heavy slots per tile; ``BLOCK_P``: pages per tile; ``BLOCK_S >= PAGE``, ``BLOCK_M >= TOP`` powers
    of two.

    With ``SUPER = S > 0`` (a page hierarchy, not with ``CANDIDATES``) the top pages are chosen through the
    super-pages of ``S`` pages (:func:`hierarchical_top`: the group's ``SUPER_TOP`` best, ``BLOCK_SM >= SUPER_TOP``
    a power of two, then the pages inside them), from ``SUPER_KMIN, SUPER_KMAX [b, H_kv, n_super, d]`` (the page
    extrema's dtype; strides ``stride_s*``), and the step's key joins its super-page too (split 0 writes it, and
    its float32 ``SUPER_HALVES [b, H_kv, n_super, 2d]``, strides ``stride_t*``). With ``EXACT`` (``attend_exact``)
    local heads attend over ``window ∪ E``: the decision is ``logaddexp(log A_local, log A_E) / (that + Â_rest)``,
    and split 0 writes each head's attention over ``E`` as one more split, ``EXTRA_M, EXTRA_L [b, H]``, ``EXTRA_ACC
    [b, H, d]`` float32 (contiguous, log2 domain), which the combine launch merges into the local heads' output
    (:func:`~qada.attention._triton_kernel.qada_decode_combine_kernel`'s ``EXTRA``).

    With ``PDL`` (launched as a programmatic dependent launch after the moment step's launch, which wrote ``LME``;
    not with ``CANDIDATES``, which a launch in between wrote) it lets the next launch start, makes the whole
    decision but the bulk estimate while the moment step may still run, and waits for it before reading ``LME``.

    With ``HEADS_APART`` (a launch that only scores or decides: one split, not ``ATTEND``) program ``(pair, g)``
    takes query head ``g`` of the group alone: the same window, heavy set and page choice as the group's program,
    then only head ``g``'s top pages' tokens (``CHUNKS`` chunks where the group's program reads ``G x CHUNKS`` one
    after the other), storing its head's ``LOG_RATIO`` and ``N_EXACT`` (with ``EXACT``, its attention over ``E``),
    and without ``SCORE`` its own threshold decision, ``DECIDED`` and ``BROKEN`` before the group policy, which the
    ``triton`` split launch applies (its ``POLICY`` mode; ``LOCAL`` and ``READ`` not written here); program ``(pair,
    0)`` writes the step key's page. ``G`` times the programs, each a ``G``-th of the serial token loop: for a launch
    of few (row, KV head) pairs, as at batch size 1, whose time is its longest program's chain of dependent loads.
    """
    scale, qk_scale = as_float32(scale), as_float32(qk_scale)  # (fp64 where torch.compile launches)
    softcap, log_tau = as_float32(softcap), as_float32(log_tau)
    let_next_start(PDL)
    pair = tl.program_id(0)
    split = tl.program_id(1)
    row = pair // H_KV
    kv_head = pair % H_KV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < G
    if HEADS_APART:  # program (pair, g): head g alone, each its own (only) split
        g_ok = g_ok & (offs_g == split)
        split = split * 0
    d_ok = offs_d < D
    heads = kv_head * G + offs_g
    row64 = row.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    k_base = K + row64 * stride_kb + kv64 * stride_kh
    v_base = V + row64 * stride_vb + kv64 * stride_vh
    q_rows = Q + row64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh
    q_head = Q + row64 * stride_qb + (kv64 * G) * stride_qh  # the group's first query head

    first, last, t_bulk, bulk_lo, bulk_hi = row_range(START, END, row, C, t_sink, t_local, HAS_START, HAS_END)
    has_bulk = t_bulk > 0

    q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # --- log A_local: the window's exact mass (and the sink logit) ---------------------------------------------
    log_local, bad = window_log_local(q, k_base, stride_kt, stride_kd, first, last, bulk_lo, bulk_hi, has_bulk,
                                      scale, softcap, SINKS, heads, g_ok, D, BLOCK_G, BLOCK_N, BLOCK_D, SOFTCAP,
                                      HAS_SINKS, INPUT_PRECISION, DOT_FP32)  # fmt: skip

    # --- the step's key joins its page (append_step_key) ------------------------------------------------------
    new_page, low, high = step_key_page(
        KMIN, KMAX, END, row, row64, kv64, k_base, stride_kt, stride_kd, stride_eb, stride_eh, stride_ep, stride_ed,
        C, n_pages, D, BLOCK_D, PAGE, HAS_END)  # fmt: skip
    # The step key's page, as append_step_key leaves it, written first so that its extrema hold no registers
    # through the rest of the decision. Any order is safe: every split takes the page's extrema from registers, and
    # a split reading the extrema after this write gets the same min / max again.
    if tl.program_id(1) == 0:  # (split 0; with HEADS_APART, head 0's program)
        store_step_key_page(KMIN, KMAX, HALVES, END, row, row64, kv64, low, high, stride_eb, stride_eh, stride_ep,
                            stride_ed, stride_fb, stride_fh, stride_fp, stride_fx, C, n_pages, D, BLOCK_D, PAGE,
                            HAS_END)  # fmt: skip
    if SUPER:  # and its super-page, alike
        new_super, super_low, super_high = step_key_page(
            SUPER_KMIN, SUPER_KMAX, END, row, row64, kv64, k_base, stride_kt, stride_kd, stride_sb, stride_sh,
            stride_sp, stride_sd, C, n_super, D, BLOCK_D, PAGE * SUPER, HAS_END)  # fmt: skip
        if tl.program_id(1) == 0:
            store_step_key_page(SUPER_KMIN, SUPER_KMAX, SUPER_HALVES, END, row, row64, kv64, super_low, super_high,
                                stride_sb, stride_sh, stride_sp, stride_sd, stride_tb, stride_th, stride_tp,
                                stride_tx, C, n_super, D, BLOCK_D, PAGE * SUPER, HAS_END)  # fmt: skip

    # --- the exact set E: the heavy set ----------------------------------------------------------------------
    m_e = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    total_e = tl.zeros([BLOCK_G], dtype=tl.float32)
    n_exact = tl.zeros([BLOCK_G], dtype=tl.int32)
    bad_e = tl.zeros([BLOCK_G], dtype=tl.int32)
    acc_e = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)  # with EXACT: sum of exp(s - m_e) v over E
    heavy_base = row64 * stride_hb + kv64 * stride_hh
    for h0 in range(0, n_heavy, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < n_heavy
        h_slot = tl.load(HEAVY + heavy_base + offs_h * stride_hk, mask=h_ok, other=0).to(tl.int32)
        h_valid = tl.load(HEAVY_VALID + heavy_base + offs_h * stride_hk, mask=h_ok, other=0) != 0
        h_valid = h_ok & h_valid & (h_slot >= bulk_lo) & (h_slot < bulk_hi)
        k = tl.load(k_base + h_slot[:, None].to(tl.int64) * stride_kt + offs_d[None, :] * stride_kd,
                    mask=h_valid[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        s = key_scores(q, k, INPUT_PRECISION, DOT_FP32) * scale  # [BLOCK_G, BLOCK_H]
        if SOFTCAP:
            s = cap(s, softcap)
        valid = g_ok[:, None] & h_valid[None, :]
        m_e, total_e, n_exact, bad_e, p, alpha = fold_scores(m_e, total_e, n_exact, bad_e, s, valid)
        if EXACT:  # the heavy tokens' values, for the local heads' attention over E (split 0 stores it)
            if split == 0:
                v = tl.load(v_base + h_slot[:, None].to(tl.int64) * stride_vt + offs_d[None, :] * stride_vd,
                            mask=h_valid[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
                if DOT_FP32:
                    v = v.to(tl.float32)
                acc_e = acc_e * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                                        input_precision=INPUT_PRECISION).to(tl.float32)

    # --- the exact set E: each query head's TOP pages by bound (top_pages), by tiles of BLOCK_P pages ----------
    p_lo, p_hi = page_range(bulk_lo, bulk_hi, has_bulk, PAGE)
    extrema = row64 * stride_eb + kv64 * stride_eh
    vals, ids, oks = empty_top(BLOCK_G, BLOCK_M)
    if SUPER:  # through the super-pages: those of the group's best super-pages only
        supers = row64 * stride_sb + kv64 * stride_sh
        vals, ids, oks = hierarchical_top(q_head, stride_qh, stride_qd, KMIN + extrema, KMAX + extrema, stride_ep,
                                          stride_ed, SUPER_KMIN + supers, SUPER_KMAX + supers, stride_sp, stride_sd,
                                          p_lo, p_hi, new_page, low, high, new_super, super_low, super_high, scale, G,
                                          D, BLOCK_G, BLOCK_D, BLOCK_P, TOP, BLOCK_M, SUPER, SUPER_TOP,
                                          BLOCK_SM, not ATTEND)  # fmt: skip
    elif CANDIDATES:  # merged from the stretches' lists, 4 lists per tile (ties: the lower page, as one pass would)
        offs_c = tl.arange(0, 4 * BLOCK_M)  # [list, entry] flattened
        for c0 in range(0, n_stretches, 4):
            c = c0 + offs_c // BLOCK_M
            at = ((pair.to(tl.int64) * n_stretches + c[None, :]) * BLOCK_G + offs_g[:, None]) * BLOCK_M \
                + (offs_c % BLOCK_M)[None, :]
            there = (c < n_stretches)[None, :] & (g_ok if HEADS_APART else offs_g >= 0)[:, None]
            vals, ids, oks = insert_top(vals, ids, oks, tl.load(CAND_VALS + at, mask=there, other=float("-inf")),
                                        tl.load(CAND_IDS + at, mask=there, other=0),
                                        tl.load(CAND_OKS + at, mask=there, other=0), TOP, BLOCK_M)  # fmt: skip
    else:
        vals, ids, oks = page_top(vals, ids, oks, q_head, stride_qh, stride_qd, KMIN + extrema, KMAX + extrema,
                                  stride_ep, stride_ed, p_lo, p_hi, new_page, low, high, scale, G, D, BLOCK_G,
                                  BLOCK_D, BLOCK_P, TOP, BLOCK_M, not ATTEND)  # fmt: skip

    # --- the top pages' tokens: in the bulk, not heavy (one query head and ENTRIES of its pages at a time) ------
    # One loop over (head, chunk of its list). A chunk's keys and heavy flags load together (the keys of its heavy
    # tokens too, masked out after): one round trip, not two. With TOKEN_STAGES > 1 (a launch that only decides, or
    # a split that merges page-top lists instead of bounding pages) it overlaps with the chunk before: the keys
    # through the loop's software pipeline, the heavy flags loaded by the chunk before (cp.async takes no single
    # bytes); a split that bounds its pages keeps its registers for the attention.
    CHUNKS: tl.constexpr = (TOP + ENTRIES - 1) // ENTRIES
    member_base = MEMBER + row64 * stride_ub + kv64 * stride_uh
    i_begin = tl.program_id(1) * CHUNKS if HEADS_APART else 0  # (HEADS_APART: head g's chunks only)
    i_end = i_begin + CHUNKS if HEADS_APART else G * CHUNKS
    if TOKEN_STAGES > 1:
        _, slots, valid = list_chunk(i_begin, ids, oks, bulk_lo, bulk_hi, CHUNKS, BLOCK_G, BLOCK_M, BLOCK_S, ENTRIES,
                                     PAGE, TOP)  # fmt: skip
        heavy_next = tl.load(member_base + slots.to(tl.int64) * stride_ut, mask=valid, other=0).to(tl.int8)
    for i in tl.range(i_begin, i_end, num_stages=TOKEN_STAGES):
        g, slots, valid = list_chunk(i, ids, oks, bulk_lo, bulk_hi, CHUNKS, BLOCK_G, BLOCK_M, BLOCK_S, ENTRIES, PAGE,
                                     TOP)  # fmt: skip
        if TOKEN_STAGES == 1:
            heavy = tl.load(member_base + slots.to(tl.int64) * stride_ut, mask=valid, other=0).to(tl.int8)
        else:
            heavy = heavy_next
            _, slots_next, valid_next = list_chunk(i + 1, ids, oks, bulk_lo, bulk_hi, CHUNKS, BLOCK_G, BLOCK_M,
                                                   BLOCK_S, ENTRIES, PAGE, TOP)  # fmt: skip
            heavy_next = tl.load(member_base + slots_next.to(tl.int64) * stride_ut, mask=valid_next,
                                 other=0).to(tl.int8)  # fmt: skip
        is_g = offs_g == g
        q_g = head_query(q_head, g, stride_qh, stride_qd, offs_d, d_ok)
        k = tl.load(k_base + slots[:, None].to(tl.int64) * stride_kt + offs_d[None, :] * stride_kd,
                    mask=valid[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        if EXACT:  # their values too, in split 0 only (the others store no attention over E and read none)
            v = tl.load(v_base + slots[:, None].to(tl.int64) * stride_vt + offs_d[None, :] * stride_vd,
                        mask=tl.where(split == 0, valid, False)[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)  # fmt: skip
        valid = valid & (heavy == 0)
        s = tl.sum(k * q_g[None, :], axis=1) * scale  # [ENTRIES * BLOCK_S]
        if SOFTCAP:
            s = cap(s, softcap)
        rows = is_g[:, None] & valid[None, :]  # head g's row only
        s_rows = tl.where(rows, s[None, :], float("-inf"))
        m_e, total_e, n_exact, bad_e, p, alpha = fold_scores(m_e, total_e, n_exact, bad_e, s_rows, rows)
        if EXACT:  # (the other heads' sums keep their scale: alpha is 1 there, or 0 on an empty sum)
            v = tl.where(valid[:, None], v, 0.0)  # (a heavy token's values, loaded with the chunk: never summed)
            head_sum = tl.sum(tl.sum(tl.where(is_g[:, None], p, 0.0), axis=0)[:, None] * v, axis=0)
            acc_e = acc_e * alpha[:, None] + tl.where(is_g[:, None], head_sum[None, :], 0.0)
    log_exact = tl.where(total_e > 0, m_e + tl.log(total_e), float("-inf"))

    # --- eqs. 5-7 on the rest of the bulk: log Â_bulk = logaddexp(log A_E, log(T_bulk - |E|) + log E[exp(s)]) ----
    wait_for_previous(PDL)  # (LME: the moment step's launch)
    log_mean_exp = tl.load(LME + row64 * (H_KV * G) + heads, mask=g_ok, other=0.0)  # (computed once per step)
    rest = t_bulk - n_exact  # [BLOCK_G]
    log_rest = tl.where(rest > 0, tl.log(tl.maximum(rest, 1).to(tl.float32)) + log_mean_exp, float("-inf"))
    bad = bad | (bad_e > 0) | (log_rest != log_rest)  # a NaN estimate of the rest: the fail-safe
    if EXACT:  # a local head keeps window ∪ E and leaves out the rest
        log_local = logaddexp(log_local, log_exact)
        log_bulk = tl.where(has_bulk, log_rest, float("-inf"))
    else:
        log_bulk = tl.where(has_bulk, logaddexp(log_exact, log_rest), float("-inf"))

    out = row64 * (H_KV * G) + heads.to(tl.int64)  # [b, H] offsets, made here: see store_step_key_page for why
    if EXACT:
        if split == 0:  # each head's attention over E, one more split for the combine launch (log2 domain)
            tl.store(EXTRA_M + out, m_e * 1.4426950408889634, mask=g_ok)
            tl.store(EXTRA_L + out, total_e, mask=g_ok)
            tl.store(EXTRA_ACC + out[:, None] * D + offs_d[None, :], acc_e, mask=g_ok[:, None] & d_ok[None, :])
    if SCORE:  # the budget's score: ranked across the row's heads by the next launch
        if split == 0:
            tl.store(LOG_RATIO + out, tl.where(bad, float("nan"), log_local - log_bulk), mask=g_ok)
            tl.store(N_EXACT + out, n_exact, mask=g_ok)
    else:  # --- the threshold decision (fail-safe), then the group policy -----------------------------------------
        decided, local, broken, dense, read = threshold_decision(log_local, log_bulk, bad, has_bulk, log_tau, G,
                                                                 BLOCK_G, PROMOTE)  # fmt: skip
        if HEADS_APART:  # head g's own decision: the split launch applies the group policy (its POLICY mode)
            tl.store(DECIDED + out, decided.to(tl.uint8), mask=g_ok)
            tl.store(BROKEN + out, broken.to(tl.uint8), mask=g_ok)
        elif split == 0:
            store_decision(DECIDED, LOCAL, BROKEN, READ, row64, kv64, heads, g_ok, H_KV, G, decided, local, broken,
                           read)  # fmt: skip
        if split == 0:
            tl.store(LOG_RATIO + out, log_local - logaddexp(log_local, log_bulk), mask=g_ok)
            tl.store(N_EXACT + out, n_exact, mask=g_ok)

    # --- the attention over this split's share of the virtual block list (not in a decision-only launch) -------
    if ATTEND:  # the queries again (kept from the start, they would hold registers through the decision)
        q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        read = through_memory(COUNTS, pair, split, num_splits, read)  # (pipelined bounds)
        attend_split(q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
                     first, last, bulk_lo, bulk_hi, has_bulk, read, dense, ACC, M, L, COUNTS, pair, split, num_splits,
                     qk_scale, softcap, G, D, BLOCK_G, BLOCK_N, BLOCK_D, INPUT_PRECISION, DOT_FP32,
                     SOFTCAP)  # fmt: skip
