"""The ``flex`` executor: ``torch.nn.attention.flex_attention`` with a block mask built once per length bucket.

Per ``(device, b, H, bucket, window)`` the executor keeps one :class:`BlockMask` and one ``mask_mod`` closure
over state tensors (``start [b]``, the length ``T``, ``dense [b, H]``). A step writes the new values into those
tensors and the block lists into the block mask in place (O(b·H·T/block) integer work, no
``create_block_mask``), so a compiled ``flex_attention`` sees the same closure and shapes and never recompiles
within a bucket. Buckets: ``T`` is padded to a power-of-two number of KV blocks (the padding is masked and
its blocks are never listed), so a new compilation happens only when ``T`` crosses such a boundary. Padding
copies K/V once per step unless ``T`` already is a bucket length (e.g. a preallocated static cache).

Compilation: ``compile=None`` compiles when the platform allows it (CUDA with triton, or CPU with a C++
compiler; the first CPU compile takes ~20 s) and otherwise warns once and runs ``flex_attention`` eagerly
(correct, but it materialises all scores); ``compile=True`` makes an unavailable compiler an error;
``compile=False`` always runs eagerly. Forward only: the block mask's transposed (backward) lists go stale.

A soft cap becomes a ``score_mod``; sink logits rescale the output by ``A / (A + e^z)`` from the log-sum-exp
``flex_attention`` returns.
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from qada.attention.base import AttentionExecutor, GroupDecision, register_executor
from qada.functional.capping import sink_output_scale
from qada.step import DecodeStep
from qada.window import Window

__all__ = ["FlexExecutor", "flex_compile_support"]


def flex_compile_support(device: torch.device) -> str | None:
    """``None`` when ``torch.compile(flex_attention)`` can run on ``device``, else the reason it cannot."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python build"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "triton is not installed (needed to compile for CUDA)"
    if device.type == "cpu":
        compilers = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
        if any(c and shutil.which(c) for c in compilers):
            return None
        return "no C++ compiler found (set CXX or install g++) for inductor's CPU code generation"
    return f"no known compile support for device type {device.type!r}"


@dataclass
class _BucketState:
    start: torch.Tensor  # [b] long
    length: torch.Tensor  # [b] long: one past each row's last token (the bucket is longer)
    dense: torch.Tensor  # [b, H] bool
    block_mask: Any  # torch.nn.attention.flex_attention.BlockMask


def _mask_mod(start: torch.Tensor, length: torch.Tensor, dense: torch.Tensor, t_sink: int, t_recent: int):
    """One closure per bucket: everything that changes per step is read from the captured tensors."""

    def mask_mod(b, h, q_idx, kv_idx):
        first, end = start[b], length[b]
        real = (kv_idx >= first) & (kv_idx < end)
        bulk = (kv_idx >= first + t_sink) & (kv_idx < end - t_recent)
        return real & (~bulk | dense[b, h])

    return mask_mod


def _kv_blocks(start: torch.Tensor, end: torch.Tensor, dense: torch.Tensor, window: Window, num_blocks: int,
               block: int):
    """``(kv_num_blocks [b, H, 1], kv_indices [b, H, 1, NB])`` int32: blocks holding an attended position of rows
    ``[start, end)`` (``[b]`` each)."""
    lo = torch.arange(num_blocks, device=start.device) * block
    hi = lo + block
    first = start[:, None]
    T = end[:, None]
    sink_end = torch.minimum(first + window.t_sink, T)
    bulk_end = torch.maximum(T - window.t_recent, sink_end)
    real = (lo < T) & (hi > first)  # [b, NB]
    in_window = ((lo < sink_end) & (hi > first) & (first < sink_end)) | ((hi > bulk_end) & (lo < T) & (bulk_end < T))
    need = torch.where(dense[:, :, None], real[:, None, :], in_window[:, None, :])  # [b, H, NB]
    kv_num = need.sum(-1, dtype=torch.int32)[:, :, None]
    kv_indices = torch.argsort((~need).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, :, None, :]
    return kv_num, kv_indices


def _lse_request(wanted: bool) -> dict:
    """``flex_attention``'s keyword asking for the log-sum-exp too (``return_aux`` where it exists)."""
    if not wanted:
        return {}
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # an older torch
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


