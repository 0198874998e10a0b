"""Shape and dtype checks shared by the math, the step, criteria and executors (clear errors, no silent broadcast)."""

from __future__ import annotations

import math

import torch

__all__ = [
    "FLOAT_DTYPES",
    "accumulation_dtype",
    "check_covariance",
    "check_float",
    "check_head_mask",
    "check_head_scores",
    "check_ndim",
    "check_positive",
    "group_size",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32: half inputs are never accumulated in half precision."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_float(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected {name} to be a torch.Tensor but got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"expected {name} to have a floating dtype {FLOAT_DTYPES} but got {tensor.dtype}")


def check_positive(name: str, value: float) -> None:
    """Raise unless ``value`` is a finite float > 0. Not while ``torch.compile`` traces: there a float argument may
    be symbolic (a process whose runs use several scales), and it was checked eagerly before."""
    if torch.compiler.is_compiling():
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected {name} to be a finite float > 0 but got {value!r}")


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


def check_head_mask(name: str, mask: object, batch: int, heads: int, device: torch.device | None = None) -> None:
    """Raise unless ``mask`` is a bool tensor ``[batch, heads]`` (on ``device`` when given)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (batch, heads):
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"expected {name} to be a bool tensor of shape [{batch}, {heads}] but got {got}")
    if device is not None and mask.device != device:
        raise ValueError(f"expected {name} on {device} but got it on {mask.device}")


def check_head_scores(name: str, scores: object, batch: int, heads: int) -> None:
    """Raise unless ``scores`` is a floating tensor ``[batch, heads]`` (one value per row and query head)."""
    if not isinstance(scores, torch.Tensor) or not scores.dtype.is_floating_point:
        got = scores.dtype if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"expected {name} to be a floating tensor of shape [{batch}, {heads}] but got {got}")
    if tuple(scores.shape) != (batch, heads):
        raise ValueError(f"expected {name} of shape [{batch}, {heads}] but got {tuple(scores.shape)}")


def check_covariance(name: str, cov: torch.Tensor, tol: float = 1e-4) -> None:
    """Raise unless every matrix of ``cov [..., d, d]`` is finite, symmetric and positive semi-definite.

    Checked in float64 relative to each matrix's scale ``s`` (its largest absolute entry):
    ``|C - Cᵀ| <= tol s`` and smallest eigenvalue ``>= -tol s`` (float32 rounding of a covariance stays far
    inside both).
    """
    if cov.ndim < 2 or cov.shape[-1] != cov.shape[-2]:
        raise ValueError(f"expected {name} of shape [..., d, d] but got {tuple(cov.shape)}")
    if cov.numel() == 0:
        return
    c = cov.detach().to(torch.float64)
    if not bool(torch.isfinite(c).all()):
        raise ValueError(f"expected {name} to be finite but it holds NaN or inf")
    scale = c.abs().amax(dim=(-1, -2))  # [...]
    asymmetry = (c - c.transpose(-1, -2)).abs().amax(dim=(-1, -2))
    if bool((asymmetry > tol * scale).any()):
        worst = float((asymmetry / scale.clamp_min(torch.finfo(torch.float64).tiny)).max())
        raise ValueError(f"expected {name} to be symmetric but an entry differs from its transpose by {worst:.3g} "
                         "of the matrix's scale")
    # smallest eigenvalue >= -tol s  <=>  C + tol s I has a Cholesky factor (cheaper than eigenvalues)
    shift = (tol * scale.clamp_min(torch.finfo(torch.float64).tiny))[..., None, None]
    _, failed = torch.linalg.cholesky_ex(c + shift * torch.eye(c.shape[-1], dtype=c.dtype))
    if bool((failed != 0).any()):
        where = [int(i) for i in (failed != 0).nonzero()[0]]
        smallest = float(torch.linalg.eigvalsh(c[tuple(where)])[0])
        raise ValueError(
            f"expected {name} to be positive semi-definite but matrix {where} has eigenvalue {smallest:.3g} "
            f"(scale {float(scale[tuple(where)]):.3g})"
        )
