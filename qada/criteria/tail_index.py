""":class:`TailIndex`: what the tail-aware criteria keep per layer between decode steps (issue 23).

Built at the prefill, kept current while decoding, on the device and updated in place (no host sync on a
preallocated cache, nothing made in a step kept past it):

* the **heavy set**: per row and KV head, the ``k`` bulk slots the prompt's last ``observe`` queries attend to
  most (SnapKV's votes, :func:`~qada.functional.tail.heavy_votes`), ``[b, H_kv, k]``, with a membership map
  ``[b, H_kv, C]`` so that a page never counts a heavy token twice;
* the **page extrema**: elementwise min and max of the keys of every page of ``P`` slots, ``[b, H_kv, C / P, d]``
  float32; the key written at each decode step joins its page;
* with a hierarchy (``super_page = S > 0``), the same extrema of every *super-page* of ``S`` pages (``S P`` slots),
  ``[b, H_kv, C / (S P), d]``: a step bounds the super-pages first and the pages inside the best ones only.

Slots are the cache's own (``C``: the buffer's capacity on a preallocated cache, the filled length on a growing one,
whose arrays then grow with it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from qada.functional.tail import extrema_dtype, heavy_votes, page_extrema, page_halves, update_page_extrema
from qada.functional.window import bulk_mask
from qada.stable_tensors import write_into
from qada.window import Window

__all__ = ["LAYER_FIELDS", "LayerTail", "TailIndex", "append_step_key"]


#: The tensors of :class:`LayerTail`, in order (the last three only with a hierarchy).
LAYER_FIELDS = ("heavy", "heavy_valid", "member", "kmin", "kmax", "halves", "super_kmin", "super_kmax", "super_halves")


@dataclass
class LayerTail:
    """One layer's state: ``heavy [b, H_kv, k]`` long slots, ``heavy_valid [b, H_kv, k]``, ``member [b, H_kv, C]``
    bool, ``kmin / kmax [b, H_kv, n_pages, d]`` (float32, or a 16-bit cache's dtype:
    :func:`~qada.functional.tail.extrema_dtype`) and their float32 ``halves [b, H_kv, n_pages, 2d]``
    (:func:`~qada.functional.tail.page_halves`: what a step's page bounds read); with a hierarchy the super-pages'
    ``super_kmin / super_kmax [b, H_kv, n_super, d]`` and ``super_halves [b, H_kv, n_super, 2d]`` (else ``None``)."""

    heavy: torch.Tensor
    heavy_valid: torch.Tensor
    member: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor
    halves: torch.Tensor
    super_kmin: torch.Tensor | None = None
    super_kmax: torch.Tensor | None = None
    super_halves: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return self.member.shape[2]

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every field, in order (the tensors themselves, not copies)."""
        return tuple(getattr(self, f.name) for f in fields(self))


class TailIndex:
    """Per layer :class:`LayerTail`, fed by the run's prefill and decode steps.

    Args:
        heavy: ``k``, heavy tokens per KV head (0: no heavy set).
        observe: the prompt's last queries that vote for the heavy set (SnapKV's observation window).
        page_size: slots per page ``P``.
        super_page: pages per super-page ``S`` (0: no hierarchy).
    """

    def __init__(self, heavy: int, observe: int, page_size: int, super_page: int = 0) -> None:
        self.heavy, self.observe, self.page_size, self.super_page = heavy, observe, page_size, super_page
        self.layers: dict[int, LayerTail] = {}

    def prefill(self, layer: int, keys: torch.Tensor, queries: torch.Tensor | None, scale: float | None,
                start: torch.Tensor | None, window: Window, capacity: int | None = None,
                heavy_size: int | None = None) -> None:
        """After the prefill of ``layer``: ``keys [b, H_kv, T, d]`` filled, ``queries [b, H, T, d]`` (or ``None``:
        no heavy set, e.g. a cache prefilled elsewhere), ``capacity``: a preallocated cache's slots, ``heavy_size``:
        the heavy set's size for this cache (default the index's)."""
        b, H_kv, T, d = keys.shape
        slots = capacity if capacity is not None else T
        kmin, kmax = _grown_extrema(keys, self.page_size, slots)
        supers = _grown_extrema(keys, self.super_slots, slots) if self.super_page else (None, None)
        k = self.heavy if heavy_size is None else heavy_size
        member = torch.zeros(b, H_kv, slots, dtype=torch.bool, device=keys.device)
        if k == 0 or queries is None or scale is None:
            heavy = torch.zeros(b, H_kv, max(k, 1), dtype=torch.long, device=keys.device)
            valid = torch.zeros_like(heavy, dtype=torch.bool)
        else:
            w = min(self.observe, queries.shape[2])  # the prompt's last queries (a resumed chunk: its own)
            positions = torch.arange(T - w, T, device=keys.device)
            votes = heavy_votes(queries[:, :, -w:], keys, scale, positions, start)  # [b, H_kv, T]
            if start is not None:
                start = start.to(keys.device)
            bulk = bulk_mask(T, window.t_local, window.t_sink, start, device=keys.device).expand(b, T)
            votes = votes.masked_fill(~bulk[:, None], float("-inf"))
            kk = min(k, T)
            top, heavy = votes.topk(kk, dim=-1)
            valid = torch.isfinite(top)
            if kk < k:  # a prompt shorter than k: the missing places stay invalid
                pad = k - kk
                heavy = torch.cat([heavy, heavy.new_zeros(b, H_kv, pad)], -1)
                valid = torch.cat([valid, valid.new_zeros(b, H_kv, pad)], -1)
            member.scatter_(2, heavy, valid)
        state = LayerTail(heavy, valid, member, kmin, kmax, page_halves(kmin, kmax), *supers,
                          None if supers[0] is None else page_halves(*supers))
        kept = self.layers.get(layer)  # an earlier sequence's tensors are rewritten in place: a CUDA graph reads them
        held = None if kept is None else kept.tensors()
        if write_into(held, state.tensors()) is not held:  # nothing of this layout kept
            self.layers[layer] = state

    @property
    def super_slots(self) -> int:
        """Slots per super-page, ``S P``."""
        return self.super_page * self.page_size

    def layer_state(self, layer: int, slots: int) -> dict[str, torch.Tensor]:
        """The tensors of ``layer`` for a cache of ``slots`` slots (a growing cache grows them first, doubling):
        ``heavy``, ``heavy_valid``, ``member``, ``kmin``, ``kmax``, ``halves`` (:class:`LayerTail`)."""
        state = self.layers.get(layer)
        if state is None:
            raise RuntimeError(f"layer {layer}: no prefill seen (the tail-aware criteria build their index at the "
                               "prefill; decode through a run attached before it)")
        if slots > state.slots:
            state = self._grown(layer, state, slots)
        names = LAYER_FIELDS if state.super_halves is not None else LAYER_FIELDS[:6]
        return {name: getattr(state, name) for name in names}

    def _grown(self, layer: int, state: LayerTail, slots: int) -> LayerTail:
        """``state`` grown to at least ``slots`` slots (new pages empty), kept as ``layer``'s."""
        slots = max(slots, 2 * state.slots)  # amortised: the arrays double
        n_pages = -(-slots // self.page_size)
        member = torch.cat([state.member, state.member.new_zeros(*state.member.shape[:2], slots - state.slots)], 2)
        kmin, kmax = _grow(state.kmin, n_pages, float("inf")), _grow(state.kmax, n_pages, float("-inf"))
        supers: tuple = (None, None, None)
        if state.super_kmin is not None:
            n_super = -(-slots // self.super_slots)
            low, high = _grow(state.super_kmin, n_super, float("inf")), _grow(state.super_kmax, n_super, float("-inf"))
            supers = (low, high, page_halves(low, high))
        grown = LayerTail(state.heavy, state.heavy_valid, member, kmin, kmax, page_halves(kmin, kmax), *supers)
        self.layers[layer] = grown
        return grown


def _grown_extrema(keys: torch.Tensor, page_size: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~qada.functional.tail.page_extrema` of ``keys`` padded to the pages of ``slots`` slots, in
    :func:`~qada.functional.tail.extrema_dtype`."""
    kmin, kmax = (x.to(extrema_dtype(keys.dtype)) for x in page_extrema(keys, page_size))
    n_pages = -(-slots // page_size)
    return _grow(kmin, n_pages, float("inf")), _grow(kmax, n_pages, float("-inf"))


def _grow(extrema: torch.Tensor, n_pages: int, fill: float) -> torch.Tensor:
    """``extrema [b, H_kv, n, d]`` padded with ``fill`` to ``n_pages`` pages."""
    b, H_kv, n, d = extrema.shape
    if n >= n_pages:
        return extrema
    return torch.cat([extrema, extrema.new_full((b, H_kv, n_pages - n, d), fill)], 2)


def append_step_key(state: dict[str, torch.Tensor], keys: torch.Tensor, end: torch.Tensor | None,
                    page_size: int, super_page: int = 0) -> None:
    """In place: the decode step's key (slot ``end - 1`` of ``keys [b, H_kv, C, d]``; the last slot without ``end``)
    joins its page's extrema in ``state`` (:meth:`TailIndex.layer_state`), and its super-page's with a hierarchy
    (``super_page`` pages each). No host read."""
    b, H_kv, C, d = keys.shape
    if end is None:
        slot = torch.full((b,), C - 1, dtype=torch.long, device=keys.device)
    else:
        slot = (end - 1).clamp(min=0)
    key = keys.gather(2, slot.view(b, 1, 1, 1).expand(b, H_kv, 1, d))[:, :, 0]
    update_page_extrema(state["kmin"], state["kmax"], key, slot, page_size, state["halves"])
    if super_page:
        update_page_extrema(state["super_kmin"], state["super_kmax"], key, slot, super_page * page_size,
                            state["super_halves"])