@register_executor("flex")
@dataclass
class FlexExecutor(AttentionExecutor):
    """Decided attention with ``flex_attention`` (GQA via ``enable_gqa=True``), block masks reused per bucket.

    Args:
        block_size: KV block size of the block mask (a power of two >= 16).
        compile: ``None`` = compile when possible, else warn and run eagerly; ``True`` = compile or raise;
            ``False`` = always eager.
    """

    block_size: int = 128
    compile: bool | None = None
    _states: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _compiled: Any = field(default=None, init=False, repr=False, compare=False)
    _warned: bool = field(default=False, init=False, repr=False, compare=False)
    _score_mods: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
            raise ValueError(f"expected block_size to be a power of two >= 16 but got {bs!r}")
        if self.compile not in (None, True, False):
            raise ValueError(f"expected compile in (None, True, False) but got {self.compile!r}")

    def bucket_length(self, T: int) -> int:
        """The padded KV length for ``T`` tokens: a power-of-two number of blocks."""
        blocks = -(-T // self.block_size)
        return self.block_size * (1 << max(blocks - 1, 0).bit_length())

    def _attention_fn(self, device: torch.device):
        from torch.nn.attention.flex_attention import flex_attention

        if self.compile is False:
            return flex_attention
        reason = flex_compile_support(device)
        if reason is not None:
            if self.compile:
                raise RuntimeError(f"flex executor: compile=True but flex_attention cannot be compiled: {reason}")
            if not self._warned:
                warnings.warn(
                    f"flex executor runs flex_attention uncompiled (eager, materialises all scores): {reason}",
                    stacklevel=3,
                )
                self._warned = True
            return flex_attention
        if self._compiled is None:
            self._compiled = torch.compile(flex_attention, dynamic=False)
        return self._compiled

    def _state(self, device, b, H, T_pad, window) -> _BucketState:
        key = (str(device), b, H, T_pad, window.t_local, window.t_sink)
        state = self._states.get(key)
        if state is None:
            from torch.nn.attention.flex_attention import BlockMask

            start = torch.zeros(b, dtype=torch.long, device=device)
            length = torch.zeros(b, dtype=torch.long, device=device)
            dense = torch.zeros(b, H, dtype=torch.bool, device=device)
            num_blocks = T_pad // self.block_size
            block_mask = BlockMask.from_kv_blocks(
                torch.zeros(b, H, 1, dtype=torch.int32, device=device),
                torch.zeros(b, H, 1, num_blocks, dtype=torch.int32, device=device),
                # An explicit empty set of "full" blocks: inductor's CPU flex template (torch 2.13) fails to
                # compile a block mask without one (it references full_kv_num_blocks unconditionally).
                full_kv_num_blocks=torch.zeros(b, H, 1, dtype=torch.int32, device=device),
                full_kv_indices=torch.zeros(b, H, 1, num_blocks, dtype=torch.int32, device=device),
                BLOCK_SIZE=(128, self.block_size),
                mask_mod=_mask_mod(start, length, dense, window.t_sink, window.t_recent),
                seq_lengths=(1, T_pad),
            )
            state = self._states[key] = _BucketState(start, length, dense, block_mask)
        return state

    def attend(self, step: DecodeStep, decision: GroupDecision) -> tuple[torch.Tensor, None]:
        local = decision.local
        b, H = local.shape
        T, window = step.length, step.window
        T_pad = self.bucket_length(T)
        starts = step.starts
        state = self._state(step.device, b, H, T_pad, window)
        ends = step.end if step.end is not None else torch.full_like(starts, T)
        state.start.copy_(starts)
        state.length.copy_(ends)
        state.dense.copy_(~local)
        kv_num, kv_indices = _kv_blocks(starts, ends, ~local, window, T_pad // self.block_size, self.block_size)
        state.block_mask.kv_num_blocks.copy_(kv_num)
        state.block_mask.kv_indices.copy_(kv_indices)
        key, value = step.keys, step.values
        if T_pad != T:
            key = F.pad(key, (0, 0, 0, T_pad - T))
            value = F.pad(value, (0, 0, 0, T_pad - T))
        attention = self._attention_fn(step.device)
        sinks = step.sink_logits is not None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = attention(step.query[:, :, None], key, value, block_mask=state.block_mask, scale=step.scale,
                            enable_gqa=True, score_mod=self._score_mod(step.softcap), **_lse_request(sinks))
        if sinks:  # the sink logits join the denominator: out * A / (A + e^z), from the log-sum-exp A
            out, aux = out
            lse = getattr(aux, "lse", aux)
            out = (out.float() * sink_output_scale(lse[..., 0].float(), step.sink_logits)[..., None, None]
                   ).to(step.query.dtype)
        return out, None

    def _score_mod(self, softcap: float | None):
        """A ``score_mod`` applying the soft cap ``softcap`` (one per value, so that a compiled ``flex_attention``
        sees the same function every step), ``None`` without one."""
        if softcap is None:
            return None
        mod = self._score_mods.get(softcap)
        if mod is None:
            def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001
                return torch.tanh(score / softcap) * softcap

            self._score_mods[softcap] = mod
        return mod
