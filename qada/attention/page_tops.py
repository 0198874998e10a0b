"""The page-top programs of a ``qada_tail`` step: each query head's top pages of one stretch of a row's pages, by
bound, before the decision merges the stretches' lists (:func:`~qada.attention._fused_tail_kernel.page_top_program`).

Where a row's bulk spans more pages than the ``triton_fused`` executor's ``pages_per_program``, its page bounds are
spread over ``stretches`` programs per (row, KV head). Those programs read the queries, the step's key and the page
extrema, and nothing the moment step writes, so the launch that steps the moments and writes ``log E[exp(s)]``
(:mod:`qada.attention.moment_step`) carries them after its own programs: its grid grows from ``(pairs, own)`` to
``(pairs, own + stretches)`` (``own``: the moment step's block pairs, or the estimate's one program), and program
``(pair, own + s)`` finds stretch ``s``'s top pages. A layer's ``qada_tail`` step then takes the launches of a
``qada`` one (moment step, split, combine) instead of one more. A :class:`PageTops` describes the work and where its
lists go; :func:`rider_args` gives a moment kernel its arguments (none: placeholders and ``PAGE_TOPS=False``, the
branch compiled away).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from qada.attention.triton_decode import _tile

__all__ = ["PageTops", "rider_args"]


class PageTops(NamedTuple):
    """The page-top programs of one layer's ``qada_tail`` step and the lists they fill.

    Attributes:
        query: ``[b, H, d]`` the step's queries; keys: ``[b, H_kv, C, d]`` the layer's cache (the step's key at
            ``end - 1``).
        start, end: ``[b]`` the rows' bounds, or ``None`` (0, and ``C``).
        kmin, kmax: ``[b, H_kv, n_pages, d]`` the tail index's page extrema (same strides).
        vals, ids, oks: ``[pairs, stretches, BLOCK_G, BLOCK_M]`` float32, int32, int32 (contiguous): filled with each
            stretch's lists (rank, page, valid) for the decision to merge.
        scale: the attention scale; t_sink, t_local: the window; pages_per_program: pages per stretch.
        page, top, block_p: pages of ``page`` slots, ``top`` per query head, bounded in tiles of ``block_p``.
    """

    query: torch.Tensor
    keys: torch.Tensor
    start: torch.Tensor | None
    end: torch.Tensor | None
    kmin: torch.Tensor
    kmax: torch.Tensor
    vals: torch.Tensor
    ids: torch.Tensor
    oks: torch.Tensor
    scale: float
    t_sink: int
    t_local: int
    pages_per_program: int
    page: int
    top: int
    block_p: int

    @property
    def stretches(self) -> int:
        """Page-top programs per (row, KV head)."""
        return self.vals.shape[1]

    def lists(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(vals, ids, oks)``, what the decision merges."""
        return self.vals, self.ids, self.oks

    def kernel_args(self) -> tuple:
        """The positional arguments of :func:`~qada.attention._fused_tail_kernel.qada_tail_page_top_kernel` (a
        rider's, after the moment kernel's own)."""
        query, keys = self.query, self.keys
        start = query if self.start is None else self.start
        end = query if self.end is None else self.end
        return (query, keys, start, end, self.kmin, self.kmax, self.vals, self.ids, self.oks, *query.stride(),
                *keys.stride(), *self.kmin.stride(), keys.shape[2], keys.shape[1], self.t_sink, self.t_local,
                float(self.scale), self.kmin.shape[2], self.pages_per_program, self.stretches)

    def kernel_constants(self, prefix: str = "") -> dict[str, Any]:
        """The constants of the page-top programs, each name with ``prefix`` (a rider's: ``"PT_"``)."""
        _, H, d = self.query.shape
        G = H // self.keys.shape[1]
        constants = dict(G=G, D=d, BLOCK_G=self.vals.shape[2], BLOCK_D=_tile(d), BLOCK_P=self.block_p,
                         PAGE=self.page, TOP=self.top, BLOCK_M=self.vals.shape[3], HAS_START=self.start is not None,
                         HAS_END=self.end is not None)
        return {prefix + name: value for name, value in constants.items()}

    def check(self) -> None:
        """Raise ``ValueError`` unless the lists fit the step: ``[b * H_kv, stretches, BLOCK_G, BLOCK_M]``,
        contiguous, float32 / int32 / int32."""
        b, H_kv = self.keys.shape[:2]
        for name, tensor, dtype in (("vals", self.vals, torch.float32), ("ids", self.ids, torch.int32),
                                    ("oks", self.oks, torch.int32)):
            if (tensor.dim() != 4 or tensor.shape[:2] != (b * H_kv, self.stretches) or tensor.dtype != dtype
                    or not tensor.is_contiguous()):
                raise ValueError(f"expected the page-top lists' {name!r} as a contiguous {dtype} tensor of shape "
                                 f"[{b * H_kv}, {self.stretches}, BLOCK_G, BLOCK_M] but got {tensor.dtype} "
                                 f"{tuple(tensor.shape)}")


_NO_RIDER_CONSTANTS = dict(PT_G=1, PT_D=16, PT_BLOCK_G=16, PT_BLOCK_D=16, PT_BLOCK_P=8, PT_PAGE=1, PT_TOP=1,
                           PT_BLOCK_M=2, PT_HAS_START=False, PT_HAS_END=False)
"""A moment kernel's page-top constants when its launch carries no page-top programs (never read)."""


def rider_args(page_tops: PageTops | None, placeholder: torch.Tensor) -> tuple[tuple, dict[str, Any], int]:
    """What a moment step's launch (:mod:`qada.attention.moment_step`) passes for ``page_tops``: ``(positional
    arguments after its own, constants (``PAGE_TOPS`` and the ``PT_`` ones), page-top programs per (row, KV head),
    after the launch's own)``; with none, ``placeholder`` for every tensor and no program."""
    if page_tops is None:
        sizes = (1, 1, 0, 0, 1.0, 1, 1, 1)  # (C, H_kv, t_sink, t_local, scale, pages, per program, stretches)
        return (placeholder,) * 9 + (0,) * 11 + sizes, {"PAGE_TOPS": False, **_NO_RIDER_CONSTANTS}, 0
    page_tops.check()
    return page_tops.kernel_args(), {"PAGE_TOPS": True, **page_tops.kernel_constants("PT_")}, page_tops.stretches
