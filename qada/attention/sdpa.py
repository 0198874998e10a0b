"""The ``sdpa`` executor: PyTorch's ``scaled_dot_product_attention`` on the gathered window, plus full
attention only for the KV groups that read their bulk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from qada.attention.base import AttentionExecutor, GroupDecision, register_executor
from qada.attention.streamed import balanced_chunks, kernel_error, specialised, streamed_attention, streamed_fits
from qada.functional.capping import soft_cap, softmax_with_sink_column
from qada.functional.checks import accumulation_dtype
from qada.step import DecodeStep

__all__ = ["HostPlan", "SDPAExecutor", "dense_row", "pack_host_plan", "products_attention", "skips_on_host",
           "split_k_attention"]


@register_executor("sdpa")
@dataclass
class SDPAExecutor(AttentionExecutor):
    """Window attention for every head (``W = min(T, T_local)`` gathered keys, cheap), full attention only
    for the (row, KV group) pairs with a dense head.

    The ``G`` query heads of a KV group attend as ``G`` query rows of its single KV head (no repeat of K/V).
    Full attention runs once over the whole batch when every group reads its bulk; otherwise each read
    (row, group) attends over views of its own K/V (no copy of the cache). On the CPU (``splits=None``, the default)
    each read group's keys are cut into chunks attended in one call and merged by log-sum-exp (split-K), as many as
    spread the call's work items evenly over the torch threads (:func:`~qada.attention.streamed.balanced_chunks`):
    one group alone is otherwise a single work item, i.e. a single core (on 2 cores one group took 217 us, the same
    as two; split in two, 129 us). On the embedded model at 7.68k this made the decode step 1-4% faster.
    ``splits=1`` turns it off. In float32 such a group attends by qada's streamed C kernel (``streamed``), else by
    two BLAS products.
    On the CPU the window is skipped when no head is local. A step with a soft cap or sink logits (Gemma-2, gpt-oss)
    attends in explicit scores instead of ``scaled_dot_product_attention``, which cannot apply them, over the same
    keys.

    Choosing the groups needs them on the host: one host read per call (:class:`HostPlan`: the groups read, whether
    a head is local, how far the rows reach, in one transfer) when ``T > T_local``. On the CPU that costs nothing
    (there is no device queue to drain), so that is the default there; with ``host_skip=False`` (the default on
    other devices) every group attends in full and the window result is chosen per head on the device: no host sync
    and no Python loop, but no K/V bytes saved either — on a GPU the ``triton`` executor skips bulk reads inside its
    kernel and ``flex`` through block masks updated in place, both without a sync. The reported sparsities stay on
    the device.

    Args:
        splits: key chunks per read group on the CPU (``None``, the default: as many as spread the KV heads of
            each call evenly over the torch threads, :func:`~qada.attention.streamed.balanced_chunks`; 1: no
            split-K).
        min_split: shortest chunk worth a split, in tokens.
        host_skip: skip the bulk of unread groups by a host-side choice (``None``: on the CPU only).
        step_window: inside a run, take every head's attention over the window from the layer step
            (:attr:`~qada.step.DecodeStep.window_output`: computed from the window scores the criterion computed
            anyway, one small product inside the compiled step) instead of attending over the window here; a step
            without it (the executor called on its own) attends here. On the embedded model at 7.68k on the CPU this
            saves an attention call per layer.
        products: on the CPU in float32, a read group whose keys would be split (``splits``) attends by two BLAS
            products instead (:func:`products_attention`: the scores, their softmax, the values), which read a
            group's cold K/V faster than the flash kernel does for a few query rows: on the embedded model at 7.68k
            the ``qada_tail`` decode step with the read-lean settings was 3-4% faster (steps alternated in one
            process). ``False``: the split-K flash kernel. Other dtypes always take the flash kernel (whose sums are
            in float32).
        streamed: on the CPU in float32, a read group attends by qada's C kernel
            (:func:`~qada.attention.streamed.streamed_attention`: one pass over its K and V, an online softmax, the
            threads sharing its keys): every read group where the kernel has a version for its group size and head
            dim (:func:`~qada.attention.streamed.specialised`: 1-8 query heads per KV head, 64 or 128 features, which
            beat PyTorch's flash attention at every length measured), else a group whose keys would be split; built
            by the machine's C compiler on first use. Inside decode steps on 2 cores its first, general version read
            the groups at 8.7 GB/s against 6.6 GB/s for the BLAS products (whole steps ~1.5% faster). Where it cannot
            run (:func:`~qada.attention.streamed.kernel_error`), or with ``False``, such a group takes the
            ``products`` path (or flash attention, unsplit).
    """

    splits: int | None = None
    min_split: int = 1024
    host_skip: bool | None = None
    step_window: bool = True
    products: bool = True
    streamed: bool = True

    @property
    def uses_window_output(self) -> bool:
        """Whether a run's layer step attends over the window for this executor (``step_window``)."""
        return self.step_window

    @property
    def host_plan(self) -> bool | None:
        """Where a run's layer step packs what :meth:`HostPlan.read` reads into one tensor (``True``: on every
        device, ``None``: on the CPU, ``False``: never): where this executor skips by a host-side choice."""
        return self.host_skip

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("min_split", 1),) + ((("splits", 1),) if self.splits is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"expected {name} to be an int >= {low} but got {value!r}")
        if self.host_skip not in (None, True, False):
            raise ValueError(f"expected host_skip in (None, True, False) but got {self.host_skip!r}")
        for name in ("step_window", "products", "streamed"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {name} to be a bool but got {getattr(self, name)!r}")

    @property
    def static_shapes(self) -> bool:  # type: ignore[override]
        """On a preallocated buffer without host syncs unless ``host_skip=True`` is forced: the default reads the
        decision on the host only on the CPU, where that is no round trip (there is no device queue to drain)."""
        return self.host_skip is not True

    def _chunks(self, step: DecodeStep, real: torch.Tensor | None, length: int, items: int) -> int:
        """How many key chunks each of the ``items`` KV heads of one call, ``length`` keys each, is split into (1:
        none); ``real``: the mask of the keys attended (``None``: every row holds all of them)."""
        if step.device.type != "cpu" or real is not None or _FLASH_CPU is None or not step.plain_softmax:
            return 1
        if step.query.dtype not in (torch.float32, torch.bfloat16) or step.keys.stride(-1) != 1:
            return 1
        wanted = self.splits if self.splits is not None else balanced_chunks(items, torch.get_num_threads())
        return max(1, min(wanted, length // self.min_split))

    def attend(self, step: DecodeStep, decision: GroupDecision) -> tuple[torch.Tensor, None]:
        local, read = decision
        if skips_on_host(self.host_skip, step.device):
            return self._attend_planned(step, HostPlan.read(step, local, read), local), None  # the one host read
        # every group in full, the window result chosen per head: no sync, no loop
        b, H, d = step.query.shape
        # GQA without a repeat of K/V: the G query heads of a group attend as G query rows of its one KV head.
        rows = step.query.reshape(b, step.num_kv_heads, H // step.num_kv_heads, d)
        sdpa = _attention_for(step)
        out = self._window(step, rows, sdpa).reshape(b, H, 1, d)  # GPU kernels may return it strided
        if step.length <= step.window.t_local:  # the window is the whole cache: nothing else to read
            return out, None
        return torch.where(local[:, :, None, None], out, _whole_rows(step, rows, sdpa)), None

    def attend_dense(self, step: DecodeStep, add_to: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, None, torch.Tensor]:
        """Every head of ``step`` over its whole row (the ``dense`` criterion's decision after the group policy: the
        heads of a row without a bulk are local, their window being the row), with no decision to compute or read:
        ``(output [b, H, 1, d], None, row [5] float64)``, ``row`` the step's statistics (:func:`dense_row`), also
        added to ``sums[layer]`` with ``add_to = (sums, layer)``. Where this executor skips on the host (the CPU) the
        rows' bounds are its one host read (:meth:`HostPlan.dense`) and every row with a bulk attends as
        :meth:`attend` attends a read group; elsewhere every row attends in full under its mask, on the device."""
        b, H, d = step.query.shape
        if skips_on_host(self.host_skip, step.device):
            plan, bulkless = HostPlan.dense(step)
            local = torch.tensor(bulkless, device=step.device)[:, None].expand(b, H) if plan.any_local else None
            output = self._attend_planned(step, plan, local)
            skipped = sum(bulkless) / b
            row = torch.tensor([skipped, skipped, 1.0, 0.0, 1.0], dtype=torch.float64, device=step.device)
        else:
            rows = step.query.reshape(b, step.num_kv_heads, H // step.num_kv_heads, d)
            output = _whole_rows(step, rows, _attention_for(step))
            row = dense_row(step.has_bulk)
        if add_to is not None:
            sums, layer = add_to
            sums.index_add_(0, layer.reshape(1), row[None])
        return output, None, row

    def _attend_planned(self, step: DecodeStep, plan: HostPlan, local: torch.Tensor | None) -> torch.Tensor:
        """:meth:`attend`'s host-skipping path after its host read: the window for the ``local [b, H]`` heads where
        ``plan`` has some, the bulk of ``plan``'s pairs (``[b, H, 1, d]``)."""
        b, H, d = step.query.shape
        H_kv, T = step.num_kv_heads, step.length
        G = H // H_kv
        key, value, scale = step.keys, step.values, step.scale
        rows = step.query.reshape(b, H_kv, G, d)
        sdpa = _attention_for(step)
        out = None
        if plan.any_local:  # the window, for the local heads
            out = self._window(step, rows, sdpa)  # [b, H_kv, G, d]
            if T <= step.window.t_local or not plan.pairs:  # nothing else to read
                return out.reshape(b, H, 1, d)
        # the mask of the keys attended, built only where some row needs one (~100 us a layer on a 2-core CPU)
        if step.end is not None:  # a preallocated buffer: attend only as far as some row reaches
            key, value = key[:, :, : plan.reach], value[:, :, : plan.reach]
            # unmasked where every row holds the slots [0, reach)
            real = None if plan.unmasked or step.real is None else step.real[:, : plan.reach]
            T = plan.reach
        else:
            real = step.real
        streams = self._streams(step, real)
        compiled = streams and specialised(G, d)  # its version for this shape: faster than flash, any T measured
        if not compiled and len(plan.pairs) == b * H_kv and self._chunks(step, real, T, len(plan.pairs)) == 1:
            mask = None if real is None else real[:, None, None, :]
            full = sdpa(rows, key, value, attn_mask=mask, scale=scale)
        else:
            # The read KV groups of a row attend in as few calls as possible, over views of the cache (no copy): the
            # groups of an arithmetic progression are one strided view, one call that the threads share. Heads of
            # unread groups are all local: their rows of ``full`` are never chosen.
            full = torch.empty_like(rows)
            for row, groups in _groups_by_row(plan.pairs):
                for run in _progressions(groups):
                    heads = _heads(run)  # views, strided over the progression's KV heads
                    q, k, v = rows[row : row + 1, heads], key[row : row + 1, heads], value[row : row + 1, heads]
                    chunks = self._chunks(step, real, T, len(run))
                    if streams and (compiled or chunks > 1) and streamed_fits(q, k, v):
                        full[row, heads] = streamed_attention(q, k, v, scale)
                    elif chunks > 1 and self.products and step.query.dtype == torch.float32:
                        full[row, heads] = products_attention(q, k, v, scale)
                    elif chunks > 1:
                        full[row, heads] = split_k_attention(q, k, v, scale, chunks)
                    else:
                        full[row, heads] = sdpa(
                            q, k, v, attn_mask=None if real is None else real[row : row + 1, None, None, :],
                            scale=scale, groups=run)[0]
        if out is not None:  # some heads local, among them maybe some of a read group's
            full = torch.where(local.reshape(b, H_kv, G, 1), out, full)
        return full.reshape(b, H, 1, d)

    def _streams(self, step: DecodeStep, real: torch.Tensor | None) -> bool:
        """Whether qada's streamed kernel may attend this call's read groups (:attr:`streamed`): on the CPU in
        float32, plain softmax, no mask of the keys attended (``real``), the kernel built here."""
        return (self.streamed and real is None and step.device.type == "cpu" and step.plain_softmax
                and step.query.dtype == torch.float32 and kernel_error() is None)

    @staticmethod
    def _window(step: DecodeStep, rows: torch.Tensor, sdpa) -> torch.Tensor:
        """Every head's attention over its row's gathered window: ``[b, H_kv, G, d]`` (the layer step's
        :attr:`~qada.step.DecodeStep.window_output` where it computed it)."""
        if step.window_output is not None:
            return step.window_output.view(rows.shape)
        mask = None if step.full_rows else step.window_valid[:, None, None, :]
        return sdpa(rows, step.window_keys, step.window_values, attn_mask=mask, scale=step.scale)


class HostPlan(NamedTuple):
    """What the host-skipping path reads of a step's decision and rows, in one host read (:meth:`read`).

    Attributes:
        pairs: the ``(row, KV head)`` pairs whose bulk is read, row-major.
        any_local: whether some head is local (the window is attended).
        reach: one past the last slot some row holds (a preallocated buffer), else the step's length.
        unmasked: whether every row holds the slots ``[0, reach)`` (no mask needed; on a growing cache, whether the
            step has no row starts).
    """

    pairs: list[tuple[int, int]]
    any_local: bool
    reach: int
    unmasked: bool

    @classmethod
    def read(cls, step: DecodeStep, local: torch.Tensor, read: torch.Tensor) -> HostPlan:
        """The plan of ``step`` with ``local [b, H]`` and ``read [b, H_kv]`` (bool): one concatenation
        (:func:`pack_host_plan`, or the layer step's, :attr:`~qada.step.DecodeStep.host_plan`), one host read, the
        rest in Python."""
        b, H_kv = read.shape
        packed = step.host_plan
        if packed is None:
            packed = pack_host_plan(local, read, step.start, step.end)
        values = packed.tolist()  # the host read
        flags, rest = values[: b * H_kv], values[b * H_kv :]
        pairs = [(i // H_kv, i % H_kv) for i, flag in enumerate(flags) if flag]
        any_local = any(rest[: local.numel()])
        bounds = rest[local.numel() :]
        if not bounds:  # a growing cache: every row ends at its length
            return cls(pairs, any_local, step.length, step.start is None)
        return cls(pairs, any_local, *_reach(bounds[:b], bounds[b:]))

    @classmethod
    def dense(cls, step: DecodeStep) -> tuple[HostPlan, list[bool]]:
        """The plan of the ``dense`` criterion's step (every row with a bulk reads it, every head of a row without
        one is local) and which rows have no bulk: made from the rows' bounds alone, read in one host read where the
        step has them."""
        b, H_kv, t_local = step.batch_size, step.num_kv_heads, step.window.t_local
        if step.end is None:  # a growing cache: every row ends at its length
            starts = [0] * b if step.start is None else step.start.tolist()
            ends, reach, unmasked = [step.length] * b, step.length, step.start is None
        else:
            bounds = (step.end if step.start is None else torch.cat([step.end, step.start])).tolist()
            ends, starts = bounds[:b], bounds[b:] or [0] * b
            reach, unmasked = _reach(ends, starts)
        bulkless = [end - start <= t_local for start, end in zip(starts, ends, strict=True)]
        pairs = [(row, group) for row in range(b) if not bulkless[row] for group in range(H_kv)]
        return cls(pairs, any(bulkless), reach, unmasked), bulkless


def _reach(ends: list[int], starts: list[int]) -> tuple[int, bool]:
    """``(reach, unmasked)`` of :class:`HostPlan` for a buffer's rows ending at ``ends`` and starting at ``starts``
    (empty: all at 0)."""
    reach = max(ends)
    return reach, min(ends) == reach and not any(starts)


def _whole_rows(step: DecodeStep, rows: torch.Tensor, sdpa) -> torch.Tensor:
    """Every head of ``step`` over its whole row under the mask of the keys attended (none for full rows), on the
    device: ``[b, H, 1, d]`` from its query ``rows [b, H_kv, G, d]`` and ``sdpa`` (:func:`_attention_for`)."""
    b, H, d = step.query.shape
    real = step.real
    mask = None if real is None else real[:, None, None, :]
    return sdpa(rows, step.keys, step.values, attn_mask=mask, scale=step.scale).reshape(b, H, 1, d)


def dense_row(has_bulk: torch.Tensor) -> torch.Tensor:
    """The ``dense`` criterion's statistics row from ``has_bulk [b]`` bool, ``[5]`` float64 as a run's statistics
    hold it (:class:`~qada.attention.triton_decode.StepStatistics`' ``row``): the fraction of heads local and of bulks
    not read (the rows without a bulk), 1 (a step), no head forced dense, and ``kv_read`` 1 (a row without a bulk
    reads its window, which is the whole row). Device work only."""
    skipped = (~has_bulk).to(torch.float64).mean()
    one, zero = torch.ones_like(skipped), torch.zeros_like(skipped)
    return torch.stack([skipped, skipped, one, zero, one])


def skips_on_host(host_skip: bool | None, device: torch.device) -> bool:
    """Whether the ``sdpa`` executor with ``host_skip`` chooses the groups to read on the host on ``device``
    (``None``: on the CPU only); the run's layer step packs its host read by the same rule (:func:`pack_host_plan`)."""
    return host_skip if host_skip is not None else device.type == "cpu"


def pack_host_plan(local: torch.Tensor, read: torch.Tensor, start: torch.Tensor | None, end: torch.Tensor | None
                   ) -> torch.Tensor:
    """What :meth:`HostPlan.read` reads, as one int64 vector: ``read [b, H_kv]`` and ``local [b, H]`` flattened,
    then (a preallocated buffer) ``end [b]`` and ``start [b]`` where given. Computed by the run's layer step where
    the executor asks for it (:attr:`SDPAExecutor.host_plan`), so that the executor's host read is one call."""
    parts = [read.reshape(-1), local.reshape(-1)]
    if end is not None:
        parts += [end] + ([] if start is None else [start])
    return torch.cat([p.to(torch.int64) for p in parts])


def _heads(run: list[int]) -> slice:
    """The KV heads of an arithmetic progression ``run`` as a slice: indexing ``[b, H_kv, ...]`` by it makes a
    strided view, no copy."""
    step = run[1] - run[0] if len(run) > 1 else 1
    return slice(run[0], run[-1] + 1, step)


def _attention_for(step: DecodeStep):
    """``attention(q [B, K, G, d], k, v [B, K, N, d], attn_mask, scale, groups=None) -> [B, K, G, d]`` for ``step``:
    PyTorch's ``scaled_dot_product_attention`` for plain softmax attention; with the step's soft cap or sink logits
    (which it cannot do) the same in explicit scores, ``groups`` naming the KV heads of ``K`` (``None``: all)."""
    if step.plain_softmax:
        return lambda q, k, v, attn_mask=None, scale=None, groups=None: F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, scale=scale)
    G = step.group_size
    sinks = None if step.sink_logits is None else step.sink_logits.view(-1, G)  # [H_kv, G]

    def attention(q, k, v, attn_mask=None, scale=None, groups=None):
        dtype = accumulation_dtype(q, k)
        scores = soft_cap((q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale, step.softcap)  # [B, K, G, N]
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        if sinks is None:
            probabilities = torch.softmax(scores, -1)
        else:
            sink = sinks if groups is None else sinks[groups]  # [K, G]: the sink logits of these KV heads' queries
            probabilities = softmax_with_sink_column(scores, sink[None, :, :, None])
        return (probabilities @ v.to(dtype)).to(q.dtype)

    return attention


def _groups_by_row(pairs: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """``[(row, [KV heads ascending])]`` from ``(row, KV head)`` pairs in row-major order (``nonzero``'s)."""
    grouped: dict[int, list[int]] = {}
    for row, group in pairs:
        grouped.setdefault(row, []).append(group)
    return list(grouped.items())


def _progressions(groups: list[int]) -> list[list[int]]:
    """Ascending ``groups`` cut into runs of equal steps (arithmetic progressions), each one strided view."""
    runs = [[groups[0]]]
    for group in groups[1:]:
        run = runs[-1]
        if len(run) == 1 or group - run[-1] == run[1] - run[0]:
            run.append(group)
        else:
            runs.append([group])
    return runs


# PyTorch's CPU flash-attention kernel, which also returns the log-sum-exp of each query row (None if absent).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def products_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``q [1, n, G, d]`` over ``k, v [1, n, T, d]`` (views of the cache), ``[n, G, d]`` out, as two
    batched BLAS products: ``softmax(q k^T * scale) v`` with the ``[n, G, T]`` scores in ``q``'s dtype (float32 on
    the path that takes it). The library spreads each product over the threads along ``T``."""
    scores = torch.matmul(q[0], k[0].transpose(-1, -2)).mul_(scale)  # [n, G, T]
    return torch.matmul(torch.softmax(scores, -1), v[0])


def split_k_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunks: int) -> torch.Tensor:
    """Attention of ``q [1, n, G, d]`` over ``k, v [1, n, T, d]`` (views whose last dim is contiguous, e.g. the
    strided view of a progression of KV heads), ``[n, G, d]`` out: split-K (flash-decoding) on the CPU.

    Each head's keys are cut into ``chunks`` equal views (strides only, no copy): ``n * chunks`` independent work
    items in one call of the CPU flash kernel, which parallelises over them (one head alone would be one item, one
    core). The ``T mod chunks < chunks`` keys left over are attended in explicit scores (a second kernel call costs
    more than they do); the parts are merged by the softmax of their log-sum-exps. No padding: every key is
    attended once.
    """
    n, G, d = q.shape[1], q.shape[2], q.shape[3]
    T = k.shape[2]
    c = T // chunks

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [n, chunks, c, d]: head h's chunk j = keys j*c .. j*c+c-1
        return x.as_strided((n, chunks, c, d), (x.stride(1), c * x.stride(2), x.stride(2), x.stride(3)),
                            x.storage_offset())

    out, lse = _FLASH_CPU(q[0][:, None].expand(n, chunks, G, d), chunked(k), chunked(v), scale=scale)[:2]
    out, lse = out.float(), lse.float()  # [n, chunks, G, d], [n, chunks, G]
    if chunks * c < T:  # the rest, [n, r, d]: scores in float32
        rest_k, rest_v = k[0, :, chunks * c :].float(), v[0, :, chunks * c :].float()
        scores = (q[0].float() @ rest_k.transpose(1, 2)) * scale  # [n, G, r]
        rest_lse = torch.logsumexp(scores, -1)  # [n, G]
        rest = torch.softmax(scores, -1) @ rest_v  # [n, G, d]
        out, lse = torch.cat([out, rest[:, None]], 1), torch.cat([lse, rest_lse[:, None]], 1)
    weight = torch.softmax(lse, dim=1)  # [n, parts, G]
    return (out * weight[..., None]).sum(1).to(q.dtype)
