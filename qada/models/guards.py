"""Cache and position guards: the moment state of a run follows a cache that grows by one key per decode step.

:class:`CacheGuard` refuses what it cannot follow, with a message that names it: a decode step without a
prefill seen by qada, a cache that was cropped or grew by more than one key (assisted decoding), rows that were
reordered between steps (beam search) while a moment source keeps per-row state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["CacheGuard", "StaleStateError", "UnsupportedModelError", "bounds_by_min_max", "buffer_row_bounds",
           "check_contiguous_rows", "mask_filled_length", "row_bounds", "row_starts"]


class UnsupportedModelError(ValueError):
    """The model (or this use of it) is outside what the wrapper supports; the message names the problem."""


class StaleStateError(RuntimeError):
    """The cache changed in a way the moment state cannot follow (cropping, reordering, multi-token decode)."""


def _last_query_allowed(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b, T]`` bool: the keys the last query of each row may attend to (bool or additive 4D mask)."""
    last_query = attention_mask[:, 0, -1, :]
    return last_query if last_query.dtype == torch.bool else last_query == 0


def row_starts(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """``[b]`` index of each row's first attended key from a 4D mask ``[b, 1, q, T]`` (bool or additive)."""
    if attention_mask is None:
        return None
    if attention_mask.ndim != 4 or attention_mask.shape[-1] != length:
        raise UnsupportedModelError(
            f"expected a 4D attention mask [batch, 1, q, {length}] but got shape {tuple(attention_mask.shape)}"
        )
    return _last_query_allowed(attention_mask).to(torch.int8).argmax(-1)


def row_bounds(
    attention_mask: torch.Tensor | None, key_len: int, position_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """``(start [b], end [b])`` of each row's tokens in a preallocated cache of ``key_len`` slots, as device
    tensors (no host sync): the first and one past the last key the row's last query may attend to, from a 4D
    mask ``[b, 1, q, >= key_len]`` (bool or additive). Without a mask (no padding) ``start`` is ``None`` and
    ``end = position_ids[:, -1] + 1``; ``None`` when neither is given."""
    if attention_mask is None:
        if position_ids is None:
            return None
        return None, position_ids[:, -1].to(torch.long) + 1
    if attention_mask.ndim != 4:
        raise UnsupportedModelError(
            f"expected a 4D attention mask [batch, 1, q, {key_len}] but got shape {tuple(attention_mask.shape)}"
        )
    allowed = _last_query_allowed(attention_mask[..., :key_len])  # [b, key_len]
    if torch.compiler.is_compiling():
        return bounds_by_min_max(allowed)
    allowed = allowed.to(torch.int8)
    start = allowed.argmax(-1)
    end = key_len - allowed.flip(-1).argmax(-1)
    return start, end


def buffer_row_bounds(attention_mask: torch.Tensor | None, key_len: int,
                      position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`row_bounds` of a decode step on a preallocated cache, which needs them: raises
    :class:`UnsupportedModelError` when the step has neither a mask nor positions."""
    bounds = row_bounds(attention_mask, key_len, position_ids)
    if bounds is None:
        raise UnsupportedModelError(
            "a decode step on a preallocated cache came without an attention mask and without position_ids: "
            "qada cannot tell where the rows end"
        )
    return bounds


def bounds_by_min_max(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_bounds` of ``allowed [b, T]`` bool by a min and a max over the slots, as traced: compiled for the
    CPU into a model that computes it once per layer (:mod:`qada.models.inline_step`), the argmax of the int8 mask
    took ~0.25 ms per layer in place; eagerly it is a few more operations. A row that sees no key: ``(0, T)``, as the
    argmax gives."""
    T = allowed.shape[-1]
    slots = torch.arange(T, device=allowed.device)
    start = torch.where(allowed, slots, T).amin(-1).remainder(T)
    end = torch.where(allowed, slots + 1, 0).amax(-1)
    return start, torch.where(end > 0, end, T)


def check_contiguous_rows(attention_mask: torch.Tensor | None, length: int) -> None:
    """Raise :class:`UnsupportedModelError` when a row of the 4D mask ``[b, 1, q, >= length]`` lets its last query
    see keys that are not one contiguous run (a padding token inside a prompt, e.g. ``generate`` inferring the mask
    from a ``pad_token_id`` that also occurs in the text): qada's rows are ``[start, end)`` (left padding). A host
    sync: called once per prefill."""
    if attention_mask is None or attention_mask.ndim != 4:
        return
    allowed = _last_query_allowed(attention_mask[..., :length]).to(torch.int8)  # [b, T]
    count = allowed.sum(-1)
    start = allowed.argmax(-1)
    end = allowed.shape[-1] - allowed.flip(-1).argmax(-1)
    broken = ((end - start) != count) & (count > 0)
    if bool(broken.any()):
        row = int(broken.nonzero()[0, 0])
        raise UnsupportedModelError(
            f"row {row} of the attention mask hides tokens inside the row (padding that is not on the left, e.g. "
            "generate() inferring the mask from a pad_token_id that also occurs in the prompt): qada attends over "
            "each row's tokens from its first to its last; pass an explicit attention_mask (left padding only)"
        )


def mask_filled_length(attention_mask: torch.Tensor | None) -> int | None:
    """One past the last key any row's last query may attend to, from a 4D mask ``[b, 1, q, T]`` (bool or
    additive); ``None`` without a mask. A host sync: called once per prefill, not per decode step."""
    if attention_mask is None or attention_mask.ndim != 4:
        return None
    index = _last_query_allowed(attention_mask).any(0).nonzero()
    return int(index[-1]) + 1 if index.numel() else None


class CacheGuard:
    """Per-layer cache length and decode-step counter, and (optionally) a check that rows keep their order.

    Args:
        track_row_order: remember the newest key of the first layer and compare it at the next step (one host
            sync per decode step; only needed when a moment source keeps per-row state and batch > 1).
    """

    def __init__(self, track_row_order: bool = False) -> None:
        self.track_row_order = track_row_order
        # Buffer decoding (device tensors, kept across resets and prefills and rewritten in place, so that a
        # captured CUDA graph keeps writing the tensors that are read): the first layer's row ends, and a flag
        # set when a row did not grow by one key.
        self._last_end: torch.Tensor | None = None
        self._stale: torch.Tensor | None = None
        self.reset()

    def reset(self) -> None:
        self._length: dict[int, int] = {}
        self._step: dict[int, int] = {}
        self._newest_key: dict[int, torch.Tensor] = {}
        self._capacity: dict[int, int] = {}

    # --- decoding on a preallocated buffer (no host sync) --------------------------------------------------
    def buffer_capacity(self, layer: int) -> int | None:
        """Slots of ``layer``'s preallocated cache as seen at its prefill (``None``: a growing cache)."""
        return self._capacity.get(layer)

    def start_buffer(self, end: torch.Tensor) -> None:
        """Decoding on a preallocated buffer starts: the rows end at ``end [b]`` (after the prefill). Rewrites the
        previous sequence's tensors in place when the batch and device are the same."""
        end = end.detach().to(torch.long)
        if self._last_end is None or self._last_end.shape != end.shape or self._last_end.device != end.device:
            self._last_end = end.clone()
            self._stale = torch.zeros((), dtype=torch.bool, device=end.device)
        else:
            self._last_end.copy_(end)
            self._stale.zero_()

    def decode_buffer(self, layer: int, end: torch.Tensor, first_layer: bool) -> int:
        """One decode step of ``layer`` on a preallocated buffer whose rows now end at ``end [b]`` (device).

        Checked on the device, never on the host: at the first decided layer every row must have grown by exactly
        one key since the previous step; a violation sets a device flag that :meth:`check` raises at the next
        host point (``run.summary()`` or ``run.check()``). Returns the step index, a Python counter kept for observers
        only (observers read the host; a replayed CUDA graph does not run Python, so it stops there)."""
        self.check_buffer_growth(layer, end, first_layer)
        return self.count_step(layer)

    def check_buffer_growth(self, layer: int, end: torch.Tensor, first_layer: bool) -> None:
        """The device half of :meth:`decode_buffer` (tensor operations only: ``torch.compile`` traces it)."""
        if self._length.get(layer) is None:
            raise StaleStateError(
                f"layer {layer} decodes without a prefill seen by qada: enable qada before the prompt is processed"
            )
        if first_layer and self._last_end is not None:
            if self._last_end.shape != end.shape:
                raise StaleStateError(f"the batch changed from {self._last_end.shape[0]} to {end.shape[0]} rows "
                                      "between decode steps")
            self._stale |= (end != self._last_end + 1).any()
            self._last_end.copy_(end)

    def count_step(self, layer: int) -> int:
        """The host half of :meth:`decode_buffer`: ``layer``'s step index (for observers), counted up."""
        step = self._step.get(layer, 0)
        self._step[layer] = step + 1
        return step

    def check(self) -> None:
        """Raise :class:`StaleStateError` if a buffer decode step saw a row that did not grow by one key."""
        if self._stale is not None and bool(self._stale):
            self._stale.zero_()
            raise StaleStateError(
                "a row of the preallocated cache did not grow by exactly one key per decode step (cache cropping, "
                "assisted decoding, or decoding without a prefill seen by qada): qada's moment state cannot follow "
                "that, and the decisions of those steps are not trustworthy"
            )

    def note_capacity(self, layer: int, capacity: int) -> None:
        """``layer``'s cache is preallocated with ``capacity`` slots (its decode steps then need no sync)."""
        self._capacity[layer] = capacity

    def filled_length(self, layer: int, q_len: int, key_len: int, from_mask: Callable[[], int | None]) -> int:
        """How many of the ``key_len`` cache slots hold tokens after this forward of ``q_len`` queries.

        A growing cache (``DynamicCache``) returns exactly its tokens, so the answer is ``key_len``. A
        preallocated one (``StaticCache``) returns its whole buffer: the answer is then the previous length plus
        ``q_len``; at a new prefill, where the previous length is unknown, it comes from the attention mask
        (``from_mask()``: one host sync per forward, shared by the layers). Decode steps of a preallocated cache
        need no sync: its capacity is remembered.
        """
        previous = self._length.get(layer)
        if q_len == 1 and previous is not None and self._capacity.get(layer) == key_len:
            return previous + 1
        if previous is not None and q_len == 1 and key_len == previous + 1:
            return key_len
        if q_len > 1 or previous is None:  # a prefill (or a resumed chunk): the mask says where the tokens end
            filled = from_mask()
            if filled is None and q_len == 1:  # a one-token forward without a prefill and without a mask
                return key_len
            if filled is None:
                # No mask: transformers then relies on SDPA's causal mask, aligned at the first key, so the
                # tokens are the previous ones (none at a first prefill) plus this chunk.
                filled = (previous or 0) + q_len
            if q_len <= filled < key_len:
                self._capacity[layer] = key_len
                return filled
            self._capacity.pop(layer, None)
            return key_len
        return key_len  # a growing cache that did not grow by one: decode() says what went wrong

    def length(self, layer: int) -> int | None:
        """Tokens in ``layer``'s cache after its last forward seen by qada (``None`` before its first prefill)."""
        return self._length.get(layer)

    def prefill(self, layer: int, key: torch.Tensor) -> None:
        """``layer`` was prefilled: its cache is ``key [b, H_kv, T, d]``."""
        self._length[layer] = key.shape[2]
        self._step[layer] = 0
        self._remember_newest_key(layer, key)

    def decode(self, layer: int, key: torch.Tensor) -> int:
        """Check one decode step of ``layer`` (filled cache ``key [b, H_kv, T, d]``); return its step index."""
        T = key.shape[2]
        previous = self._length.get(layer)
        if previous is None:
            raise StaleStateError(
                f"layer {layer} decodes without a prefill seen by qada: enable qada before the prompt is processed"
            )
        if T != previous + 1:
            raise StaleStateError(
                f"layer {layer}: the cache went from {previous} to {T} keys in one decode step; qada's moment state "
                "follows a cache that grows by one key per step (cache cropping, e.g. assisted decoding, is not "
                "supported)"
            )
        self._check_row_order(layer, key)
        self._length[layer] = T
        step = self._step[layer]
        self._step[layer] = step + 1
        return step

    def _remember_newest_key(self, layer: int, key: torch.Tensor) -> None:
        self._newest_key.pop(layer, None)
        if self.track_row_order and key.shape[0] > 1 and layer == min(self._length):
            self._newest_key[layer] = key[:, :, -1].clone()

    def _check_row_order(self, layer: int, key: torch.Tensor) -> None:
        previous = self._newest_key.get(layer)
        if previous is not None and not torch.equal(key[:, :, -2], previous):
            raise StaleStateError(
                "the rows of the cache were reordered between decode steps (beam search?); qada's per-row moment "
                "state (the 'current' source) cannot follow that: use greedy or sampling, or a stored moment source"
            )
        self._remember_newest_key(layer, key)
