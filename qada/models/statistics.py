"""Decode statistics of a run, torchmetrics-style: ``update`` per (layer, step) on the device, ``compute`` once.

Nothing in :meth:`DecodeStatistics.update` synchronises with the host or allocates: the sums live in one
preallocated device tensor updated in place, so a decode step replayed from a CUDA graph updates them too
(a Python counter would silently stop). Only :meth:`DecodeStatistics.compute` reads them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qada.attention.group_policy import kv_read

__all__ = ["DecodeStatistics", "all_layer_sparsity", "step_counts", "step_row", "step_row_in_one_reduction"]

_SPARSITY, _KV_SPARSITY, _STEPS, _FAIL_SAFE, _KV_READ = 0, 1, 2, 3, 4
COLUMNS = 5


def step_counts(local: torch.Tensor, read: torch.Tensor, fail_safe: torch.Tensor | None,
                kv_read: torch.Tensor) -> torch.Tensor:
    """One decode step of one layer as a row of :class:`DecodeStatistics`, ``[5]`` float64: the fraction of query
    heads local (``local [b, H]``), of bulk reads skipped (``read [b, H_kv]``), 1 (a step), the heads forced dense
    (``fail_safe``, 0-d or ``None``) and ``kv_read`` (0-d). Device work only."""
    f64 = dict(dtype=torch.float64, device=local.device)
    forced = torch.zeros((), **f64) if fail_safe is None else fail_safe.to(**f64)
    return torch.stack([local.to(torch.float64).mean(), (~read).to(torch.float64).mean(), torch.ones((), **f64),
                        forced, kv_read.to(**f64)])


def step_row(local: torch.Tensor, read: torch.Tensor, length: torch.Tensor, t_local: int,
             extra: torch.Tensor | None = None, forced: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`step_counts` of ``local [b, H]``, ``read [b, H_kv]``, the heads forced dense (``forced [b, H]``, how
    often each was, or ``None``) and the :func:`~qada.attention.group_policy.kv_read` of ``read``, ``length [b]``,
    ``t_local`` and ``extra [b]``: traced by ``torch.compile``, :func:`step_row_in_one_reduction` (two kernels
    where the means, sums and the stack of scalars took six); eagerly, where every operation is a call of its own,
    the fewest operations, those of the definition."""
    if torch.compiler.is_compiling():
        return step_row_in_one_reduction(local, read, length, t_local, extra, forced)
    return step_counts(local, read, None if forced is None else forced.sum(), kv_read(read, length, t_local, extra))


