"""The ``triton_fused`` executor: the QAdA decision (paper eqs. 5-7) made inside the ``triton`` split kernel.

On a run whose criterion is the plain ``qada`` threshold rule with a moment source, the run's layer step hands the
decision to this executor (:meth:`FusedTritonExecutor.decide_and_attend`): after the moment step (one launch for
the built-in sources, :mod:`qada.attention.moment_step`, which also writes each query head's ``log E[exp(s)] = mu_s
+ sigma_s^2 / 2`` of one bulk score, eqs. 5-6, Gauss-Hermite under a soft cap: a :class:`BulkEstimate`) a layer's
decode step is two launches, whatever the decision:

1. the fused split kernel (:mod:`qada.attention._fused_kernel`), one program per (row, KV head, split): it reads the
   ``G`` queries, the row's window keys and the heads' ``log E[exp(s)]``, computes ``log A_local`` (the window's
   exact mass, sink logit included), ``log Â_bulk = log T_bulk + log E[exp(s)]`` (eq. 7), the fail-safe threshold
   decision at ``tau`` and the group policy, then its split of the attention, skipping the bulk blocks of a group
   whose heads are all local; split 0 stores the decision;
2. the ``triton`` executor's combine kernel (log-sum-exp merge of the splits, sink logits, bulk block count),
   whose last program also writes the step's statistics row (sparsity, kv_sparsity, fail-safe, kv_read:
   :class:`~qada.attention.triton_decode.StepStatistics`).

No other device work, no host read of a tensor value, grid from the shapes only. The decision equals the eager
criterion's up to float32 rounding (a head whose ratio lies within rounding of ``tau`` may go either way). A moment
source that steps in torch (or a frozen one) gets one launch more for ``log E[exp(s)]``
(:func:`~qada.attention.moment_step.estimate_launch`), as does :meth:`FusedTritonExecutor.decide_and_attend` called
without it. With ``estimate_in_splits=True`` each split computes ``log E[exp(s)]`` itself from the moments, and the
built-in sources' moment step, kept one decode step ahead, runs in the combine launch for the next step
(:mod:`qada.attention._ahead_kernel`): two launches a layer in all.

On a run whose criterion is the tail-aware ``qada_tail`` the split launch is :mod:`qada.attention._fused_tail_kernel`'s
instead (:class:`FusedTail` carries the layer's tail index): each program also makes the step's key join its page
(split 0 writes the page back), scores the heavy set and each query head's top pages by bound, and decides on
``logaddexp(log A_E, log(T_bulk - |E|) + mu_s + sigma_s^2 / 2)``; still two launches per layer after the moment
step. Any of the criterion's settings: a page hierarchy (``super_page``: the key joins its super-page too, and the
top pages are chosen inside each head's best super-pages), ``scale_exact`` (the step's sizes, from the cache length)
and ``attend_exact`` (local heads attend over ``window ∪ E``: split 0 writes each head's attention over ``E``, which
the combine launch merges as one more split).

With ``decide_once=True`` (by default: a ``qada_tail`` decision over more pages than ``pages_per_program``) the
decision is made once per group, one program per (row, KV head), and the ``triton`` executor's split and combine
launches then read its ``local`` mask: the plain ``qada`` decision by the launch that writes ``log E[exp(s)]`` (the
moment step's: two launches after it, as deciding in the splits; :class:`~qada.attention.moment_step.EstimateDecision`),
a ``qada_tail`` one in a launch of its own (three), one program per query head where that grid fits one wave
(:attr:`FusedTritonExecutor.heads_apart`: each decides its own head, and the ``triton`` split launch applies the group
policy, :class:`~qada.attention.triton_decode.HeadsDecided`). No split then recomputes the decision (what a GPU
measurement should choose between). Where a row spans more than ``pages_per_program`` pages, its page bounds are
spread over page-top programs (:mod:`qada.attention.page_tops`) that the moment step's launch runs besides its own,
and the decision merges their lists: the same launches either way.

The ``dense`` criterion has no decision to fuse: its run's step is the dense step (:mod:`qada.models.dense_step`,
the split and combine alone, as on ``triton``). Anything else (another criterion, such as ``quest`` or a composed
one; no moment source) is an error when the run is built: use ``triton``. Called as a plain executor (with a
decision given, e.g. :func:`~qada.attention.decode_attention`), it is the ``triton`` executor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from qada.attention import triton_decode
from qada.attention.base import GroupDecision, register_executor
from qada.attention.moment_step import BulkEstimate, EstimateDecision, block_sizes, estimate_launch
from qada.attention.page_tops import PageTops
from qada.attention.triton_decode import (
    BudgetRank,
    ExtraAttention,
    HeadsDecided,
    StepStatistics,
    TailReads,
    TritonExecutor,
    _next_pow2,
    _tile,
    check_triton_runtime,
    combine,
    pdl_launch_options,
    register_cap,
)
from qada.functional.tail import EXTREMA_DTYPES
from qada.step import DecodeStep

__all__ = ["FusedBudget", "FusedLaunch", "FusedTail", "FusedTritonExecutor"]

_LOG2E = 1.4426950408889634


class FusedLaunch(NamedTuple):
    """What one :meth:`FusedTritonExecutor.decide_and_attend` computed (``pairs = b * H_kv``, ``S`` splits).

    Attributes:
        output: ``[b, H, 1, d]`` in the query dtype.
        bulk_blocks: 0-d int64, blocks loaded only for the bulk.
        decided: ``[b, H]`` bool, the criterion's decision (True = local; every head of a row without a bulk).
        local: ``[b, H]`` bool after the group policy; ``read``: ``[b, H_kv]`` bool, the bulks read.
        broken: ``[b, H]`` bool, the heads forced dense by a non-finite value (the fail-safe).
        counts: ``[pairs, S, 2]`` int32 per program: blocks loaded only for the bulk, blocks loaded in all.
        log_ratio: with a ``qada_tail`` decision, ``[b, H]`` float32 ``log A_local - logaddexp(log A_local,
            log Â_bulk)`` (what is compared with ``log tau``); with a ``qada_tail_budget`` or ``qada_budget`` one the
            score ``log A_local - log Â_bulk`` that is ranked (NaN where an input is); else ``None``.
        n_exact: with a ``qada_tail`` decision, ``[b, H]`` int32 ``|E|``, the bulk tokens scored exactly, else
            ``None``.
        row: ``[5]`` float64, the step's statistics row (:func:`~qada.models.step_parts.statistics_row`: sparsity,
            kv_sparsity, 1, heads forced dense, kv_read), written by the combine launch.
    """

    output: torch.Tensor
    bulk_blocks: torch.Tensor
    decided: torch.Tensor
    local: torch.Tensor
    read: torch.Tensor
    broken: torch.Tensor
    counts: torch.Tensor
    log_ratio: torch.Tensor | None = None
    n_exact: torch.Tensor | None = None
    row: torch.Tensor | None = None


class FusedTail(NamedTuple):
    """What the ``qada_tail`` decision reads besides the step: one layer's tail index
    (:class:`~qada.criteria.tail_index.LayerTail`, updated in place) and the criterion's sizes.

    Attributes:
        heavy: ``[b, H_kv, k]`` int64 heavy slots; ``heavy_valid``: ``[b, H_kv, k]`` bool (same strides).
        member: ``[b, H_kv, C']`` bool (``C' >= C``), the heavy slots.
        kmin, kmax: ``[b, H_kv, n_pages, d]`` page extrema (same strides and dtype: float32, or a 16-bit cache's
            dtype, :func:`~qada.functional.tail.extrema_dtype`); ``halves``: ``[b, H_kv, n_pages, 2d]`` float32
            (:func:`~qada.functional.tail.page_halves`; the kernels bound pages from the extrema and write only the
            step key's page of it).
        page_size: slots per page ``P``; pages: top pages per query head (``m``).
        heavy_reads: the heavy tokens per KV head the step's ``kv_read`` counts (``None``: ``heavy``'s ``k``; a
            criterion without a heavy set keeps a placeholder slot and counts 0).
        super_kmin, super_kmax, super_halves: with a page hierarchy, the super-pages' extrema ``[b, H_kv, n_super,
            d]`` (the page extrema's dtype and strides alike) and float32 halves ``[b, H_kv, n_super, 2d]``
            (:class:`~qada.criteria.tail_index.LayerTail`); ``None``: one level.
        super_page: pages per super-page ``S`` (0: one level); super_pages: super-pages per KV group whose pages
            are bounded.
        attend_exact: local heads attend over ``window ∪ E`` (:attr:`~qada.criteria.TailCriterion.attend_exact`).
    """

    heavy: torch.Tensor
    heavy_valid: torch.Tensor
    member: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor
    halves: torch.Tensor
    page_size: int
    pages: int
    heavy_reads: int | None = None
    super_kmin: torch.Tensor | None = None
    super_kmax: torch.Tensor | None = None
    super_halves: torch.Tensor | None = None
    super_page: int = 0
    super_pages: int = 0
    attend_exact: bool = False

    def kernel_inputs(self, b: int, H_kv: int, C: int, d: int) -> tuple[torch.Tensor, ...]:
        """The six tensors as the kernel reads them (the bool ones as they are: a kernel reads a bool as a byte),
        after checking their shapes and strides (no host read of a value)."""
        k, n = self.heavy.shape[2], self.kmin.shape[2]
        shapes = (("heavy", self.heavy, (b, H_kv, k)), ("heavy_valid", self.heavy_valid, (b, H_kv, k)),
                  ("kmax", self.kmax, (b, H_kv, n, d)), ("halves", self.halves, (b, H_kv, n, 2 * d)))
        for name, tensor, shape in shapes:
            if tuple(tensor.shape) != shape:
                raise ValueError(f"expected {name} of shape {list(shape)} but got {tuple(tensor.shape)}")
        if self.member.shape[:2] != (b, H_kv) or self.member.shape[2] < C or n * self.page_size < C:
            raise ValueError(f"expected a tail index of at least {C} slots but got member {tuple(self.member.shape)} "
                             f"and {n} pages of {self.page_size}")
        if self.heavy_valid.stride() != self.heavy.stride() or self.kmin.stride() != self.kmax.stride():
            raise ValueError("expected heavy / heavy_valid and kmin / kmax of equal strides")
        if self.kmin.dtype != self.kmax.dtype or self.kmin.dtype not in EXTREMA_DTYPES:
            raise ValueError(f"expected page extrema of one dtype of {EXTREMA_DTYPES} but got {self.kmin.dtype} and "
                             f"{self.kmax.dtype}")
        if self.halves.dtype != torch.float32:
            raise ValueError(f"expected float32 page halves but got {self.halves.dtype}")
        return self.heavy, self.heavy_valid, self.member, self.kmin, self.kmax, self.halves

    def super_inputs(self, b: int, H_kv: int, C: int, d: int) -> tuple[torch.Tensor, ...]:
        """The super-pages' ``(kmin, kmax, halves)`` as the split kernel reads them, after checking them (with a
        hierarchy), or three placeholders it does not read (one level)."""
        if not self.super_page:
            return self.kmin, self.kmax, self.halves
        if self.super_kmin is None or self.super_kmax is None or self.super_halves is None or self.super_pages < 1:
            raise ValueError(f"expected the super-pages' extrema and halves and super_pages >= 1 with super_page "
                             f"{self.super_page} but got super_pages {self.super_pages}")
        n = self.super_kmin.shape[2]
        for name, tensor, shape in (("super_kmin", self.super_kmin, (b, H_kv, n, d)),
                                    ("super_kmax", self.super_kmax, (b, H_kv, n, d)),
                                    ("super_halves", self.super_halves, (b, H_kv, n, 2 * d))):
            if tuple(tensor.shape) != shape:
                raise ValueError(f"expected {name} of shape {list(shape)} but got {tuple(tensor.shape)}")
        if n * self.page_size * self.super_page < C:
            raise ValueError(f"expected super-pages covering {C} slots but got {n} of {self.super_page} pages of "
                             f"{self.page_size}")
        if self.super_kmin.stride() != self.super_kmax.stride() or self.super_kmin.dtype != self.kmin.dtype \
                or self.super_kmax.dtype != self.kmin.dtype or self.super_halves.dtype != torch.float32:
            raise ValueError("expected super_kmin / super_kmax of equal strides in the page extrema's dtype and "
                             "float32 super_halves")
        return self.super_kmin, self.super_kmax, self.super_halves

    def kernel_strides(self) -> tuple[int, ...]:
        supers = self.super_kmin if self.super_page else self.kmin
        super_halves = self.super_halves if self.super_page else self.halves
        return (*self.heavy.stride(), *self.member.stride(), *self.kmin.stride(), *self.halves.stride(),
                *supers.stride(), *super_halves.stride())

    def super_top(self) -> int:
        """The super-pages per KV group whose pages are bounded (0: one level)."""
        return self.super_pages if self.super_page else 0

    def n_super(self) -> int:
        """The super-pages of the hierarchy (0: one level)."""
        return self.super_kmin.shape[2] if self.super_page else 0

    def bounded_pages(self) -> int:
        """Pages (and super-pages) a decision bounds at most: every page, or with a hierarchy the super-pages and
        the pages of the ``super_pages`` best."""
        if self.super_page:
            return self.n_super() + self.super_pages * self.super_page
        return self.kmin.shape[2]

    def kernel_constants(self, head_dim: int) -> dict[str, int]:
        """The kernels' block sizes for queries and keys of ``head_dim`` features."""
        return dict(BLOCK_H=max(16, min(64, _next_pow2(self.heavy.shape[2]))),
                    **page_tiles(self.page_size, self.pages, head_dim))

    def split_constants(self) -> dict[str, Any]:
        """The split kernel's hierarchy and exact-set constants: ``SUPER``, ``SUPER_TOP``, ``BLOCK_SM``, ``EXACT``."""
        return dict(SUPER=self.super_page, SUPER_TOP=max(1, self.super_top()),
                    BLOCK_SM=max(2, _next_pow2(max(1, self.super_top()))),
                    EXACT=bool(self.attend_exact))

    def register_cap(self, dtype: torch.dtype, head_dim: int, num_warps: int) -> dict[str, int]:
        """The split kernel's register cap (launch options): where it holds the most state (``attend_exact``, or a
        page hierarchy), for a 16-bit cache at head sizes up to 128 and up to four warps, room for
        :data:`SPLIT_PROGRAMS_PER_SM` programs per SM (:func:`~qada.attention.triton_decode.register_cap`: 168
        registers at four warps, 255 at two); else none. Uncapped, Triton 3.6's ``ptxas`` gave that kernel 211-240
        registers at four warps (two programs per SM; Triton 3.9's, 168) and the page-hierarchy one without the exact
        set 168 with 80-92 B spilled; capped at 168 both compile without spilling under either version
        (``benchmarks/kernel_resources.py``). No cap elsewhere: a float32 cache's kernel spilled 70-130 B capped, and
        at eight warps a thread's share does not halve (190-199 registers uncapped; capped at the 80 that three
        programs leave, 264-328 B spilled); nor for a lighter kernel (``ptxas`` fills a cap it is given)."""
        if (self.attend_exact or self.super_page) and dtype != torch.float32 and _tile(head_dim) <= 128 \
                and num_warps <= 4:
            return register_cap(num_warps, SPLIT_PROGRAMS_PER_SM)
        return {}

    def reads(self) -> TailReads:
        """What the step's ``kv_read`` counts of the exact set (:class:`~qada.attention.triton_decode.TailReads`)."""
        heavy = self.heavy.shape[2] if self.heavy_reads is None else self.heavy_reads
        return TailReads(self.page_size, heavy, self.pages, self.super_page, self.super_top(),
                         bool(self.attend_exact))


