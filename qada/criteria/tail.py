"""Tail-aware QAdA (issue 23): eq. 7 with the heavy tail of the bulk scored exactly.

.. math:: \\hat A_\\text{bulk} = \\sum_{i \\in E} e^{s_i} + (T_\\text{bulk} - |E|)\\, e^{\\mu_s + \\sigma_s^2/2},
    \\qquad E = \\text{heavy set} \\cup \\text{top pages by bound}

(:mod:`qada.functional.tail`). ``qada_tail`` decides with the threshold rule of eq. 2, ``qada_tail_budget`` with the
budget rule of :class:`~qada.criteria.BudgetedQAdACriterion` on the same estimate. What a local head reads per
step: its window, the keys of ``E`` (``heavy + G * pages * page_size`` tokens per KV group) and the page extrema (two
vectors per page: ``2 / page_size`` of the keys), or with a page hierarchy the super-pages' extrema and those of the
pages inside the best super-pages only (:func:`exact_set_reads`). With ``scale_exact`` the sizes grow as
``sqrt(C)`` with the context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qada.criteria.base import register_criterion
from qada.criteria.budgeted import BudgetedQAdACriterion
from qada.criteria.tail_index import LAYER_FIELDS, LayerTail, TailIndex, append_step_key
from qada.criteria.threshold import ThresholdCriterion
from qada.functional.capping import soft_cap
from qada.functional.extra_set import extra_scores
from qada.functional.tail import page_slots, tail_log_rest, top_pages, top_pages_hierarchical
from qada.step import DecodeStep
from qada.window import Window

__all__ = ["READ_LEAN", "TailBudgetCriterion", "TailCriterion", "TailEstimate", "exact_set_reads"]

READ_LEAN = {"super_page": 16, "super_pages": 4, "pages": 4, "heavy": 16, "scale_exact": 8192, "shrink_exact": False}
"""The read-lean settings of the tail-aware criteria (add ``attend_exact=True`` and a ``tau`` or ``sparsity``): a page
hierarchy of 256-token super-pages, exact sets sized for 8k slots, grown by ``sqrt(C / 8192)`` beyond and never shrunk
below. A local KV group reads 5.3% of a dense one at 8k, window included (``docs/howto/tail.rst``); with ``tau=0.3``
it scores as dense does on RULER at 8k on the embedded model (``docs/results.md``) and is the configuration whose
compiled step is faster than dense on the CPU (``benchmarks/results/interleaved-cpu-lean.md``)."""


@dataclass
class TailEstimate:
    """The tail-aware estimate's parameters and state (a mixin of the two criteria).

    Args:
        heavy: heavy tokens per KV head, chosen at the prefill (0: none).
        observe: the prompt's last queries that choose them.
        page_size: slots per page.
        pages: pages scored exactly per query head and step (0: none).
        attend_exact: a local head attends over ``window ∪ E`` (reading ``E``'s values too) instead of the window
            alone, and the decision becomes ``(A_window + A_E) / (A_window + A_E + Â_rest) >= tau``
            (:mod:`qada.functional.extra_set`).
        super_page: pages per super-page ``S`` of a two-level page hierarchy (0: every page is bounded each step):
            the super-pages are bounded first, per KV group, and only the pages inside its best ``super_pages`` are
            (:func:`~qada.functional.tail.top_pages_hierarchical`).
        super_pages: super-pages per KV group whose pages are bounded (with ``super_page``).
        scale_exact: a reference context ``C0`` in slots (0: fixed sizes). ``heavy``, ``pages`` and
            ``super_pages`` are then the sizes at ``C0``; a cache of ``C`` slots uses
            ``max(1, round(x * sqrt(C / C0)))`` of each (:meth:`sizes`; a size of 0 stays 0).
        shrink_exact: with ``scale_exact``, whether the sizes also shrink below the fields for ``C < C0`` (False:
            they only grow, ``x * sqrt(max(C, C0) / C0)``; measured: shrunk exact sets lose needles at 2k).
    """

    heavy: int = 32
    observe: int = 32
    page_size: int = 16
    pages: int = 8
    attend_exact: bool = False
    super_page: int = 0
    super_pages: int = 4
    scale_exact: int = 0
    shrink_exact: bool = True

    def _check_tail(self) -> None:
        for name in ("heavy", "observe", "page_size", "pages", "super_page", "super_pages", "scale_exact"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"expected {name} to be an int >= 0 but got {value!r}")
        for name in ("attend_exact", "shrink_exact"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {name} to be a bool but got {getattr(self, name)!r}")
        if self.page_size < 1:
            raise ValueError(f"expected page_size to be an int >= 1 but got {self.page_size!r}")
        if self.heavy and not self.observe:
            raise ValueError("expected observe >= 1 when heavy > 0 (the queries that choose the heavy set)")
        if self.super_page and not self.super_pages:
            raise ValueError("expected super_pages >= 1 with a page hierarchy (super_page > 0)")
        self._index = TailIndex(self.heavy, self.observe, self.page_size, self.super_page)

    def sizes(self, slots: int) -> tuple[int, int, int]:
        """``(heavy, pages, super_pages)`` for a cache of ``slots`` slots: the fields, or with :attr:`scale_exact`
        ``C0`` each scaled by ``sqrt(slots / C0)`` (rounded, at least 1 where the field is not 0; never below the
        field without :attr:`shrink_exact`)."""
        if not self.scale_exact:
            return self.heavy, self.pages, self.super_pages
        factor = math.sqrt((slots if self.shrink_exact else max(slots, self.scale_exact)) / self.scale_exact)
        return tuple(max(1, round(x * factor)) if x else 0 for x in (self.heavy, self.pages, self.super_pages))

    def observe_prefill(self, layer: int, keys: torch.Tensor, queries: torch.Tensor | None, scale: float | None,
                        start: torch.Tensor | None, window: Window, capacity: int | None = None) -> None:
        slots = capacity if capacity is not None else keys.shape[2]
        self._index.prefill(layer, keys, queries, scale, start, window, capacity, heavy_size=self.sizes(slots)[0])

    def layer_state(self, layer: int, slots: int) -> dict[str, torch.Tensor]:
        """The layer's heavy set and page extrema (:meth:`~qada.criteria.tail_index.TailIndex.layer_state`)."""
        return {**super().layer_state(layer, slots), **self._index.layer_state(layer, slots)}

    def prompt_queries(self) -> int:
        """The observation window when there is a heavy set to choose, else 0."""
        return self.observe if self.heavy else 0

    def exact_set(self, step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [b, H, n], valid [b, H, n])`` of ``E``: the heavy tokens, then the tokens of the top pages."""
        scores, valid, _ = self.exact_set_slots(step)
        return scores, valid

    def exact_set_slots(self, step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`exact_set` and the slots of ``E``, ``[b, H, n]`` long (in ``[0, C)``)."""
        tensors = self.state(step)
        state = LayerTail(**{name: tensors[name] for name in LAYER_FIELDS if name in tensors})
        query, keys, scale = step.query, step.keys, step.scale
        b, H, d = query.shape
        H_kv, C, G = step.num_kv_heads, step.length, step.group_size
        first = step.starts + step.window.t_sink  # [b]: the bulk is [first, last)
        last = first + step.t_bulk
        q = query.float().reshape(b, H_kv, G, d)
        k = state.heavy.shape[2]
        heavy_keys = keys.gather(2, state.heavy[..., None].expand(b, H_kv, k, d)).float()
        heavy_scores = (scale * (q @ heavy_keys.transpose(-1, -2))).reshape(b, H, k)
        in_bulk = (state.heavy >= first[:, None, None]) & (state.heavy < last[:, None, None])
        heavy_valid = (state.heavy_valid & in_bulk)[:, :, None].expand(b, H_kv, G, k).reshape(b, H, k)
        P = self.page_size
        n_pages = -(-C // P)
        _, m, super_pages = self.sizes(C)
        if self.super_page:
            n_super = -(-C // (P * self.super_page))
            top, pages = top_pages_hierarchical(query, state.halves[:, :, :n_pages],
                                                state.super_halves[:, :, :n_super], scale, first, last, P,
                                                self.super_page, super_pages, m)
        else:
            top, pages = top_pages(query, state.halves[:, :, :n_pages], scale, first, last, P, m)  # [b, H, m]
        slots = page_slots(pages, P)  # [b, H, m * P]
        clamped = slots.clamp(max=C - 1)
        rows = torch.arange(b, device=keys.device)[:, None, None]
        groups = (torch.arange(H, device=keys.device) // G)[None, :, None]
        page_scores = extra_scores(query, keys, clamped, scale)  # [b, H, m * P]
        page_valid_slots = (torch.isfinite(top).repeat_interleave(P, dim=-1) & (slots < C)
                            & (slots >= first[:, None, None]) & (slots < last[:, None, None])
                            & ~state.member[rows, groups, clamped])  # fmt: skip
        heavy_slots = state.heavy[:, :, None].expand(b, H_kv, G, k).reshape(b, H, k)
        return (torch.cat([heavy_scores, page_scores], -1), torch.cat([heavy_valid, page_valid_slots], -1),
                torch.cat([heavy_slots, clamped], -1))

    def extra_reads(self, step: DecodeStep) -> torch.Tensor:
        """``[b]`` vectors read per KV head and step (:func:`exact_set_reads`)."""
        if step.end is None:
            filled = torch.full((step.batch_size,), step.length, dtype=torch.float64, device=step.device)
        else:
            filled = step.end.to(torch.float64)
        heavy, pages, super_pages = self.read_sizes(step)
        return exact_set_reads(filled, step.group_size, self.page_size, heavy, pages, self.attend_exact,
                               self.super_page, super_pages)

    def read_sizes(self, step: DecodeStep) -> tuple[int, int, int]:
        """``(heavy, pages, super_pages)`` of ``step``'s exact set as :meth:`extra_reads` counts them: :meth:`sizes`
        of the cache, the heavy set's size as chosen at the prefill (a growing cache's ``C`` moves on)."""
        heavy, pages, super_pages = self.sizes(step.length)
        if self.heavy and self._index.layers:
            heavy = self.state(step)["heavy"].shape[2]
        return heavy, pages, super_pages

    def tail_log_bulk(self, step: DecodeStep) -> torch.Tensor:
        """``[b, H]`` the tail-aware ``log Â_bulk``; first the step's key joins its page (in place)."""
        log_exact, log_rest = self.tail_parts(step)
        return torch.logaddexp(log_exact, log_rest)

    def tail_parts(self, step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log A_E, log Â_rest)``, each ``[b, H]``: the exact set's mass and eq. 7 on the rest of the bulk
        (computed once per step; the step's key joins its page first, in place). With :attr:`attend_exact` the step
        is also told to attend over ``E`` (:meth:`~qada.step.DecodeStep.attend_also`)."""
        cached = step.__dict__.get("tail:" + self.state_key)
        if cached is not None:
            return cached
        append_step_key(self.state(step), step.keys, step.end, self.page_size, self.super_page)
        scores, valid, slots = self.exact_set_slots(step)
        scores = soft_cap(scores, step.softcap)  # (the pages' bounds rank alike capped or not: tanh is monotone)
        log_exact = torch.logsumexp(scores.masked_fill(~valid, float("-inf")), dim=-1)
        mu_s, var_s = step.score_moments
        rest = tail_log_rest(valid.sum(-1), mu_s, var_s, step.t_bulk, step.softcap)
        if self.attend_exact:
            step.attend_also(slots, valid, scores)
        step.__dict__["tail:" + self.state_key] = (log_exact, rest)
        return log_exact, rest

    def tail_log_local(self, step: DecodeStep) -> torch.Tensor:
        """``[b, H]`` the mass a local head keeps: the window's (sink logits included), plus ``E``'s when it attends
        over ``E`` (:attr:`attend_exact`)."""
        if not self.attend_exact:
            return step.log_local
        return torch.logaddexp(step.log_local, self.tail_parts(step)[0])

    def tail_log_rest(self, step: DecodeStep) -> torch.Tensor:
        """``[b, H]`` what a local head leaves out: the whole bulk's estimate, or with :attr:`attend_exact` the rest
        beyond ``E``."""
        log_exact, rest = self.tail_parts(step)
        return rest if self.attend_exact else torch.logaddexp(log_exact, rest)


def exact_set_reads(filled: torch.Tensor, group_size: int, page_size: int, heavy: int, pages: int,
                    attend_exact: bool = False, super_page: int = 0, super_pages: int = 0) -> torch.Tensor:
    """Vectors a KV group reads per step to bound, choose and score its exact set, beyond its window, ``[b]``.

    With ``n = ceil(filled / P)`` pages holding a token of the row (a preallocated buffer's empty pages are not
    read) and ``G`` query heads per KV head:

    * the keys of ``E``: ``heavy + G * min(pages, candidates) * P`` (each query head's pages), doubled with
      ``attend_exact`` (their values too);
    * one level: the extrema of every page, ``2 n`` (``candidates = n``);
    * a hierarchy of ``S = super_page`` pages per super-page: ``2 ceil(n / S)`` super-page extrema and the
      extrema of the pages inside the group's ``super_pages`` best, ``2 min(super_pages S, n)``
      (``candidates = super_pages S``).

    Args:
        filled: ``[b]`` float, the tokens of each row.
    """
    n_pages = torch.ceil(filled / page_size)
    if super_page:
        candidates = n_pages.clamp(max=super_pages * super_page)
        bounds = 2 * torch.ceil(n_pages / super_page) + 2 * candidates
    else:
        candidates, bounds = n_pages, 2 * n_pages
    exact = heavy + group_size * candidates.clamp(max=pages) * page_size
    return exact * (2 if attend_exact else 1) + bounds


@register_criterion("qada_tail")
@dataclass
class TailCriterion(TailEstimate, ThresholdCriterion):
    """Local when ``A_local / (A_local + Â_bulk) >= tau`` with the tail-aware ``Â_bulk`` (module docstring).

    Args:
        tau: threshold in ``[0, 1]``; higher means fewer local heads.
        heavy, observe, page_size, pages, attend_exact, super_page, super_pages, scale_exact, shrink_exact: see
            :class:`TailEstimate`.
    """

    needs_moments = True

    def __post_init__(self) -> None:
        ThresholdCriterion.__post_init__(self)
        self._check_tail()

    def log_bulk(self, step: DecodeStep) -> torch.Tensor:
        return self.tail_log_rest(step)

    def log_local(self, step: DecodeStep) -> torch.Tensor:
        return self.tail_log_local(step)


@register_criterion("qada_tail_budget")
@dataclass
class TailBudgetCriterion(TailEstimate, BudgetedQAdACriterion):
    """The budget rule of :class:`~qada.criteria.BudgetedQAdACriterion` ranking heads by
    ``log A_local - log Â_bulk`` with the tail-aware estimate.

    Args:
        sparsity, per_group, allocation: see :class:`~qada.criteria.BudgetedQAdACriterion`.
        heavy, observe, page_size, pages, attend_exact, super_page, super_pages, scale_exact, shrink_exact: see
            :class:`TailEstimate`.
    """

    def __post_init__(self) -> None:
        BudgetedQAdACriterion.__post_init__(self)
        self._check_tail()

    def score(self, step: DecodeStep) -> torch.Tensor:
        return self.tail_log_local(step) - self.tail_log_rest(step)