def step_row_in_one_reduction(local: torch.Tensor, read: torch.Tensor, length: torch.Tensor, t_local: int,
                              extra: torch.Tensor | None = None, forced: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`step_row` with every sum taken in one reduction over the ``b H`` query heads, each KV head's terms
    counted once per query head of its group (``G`` times), and the row made elementwise from the sums (a stack of
    scalars compiles to a kernel for each). The same row as the definition's: counts in float64 are exact
    integers, so ``G`` times a sum over ``G`` times another is the same quotient."""
    b, H = local.shape
    G = H // read.shape[1]
    f64 = dict(dtype=torch.float64, device=local.device)
    read_heads = read[:, :, None].expand(b, read.shape[1], G).reshape(b, H)
    T = length.to(torch.float64)[:, None]  # [b, 1]
    reads = torch.where(read_heads, 2 * T, 2 * T.clamp(max=t_local))
    if extra is not None:
        reads = reads + extra.to(torch.float64)[:, None]
    forced = torch.zeros((), **f64) if forced is None else forced.to(torch.float64)
    # [b, H, 6]: local, bulk skipped, 0, forced dense, vectors read, dense's vectors (a KV head's G times), made by
    # selecting on the last index (one expression, summed in one kernel; a stack is a buffer that kernels write)
    part = torch.arange(COLUMNS + 1, device=local.device)
    parts = torch.where(part == _SPARSITY, local.to(torch.float64)[..., None],
                        torch.where(part == _KV_SPARSITY, (~read_heads).to(torch.float64)[..., None],
                                    torch.where(part == _FAIL_SAFE, forced.expand(b, H)[..., None],
                                                torch.where(part == _KV_READ, reads[..., None],
                                                            torch.where(part == COLUMNS, 2 * T[..., None], 0.0)))))
    sums = parts.sum((0, 1))  # [6]
    column = part[:COLUMNS]  # the row elementwise from the sums: a stack of scalars is a kernel each
    divisor = torch.where(column == _KV_READ, sums[COLUMNS].clamp(min=G), torch.where(column < _STEPS, b * H, 1.0))
    return sums[:COLUMNS] / divisor + (column == _STEPS).to(torch.float64)


class DecodeStatistics:
    """Per-layer sums of sparsity, kv_sparsity and kv_read over decode steps, step counts and fail-safe counts.

    State: ``sums [L, 5]`` float64 (sparsity, kv_sparsity, steps, heads forced dense and kv_read per layer, see
    :func:`~qada.attention.group_policy.kv_read`; counts are exact in float64 up to 2^53), on the device of the
    first :meth:`prepare` or :meth:`update`: one decode step of a layer is one in-place addition to one row.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the sums (the buffer is kept and zeroed in place, so a captured graph keeps writing it)."""
        if getattr(self, "sums", None) is not None:
            self.sums.zero_()
            return
        self.sums: torch.Tensor | None = None

    @property
    def fail_safe(self) -> torch.Tensor | None:
        """0-d float64: heads forced dense over all layers and steps (``None`` before any preparation)."""
        return None if self.sums is None else self.sums[:, _FAIL_SAFE].sum()

    def prepare(self, num_layers: int, device: torch.device | str) -> None:
        """Allocate the sums for ``num_layers`` layers on ``device`` (before decoding: no allocation later)."""
        device = torch.device(device)
        if self.sums is not None and self.sums.shape[0] >= num_layers and self.sums.device == device:
            return
        old = self.sums
        self.sums = torch.zeros(num_layers, COLUMNS, dtype=torch.float64, device=device)
        if old is not None:  # a later, larger or moved preparation keeps what was counted
            self.sums[: old.shape[0]] += old.to(device)

    def update(
        self,
        layer: int,
        sparsity: torch.Tensor,
        kv_sparsity: torch.Tensor,
        fail_safe: torch.Tensor | None = None,
        kv_read: torch.Tensor | None = None,
    ) -> None:
        """Add one decode step of ``layer`` (0-d tensors from the executor; ``fail_safe``: heads forced dense;
        ``kv_read``: the fraction of the dense K/V read, ``None``: not known, and the run's ``kv_read`` is then
        ``None``)."""
        if self.sums is None or layer >= self.sums.shape[0]:
            self.prepare(layer + 1, sparsity.device)  # eager use without a prefill: allocate once
        f64 = dict(dtype=torch.float64, device=self.sums.device)
        forced = torch.zeros((), **f64) if fail_safe is None else fail_safe.detach().to(**f64)
        read = torch.full((), float("nan"), **f64) if kv_read is None else kv_read.detach().to(**f64)
        self.sums[layer].add_(torch.stack([sparsity.detach().to(**f64), kv_sparsity.detach().to(**f64),
                                           torch.ones((), **f64), forced, read]))

    def merge(self, other: DecodeStatistics) -> None:
        """Add ``other``'s sums (e.g. from another run or process)."""
        if other.sums is None:
            return
        self.prepare(other.sums.shape[0], other.sums.device if self.sums is None else self.sums.device)
        self.sums[: other.sums.shape[0]] += other.sums.to(self.sums.device)

    @property
    def steps(self) -> dict[int, int]:
        """Decode steps per layer that saw at least one (a host read)."""
        if self.sums is None:
            return {}
        counts = self.sums[:, _STEPS].tolist()
        return {layer: int(n) for layer, n in enumerate(counts) if n > 0}

    def compute(self) -> dict[str, Any]:
        """Mean sparsity, kv_sparsity and kv_read over all decoded (layer, step) pairs, per layer, and the fail-safe
        count.

        Without any decode step (a model whose every layer slides has none on its global layers) the means are
        ``None``, never ``nan``; so is ``kv_read`` where a step did not report it. Reads the device sums once (a host
        sync).
        """
        sums = self.sums.tolist() if self.sums is not None else []
        decoded = [(layer, row) for layer, row in enumerate(sums) if row[_STEPS] > 0]
        steps = sum(row[_STEPS] for _, row in decoded)
        per_layer = {layer: row[_SPARSITY] / row[_STEPS] for layer, row in decoded}
        per_layer_kv = {layer: row[_KV_SPARSITY] / row[_STEPS] for layer, row in decoded}
        per_layer_read = {layer: row[_KV_READ] / row[_STEPS] for layer, row in decoded}
        return {
            "decode_steps": int(max((row[_STEPS] for _, row in decoded), default=0)),
            "sparsity": _mean(sum(row[_SPARSITY] for _, row in decoded), steps),
            "kv_sparsity": _mean(sum(row[_KV_SPARSITY] for _, row in decoded), steps),
            "sparsity_per_layer": per_layer,
            "kv_sparsity_per_layer": per_layer_kv,
            "kv_read": _mean(sum(row[_KV_READ] for _, row in decoded), steps),
            "kv_read_per_layer": {layer: value for layer, value in per_layer_read.items() if math.isfinite(value)},
            "fail_safe": int(sum(row[_FAIL_SAFE] for row in sums)),
        }


def _mean(total: float, count: float) -> float | None:
    """``total / count``, ``None`` where there is nothing (no step) or it is not a number."""
    return total / count if count and math.isfinite(total) else None


def all_layer_sparsity(summary: dict[str, Any], layers: Any) -> dict[str, Any]:
    """``sparsity_all_layers`` / ``kv_sparsity_all_layers``: the per-layer means of ``summary`` (global layers)
    averaged with 1.0 for every sliding-window layer (all of its heads are local), plus ``global_layers`` and
    ``sliding_layers``. ``None`` where no global layer decoded (and the model has global layers)."""
    result: dict[str, Any] = {"global_layers": layers.global_layers, "sliding_layers": layers.sliding}
    for name in ("sparsity", "kv_sparsity"):
        per_layer = summary.get(f"{name}_per_layer") or {}
        decided = [per_layer[layer] for layer in layers.global_layers if layer in per_layer]
        if layers.global_layers and not decided:
            result[f"{name}_all_layers"] = None
            continue
        result[f"{name}_all_layers"] = (sum(decided) + len(layers.sliding)) / (len(decided) + len(layers.sliding))
    return result
