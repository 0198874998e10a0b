"""Bucketed moments: a reference prompt's bulk moments precomputed on a grid of lengths, O(1) lookup."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from qada.artifacts import ArtifactError, model_fingerprint
from qada.moments.base import register_moment_source
from qada.moments.reference import BucketedMomentsData, compute_bucketed_moments
from qada.moments.stored import ReferenceMomentSource, reference_bulk_end
from qada.step import BulkMoments
from qada.window import Window

__all__ = ["BucketedMoments"]


@register_moment_source("bucketed")
@dataclass
class BucketedMoments(ReferenceMomentSource):
    """Moments of the reference bulk ``[first, end_j)`` for the largest bucket end ``end_j <= n - offset``.

    The target end per row follows :func:`~qada.moments.stored.reference_bulk_end` (short-prompt rule
    included); a row whose target lies below the smallest bucket gets the smallest bucket (by default
    ``first + min_bulk_keys`` keys), a row without a bulk gets zeros.

    Args:
        bucket_size: spacing of the grid in tokens (plus a geometric ladder below it, see
            :func:`~qada.moments.reference.bucket_ends`). Other arguments as for ``stored``.
    """

    bucket_size: int = 512
    layer_state = ()  # a stateless lookup: the bucket depends on the length only

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) or self.bucket_size < 1:
            raise ValueError(f"expected bucket_size to be an int >= 1 but got {self.bucket_size!r}")
        self._data: BucketedMomentsData | None = None
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def prepare(self, model: Any, tokenizer: Any = None, window: Window | None = None) -> None:
        window = window or Window()
        fingerprint = model_fingerprint(model.config, model)
        first = self.first(window)
        if self.path is not None:
            self.set_data(BucketedMomentsData.load(self.path, fingerprint, first))
            return
        length = self.resolved_length(model)
        extra = f"-b{self.bucket_size}-f{first}-m{self.min_bulk_keys}"
        file = self._cache_file("bucketed", fingerprint, length, extra)
        if file.exists():
            try:
                self.set_data(BucketedMomentsData.load(file, fingerprint, first))
                return
            except ArtifactError as error:
                warnings.warn(f"rebuilding the cached bucketed moments: {error}", stacklevel=2)
        reference = self.reference_keys_for(model, tokenizer)
        data = compute_bucketed_moments(reference, self.bucket_size, first, self.min_bulk_keys)
        data.save(file)
        self.set_data(data)

    def set_data(self, data: BucketedMomentsData) -> None:
        """Use precomputed bucketed moments from now on."""
        self._data = data
        self._on_device.clear()

    @property
    def data(self) -> BucketedMomentsData:
        if self._data is None:
            raise RuntimeError("bucketed moments have no data: call prepare(model, tokenizer) or set_data")
        return self._data

    def reset(self) -> None:
        """Stateless per sequence apart from a CPU copy of ``start``."""
        self._starts_cpu = None

    def prefill(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window,
                capacity: int | None = None) -> None:
        """Nothing to keep: the lookup depends on the current length only. With ``capacity`` (a preallocated
        buffer) the device copies are made and a too-short reference is reported here, not during decoding."""
        if capacity is not None:
            if self.data.first != self.first(window):
                raise ValueError(
                    f"expected bucketed moments whose bulk starts at {self.first(window)} ({window}) but got "
                    f"moments built from {self.data.first}"
                )
            self._device_data(keys.device)
            self.__dict__["_device"] = keys.device
            longest = capacity - self._cpu_starts(start, keys.shape[0])  # each row's length when the cache is full
            self._within_reference(  # warns once if the longest prompt needs more than the reference
                reference_bulk_end(longest, window, self.offset, self.first(window), self.min_bulk_keys),
                int(self.data.ends[-1]), "this prompt may need at the cache's capacity")

    def append(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window,
               end: torch.Tensor | None = None) -> None:
        """Nothing to do: the lookup depends on the current length only."""

    def _device_data(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mean [L, J+1, H_kv, d], cov [L, J+1, H_kv, d, d], ends [J])`` on ``device``; slot 0 holds zeros for
        rows without a bulk, bucket ``j`` lives in slot ``j + 1``."""
        data = self.data
        if device not in self._on_device:
            zero_mean = torch.zeros_like(data.mean[:, :1])
            zero_cov = torch.zeros_like(data.cov[:, :1])
            self._on_device[device] = (
                torch.cat([zero_mean, data.mean], 1).to(device, torch.float32),
                torch.cat([zero_cov, data.cov], 1).to(device, torch.float32),
                data.ends.to(device=device, dtype=torch.long),
            )
        return self._on_device[device]

    def bucket_index(self, keys: torch.Tensor, start: torch.Tensor | None, window: Window) -> torch.Tensor:
        """``[b]`` index of the chosen bucket per row, ``-1`` for rows without a bulk."""
        data = self.data
        if data.first != self.first(window):
            raise ValueError(
                f"expected bucketed moments whose bulk starts at {self.first(window)} ({window}) but got "
                f"moments built from {data.first}"
            )
        ends = data.ends.to(torch.long)
        target = self._ends(keys, start, window, int(ends[-1]))
        index = torch.searchsorted(ends, target, right=True) - 1
        return torch.where(target > data.first, index.clamp(min=0), torch.full_like(index, -1))

    def moments(self, layer: int, keys: torch.Tensor, start: torch.Tensor | None, window: Window,
                end: torch.Tensor | None = None) -> BulkMoments:
        if end is not None:
            return self._moments_on_buffer(layer, start, window, end)
        data = self.data
        if not 0 <= layer < data.mean.shape[0]:
            raise ValueError(f"expected a layer in [0, {data.mean.shape[0]}) but got {layer}")
        if data.mean.shape[2] != keys.shape[1] or data.mean.shape[3] != keys.shape[3]:
            raise ValueError(
                f"expected keys with {data.mean.shape[2]} KV heads of dim {data.mean.shape[3]} but got "
                f"{tuple(keys.shape)}"
            )
        mean, cov, _ = self._device_data(keys.device)
        slot = (self.bucket_index(keys, start, window) + 1).to(keys.device)
        return BulkMoments(mean[layer, slot], cov[layer, slot])

    def step_state(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's bucket table: ``mean [J+1, H_kv, d]``, ``cov [J+1, H_kv, d, d]`` (slot 0: zeros) and the
        bucket ``ends [J]``, on the device of the last prefill."""
        return self._layer_table(layer, self.__dict__.get("_device", torch.device("cpu")))

    def _layer_table(self, layer: int, device: torch.device) -> dict[str, torch.Tensor]:
        mean, cov, ends = self._device_data(device)
        if not 0 <= layer < mean.shape[0]:
            raise ValueError(f"expected a layer in [0, {mean.shape[0]}) but got {layer}")
        return {"mean": mean[layer], "cov": cov[layer], "ends": ends}

    def step(self, state: dict[str, torch.Tensor], keys: torch.Tensor, start: torch.Tensor | None,
             end: torch.Tensor, window: Window) -> BulkMoments:
        """The lookup for rows ending at ``end [b]``, on the device (no host read): the largest bucket whose end is
        ``<=`` the row's reference end (:func:`reference_bulk_end`)."""
        mean, cov, ends = state["mean"], state["cov"], state["ends"]
        first = self.first(window)
        n = end if start is None else end - start
        target = reference_bulk_end(n, window, self.offset, first, self.min_bulk_keys).clamp(max=ends[-1])
        index = torch.searchsorted(ends, target, right=True) - 1
        slot = torch.where(target > first, index.clamp(min=0) + 1, 0)
        return BulkMoments(mean[slot], cov[slot])

    def _moments_on_buffer(self, layer: int, start: torch.Tensor | None, window: Window,
                           end: torch.Tensor) -> BulkMoments:
        return self.step(self._layer_table(layer, end.device), end, start, end, window)  # keys are not read