def page_tiles(page_size: int, pages: int, head_dim: int) -> dict[str, int]:
    """The ``qada_tail`` kernels' page sizes and tiles for pages of ``page_size`` slots, ``pages`` top pages per query
    head and keys of ``head_dim`` features: ``PAGE``, ``TOP``, ``BLOCK_S`` (slots of a page, padded), ``BLOCK_M`` (a
    head's list, padded), ``BLOCK_P`` (pages bounded per tile) and ``ENTRIES`` (a head's top pages read per tile)."""
    block_s, block_d = max(2, _next_pow2(page_size)), _tile(head_dim)
    return dict(PAGE=page_size, TOP=pages, BLOCK_S=block_s, BLOCK_M=max(2, _next_pow2(pages)),
                BLOCK_P=max(8, _PAGE_TILE_FEATURES // block_d),
                ENTRIES=max(1, min(_next_pow2(pages), _TOKEN_TILE_FEATURES // (block_s * block_d))))


SPLIT_PROGRAMS_PER_SM = 3
"""Programs of the ``qada_tail`` split kernel that :meth:`FusedTail.register_cap` leaves room for on one SM: the split
count aims at two per SM (:attr:`~qada.attention.triton_decode.TritonExecutor.programs_per_sm`), plus a partial
wave."""


TOKEN_STAGES = 2
"""Pipeline stages of the ``qada_tail`` decision's loop over its top pages' tokens (``tl.range``'s ``num_stages``) in
a launch that only decides, and in a split that attends too where it merges page-top lists: the next chunk's keys
load while the current chunk is scored. A split that bounds its own pages takes 1 (its registers go to the
attention)."""

_TOKEN_TILE_FEATURES = 4096
"""Tokens of the top pages read per tile of the ``qada_tail`` split kernel (``ENTRIES`` pages of one query head's
list at a time), times the padded head dimension: 4 pages of 16 tokens of 64 features, 2 of 128. Each tile is one
chain of two dependent loads (the heavy mask, then the keys); one page per tile made ``G x TOP`` chains."""

_PAGE_TILE_FEATURES = 1024
"""Page bounds per tile of the ``qada_tail`` kernels, times the padded head dimension: 16 pages of 64 features, 8 of
128 (each tile is merged into the running top pages). A tile of a float32 half of ``[pages, d]`` costs ``pages d /
threads`` registers per thread. Compiled for sm_90 by Triton 3.9 (``benchmarks/kernel_resources.py``), 32 pages of
128 features left the page-top kernel at 168 registers and the split kernel that bounds its own pages at 198 (two
programs per SM); 8 pages, at 91 and 168."""


_PAGE_TOP_TILE_FEATURES = 4096
"""Page bounds per tile of the page-top launch, times the padded head dimension: 64 pages of 64 features, 32 of 128.
Triton's pipeliner leaves a loop of page-extrema tiles alone (a loop with the insertion's ``while`` inside: sm_90
PTX, no ``cp.async``), so a program loads each tile while it bounds and inserts the one before
(:func:`~qada.attention._fused_tail_kernel.page_top`'s ``AHEAD``): a program of 256 pages waits for the first of its
4 tiles only (of 16 at 1,024 features, each waited for). It holds two tiles (168 registers with Triton 3.6, 196-230
with 3.9, no spill: two or three programs per SM, for a launch of a few hundred); tiles of 2,048 features loaded
ahead took 1,204 insertion rounds instead of 826 on SmolLM2 at 7.68k (``benchmarks/tail_rounds.py``). The decision
launched apart keeps :data:`_PAGE_TILE_FEATURES`: it also holds the window's scores and the exact set, and with twice
the tile it spilled 20-28 bytes per thread under Triton 3.6."""


def page_top_tile(head_dim: int, pages_per_program: int) -> int:
    """``BLOCK_P`` of the page-top launch: :data:`_PAGE_TOP_TILE_FEATURES` over the padded head dimension, at least 8
    pages and at most a program's ``pages_per_program`` rounded up to a power of two."""
    tile = max(8, _PAGE_TOP_TILE_FEATURES // _tile(head_dim))
    return min(tile, max(8, _next_pow2(pages_per_program)))


class FusedBudget(NamedTuple):
    """The budget rule of ``qada_budget`` or ``qada_tail_budget`` (:class:`~qada.criteria.BudgetedQAdACriterion`,
    :class:`~qada.criteria.TailBudgetCriterion`) for one layer's step.

    Attributes:
        count: 0-d int64 on the device, how many heads (with ``per_group``: KV groups) of each row are local at this
            layer (:meth:`~qada.criteria.BudgetedQAdACriterion.local_count`, ``group_count``).
        per_group: rank KV groups by their heads' minimum score instead of heads.
    """

    count: torch.Tensor
    per_group: bool = False

    def rank(self, score: torch.Tensor, policy: str, flags: tuple[torch.Tensor, ...]) -> BudgetRank:
        """The rule as the ``triton`` split launch makes it (:class:`~qada.attention.triton_decode.BudgetRank`):
        ``score [b, H]`` ranked, the group ``policy``, writing ``flags`` (decided, local, broken: each ``[b, H]``;
        the launch's ``decision`` holds local and the bulks read)."""
        return BudgetRank(score, self.count, self.per_group, policy == "promote", flags[0], flags[2])


def _score_precision(dtype: torch.dtype) -> tuple[str | None, bool]:
    """How the kernels compute window scores for queries of ``dtype``: ``(INPUT_PRECISION, DOT_FP32)`` (``ieee``
    for float32; bfloat16 upcast to float32 in Triton's interpreter, whose dots do not take it)."""
    from qada.attention import _triton_kernel

    dot_fp32 = _triton_kernel.INTERPRETED and dtype == torch.bfloat16
    return ("ieee" if dtype == torch.float32 or dot_fp32 else None), dot_fp32


@register_executor("triton_fused")
@dataclass
class FusedTritonExecutor(TritonExecutor):
    """The ``triton`` executor whose split kernel also makes the ``qada`` criterion's decision: one split launch and
    one combine launch per layer and step for the whole decision and attention (module docstring).

    In a run it applies when the criterion is the plain ``qada`` one (:class:`~qada.criteria.QAdACriterion`, any
    ``tau``), ``qada_budget``, ``qada_tail`` or ``qada_tail_budget`` (:class:`~qada.criteria.BudgetedQAdACriterion`,
    :class:`~qada.criteria.TailCriterion`, :class:`~qada.criteria.TailBudgetCriterion`, any settings) with a moment
    source (``stored``, ``current``, ...); the ``dense`` criterion takes the dense step (the split and combine alone,
    :mod:`qada.models.dense_step`); any other criterion is an error when the run is built (``triton`` decodes for
    every criterion). Its decisions,
    statistics and output are those of the criterion with the ``triton`` executor, up to float32 rounding (and
    ``qada_tail``'s tail index after each step too). Arguments as for :class:`~qada.attention.TritonExecutor`.
    """

    fuses_decision = True
    """A run's layer step decides through :meth:`decide_and_attend` (:meth:`~qada.models.layer_step.LayerStep.fuse`)."""

    decide_once: bool | None = None
    """``False``: the decision in the split launch (two launches; every split recomputes it, since it fixes the
    split's blocks). ``True``: the decision made once, one program per (row, KV head), then the ``triton`` executor's
    split and combine launches reading its ``local`` mask: the plain ``qada`` decision by the moment step's launch
    (two launches after it), a ``qada_tail`` one (the exact set, the page bounds) in a launch of its own (three).
    ``None`` (the default): ``True`` for a ``qada_tail`` decision
    whose tail index has more than :attr:`pages_per_program` pages (a long context, where every split would merge
    the page-top programs' lists and read the exact set's tokens), else ``False``. The same decisions and output
    either way."""

    pages_per_program: int = 256
    """Where a row's tail index spans more pages than this (one level: a page hierarchy bounds few pages), the page
    bounds of ``qada_tail`` are spread over page-top programs of this many pages each
    (:func:`~qada.attention._fused_tail_kernel.page_top_program`, :meth:`page_tops`): each finds its stretch's top
    pages per head, the decision (in every split, or launched apart) merges the lists. The launch that writes
    ``log E[exp(s)]`` (the moment step's) runs them besides its own programs: no launch more. At 128k tokens and
    pages of 16 one program per (row, KV head) would bound 8192 pages alone. The same decisions either way."""

    compile_step: bool = False
    """Whether a run's layer step (the launches and the few tensor operations around them) is compiled by
    ``torch.compile`` (on a GPU: under Triton's interpreter it always runs eagerly). ``False`` (the default): it runs
    eagerly, the same kernels launched by Triton itself; a model compiled with ``mode="reduce-overhead"`` records
    them into its CUDA graph all the same, so a replayed step costs the same. ``True``: Inductor launches them.
    On an H200 (torch 2.11, Triton 3.6) a first version of that compiled step decided 4 of a tiny model's 96
    head-steps otherwise than the eager one; the current one decides as the eager one for ``qada`` and ``qada_tail``
    (the same tokens and statistics, measured there). It stays opt-in until its speed in a CUDA graph is measured:
    there the eager step's kernels are replayed all the same. Inductor (torch 2.11 to 2.13) compiles the kernels it
    launches without a register cap, so the ``qada_tail`` split with ``attend_exact`` or a page hierarchy loses its
    own (:meth:`FusedTail.register_cap`) when compiled."""

    pdl: bool = False
    """Whether a layer's launches after the moment step's are programmatic dependent launches (CUDA's PDL, sm_90 and
    later, eager steps): each may start while the launch before it runs (the moment step's and the split's let it at
    once), does what does not depend on that launch (a split scores the window, and for ``qada_tail`` the exact set
    and the page bounds), then waits for it before reading what it wrote. It hides the launch latency between a
    layer's dependent launches and overlaps the decision's window scan with the moment step: what a step of few
    programs, as at batch size 1, waits for. Off where the device has none (the CPU, Triton's interpreter, before
    sm_90) or Triton's intrinsics for it do not compile (before 3.5:
    :func:`~qada.attention._triton_kernel.pdl_intrinsics_compile`), inside a step ``torch.compile`` compiles
    (``compile_step``), and for a ``qada_tail`` decision merging the page-top launch's lists. The same kernels and
    results either way; opt-in until a GPU has timed it."""

    cap_registers: bool = True
    """Whether the ``qada_tail`` split kernel that holds the most state (``attend_exact`` or a page hierarchy, 16-bit
    caches, head sizes up to 128, up to four warps) is launched with its register cap
    (:meth:`FusedTail.register_cap`: three programs per SM). ``False``: ``ptxas`` chooses (with Triton 3.6, 211-240
    registers: two programs per SM). The same kernels and results either way; what the cap is worth in time awaits
    a GPU (the GPU suite's ``qada_tail+E/lean fused uncapped`` row)."""

    heads_apart: bool | None = None
    """Whether the ``qada_tail`` launch that only scores or decides (the score launch of a ``qada_tail_budget``
    step; a ``qada_tail`` decision launched apart, :attr:`decide_once`) runs one program per (row, query head)
    instead of one per (row, KV head) (the ``qada_tail`` kernel's ``HEADS_APART``): each takes one head, reading its
    own top pages' tokens where the group's program reads every head's one chunk after the other (``G`` times the
    programs, each a ``G``-th of that serial loop; the window, the heavy set and the page choice read by each, from
    L2 after the first). A threshold decision so made is each head's own: the ``triton`` split launch then applies
    the group policy (:class:`~qada.attention.triton_decode.HeadsDecided`). ``None`` (the default): where the
    ``G``-fold grid still fits one wave of the split launch's target, ``b H <= programs_per_sm x SMs`` (Llama-3-8B
    at batch size 1: 32 programs instead of 8 on a 132-SM GPU; SmolLM2 at batch size 1: 9 instead of 3; at 32 rows:
    not, 288 > 264); under Triton's interpreter (one SM counted) at most 2 heads. The same scores and decisions
    either way."""

    spread_moments: bool = True
    """Whether the moment step's launch runs one program per (row, KV head) and block pair of the ``d x d`` state
    (three at ``d = 64``; the last of a (row, KV head)'s programs to finish updates the count and sums and writes the
    estimate: :mod:`qada.attention._moment_kernel`) or one per (row, KV head) taking every pair in turn (``False``:
    the launch until 2026-12-06, but for a few loads: each pair reads its row block's key and mean again). At batch
    size 1 the launch has a few programs, and its longest one sets its time: on SmolLM2 one block pair and the end
    is 24 loads against 38 for all three, counted in Triton's interpreter (``benchmarks/launch_bytes.py``). The same
    state, moments, estimates and decisions either way; what it is worth in time awaits a GPU (the GPU suite's
    ``qada fused unspread`` row)."""

    estimate_in_splits: bool = False
    """Whether a plain ``qada`` decision made in the splits (not :attr:`decide_once`) computes each head's ``log
    E[exp(s)]`` in every split program from the float32 bulk moments (the split kernel's ``ESTIMATE``: the same
    float32 value as the launch that writes it) instead of reading it from a launch before. A layer's step is then two
    launches, the split and the combine: with the built-in ``current`` (stepping every key) and ``stored`` sources the
    moments are kept one decode step ahead, each step's combine launch stepping them for the next
    (:mod:`qada.attention._ahead_kernel`) and the prefill for the first; after a source stepped in torch or a frozen
    one there is no moment launch. Each split program then reads the ``d x d`` covariance too (16 KB at ``d = 64``,
    from L2 after the first), and the layer step returns no moments (the next step's overwrite them). The same
    decisions, output and statistics either way; opt-in until a GPU has timed it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.pages_per_program
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"expected pages_per_program to be a positive int but got {value!r}")
        if not isinstance(self.compile_step, bool):
            raise ValueError(f"expected compile_step to be a bool but got {self.compile_step!r}")
        if self.decide_once is not None and not isinstance(self.decide_once, bool):
            raise ValueError(f"expected decide_once to be a bool or None but got {self.decide_once!r}")
        if not isinstance(self.cap_registers, bool):
            raise ValueError(f"expected cap_registers to be a bool but got {self.cap_registers!r}")
        if not isinstance(self.pdl, bool):
            raise ValueError(f"expected pdl to be a bool but got {self.pdl!r}")
        if not isinstance(self.spread_moments, bool):
            raise ValueError(f"expected spread_moments to be a bool but got {self.spread_moments!r}")
        if not isinstance(self.estimate_in_splits, bool):
            raise ValueError(f"expected estimate_in_splits to be a bool but got {self.estimate_in_splits!r}")
        if self.heads_apart is not None and not isinstance(self.heads_apart, bool):
            raise ValueError(f"expected heads_apart to be a bool or None but got {self.heads_apart!r}")

    def launches_heads_apart(self, device: torch.device, heads: int) -> bool:
        """Whether a ``qada_tail`` launch that only scores or decides, over ``heads = b H`` query heads, runs one
        program per head (:attr:`heads_apart`)."""
        if self.heads_apart is not None:
            return self.heads_apart
        return heads <= self.programs_per_sm * triton_decode._num_sms(device)  # (as the split count: one SM on CPU)

    def programmatic(self, device: torch.device) -> bool:
        """Whether this step's launches on ``device`` are programmatic dependent launches (:attr:`pdl`)."""
        from qada.attention import _triton_kernel

        return (self.pdl and _triton_kernel.HAS_PDL and not _triton_kernel.INTERPRETED and device.type == "cuda"
                and not torch.compiler.is_compiling() and torch.cuda.get_device_capability(device)[0] >= 9)

    def bulk_estimate(self, query: torch.Tensor, scale: float, softcap: float | None,
                      decision: EstimateDecision | None = None, page_tops: PageTops | None = None) -> BulkEstimate:
        """The :class:`~qada.attention.moment_step.BulkEstimate` of a step's queries ``query [b, H, d]``: the held
        Gauss-Hermite rule (under a soft cap) and a new ``[b, H]`` float32 output, for the moment step's launch to
        fill (and with ``decision`` (:meth:`estimate_decision`) to decide from; with ``page_tops``
        (:meth:`page_tops`) to run those programs too)."""
        out = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        nodes, log_weights = self.hermite_rule(query.device) if softcap else (out, out)  # (read only under a cap)
        return BulkEstimate(query, scale, softcap, nodes, log_weights, out, decision, self.programmatic(query.device),
                            page_tops, self.spread_moments)

    def page_top_stretches(self, tail: FusedTail) -> int:
        """Page-top programs per (row, KV head) of a ``qada_tail`` step on ``tail``: its pages over
        :attr:`pages_per_program`; 1 (no page-top program: the decision bounds every page) for a page hierarchy,
        which bounds few pages, or a tail index of at most :attr:`pages_per_program` pages."""
        return 1 if tail.super_page else -(-tail.kmin.shape[2] // self.pages_per_program)

    def page_tops(self, step: DecodeStep, tail: FusedTail) -> PageTops | None:
        """The page-top programs of ``step``'s ``qada_tail`` decision on ``tail`` with new lists to fill, for the
        launch that writes ``log E[exp(s)]`` to carry (:meth:`bulk_estimate`) or a launch of their own; ``None``
        where there are none (:meth:`page_top_stretches` is 1)."""
        stretches = self.page_top_stretches(tail)
        if stretches == 1:
            return None
        query, key = step.query, step.keys
        b, H, d = query.shape
        H_kv = key.shape[1]
        constants = tail.kernel_constants(d)
        shape = (b * H_kv, stretches, _tile(H // H_kv), constants["BLOCK_M"])
        vals = torch.empty(shape, dtype=torch.float32, device=query.device)
        ids = torch.empty(shape, dtype=torch.int32, device=query.device)
        oks = torch.empty(shape, dtype=torch.int32, device=query.device)
        _, _, _, kmin, kmax, _ = tail.kernel_inputs(b, H_kv, key.shape[2], d)
        return PageTops(query, key, step.start, step.end, kmin, kmax, vals, ids, oks, float(step.scale),
                        step.window.t_sink, step.window.t_local, self.pages_per_program, constants["PAGE"],
                        constants["TOP"], page_top_tile(d, self.pages_per_program))

    def decides_in_estimate(self, tail_aware: bool = False) -> bool:
        """Whether the launch that writes each head's ``log E[exp(s)]`` also decides: the plain ``qada`` decision
        (not ``tail_aware``) made once per group (:attr:`decide_once`)."""
        return not tail_aware and self.decides_once()

    def estimate_decision(self, query: torch.Tensor, keys: torch.Tensor, start: torch.Tensor | None,
                          end: torch.Tensor | None, sinks: torch.Tensor | None, tau: float, policy: str,
                          window: Any) -> EstimateDecision:
        """The :class:`~qada.attention.moment_step.EstimateDecision` of a step (``query [b, H, d]``, ``keys [b, H_kv,
        C, d]``, the rows' bounds, the sink logits, the window) at ``tau`` with the group ``policy``: new flags."""
        b, H = query.shape[:2]
        input_precision, dot_fp32 = _score_precision(query.dtype)
        flags = tuple(torch.empty(b, H, dtype=torch.bool, device=query.device) for _ in range(3))
        read = torch.empty(b, keys.shape[1], dtype=torch.bool, device=query.device)
        return EstimateDecision(keys, start, end, sinks, math.log(tau) if tau > 0 else float("-inf"),
                                policy == "promote", window.t_sink, window.t_local, self.block_size, input_precision,
                                dot_fp32, *flags, read)

    def decide_and_attend(self, step: DecodeStep, tau: float, policy: str = "exact",
                          tail: FusedTail | None = None, budget: FusedBudget | None = None,
                          add_to: tuple[torch.Tensor, torch.Tensor] | None = None,
                          log_mean_exp: torch.Tensor | None = None,
                          decision: EstimateDecision | None = None,
                          page_tops: PageTops | None = None, moment_rider: Any = None) -> FusedLaunch:
        """The ``qada`` decision at ``tau`` with the group ``policy`` and the attention of ``step``, in two launches;
        with ``tail``, the ``qada_tail`` decision (:mod:`qada.attention._fused_tail_kernel`), whose split launch
        also makes the step's key join its page in ``tail``'s extrema (in place, as
        :func:`~qada.criteria.tail_index.append_step_key` does); with ``tail`` and ``budget``, the
        ``qada_tail_budget`` decision (``tau`` unused) in three launches: the tail kernel writes each head's score
        (one program per (row, KV head), or per query head: :attr:`heads_apart`), then the ``triton`` split launch,
        each of whose programs ranks its row's heads (:class:`~qada.attention.triton_decode.BudgetRank`: no launch
        of its own), and the combine launch; with ``budget`` alone, the ``qada_budget`` decision so
        (:meth:`_budget_decision`: eq. 7's scores).

        Reads ``step.query [b, H, d]``, ``keys, values [b, H_kv, C, d]``, ``start``, ``end``, the window, the scale,
        ``softcap``, ``sink_logits [H]`` and ``step.bulk_moments`` (mean ``[b, H_kv, d]``, cov ``[b, H_kv, d, d]``,
        the bulk of each row as :attr:`~qada.step.DecodeStep.t_bulk` counts it). ``add_to``: ``(sums [L, 5], layer)``,
        the combine launch adds the statistics row to ``sums[layer]`` (:class:`~qada.attention.StepStatistics`).
        ``log_mean_exp``: ``[b, H]`` float32 (contiguous), each query head's ``log E[exp(s)]`` from those moments
        (the ``out`` of the :meth:`bulk_estimate` the moment step's launch filled); ``None``: one launch more makes it
        (:func:`~qada.attention.moment_step.estimate_launch`). Where the plain ``qada`` decision is made once
        (:meth:`decides_in_estimate`), that launch makes it: ``decision`` is the one the moment step's launch made
        (:meth:`estimate_decision`), or, ``None``, one estimate launch makes both (``log_mean_exp`` unused); then
        the ``triton`` split and combine launches. A ``qada_tail`` step whose pages are spread over page-top
        programs (:meth:`page_tops`) has them run by the launch that writes ``log_mean_exp``: ``page_tops`` are those
        it ran (:meth:`bulk_estimate`); ``None`` with ``log_mean_exp``: a launch of their own runs them now.
        ``moment_rider``: with :attr:`estimate_in_splits`, the moment step for the next decode step that the combine
        launch runs besides (:class:`~qada.attention.moment_step.MomentRider`, :mod:`qada.attention._ahead_kernel`),
        or ``None``.
        """
        query, key, value = step.query, step.keys, step.values
        check_triton_runtime(query.device, query.dtype, "triton_fused")
        from qada.attention import _fused_kernel, _triton_kernel

        mean, cov = step.bulk_moments
        b, H, d = query.shape
        H_kv, C = key.shape[1], key.shape[2]
        G = H // H_kv
        if mean.shape != (b, H_kv, d) or cov.shape != (b, H_kv, d, d):
            raise ValueError(f"expected moments mean [{b}, {H_kv}, {d}] and cov [{b}, {H_kv}, {d}, {d}] but got mean "
                             f"{tuple(mean.shape)} and cov {tuple(cov.shape)}")
        if budget is not None and tail is None:
            if decision is not None or page_tops is not None:
                raise ValueError("a qada_budget step ranks eq. 7's scores in launches of its own: no decision made "
                                 "with the estimate and no page-top programs")
            return self._budget_decision(step, budget, policy, add_to, log_mean_exp)
        if self.decides_in_estimate(tail is not None):
            return self._decided_in_estimate(step, tau, policy, add_to, decision)
        if decision is not None:
            raise ValueError("a decision made with the estimate is the plain 'qada' one made once per group "
                             "(decide_once=True, no tail index): this call decides in its own launches")
        if page_tops is not None and (tail is None or log_mean_exp is None):
            raise ValueError("page_tops are the page-top programs of a qada_tail step that the launch writing "
                             "log_mean_exp ran: pass the tail index and log_mean_exp with them")
        spread = page_tops  # the step's page-top programs: run already (page_tops), or to run (made now)
        if tail is not None and page_tops is None:
            spread = self.page_tops(step, tail)
        if page_tops is not None and page_tops.stretches != self.page_top_stretches(tail):
            raise ValueError(f"expected page_tops of {self.page_top_stretches(tail)} stretches for this tail index "
                             f"and pages_per_program={self.pages_per_program} but got {page_tops.stretches}")
        in_splits = self.estimates_in_splits(tail, budget)
        if moment_rider is not None and not in_splits:
            raise ValueError("a moment step riding in the combine launch steps the moments ahead of a split launch "
                             "that computes the estimate from them: estimate_in_splits=True, a plain qada decision")
        if in_splits:
            if log_mean_exp is not None:
                raise ValueError("with estimate_in_splits the split launch computes log_mean_exp itself: pass None")
        elif log_mean_exp is None:  # (one estimate launch, which runs the page-top programs too)
            log_mean_exp = estimate_launch(self.bulk_estimate(query, step.scale, step.softcap, page_tops=spread),
                                           step.bulk_moments)
            page_tops = spread
        elif (log_mean_exp.shape != (b, H) or log_mean_exp.dtype != torch.float32
              or not log_mean_exp.is_contiguous()):
            raise ValueError(f"expected log_mean_exp as a contiguous float32 tensor of shape [{b}, {H}] but got "
                             f"{log_mean_exp.dtype} {tuple(log_mean_exp.shape)}")
        input_precision, dot_fp32 = _score_precision(query.dtype)
        BLOCK_G, BLOCK_D = _tile(G), _tile(d)
        pairs = b * H_kv
        apart = budget is not None or self.decides_once(tail)  # a decision launch of its own, then the triton ones
        S = 1 if apart else self.splits(query.device, pairs, C)  # a decision launch: one per group
        device = query.device
        f32 = dict(dtype=torch.float32, device=device)
        acc = torch.empty(pairs, S, G, d, **f32)
        m = torch.empty(pairs, S, G, **f32)
        l = torch.empty(pairs, S, G, **f32)
        counts = torch.empty(pairs, S, 2, dtype=torch.int32, device=device)
        # decided, local, broken: three tensors, not views of one (a kernel writing views of a tensor would make
        # torch.compile copy and scatter them back)
        # (bool, written by the kernels as bytes: no dtype view, which Inductor cannot lower for bool)
        flags = tuple(torch.empty(b, H, dtype=torch.bool, device=device) for _ in range(3))
        read = torch.empty(b, H_kv, dtype=torch.bool, device=device)
        start, end = step.start, step.end
        softcap, sinks = step.softcap, step.sink_logits
        window = step.window
        log_tau = math.log(tau) if tau > 0 else float("-inf")
        common = dict(G=G, D=d, BLOCK_G=BLOCK_G, BLOCK_N=self.block_size, BLOCK_D=BLOCK_D,
                      HAS_START=start is not None, HAS_END=end is not None, HAS_SINKS=sinks is not None,
                      PROMOTE=policy == "promote",
                      INPUT_PRECISION=input_precision, DOT_FP32=dot_fp32, SOFTCAP=bool(softcap),
                      num_warps=self.num_warps, num_stages=self.num_stages)
        inputs = (query, key, value, m if in_splits else log_mean_exp, query if start is None else start,
                  query if end is None else end, query if sinks is None else sinks)
        outputs = (acc, m, l, counts, flags[0], flags[1], read, flags[2])
        strides = (*query.stride(), *key.stride(), *value.stride())
        sizes = (C, H_kv, window.t_sink, window.t_local, S, float(step.scale),
                 float(step.scale) * (1.0 if softcap else _LOG2E), float(softcap or 1.0), log_tau)
        log_ratio = n_exact = extra = None
        # the score launch of a budget, or a qada_tail decision launched apart: one program per query head?
        heads_apart = apart and tail is not None and self.launches_heads_apart(device, b * H)
        grid = (pairs, G if heads_apart else S)
        pdl = self.programmatic(device)  # each launch below may start while the one before it runs
        if tail is None:  # (the decision made in every split: not apart)
            estimate_args, estimate_constants = self._split_estimate(step, in_splits, m)
            _triton_kernel.run(_fused_kernel.qada_fused_split_kernel, grid, *inputs, *outputs, *strides,
                               *sizes, *estimate_args, **common, **estimate_constants, **pdl_launch_options(pdl))
        else:
            from qada.attention import _fused_tail_kernel

            log_ratio = torch.empty(b, H, **f32)
            n_exact = torch.empty(b, H, dtype=torch.int32, device=device)
            n_pages = tail.kmin.shape[2]
            # the page bounds spread over page-top programs (:meth:`page_tops`), for a decision launched apart as for
            # one made in every split (each then merges the lists instead of bounding every page itself): run by the
            # launch that wrote log_mean_exp, else by a launch of their own now
            stretches = 1 if spread is None else spread.stretches
            tail_inputs, constants = tail.kernel_inputs(b, H_kv, C, d), tail.kernel_constants(d)
            supers = tail.super_inputs(b, H_kv, C, d)
            cap = tail.register_cap(query.dtype, d, self.num_warps) if self.cap_registers else {}
            candidates = (m, m, m)
            if spread is not None:
                candidates = (page_tops if page_tops is not None else self._launch_page_tops(spread)).lists()
            if tail.attend_exact:  # each head's attention over E, merged into the local heads' by the combine
                extra = ExtraAttention(torch.empty(b, H, **f32), torch.empty(b, H, **f32),
                                       torch.empty(b, H, d, **f32), flags[1])
            _triton_kernel.run(_fused_tail_kernel.qada_tail_fused_split_kernel, grid, *inputs, *tail_inputs,
                               *candidates, *supers, *outputs, log_ratio, n_exact,
                               *((extra.m, extra.l, extra.acc) if extra is not None else (m, m, m)), *strides,
                               *tail.kernel_strides(), *sizes, tail.heavy.shape[2], n_pages, stretches,
                               tail.n_super(), CANDIDATES=stretches > 1,
                               SCORE=budget is not None,  # SCORE: the heads' scores, the budget decides
                               ATTEND=not apart, TOKEN_STAGES=TOKEN_STAGES if apart or stretches > 1 else 1,
                               HEADS_APART=heads_apart,
                               **common,
                               **constants, **tail.split_constants(), **cap,
                               **pdl_launch_options(pdl and stretches == 1))  # (not with page-top lists: merged first)
        tail_reads = None if tail is None else tail.reads()
        statistics = StepStatistics.of(step, flags[1], read, flags[2], tail_reads, add_to)
        row = statistics.row
        if apart:  # the triton executor's two launches on the decision just made (a budget: ranked in the split)
            rank = None if budget is None else budget.rank(log_ratio, policy, flags)
            heads = HeadsDecided(flags[0], policy == "promote") if heads_apart and budget is None else None
            done = self.launch(step, GroupDecision(flags[1], read), statistics, pdl, extra, rank, heads)
            return FusedLaunch(done.output, done.bulk_blocks, flags[0], flags[1], read, flags[2], done.counts,
                               log_ratio, n_exact, row)
        output, bulk_blocks = combine(query, acc, m, l, counts, sinks, statistics, pdl, extra, moment_rider)
        return FusedLaunch(output, bulk_blocks, flags[0], flags[1], read, flags[2], counts, log_ratio, n_exact, row)

    def _split_estimate(self, step: DecodeStep, in_splits: bool, placeholder: torch.Tensor) -> tuple[tuple, dict]:
        """The plain ``qada`` split kernel's estimate arguments (``MEAN, COV, GH_X, GH_LOGW``, the moments' strides,
        ``n_nodes``) and constants (``ESTIMATE``, ``BLOCK_T``, ``BLOCK_E``, ``BLOCK_X``): ``step``'s moments where
        the splits compute the estimate (``in_splits``), ``placeholder`` (never read) where they read it."""
        if not in_splits:
            return (placeholder,) * 4 + (0,) * 7 + (1,), dict(ESTIMATE=False, BLOCK_T=16, BLOCK_E=16, BLOCK_X=16)
        mean, cov = step.bulk_moments
        query = step.query
        d = query.shape[2]
        G = query.shape[1] // mean.shape[1]
        nodes, log_weights = self.hermite_rule(query.device) if step.softcap else (placeholder, placeholder)
        sizes = block_sizes(d, G)
        return ((mean, cov, nodes, log_weights, *mean.stride(), *cov.stride(), nodes.shape[0]),
                dict(ESTIMATE=True, BLOCK_T=sizes["BLOCK_T"], BLOCK_E=sizes["BLOCK_E"], BLOCK_X=_tile(nodes.shape[0])))

    def _budget_decision(self, step: DecodeStep, budget: FusedBudget, policy: str,
                         add_to: tuple[torch.Tensor, torch.Tensor] | None,
                         log_mean_exp: torch.Tensor | None) -> FusedLaunch:
        """The ``qada_budget`` decision (:class:`~qada.criteria.BudgetedQAdACriterion`, eq. 7's scores ranked) and
        the attention: a launch of one program per (row, KV head) writes each head's score
        (:func:`~qada.attention._fused_budget_kernel.qada_budget_score_kernel`, from ``log_mean_exp``, the moment step
        launch's ``[b, H]``; ``None``: one estimate launch more makes it), then the ``triton`` executor's split launch,
        which ranks them (:meth:`FusedBudget.rank`), and its combine launch."""
        from qada.attention import _fused_budget_kernel, _triton_kernel

        query, key = step.query, step.keys
        b, H, d = query.shape
        H_kv, C = key.shape[1], key.shape[2]
        G = H // H_kv
        if log_mean_exp is None:
            log_mean_exp = estimate_launch(self.bulk_estimate(query, step.scale, step.softcap), step.bulk_moments)
        elif (log_mean_exp.shape != (b, H) or log_mean_exp.dtype != torch.float32
              or not log_mean_exp.is_contiguous()):
            raise ValueError(f"expected log_mean_exp as a contiguous float32 tensor of shape [{b}, {H}] but got "
                             f"{log_mean_exp.dtype} {tuple(log_mean_exp.shape)}")
        device = query.device
        score = torch.empty(b, H, dtype=torch.float32, device=device)
        flags = tuple(torch.empty(b, H, dtype=torch.bool, device=device) for _ in range(3))  # decided, local, broken
        read = torch.empty(b, H_kv, dtype=torch.bool, device=device)
        start, end, sinks, softcap = step.start, step.end, step.sink_logits, step.softcap
        input_precision, dot_fp32 = _score_precision(query.dtype)
        _triton_kernel.run(
            _fused_budget_kernel.qada_budget_score_kernel, (b * H_kv,),
            query, key, log_mean_exp, query if start is None else start, query if end is None else end,
            query if sinks is None else sinks, score, *query.stride(), *key.stride(),
            C, H_kv, step.window.t_sink, step.window.t_local, float(step.scale), float(softcap or 1.0),
            G=G, D=d, BLOCK_G=_tile(G), BLOCK_N=self.block_size, BLOCK_D=_tile(d), HAS_START=start is not None,
            HAS_END=end is not None, SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None,
            INPUT_PRECISION=input_precision, DOT_FP32=dot_fp32, num_warps=self.num_warps,
        )  # fmt: skip
        statistics = StepStatistics.of(step, flags[1], read, flags[2], add_to=add_to)
        done = self.launch(step, GroupDecision(flags[1], read), statistics, self.programmatic(device),
                           rank=budget.rank(score, policy, flags))
        return FusedLaunch(done.output, done.bulk_blocks, flags[0], flags[1], read, flags[2], done.counts, score, None,
                           statistics.row)

    def _decided_in_estimate(self, step: DecodeStep, tau: float, policy: str,
                             add_to: tuple[torch.Tensor, torch.Tensor] | None,
                             decision: EstimateDecision | None) -> FusedLaunch:
        """The plain ``qada`` decision made once per group by the launch that writes ``log E[exp(s)]``
        (``decision``, or one :func:`~qada.attention.moment_step.estimate_launch` now), then the ``triton``
        executor's split and combine launches on it."""
        if decision is None:
            decision = self.estimate_decision(step.query, step.keys, step.start, step.end, step.sink_logits, tau,
                                              policy, step.window)
            estimate_launch(self.bulk_estimate(step.query, step.scale, step.softcap, decision), step.bulk_moments)
        b, H = step.query.shape[:2]
        for name in ("decided", "local", "broken"):
            flag = getattr(decision, name)
            if flag.shape != (b, H) or flag.dtype != torch.bool:
                raise ValueError(f"expected the decision's {name} as a bool tensor of shape [{b}, {H}] but got "
                                 f"{flag.dtype} {tuple(flag.shape)}")
        statistics = StepStatistics.of(step, decision.local, decision.read, decision.broken, add_to=add_to)
        done = self.launch(step, GroupDecision(decision.local, decision.read), statistics,
                           self.programmatic(step.query.device))
        return FusedLaunch(done.output, done.bulk_blocks, decision.decided, decision.local, decision.read,
                           decision.broken, done.counts, None, None, statistics.row)

    def estimates_in_splits(self, tail: FusedTail | None = None, budget: FusedBudget | None = None) -> bool:
        """Whether the split launch computes each head's ``log E[exp(s)]`` itself (:attr:`estimate_in_splits`): a
        plain ``qada`` decision (no ``tail``, no ``budget``) made in the splits."""
        return self.estimate_in_splits and tail is None and budget is None and not self.decides_once(None)

    def decides_once(self, tail: FusedTail | None = None) -> bool:
        """Whether a threshold decision (``tail``: a ``qada_tail`` one) is a launch of its own (:attr:`decide_once`,
        or by default whether the tail index has more than :attr:`pages_per_program` pages)."""
        if self.decide_once is not None:
            return self.decide_once
        return tail is not None and tail.bounded_pages() > self.pages_per_program

    def _launch_page_tops(self, page_tops: PageTops) -> PageTops:
        """The page-top launch of its own: ``page_tops.stretches`` programs per (row, KV head), each filling its
        stretch's lists (:func:`~qada.attention._fused_tail_kernel.qada_tail_page_top_kernel`); for a step whose
        ``log E[exp(s)]`` was written without them. Returns ``page_tops``."""
        from qada.attention import _fused_tail_kernel, _triton_kernel

        page_tops.check()
        _triton_kernel.run(_fused_tail_kernel.qada_tail_page_top_kernel, (page_tops.vals.shape[0], page_tops.stretches),
                           *page_tops.kernel_args(), **page_tops.kernel_constants(), num_warps=self.num_warps)
        return page_tops
