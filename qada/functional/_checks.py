"""Shape and dtype checks shared by the functional math (clear errors instead of silent broadcasting)."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32: half inputs are never accumulated in half precision."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_float(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected {name} to be a torch.Tensor but got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"expected {name} to have a floating dtype {FLOAT_DTYPES} but got {tensor.dtype}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.ndim != ndim:
        raise ValueError(f"expected {name} of shape {layout} but got shape {tuple(tensor.shape)}")


def group_size(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head (GQA); raises when ``H`` is not a multiple of ``H_kv``."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"expected the number of query heads ({num_heads}) to be a multiple of the number of KV heads "
            f"({num_kv_heads})"
        )
    return num_heads // num_kv_heads
