"""Stored-prompt moments (paper Option 2): bulk moments of a reference prompt's keys, matched to the length.

For a row of real length ``n`` the moments come from the reference bulk ``[first, n - offset)`` with
``first = T_sink`` (0 with ``include_sinks``) and ``offset = 1024`` (paper App. B). See
:func:`reference_bulk_end` for the short-prompt rule.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from qada.artifacts import model_fingerprint
from qada.moments.base import MomentSource, arrival_count, register_moment_source
from qada.moments.math import shifted_sums, state_from_shifted_sums, to_bulk_moments
from qada.moments.reference import (
    ReferenceKeys,
    fingerprint_key,
    load_or_build_reference,
    reference_cache_file,
    reference_length,
)
from qada.step import BulkMoments
from qada.window import Window

__all__ = ["ReferenceMomentSource", "StoredMoments", "advance_reference_range", "reference_bulk_end",
           "stored_buffer_step"]

MAX_CHECKPOINT_BYTES = 256 * 2**20  # prefix-sum checkpoints of the reference, all layers

# What is derived from a reference's keys (float32 copy per device, shift, prefix-sum checkpoints), shared by every
# source that uses the same keys tensor: a sweep's many stored-moment configurations hold one copy, not one each.
_DERIVED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def reference_bulk_end(
    n: torch.Tensor, window: Window, offset: int, first: int, min_bulk_keys: int = 64
) -> torch.Tensor:
    """``[b]`` end index into the reference bulk ``[first, end)`` for rows of real length ``n [b]``.

    * Normally ``end = n - offset``.
    * Short prompts: when that leaves fewer than ``min_bulk_keys`` keys, the reference keys at the prompt's
      own bulk positions are used instead, ``end = first + T_bulk`` with ``T_bulk = n - T_local`` (never more
      keys than the prompt's own bulk).
    * Rows without a bulk (``n <= T_local``) get ``end = first`` (an empty bulk, zero moments).

    The caller clamps ``end`` to the reference length.
    """
    t_bulk = (n - window.t_local).clamp(min=0)
    primary = n - offset
    end = torch.where(primary - first >= min_bulk_keys, primary, first + t_bulk)
    return torch.where(t_bulk > 0, end, torch.full_like(end, first))


@dataclass
class ReferenceMomentSource(MomentSource):
    """Shared fields and plumbing of the sources built from a reference prompt (``stored``, ``bucketed``).

    Args:
        path: artifact to load; ``None`` builds the reference on :meth:`prepare` and caches it.
        prompt: reference prompt kind (``random_words``, ``text``, ``single_word``).
        length: reference length in tokens; ``None`` is the model's maximum positions capped at 32768.
        seed: seed of the prompt builder.
        offset: the reference bulk ends ``offset`` tokens before the prompt's length.
        include_sinks: let the reference bulk start at 0 instead of ``T_sink``.
        min_bulk_keys: below this many keys the short-prompt rule applies.
        cache_dir: artifact cache (default ``$QADA_CACHE_DIR`` or ``~/.cache/qada``).
        chunk_size: tokens per forward when the reference is built.
    """

    path: str | None = None
    prompt: str = "random_words"
    length: int | None = None
    seed: int = 0
    offset: int = 1024
    include_sinks: bool = False
    min_bulk_keys: int = 64
    cache_dir: str | None = None
    chunk_size: int = 1024

    needs_model = True

    def __post_init__(self) -> None:
        from qada.moments.prompts import PROMPT_BUILDERS

        for name, low in (("offset", 0), ("min_bulk_keys", 0), ("chunk_size", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"expected {name} to be an int >= {low} but got {value!r}")
        if self.length is not None and (
            isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1
        ):
            raise ValueError(f"expected length to be None or an int >= 1 but got {self.length!r}")
        if not isinstance(self.include_sinks, bool):
            raise ValueError(f"expected include_sinks to be a bool but got {self.include_sinks!r}")
        if self.prompt not in PROMPT_BUILDERS:
            raise ValueError(f"expected prompt in {sorted(PROMPT_BUILDERS)} but got {self.prompt!r}")
        for name in ("path", "cache_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"expected {name} to be None or a file path but got {type(value).__name__} {value!r}")
        if self.path is not None:
            self.path = os.fspath(self.path)
            if Path(self.path).is_dir():
                raise ValueError(f"expected path to be an artifact file but {self.path!r} is a directory")
        self._warned_short = False
        self._starts_cpu: tuple[tuple, torch.Tensor] | None = None
        self._ends_cache: dict[tuple, torch.Tensor] = {}

    # --- shared helpers --------------------------------------------------------------------------------
    def first(self, window: Window) -> int:
        """Where the reference bulk starts: ``T_sink``, or 0 with ``include_sinks``."""
        return 0 if self.include_sinks else window.t_sink

    def _cpu_starts(self, start: torch.Tensor | None, b: int) -> torch.Tensor:
        """``start`` on the CPU, copied once per tensor (no device sync on every step and layer)."""
        if start is None:
            return torch.zeros(b, dtype=torch.long)
        version = None if start.is_inference() else start._version  # inference tensors have no version counter
        key = (start.data_ptr(), str(start.device), tuple(start.shape), version)
        if self._starts_cpu is None or self._starts_cpu[0] != key:
            self._starts_cpu = (key, start.detach().to("cpu", torch.long))
        return self._starts_cpu[1]

    def _ends(self, keys: torch.Tensor, start: torch.Tensor | None, window: Window, available: int) -> torch.Tensor:
        """``[b]`` CPU LongTensor of each row's reference bulk end, clamped to ``available`` (warns once)."""
        b, T = keys.shape[0], keys.shape[2]
        if start is None:  # every row is the whole cache: the same end, computed once per length
            cached = self._ends_cache.get((b, T, available, window))
            if cached is not None:
                return cached
        starts = self._cpu_starts(start, b)
        if starts.shape != (b,):
            raise ValueError(f"expected start of shape [{b}] but got {tuple(starts.shape)}")
        first = self.first(window)
        end = self._within_reference(reference_bulk_end(T - starts, window, self.offset, first, self.min_bulk_keys),
                                     available, "this prompt needs")
        if start is None:
            self._ends_cache = {(b, T, available, window): end}  # the layers of one step share it
        return end

    def _within_reference(self, ends: torch.Tensor, available: int, what: str) -> torch.Tensor:
        """``ends`` (CPU) clamped to the ``available`` reference keys; warns once per source when it clamps."""
        if bool((ends > available).any()) and not self._warned_short:
            self._warned_short = True
            warnings.warn(
                f"the reference ({available} keys) is shorter than {what} (up to {int(ends.max())} keys): using "
                "all of it. Build a longer reference (length=...) to avoid this.",
                stacklevel=4,
            )
        return ends.clamp(max=available)

    def describe(self) -> dict[str, Any]:
        described = {**super().describe(), "prompt": self.prompt, "seed": self.seed, "offset": self.offset}
        return {**described, **({"path": self.path} if self.path is not None else {})}

    def resolved_length(self, model: Any) -> int:
        """``length``, or the model's maximum positions capped at 32768
        (:func:`~qada.moments.reference.reference_length`)."""
        return reference_length(model, self.length)

    def _cache_file(self, kind: str, fingerprint: dict[str, Any], length: int, extra: str = "") -> Path:
        return reference_cache_file(kind, fingerprint, self.prompt, length, self.seed, self.cache_dir, extra)

    def reference_keys_for(self, model: Any, tokenizer: Any) -> ReferenceKeys:
        """Reference keys for ``model``: loaded from the cache, or built (prompt, forward) and cached
        (:func:`~qada.moments.reference.load_or_build_reference` with this source's parameters)."""
        return load_or_build_reference(
            model, tokenizer, self.prompt, self.length, self.seed, self.cache_dir, self.chunk_size
        )


@register_moment_source("stored")
@dataclass
class StoredMoments(ReferenceMomentSource):
    """Moments of a reference prompt's bulk keys ``[first, n - offset)``, per layer, KV head and row.

    Reference keys come from :meth:`prepare` (``path``, or built and cached for the model) or
    :meth:`set_reference`. The float64 shifted sums of each row's range are kept and moved as the prompt
    grows: one key per decode step, O(d²), whatever ``T``. A jump (a new prompt) is answered from prefix sums of
    the reference at every ``C``-th key, computed once per layer and device (at most 256 MiB in all): O(C d²)
    instead of ``O(|jump| d²)``, so the first decode step of a prompt costs about as much as the others.
    """

    layer_state = ("float64 shifted sums of each row's reference range", "the range's ends")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._reference: ReferenceKeys | None = None

    # --- reference ---------------------------------------------------------------------------------------
    def prepare(self, model: Any, tokenizer: Any = None, window: Window | None = None) -> None:
        if self.path is not None:
            self.set_reference(ReferenceKeys.load(self.path, model_fingerprint(model.config, model)))
        else:
            self.set_reference(self.reference_keys_for(model, tokenizer))

    def set_reference(self, reference: ReferenceKeys) -> None:
        """Use ``reference`` (keys ``[L, H_kv, N, d]``) from now on; per-sequence state is reset."""
        self._reference = reference
        self.reset()

    def describe(self) -> dict[str, Any]:
        """:meth:`ReferenceMomentSource.describe` plus, once prepared, the reference's length, the file it was loaded
        from or cached to, the fingerprint of the model it was built with and, where the file records it, how it was
        built (``built``: device, dtype, processor, torch and threads,
        :func:`~qada.moments.reference.reference_build_conditions`; the same name built elsewhere may hold other
        keys)."""
        described = super().describe()
        if self._reference is not None:
            reference = self._reference
            described.update(length=reference.length, file=Path(reference.path).name if reference.path else None,
                             fingerprint=fingerprint_key(reference.fingerprint))
            if reference.info.get("built"):
                described["built"] = reference.info["built"]
        return described

    @property
    def reference(self) -> ReferenceKeys:
        if self._reference is None:
            raise RuntimeError("stored moments have no reference: call prepare(model, tokenizer) or set_reference")
        return self._reference

    def _derived(self) -> dict:
        """The tensors derived from this reference's keys, shared with every source using the same keys."""
        keys = self.reference.keys
        if keys not in _DERIVED:
            _DERIVED[keys] = {}
        return _DERIVED[keys]

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        derived = self._derived()
        if ("keys", device) not in derived:
            keys = self.reference.keys.to(device=device, dtype=torch.float32)
            # [L, H_kv, d]: sums around it keep their precision
            derived["keys", device] = (keys, keys.double().mean(2))
        return derived["keys", device]

    # --- MomentSource --------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.clear_state()
        self._starts_cpu = None

    def prefill(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window,
                capacity: int | None = None) -> None:
        """Declare ``layer``'s state for a cache of ``capacity`` slots (default: its length): each row's reference
        range and its sums, and the jumps the range makes up to that capacity (:meth:`_prefill_state`)."""
        self.set_state(layer, **self._prefill_state(layer, keys, start, window, capacity or keys.shape[2]))

    def append(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window,
               end: torch.Tensor | None = None) -> None:
        """With ``end [b]`` (device): one step of the layer's state (:meth:`step`). Without: nothing
        (:meth:`moments` reads the range of the cache it is given)."""
        if end is not None and self.has_state(layer):
            state = self.step_state(layer)
            self.step(state, state["ref"], start, end, window)

    def _layer_reference(self, layer: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ref [H_kv, N, d] float32, shift [H_kv, d] float64)`` of ``layer`` on the keys' device, checked."""
        ref, shift = self._on(keys.device)
        if not 0 <= layer < ref.shape[0]:
            raise ValueError(f"expected a layer in [0, {ref.shape[0]}) but got {layer}")
        if keys.shape[1] != ref.shape[1] or keys.shape[3] != ref.shape[3]:
            raise ValueError(
                f"expected keys with {ref.shape[1]} KV heads of dim {ref.shape[3]} (the reference) but got "
                f"{tuple(keys.shape)}"
            )
        return ref[layer], shift[layer]

    def _prefill_state(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window,
                       capacity: int) -> dict[str, torch.Tensor]:
        """The state of ``layer`` at the prefill (``keys [b, H_kv, T, d]``, the filled part) and, for every later
        length up to ``capacity`` at which a row's reference range jumps by more than one key (the short-prompt
        rule of :func:`reference_bulk_end` switching, a bulk appearing), the sums it jumps to: computed here, on
        the host's schedule, so that each decode step is a rank-1 update or a select, never a host read."""
        ref, shift = self._layer_reference(layer, keys)
        b, T, N = keys.shape[0], keys.shape[2], ref.shape[1]
        first = self.first(window)
        # the lengths to look ahead to: the cache's capacity, and at least past the lengths where the short-prompt
        # rule may switch (a growing cache has no capacity: its range only moves by one key beyond them)
        horizon = max(capacity, T + 1, self.offset + first + self.min_bulk_keys + window.t_local + 2)
        n = (T - self._cpu_starts(start, b))[:, None] + torch.arange(horizon - T + 1)  # [b, steps + 1] lengths
        ends = reference_bulk_end(n.flatten(), window, self.offset, first, self.min_bulk_keys).view(n.shape)
        self._within_reference(ends[:, : capacity - T + 1], N, "this prompt may need at the cache's capacity")
        ends = ends.clamp(max=N)
        count, s1, s2 = self._range_sums(layer, ref, shift, first, ends[:, 0])
        jumps = (ends[:, 1:] - ends[:, :-1]).abs() > 1  # [b, steps]: where a rank-1 update is not enough
        K = max(2, int(jumps.sum(1).max()))  # the rule jumps at most twice (a bulk appears, the rule switches)
        f64 = dict(dtype=torch.float64, device=ref.device)
        H_kv, d = ref.shape[0], ref.shape[2]
        jump_n = torch.full((b, K), -1, dtype=torch.long)
        jump_sums = (torch.zeros(b, K, H_kv, **f64), torch.zeros(b, K, H_kv, d, **f64),
                     torch.zeros(b, K, H_kv, d, d, **f64))
        every, p1, p2 = self._checkpoints(layer, ref, shift)
        n0, t0, u0 = self._prefix_sums(ref, shift, every, p1, p2, first)  # the keys before the range, once
        for r, j in jumps.nonzero().tolist():
            k = int((jump_n[r] >= 0).sum())
            target = int(ends[r, j + 1])
            n1, t1, u1 = self._prefix_sums(ref, shift, every, p1, p2, target)
            jump_n[r, k] = int(n[r, j + 1])
            jump_sums[0][r, k], jump_sums[1][r, k], jump_sums[2][r, k] = max(n1 - n0, 0.0), t1 - t0, u1 - u0
        device = ref.device
        mean, cov = to_bulk_moments(state_from_shifted_sums(count, s1, s2, shift))
        return {"count": count, "s1": s1, "s2": s2, "old_end": ends[:, 0].to(device), "jump_n": jump_n.to(device),
                "jump_count": jump_sums[0], "jump_s1": jump_sums[1], "jump_s2": jump_sums[2], "mean": mean,
                "cov": cov, "arrived": arrival_count(count)}

    def step_state(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's declared state (float64 shifted sums and range ends, the prepared jumps, the float32 moments
        handed to criteria, the moment kernel's ``arrived``, :func:`~qada.moments.base.arrival_count`) and its
        reference keys and shift: :func:`stored_buffer_step`'s arguments (but ``arrived``)."""
        state = super().step_state(layer)
        ref, shift = self._on(state["count"].device)
        return {**state, "ref": ref[layer], "shift": shift[layer]}

    def step(self, state: dict[str, torch.Tensor], keys: torch.Tensor, start: torch.Tensor | None,
             end: torch.Tensor, window: Window) -> BulkMoments:
        """:func:`stored_buffer_step` with this source's offset, short-prompt rule and window."""
        sums = {name: tensor for name, tensor in state.items() if name != "arrived"}  # (the kernel's alone)
        return stored_buffer_step(**sums, keys=keys, start=start, end=end, t_local=window.t_local,
                                  offset=self.offset, first=self.first(window), min_bulk_keys=self.min_bulk_keys)

    def moments(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window,
                end: torch.Tensor | None = None) -> BulkMoments:
        """The moments of each row's reference range for the cache ``keys`` (its length, or ``end``): from the
        layer's state when a decode step brought it there, else from the reference's prefix sums (the analysis
        path: O(C d²) per row, C the checkpoint spacing)."""
        if end is not None and self.has_state(layer):
            state = self.step_state(layer)  # brought up to date by append(..., end=...)
            return BulkMoments(state["mean"], state["cov"])
        ref, shift = self._layer_reference(layer, keys)  # [H_kv, N, d], [H_kv, d]
        first = self.first(window)
        ends = self._ends(keys, start, window, ref.shape[1])
        count, s1, s2 = self._range_sums(layer, ref, shift, first, ends)
        mean, cov = to_bulk_moments(state_from_shifted_sums(count, s1, s2, shift))
        return BulkMoments(mean, cov)

    def _range_sums(self, layer: int, ref: torch.Tensor, shift: torch.Tensor, first: int,
                    ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(count [b, H_kv], s1 [b, H_kv, d], s2 [b, H_kv, d, d])``: float64 shifted sums of each row's reference
        range ``[first, ends_r)`` (``ends [b]`` on the host), from the prefix sums at the checkpoints. A reference
        with no key past ``first`` (the window's ``T_sink``) gives no prompt a bulk: an error, not zero moments."""
        H_kv, N, d = ref.shape
        if N <= first:
            raise ValueError(f"expected a reference longer than its bulk start {first} (the window's t_sink) but got "
                             f"{N} keys: build a longer reference (length=...)")
        f64 = dict(dtype=torch.float64, device=ref.device)
        b = ends.shape[0]
        count, s1, s2 = torch.zeros(b, H_kv, **f64), torch.zeros(b, H_kv, d, **f64), torch.zeros(b, H_kv, d, d, **f64)
        every, p1, p2 = self._checkpoints(layer, ref, shift)
        n0, t0, u0 = self._prefix_sums(ref, shift, every, p1, p2, first)
        for r, end in enumerate(ends.tolist()):
            if end > first:
                n1, t1, u1 = self._prefix_sums(ref, shift, every, p1, p2, end)
                count[r], s1[r], s2[r] = n1 - n0, t1 - t0, u1 - u0
        return count, s1, s2

    def _checkpoints(
        self, layer: int, ref: torch.Tensor, shift: torch.Tensor
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(C, P1 [H_kv, J+1, d], P2 [H_kv, J+1, d, d])``: float64 shifted sums of the reference's first
        ``j * C`` keys of ``layer``, computed once (the whole reference's checkpoints fit in 256 MiB)."""
        derived = self._derived()
        key = ("checkpoints", layer, ref.device)
        if key not in derived:
            H_kv, N, d = ref.shape
            per_checkpoint = self.reference.keys.shape[0] * H_kv * d * d * 8  # float64 P2 over all layers
            J = max(1, min(max(N // 64, 1), MAX_CHECKPOINT_BYTES // per_checkpoint))
            every = -(-N // J)
            x = ref.double() - shift.double()[:, None, :]  # [H_kv, N, d]
            x = torch.nn.functional.pad(x, (0, 0, 0, J * every - N)).view(H_kv, J, every, d)
            zeros1, zeros2 = x.new_zeros(H_kv, 1, d), x.new_zeros(H_kv, 1, d, d)
            p1 = torch.cat([zeros1, x.sum(2).cumsum(1)], 1)
            p2 = torch.cat([zeros2, (x.transpose(-1, -2) @ x).cumsum(1)], 1)
            derived[key] = (every, p1, p2)
        return derived[key]

    @staticmethod
    def _prefix_sums(ref, shift, every: int, p1, p2, upto: int) -> tuple[float, torch.Tensor, torch.Tensor]:
        """``(n, Σ x, Σ x xᵀ)`` of the shifted reference keys ``[0, upto)``: a checkpoint plus < ``C`` keys."""
        j = upto // every
        n, t1, t2 = shifted_sums(ref[:, j * every : upto], shift)
        return float(upto), p1[:, j] + t1, p2[:, j] + t2


def advance_reference_range(
    count: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, old_end: torch.Tensor, jump_n: torch.Tensor,
    jump_count: torch.Tensor, jump_s1: torch.Tensor, jump_s2: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor,
    ref: torch.Tensor, shift: torch.Tensor, n: torch.Tensor, t_local: int, offset: int, first: int,
    min_bulk_keys: int,
) -> None:
    """One decode step of the stored moments, in place: rows of real length ``n [b]`` (device).

    Each row's reference range ``[first, old_end)`` moves to ``[first, e(n))`` (:func:`reference_bulk_end`,
    clamped to the reference): by one key, added or removed from the float64 shifted sums ``count [b, H_kv]``,
    ``s1 [b, H_kv, d]``, ``s2 [b, H_kv, d, d]`` (around ``shift [H_kv, d]``, keys ``ref [H_kv, N, d]``), or, at a
    length listed in ``jump_n [b, K]``, to the sums ``jump_* [b, K, ...]`` prepared at the prefill. Writes the
    float32 ``mean [b, H_kv, d]`` and population ``cov [b, H_kv, d, d]`` (paper §3.2). A pure function of device
    tensors: no host read, fixed shapes.
    """
    N = ref.shape[1]
    new_end = reference_bulk_end(n, Window(t_local, 0), offset, first, min_bulk_keys)  # reads t_local only
    new_end = new_end.clamp(max=N)
    delta = new_end - old_end
    w = torch.where(delta.abs() <= 1, delta, 0).to(torch.float64)[:, None]  # [b, 1]
    index = torch.where(delta > 0, old_end, new_end).clamp(0, N - 1)
    x = ref[:, index].transpose(0, 1).double() - shift  # [b, H_kv, d]: the key that enters or leaves
    count.add_(w)
    s1.add_(w[..., None] * x)
    s2.add_(w[..., None, None] * (x[..., :, None] * x[..., None, :]))
    for k in range(jump_n.shape[1]):
        hit = n == jump_n[:, k]  # [b]
        count.copy_(torch.where(hit[:, None], jump_count[:, k], count))
        s1.copy_(torch.where(hit[:, None, None], jump_s1[:, k], s1))
        s2.copy_(torch.where(hit[:, None, None, None], jump_s2[:, k], s2))
    old_end.copy_(new_end)
    moments = to_bulk_moments(state_from_shifted_sums(count, s1, s2, shift))
    mean.copy_(moments.mean)
    cov.copy_(moments.cov)


def stored_buffer_step(
    count: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, old_end: torch.Tensor, jump_n: torch.Tensor,
    jump_count: torch.Tensor, jump_s1: torch.Tensor, jump_s2: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor,
    ref: torch.Tensor, shift: torch.Tensor, keys: torch.Tensor, start: torch.Tensor | None, end: torch.Tensor, *,
    t_local: int, offset: int, first: int, min_bulk_keys: int,
) -> BulkMoments:
    """:func:`advance_reference_range` for rows ``[start, end)`` of a buffer (the keys themselves are not read:
    stored moments depend on the length only); returns the updated ``(mean, cov)``."""
    n = end if start is None else end - start
    advance_reference_range(count, s1, s2, old_end, jump_n, jump_count, jump_s1, jump_s2, mean, cov, ref, shift, n,
                            t_local, offset, first, min_bulk_keys)
    return BulkMoments(mean, cov)
