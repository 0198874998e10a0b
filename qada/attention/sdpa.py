"""The ``sdpa`` executor: PyTorch's ``scaled_dot_product_attention`` on the gathered window, plus full
attention only for the KV groups that read their bulk."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from qada.attention.base import AttentionExecutor, GroupDecision, register_executor
from qada.functional.capping import soft_cap, softmax_with_sink_column
from qada.functional.checks import accumulation_dtype
from qada.step import DecodeStep

__all__ = ["SDPAExecutor"]


@register_executor("sdpa")
@dataclass
class SDPAExecutor(AttentionExecutor):
    """Window attention for every head (``W = min(T, T_local)`` gathered keys, cheap), full attention only
    for the (row, KV group) pairs with a dense head.

    The ``G`` query heads of a KV group attend as ``G`` query rows of its single KV head (no repeat of K/V).
    Full attention runs once over the whole batch when every group reads its bulk; otherwise each read
    (row, group) attends over views of its own K/V (no copy of the cache). With ``splits > 1`` (CPU, no padding)
    each read group's keys are cut into that many chunks attended in one call and merged by log-sum-exp (split-K),
    since one group is otherwise a single work item, i.e. a single core: 1.6-1.9x as fast for one group in
    isolation on 2 cores, but no end-to-end gain measured on the embedded model (between two layers the model's
    weights stream through the caches; measured again in place, ratio 0.99-1.01), hence off by default. On the
    CPU the window is skipped when no head is local. A step with a soft cap or sink logits (Gemma-2, gpt-oss)
    attends in explicit scores instead of ``scaled_dot_product_attention``, which cannot apply them, over the same
    keys.

    Choosing the groups needs them on the host: one sync per call (``nonzero``) when ``T > T_local``. On the CPU
    that costs nothing (there is no device queue to drain), so that is the default there; with
    ``host_skip=False`` (the default on other devices) every group attends in full and the window result is
    chosen per head on the device: no host sync and no Python loop, but no K/V bytes saved either — on a GPU the
    ``triton`` executor skips bulk reads inside its kernel and ``flex`` through block masks updated in place,
    both without a sync. The reported sparsities stay on the device.

    Args:
        splits: key chunks per read group on the CPU (1: no split-K, the default; ``None``: as many as spread the
            KV heads of each call evenly over the torch threads, :func:`balanced_chunks`).
        min_split: shortest chunk worth a split, in tokens.
        host_skip: skip the bulk of unread groups by a host-side choice (``None``: on the CPU only).
    """

    splits: int | None = 1
    min_split: int = 1024
    host_skip: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("min_split", 1),) + ((("splits", 1),) if self.splits is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"expected {name} to be an int >= {low} but got {value!r}")
        if self.host_skip not in (None, True, False):
            raise ValueError(f"expected host_skip in (None, True, False) but got {self.host_skip!r}")

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
        b, H, d = step.query.shape
        H_kv, T = step.num_kv_heads, step.length
        key, value, scale = step.keys, step.values, step.scale
        # GQA without a repeat of K/V: the G query heads of a group attend as G query rows of its one KV head.
        rows = rearrange(step.query, "b (k g) d -> b k g d", k=H_kv)
        real = step.real
        host = self.host_skip if self.host_skip is not None else step.device.type == "cpu"
        sdpa = _attention_for(step)
        out = None
        if not host or bool(local.any()):  # data-dependent shortcuts only where a host sync is allowed
            valid = step.window_valid
            out = sdpa(
                rows, step.window_keys, step.window_values,
                attn_mask=None if step.full_rows else valid[:, None, None, :], scale=scale,
            ).reshape(b, H, 1, d)  # GPU kernels may return it strided
            if T <= step.window.t_local:  # the window is the whole cache: nothing else to read
                return out, None
        if not host:  # every group in full, the window result chosen per head: no sync, no loop
            mask = None if real is None else real[:, None, None, :]
            full = sdpa(rows, key, value, attn_mask=mask, scale=scale).reshape(b, H, 1, d)
            return torch.where(local[:, :, None, None], out, full), None
        pairs = read.nonzero()  # [n, 2] (row, KV head): host sync
        n = pairs.shape[0]
        if n == 0:
            return out, None
        if step.end is not None:  # a preallocated buffer: read on the host how far the rows reach, attend only there
            key, value, real = _filled(key, value, real, step)
            T = key.shape[2]
        if n == b * H_kv and self._chunks(step, real, T, n) == 1:
            mask = None if real is None else real[:, None, None, :]
            full = sdpa(rows, key, value, attn_mask=mask, scale=scale).reshape(b, H, 1, d)
        else:
            # The read KV groups of a row attend in as few calls as possible, over views of the cache (no copy): the
            # groups of an arithmetic progression are one strided view, one call that the threads share.
            full = (out.clone() if out is not None else torch.empty_like(step.query)[:, :, None]).view(
                b, H_kv, H // H_kv, d)
            for row, groups in _groups_by_row(pairs.tolist()):
                for run in _progressions(groups):
                    q = rows[row : row + 1, run]  # [1, n, G, d]
                    k, v = _head_view(key, row, run), _head_view(value, row, run)
                    chunks = self._chunks(step, real, T, len(run))
                    if chunks > 1:
                        full[row, run] = split_k_attention(q, k, v, scale, chunks)
                    else:
                        full[row, run] = sdpa(
                            q, k, v, attn_mask=None if real is None else real[row : row + 1, None, None, :],
                            scale=scale, groups=run)[0]
            full = full.view(b, H, 1, d)
        if out is None:
            return full, None
        return torch.where(local[:, :, None, None], out, full), None


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


def _groups_by_row(pairs: list[list[int]]) -> list[tuple[int, list[int]]]:
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


def _head_view(x: torch.Tensor, row: int, heads: list[int]) -> torch.Tensor:
    """``x[row:row+1, heads]`` of ``x [b, H_kv, T, d]`` for an arithmetic progression ``heads``, as a view."""
    step = heads[1] - heads[0] if len(heads) > 1 else 1
    size = (1, len(heads), x.shape[2], x.shape[3])
    stride = (x.stride(0), step * x.stride(1), x.stride(2), x.stride(3))
    return x.as_strided(size, stride, x.storage_offset() + row * x.stride(0) + heads[0] * x.stride(1))


def _filled(key: torch.Tensor, value: torch.Tensor, real: torch.Tensor, step: DecodeStep):
    """``key, value [b, H_kv, T', d]`` and ``real [b, T']`` (``None`` when every row fills them) cut to the slots
    some row holds (``T' = max end``): one host read, for the host-skipping path only; unmasked where every row
    holds slots ``[0, T')`` (a ``start`` of zeros included)."""
    bounds = [step.end.min(), step.end.max()] + ([] if step.start is None else [step.start.max()])
    lo, hi, *first = torch.stack(bounds).tolist()  # one host read
    key, value, real = key[:, :, :hi], value[:, :, :hi], real[:, :hi]
    if lo == hi and not any(first):  # every row holds the slots [0, hi): attend unmasked
        real = None
    return key, value, real


# PyTorch's CPU flash-attention kernel, which also returns the log-sum-exp of each query row (None if absent).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def balanced_chunks(items: int, threads: int) -> int:
    """Key chunks per item so that ``items * chunks`` work items share ``threads`` evenly: ``threads / gcd``
    (1 item on 2 threads: 2 chunks; 3 items: 2, i.e. 6 items, 3 per thread; 2 items: 1)."""
    return threads // math.gcd(items, threads)


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
