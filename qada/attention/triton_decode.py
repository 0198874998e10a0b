"""The ``triton`` executor: one fused split-K decode kernel that reads a KV group's bulk only when needed.

Per (row, KV head) and split of the KV blocks, a program computes all ``G`` query heads of the group: blocks
holding a window token are always read, blocks of pure bulk only when some head of the group is dense (then
the local heads mask those tokens out, or, with ``promote``, are dense themselves). Partial results are
merged by log-sum-exp; an empty split (``m = -inf``, ``l = 0``) gets weight 0, never ``-inf - -inf``.

Needs a CUDA device, or Triton's interpreter on CPU (``TRITON_INTERPRET=1`` set before triton is imported,
slow, for tests). Otherwise calling it raises: no silent fallback. triton is imported on the first call only.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from qada.attention.base import AttentionExecutor, GroupDecision, register_executor
from qada.step import DecodeStep

__all__ = ["TritonExecutor", "check_triton_runtime"]


def check_triton_runtime(device: torch.device) -> None:
    """Raise unless the ``triton`` executor can run on ``device`` (CUDA, or CPU under the interpreter)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type != "cuda" and not (device.type == "cpu" and interpret):
        raise RuntimeError(
            f"the 'triton' executor needs a CUDA device, or Triton's interpreter for CPU tensors (set "
            f"TRITON_INTERPRET=1 before triton is imported) but got tensors on {device} with "
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}; choose another executor (e.g. 'sdpa')"
        )
    if importlib.util.find_spec("triton") is None:
        raise ImportError("the 'triton' executor needs triton installed: pip install 'qada[triton]'")


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@register_executor("triton")
@dataclass
class TritonExecutor(AttentionExecutor):
    """Fused decode kernel with per-group bulk skipping and split-K (flash-decoding) over the cache.

    Args:
        block_size: KV tokens per block (a power of two >= 16).
        num_splits: splits of the KV blocks per (row, KV head); ``None`` = about two programs per SM, at
            least four blocks per split (one split on CPU).
        num_warps, num_stages: launch parameters on the GPU.

    ``bulk_blocks`` in the output counts the blocks loaded only for the bulk (no window token in them).
    """

    block_size: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
            raise ValueError(f"expected block_size to be a power of two >= 16 but got {bs!r}")
        for name in ("num_warps", "num_stages") + (("num_splits",) if self.num_splits is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"expected {name} to be a positive int but got {value!r}")
        if self.num_warps & (self.num_warps - 1):  # Triton launches a power of two of warps
            raise ValueError(f"expected num_warps to be a power of two but got {self.num_warps}")

    def splits(self, device: torch.device, pairs: int, T: int) -> int:
        """Number of splits for ``pairs = b * H_kv`` (row, KV head) programs over ``T`` tokens."""
        if self.num_splits is not None:
            return self.num_splits
        return max(1, min(_cdiv(2 * _num_sms(device), pairs), _cdiv(T, self.block_size) // 4))

    def attend(self, step: DecodeStep, decision: GroupDecision) -> tuple[torch.Tensor, torch.Tensor]:
        query, key, value = step.query[:, :, None], step.keys, step.values
        local, window, scale, start = decision.local, step.window, step.scale, step.start
        check_triton_runtime(query.device)
        if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"expected float16, bfloat16 or float32 inputs for 'triton' but got {query.dtype}")
        from qada.attention import _triton_kernel

        if query.device.type == "cpu" and not _triton_kernel.INTERPRETED:
            raise RuntimeError(
                "the 'triton' executor got CPU tensors but its kernel was compiled for the GPU: set "
                "TRITON_INTERPRET=1 before triton is first imported"
            )
        b, H, _, d = query.shape
        H_kv, T = key.shape[1], key.shape[2]
        G = H // H_kv
        # Triton's interpreter computes bfloat16 tl.dot wrongly (checked on triton 3.9): upcast there
        dot_fp32 = _triton_kernel.INTERPRETED and query.dtype == torch.bfloat16
        BLOCK_G, BLOCK_D = max(16, _next_pow2(G)), max(16, _next_pow2(d))
        pairs = b * H_kv
        S = self.splits(query.device, pairs, T)
        blocks_per_split = _cdiv(_cdiv(T, self.block_size), S)
        f32 = dict(dtype=torch.float32, device=query.device)
        acc = torch.empty(pairs, S, BLOCK_G, BLOCK_D, **f32)
        m = torch.empty(pairs, S, BLOCK_G, **f32)
        l = torch.empty(pairs, S, BLOCK_G, **f32)
        bulk_blocks = torch.empty(pairs, S, dtype=torch.int32, device=query.device)
        starts = torch.zeros(b, dtype=torch.int32, device=query.device) if start is None else start.to(torch.int32)
        _triton_kernel.qada_decode_split_kernel[(pairs, S)](
            query, key, value, local.to(torch.int8).contiguous(), starts, acc, m, l, bulk_blocks,
            query.stride(0), query.stride(1), query.stride(3),
            *key.stride(), *value.stride(),
            T, H_kv, window.t_sink, window.t_recent, blocks_per_split, S, scale,
            G=G, D=d, BLOCK_G=BLOCK_G, BLOCK_N=self.block_size, BLOCK_D=BLOCK_D,
            INPUT_PRECISION="ieee" if query.dtype == torch.float32 or dot_fp32 else None,
            DOT_FP32=dot_fp32,
            num_warps=self.num_warps, num_stages=self.num_stages,
        )  # fmt: skip
        m_max = m.amax(dim=1, keepdim=True)
        weight = torch.exp(m - torch.where(m_max == float("-inf"), 0.0, m_max))  # empty split: exp(-inf) = 0
        denominator = (weight * l).sum(dim=1)  # [pairs, BLOCK_G]
        numerator = (weight[..., None] * acc).sum(dim=1)  # [pairs, BLOCK_G, BLOCK_D]
        out = numerator / torch.where(denominator > 0, denominator, 1.0)[..., None]
        out = out[:, :G, :d].reshape(b, H, 1, d).to(query.dtype)
        return out, bulk_blocks.sum()
