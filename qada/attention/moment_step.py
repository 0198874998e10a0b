"""The built-in moment sources' decode step as one Triton launch, for the ``triton_fused`` executor's layer step.

The launches run the step on the device with :mod:`qada.attention._moment_kernel`, one program per (row, KV
head), instead of the source's torch step (dozens of small operations, so dozens of kernels on a GPU):

* :func:`current_step_launch`: Welford's rank-1 update of the ``current`` source
  (:func:`~qada.moments.current.current_buffer_step`);
* :func:`stored_step_launch`: the ``stored`` source's reference range moving by one key or jumping
  (:func:`~qada.moments.stored.advance_reference_range`).

Each updates the same state in place and returns the same float32 moments as the source's own step, up to float64
rounding (a covariance entry may differ in its last float32 bit). Which source has a kernel is decided by the
run's layer step (:mod:`qada.models.fused_step`).
"""

from __future__ import annotations

import torch

from qada.attention.triton_decode import _next_pow2
from qada.step import BulkMoments

__all__ = ["current_step_launch", "stored_step_launch"]

_BLOCK_R = 16
"""Rows of the co-moment updated per tile."""


def _constants(d: int, start: torch.Tensor | None) -> dict:
    return dict(D=d, BLOCK_R=_BLOCK_R, BLOCK_D=max(16, _next_pow2(d)), HAS_START=start is not None)


def _row_strides(start: torch.Tensor | None, end: torch.Tensor) -> tuple[int, int]:
    """The strides of the rows' bounds (``end`` may be one value expanded over the rows: stride 0)."""
    return (0 if start is None else start.stride(0)), end.stride(0)


def _contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"expected the moment state's {name!r} to be contiguous")


def current_step_launch(state: dict[str, torch.Tensor], keys: torch.Tensor, start: torch.Tensor | None,
                        end: torch.Tensor, t_local: int, t_recent: int) -> BulkMoments:
    """:func:`~qada.moments.current.current_buffer_step` on ``state`` (``count``, ``mean``, ``m2``, ``out_mean``,
    ``out_cov``, updated in place) in one launch: ``keys [b, H_kv, C, d]``, ``start [b]`` or ``None``, ``end [b]``
    (one past each row's new key; any stride). Returns ``BulkMoments(out_mean, out_cov)``."""
    from qada.attention import _moment_kernel, _triton_kernel

    b, H_kv, _, d = keys.shape
    count, mean, m2, out_mean, out_cov = (state[name] for name in ("count", "mean", "m2", "out_mean", "out_cov"))
    _contiguous(count=count, mean=mean, m2=m2, out_mean=out_mean, out_cov=out_cov)
    _triton_kernel.run(
        _moment_kernel.current_moment_step_kernel, (b * H_kv,),
        count, mean, m2, out_mean, out_cov, keys, end if start is None else start, end,
        H_kv, t_local, t_recent, *keys.stride(), *_row_strides(start, end), **_constants(d, start),
    )  # fmt: skip
    return BulkMoments(out_mean, out_cov)


def stored_step_launch(state: dict[str, torch.Tensor], start: torch.Tensor | None, end: torch.Tensor, *,
                       t_local: int, offset: int, first: int, min_bulk_keys: int) -> BulkMoments:
    """:func:`~qada.moments.stored.stored_buffer_step` on ``state`` (the ``stored`` source's
    :meth:`~qada.moments.StoredMoments.step_state`, updated in place) in one launch, for rows of real length ``end -
    start``, each one key longer than at the previous step. Returns ``BulkMoments(mean, cov)``."""
    from qada.attention import _moment_kernel, _triton_kernel

    ref, shift = state["ref"], state["shift"]  # [H_kv, N, d], [H_kv, d]
    count, s1, s2, mean, cov = (state[name] for name in ("count", "s1", "s2", "mean", "cov"))
    jumps = tuple(state[name] for name in ("jump_n", "jump_count", "jump_s1", "jump_s2"))
    _contiguous(count=count, s1=s1, s2=s2, mean=mean, cov=cov, shift=shift, jump_n=jumps[0], jump_count=jumps[1],
                jump_s1=jumps[2], jump_s2=jumps[3])
    b, H_kv = count.shape
    N, d = ref.shape[1], ref.shape[2]
    _triton_kernel.run(
        _moment_kernel.stored_moment_step_kernel, (b * H_kv,),
        count, s1, s2, state["old_end"], *jumps, mean, cov, ref, shift, end if start is None else start, end,
        H_kv, N, jumps[0].shape[1], t_local, offset, first, min_bulk_keys,
        *ref.stride(), *_row_strides(start, end), **_constants(d, start),
    )  # fmt: skip
    return BulkMoments(mean, cov)
