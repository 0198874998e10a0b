"""The built-in moment sources' decode step as one Triton launch, for the ``triton_fused`` executor's layer step.

The launches run the step on the device with :mod:`qada.attention._moment_kernel`, one program per (row, KV
head) and block pair of its ``d x d`` state (:func:`block_pairs`), instead of the source's torch step (dozens of
small operations, so dozens of kernels on a GPU):

* :func:`current_step_launch`: Welford's rank-1 update of the ``current`` source
  (:func:`~qada.moments.current.current_buffer_step`);
* :func:`stored_step_launch`: the ``stored`` source's reference range moving by one key or jumping
  (:func:`~qada.moments.stored.advance_reference_range`).

Each updates the same state in place and returns the same float32 moments as the source's own step, up to float64
rounding (a covariance entry may differ in its last float32 bit). Which source has a kernel is decided by the
run's layer step (:mod:`qada.models.fused_step`).

Given a :class:`BulkEstimate` (the step's queries), the same launch then also writes each query head's ``log
E[exp(s)]`` (paper eqs. 5-7 without ``T_bulk``, :mod:`qada.attention._estimate_kernel`) from the moments it just
wrote, which the ``triton_fused`` decision reads instead of the ``d x d`` covariance; :func:`estimate_launch` does
the same from moments a source stepped in torch, in a launch of its own.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from qada.attention.page_tops import rider_args
from qada.attention.triton_decode import _next_pow2, _tile
from qada.step import BulkMoments

__all__ = ["BulkEstimate", "EstimateDecision", "MomentRider", "current_step_launch", "current_step_rider",
           "estimate_launch", "stored_step_launch", "stored_step_rider"]

_PAIR_TERMS = 4096
"""Elements of the estimate's running ``[BLOCK_E, BLOCK_T, BLOCK_T]`` sum of ``q^T cov q`` (float32, 32 registers per
thread at 4 warps): it sets the block size ``BLOCK_T`` of the moment kernels' block pairs (:func:`block_sizes`)."""


def block_sizes(d: int, G: int) -> dict[str, int]:
    """The moment and estimate kernels' ``BLOCK_D`` (the padded head dimension), ``BLOCK_E`` (the ``G`` query heads
    of a KV head, padded to a power of two) and ``BLOCK_T`` (the side of a block of the ``d x d`` state and
    covariance: ``BLOCK_E BLOCK_T^2 <= 4096``, at most 32, at least 8): for ``d = 64``, ``G = 3`` blocks of 32, so
    three block pairs."""
    block_d, block_e = _tile(d), _next_pow2(G)
    block_t = 32
    while block_t > 8 and block_e * block_t * block_t > _PAIR_TERMS:
        block_t //= 2
    return dict(BLOCK_D=block_d, BLOCK_E=block_e, BLOCK_T=min(block_t, block_d))


class EstimateDecision(NamedTuple):
    """The ``qada`` threshold decision that the launch writing a :class:`BulkEstimate` also makes, one program per
    (row, KV head), as a split of the ``triton_fused`` executor makes it (:mod:`qada.attention._fused_kernel`):
    the ``decide_once`` arrangement of a plain ``qada`` run, whose split launch is then the ``triton`` executor's.

    Attributes:
        keys: ``[b, H_kv, C, d]`` the layer's cache (any strides).
        start, end: ``[b]`` the rows' bounds (contiguous), or ``None`` (0, and ``C``); ``end`` must be the tensor the
            moment step's launch is given.
        sinks: ``[H]`` sink logits or ``None``.
        log_tau: ``log tau`` (``-inf`` for ``tau = 0``); promote: the ``promote`` group policy.
        t_sink, t_local: the window; block_n: the keys per block the window is read in.
        input_precision, dot_fp32: how the window's scores are computed (as the split kernels take them).
        decided, local, broken: ``[b, H]`` bool, written; read: ``[b, H_kv]`` bool, written.
    """

    keys: torch.Tensor
    start: torch.Tensor | None
    end: torch.Tensor | None
    sinks: torch.Tensor | None
    log_tau: float
    promote: bool
    t_sink: int
    t_local: int
    block_n: int
    input_precision: str | None
    dot_fp32: bool
    decided: torch.Tensor
    local: torch.Tensor
    broken: torch.Tensor
    read: torch.Tensor


class BulkEstimate(NamedTuple):
    """The query side of the lognormal estimate for one layer's step, and where it goes.

    Attributes:
        query: ``[b, H, d]`` the step's queries (any strides, the cache's dtype).
        scale: the attention scale; softcap: the scores' soft cap (``None``: none).
        nodes, log_weights: ``[n]`` float32, the Gauss-Hermite nodes and ``log(w_j / sqrt(pi))`` a soft cap's
            estimate sums over (:func:`~qada.functional.capping.hermite_rule`; read only under a cap).
        out: ``[b, H]`` float32, contiguous: written with each query head's ``log E[exp(s)]`` of one bulk score,
            ``mu_s + sigma_s^2 / 2`` (eqs. 5-6), or ``log E[exp(c tanh(s / c))]`` under a cap
            (:func:`~qada.functional.capping.log_mean_exp_score`, float32 in the kernel).
        decision: the decision the same launch then makes from it (:class:`EstimateDecision`), or ``None``.
        pdl: the launch lets the next one start at once (a programmatic dependent launch, sm_90+: it waits for this
            one before reading what this one writes).
        page_tops: the page-top programs of a ``qada_tail`` step the same launch carries
            (:class:`~qada.attention.page_tops.PageTops`: its grid grows by ``stretches`` programs per (row, KV
            head)), or ``None``.
        spread: a moment step's launch runs one program per block pair of the state (:func:`block_pairs`), else one
            per (row, KV head) taking every pair in turn (the ``triton_fused`` executor's ``spread_moments``).
    """

    query: torch.Tensor
    scale: float
    softcap: float | None
    nodes: torch.Tensor
    log_weights: torch.Tensor
    out: torch.Tensor
    decision: EstimateDecision | None = None
    pdl: bool = False
    page_tops: Any = None
    spread: bool = True

    @classmethod
    def uncapped(cls, query: torch.Tensor, scale: float) -> BulkEstimate:
        """The estimate of ``query [b, H, d]`` without a soft cap (no Gauss-Hermite rule to read), into a new ``out``,
        and no decision: what the general layer step's moment launch writes (``moment_launch`` of
        :func:`~qada.models.layer_step.layer_step`)."""
        out = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        return cls(query, scale, None, out, out, out)

    @classmethod
    def capped(cls, query: torch.Tensor, scale: float, softcap: float, nodes: torch.Tensor,
               log_weights: torch.Tensor) -> BulkEstimate:
        """The estimate of ``query [b, H, d]`` under the soft cap ``softcap``, summed over the Gauss-Hermite
        ``nodes`` and ``log_weights`` (``[n]`` float32 on the query's device), into a new ``out``, and no decision:
        the general layer step's moment launch under a cap."""
        out = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        return cls(query, scale, softcap, nodes, log_weights, out)

    def kernel_args(self) -> tuple[tuple, tuple]:
        """``(Q, LME, GH_X, GH_LOGW, SINKS, DECIDED, LOCAL, READ, BROKEN)`` and ``(stride_qb, stride_qh, stride_qd,
        scale, softcap, n_nodes, C, t_sink, log_tau)``, the decision's placeholders where there is none."""
        made = self.decision
        if made is None:
            decision, sizes = (self.out,) * 5, (1, 0, 0.0)
        else:
            decision = (self.out if made.sinks is None else made.sinks, made.decided, made.local, made.read,
                        made.broken)
            sizes = (made.keys.shape[2], made.t_sink, made.log_tau)
        return ((self.query, self.out, self.nodes, self.log_weights, *decision),
                (*self.query.stride(), float(self.scale), float(self.softcap or 1.0), self.nodes.shape[0], *sizes))

    def kernel_constants(self, H_kv: int) -> dict:
        b, H, _ = self.query.shape
        if H % H_kv or self.out.shape != (b, H) or self.out.dtype != torch.float32 or not self.out.is_contiguous():
            raise ValueError(f"expected queries of a multiple of {H_kv} heads and a contiguous float32 output of "
                             f"shape [{b}, {H}] but got {H} heads and {self.out.dtype} {tuple(self.out.shape)}")
        made = self.decision
        decide = _NO_DECISION if made is None else dict(
            DECIDE=True, BLOCK_N=made.block_n, END_GIVEN=made.end is not None, HAS_SINKS=made.sinks is not None,
            PROMOTE=made.promote, INPUT_PRECISION=made.input_precision, DOT_FP32=made.dot_fp32)
        return dict(ESTIMATE=True, G=H // H_kv, BLOCK_G=_tile(H // H_kv),
                    BLOCK_X=_tile(self.nodes.shape[0]), SOFTCAP=bool(self.softcap), **decide,
                    PDL=self.pdl)

    def decision_keys(self, placeholder: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``KEYS`` and its four strides for a launch that reads the decision's keys (``placeholder``: none)."""
        if self.decision is None:
            return placeholder, (0, 0, 0, 0)
        return self.decision.keys, self.decision.keys.stride()

    def check_rows(self, start: torch.Tensor | None, end: torch.Tensor) -> None:
        """Raise ``ValueError`` unless the decision (if any) reads the rows' bounds the launch is given."""
        made = self.decision
        if made is None:
            return
        if (made.start is None) != (start is None) or (made.start is not None and made.start is not start):
            raise ValueError("expected the decision's row starts to be the moment step's")
        if made.end is not None and (made.end is not end or end.stride(0) != 1):
            raise ValueError("expected the decision's row ends to be the moment step's (contiguous)")


_NO_DECISION = dict(DECIDE=False, BLOCK_N=16, END_GIVEN=False, HAS_SINKS=False, PROMOTE=False, INPUT_PRECISION=None,
                    DOT_FP32=False)
"""The moment kernels' decision constants when the launch does not decide."""


def _without_estimate(placeholder: torch.Tensor) -> tuple[tuple, tuple, dict]:
    """The estimate's kernel arguments when there is none (``ESTIMATE`` off; ``placeholder`` is never read)."""
    return ((placeholder,) * 9, (0, 0, 0, 1.0, 1.0, 1, 1, 0, 0.0),
            dict(ESTIMATE=False, G=1, BLOCK_G=16, BLOCK_X=16, SOFTCAP=False, PDL=False, **_NO_DECISION))


def _estimate_parts(estimate: BulkEstimate | None, H_kv: int, placeholder: torch.Tensor, start: torch.Tensor | None,
                    end: torch.Tensor) -> tuple[tuple, tuple, dict]:
    if estimate is None:
        return _without_estimate(placeholder)
    estimate.check_rows(start, end)
    tensors, scalars = estimate.kernel_args()
    return tensors, scalars, estimate.kernel_constants(H_kv)


def _rider(estimate: BulkEstimate | None, pairs: int, own: int, placeholder: torch.Tensor) -> tuple[tuple, tuple,
                                                                                                   dict]:
    """``(grid, positional arguments, constants)`` of a launch of ``own`` programs per (row, KV head) writing
    ``estimate``, with the page-top programs it carries (:func:`~qada.attention.page_tops.rider_args`) after them."""
    args, constants, stretches = rider_args(None if estimate is None else estimate.page_tops, placeholder)
    programs = own + stretches
    return ((pairs,) if programs == 1 else (pairs, programs)), args, constants


def block_pairs(d: int, G: int) -> int:
    """Block pairs of the ``d x d`` moment state (``BLOCK_T x BLOCK_T`` blocks, :func:`block_sizes`): the moment
    kernels' programs per (row, KV head), three at ``d = 64``."""
    sizes = block_sizes(d, G)
    blocks = sizes["BLOCK_D"] // sizes["BLOCK_T"]
    return blocks * (blocks + 1) // 2


def _rendezvous(state: dict[str, torch.Tensor], count: torch.Tensor, pairs: int, estimate: BulkEstimate | None,
                G: int, d: int) -> tuple[torch.Tensor, torch.Tensor, int, dict[str, bool]]:
    """``(ARRIVED, SHARES, programs per (row, KV head), constants)`` of a moment step's launch: spread over the
    state's block pairs (:func:`block_pairs`; unless ``estimate.spread`` is off) where it has several, the state's
    ``arrived`` (``[b, H_kv]`` int32, 0 between launches) and, with ``estimate``, a new ``[pairs, block pairs,
    BLOCK_E]`` float32 buffer for their shares of ``q^T cov q`` (:func:`~qada.attention._moment_kernel.
    last_to_arrive`); ``count`` in place of either where none is read."""
    n_pairs = block_pairs(d, G)
    spread = (estimate is None or estimate.spread) and n_pairs > 1
    own = n_pairs if spread else 1
    arrived = shares = count
    if spread:
        arrived = state.get("arrived")
        if (arrived is None or arrived.dtype != torch.int32 or arrived.shape != count.shape
                or not arrived.is_contiguous()):
            raise ValueError(f"expected the moment state's 'arrived' as a contiguous int32 tensor of shape "
                             f"{tuple(count.shape)} (zeros: the state a prefill declares)")
        if estimate is not None:
            shares = torch.empty(pairs, own, block_sizes(d, G)["BLOCK_E"], dtype=torch.float32, device=count.device)
    return arrived, shares, own, {"SPREAD": spread}


def _constants(d: int, start: torch.Tensor | None, G: int) -> dict:
    return dict(D=d, HAS_START=start is not None, **block_sizes(d, G))


def _row_strides(start: torch.Tensor | None, end: torch.Tensor) -> tuple[int, int]:
    """The strides of the rows' bounds (``end`` may be one value expanded over the rows: stride 0)."""
    return (0 if start is None else start.stride(0)), end.stride(0)


def _contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"expected the moment state's {name!r} to be contiguous")


_STORED_STATE = ("count", "s1", "s2", "old_end", "jump_n", "jump_count", "jump_s1", "jump_s2", "mean", "cov", "ref",
                 "shift")
"""The ``stored`` source's step state as its kernel takes it (``COUNT`` .. ``SHIFT``)."""


def _stored_state(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The tensors :data:`_STORED_STATE` names, in order, checked contiguous (but ``old_end`` and the reference
    keys ``ref [H_kv, N, d]``, read with their strides)."""
    _contiguous(**{name: state[name] for name in _STORED_STATE if name not in ("old_end", "ref")})
    return tuple(state[name] for name in _STORED_STATE)


def current_step_launch(state: dict[str, torch.Tensor], keys: torch.Tensor, start: torch.Tensor | None,
                        end: torch.Tensor, t_local: int, t_recent: int,
                        estimate: BulkEstimate | None = None) -> BulkMoments:
    """:func:`~qada.moments.current.current_buffer_step` on ``state`` (``count``, ``mean``, ``m2``, ``out_mean``,
    ``out_cov``, updated in place) in one launch: ``keys [b, H_kv, C, d]``, ``start [b]`` or ``None``, ``end [b]``
    (one past each row's new key; any stride); with ``estimate``, its ``out`` too. Returns ``BulkMoments(out_mean,
    out_cov)``."""
    from qada.attention import _moment_kernel, _triton_kernel

    b, H_kv, _, d = keys.shape
    count, mean, m2, out_mean, out_cov = (state[name] for name in ("count", "mean", "m2", "out_mean", "out_cov"))
    _contiguous(count=count, mean=mean, m2=m2, out_mean=out_mean, out_cov=out_cov)
    if estimate is not None and estimate.decision is not None and estimate.decision.keys is not keys:
        raise ValueError("expected the decision's keys to be the moment step's")
    tensors, scalars, constants = _estimate_parts(estimate, H_kv, count, start, end)
    arrived, shares, own, spread = _rendezvous(state, count, b * H_kv, estimate, constants["G"], d)
    grid, rider, rider_constants = _rider(estimate, b * H_kv, own, count)
    _triton_kernel.run(
        _moment_kernel.current_moment_step_kernel, grid,
        count, mean, m2, out_mean, out_cov, keys, end if start is None else start, end, *tensors, arrived, shares,
        H_kv, t_local, t_recent, *keys.stride(), *_row_strides(start, end), *scalars, *rider,
        **_constants(d, start, constants["G"]), **constants, **rider_constants, **spread,
    )  # fmt: skip
    return BulkMoments(out_mean, out_cov)


def stored_step_launch(state: dict[str, torch.Tensor], start: torch.Tensor | None, end: torch.Tensor, *,
                       t_local: int, offset: int, first: int, min_bulk_keys: int,
                       estimate: BulkEstimate | None = None) -> BulkMoments:
    """:func:`~qada.moments.stored.stored_buffer_step` on ``state`` (the ``stored`` source's
    :meth:`~qada.moments.StoredMoments.step_state`, updated in place) in one launch, for rows of real length ``end -
    start``, each one key longer than at the previous step; with ``estimate``, its ``out`` too. Returns
    ``BulkMoments(mean, cov)``."""
    from qada.attention import _moment_kernel, _triton_kernel

    sums = _stored_state(state)
    count, ref = sums[0], sums[-2]  # [b, H_kv], [H_kv, N, d]
    b, H_kv = count.shape
    N, d = ref.shape[1], ref.shape[2]
    tensors, scalars, constants = _estimate_parts(estimate, H_kv, count, start, end)
    keys, key_strides = (count, (0,) * 4) if estimate is None else estimate.decision_keys(count)
    arrived, shares, own, spread = _rendezvous(state, count, b * H_kv, estimate, constants["G"], d)
    grid, rider, rider_constants = _rider(estimate, b * H_kv, own, count)
    _triton_kernel.run(
        _moment_kernel.stored_moment_step_kernel, grid,
        *sums, end if start is None else start, end,
        keys, *tensors, arrived, shares, H_kv, N, state["jump_n"].shape[1], t_local, offset, first,
        min_bulk_keys, *ref.stride(), *_row_strides(start, end), *key_strides, *scalars, *rider,
        **_constants(d, start, constants["G"]), **constants, **rider_constants, **spread,
    )  # fmt: skip
    return BulkMoments(state["mean"], state["cov"])


def estimate_launch(estimate: BulkEstimate, moments: BulkMoments) -> torch.Tensor:
    """``estimate.out`` written from ``moments`` (mean ``[b, H_kv, d]``, cov ``[b, H_kv, d, d]``, any strides and
    float dtype) in one launch, one program per (row, KV head): for moments a source stepped in torch. Returns
    ``estimate.out``."""
    from qada.attention import _estimate_kernel, _triton_kernel

    mean, cov = moments
    b, H, d = estimate.query.shape
    H_kv = mean.shape[1]
    if mean.shape != (b, H_kv, d) or cov.shape != (b, H_kv, d, d):
        raise ValueError(f"expected moments mean [{b}, H_kv, {d}] and cov [{b}, H_kv, {d}, {d}] but got mean "
                         f"{tuple(mean.shape)} and cov {tuple(cov.shape)}")
    made = estimate.decision
    start = None if made is None else made.start
    end = None if made is None else made.end
    (query, out, nodes, log_weights, *decision), scalars = estimate.kernel_args()
    constants = estimate.kernel_constants(H_kv)
    del constants["ESTIMATE"]
    keys, key_strides = estimate.decision_keys(out)
    grid, rider, rider_constants = _rider(estimate, b * H_kv, 1, out)
    _triton_kernel.run(
        _estimate_kernel.bulk_estimate_kernel, grid,
        query, mean, cov, out, nodes, log_weights, keys, out if start is None else start, out if end is None else end,
        *decision, *mean.stride(), *cov.stride(), *scalars[:3], *key_strides, H_kv,
        0 if made is None else made.t_local, *scalars[3:], *rider,
        D=d, HAS_START=start is not None, **block_sizes(d, constants["G"]), **constants, **rider_constants,
    )  # fmt: skip
    return out


class MomentRider(NamedTuple):
    """A moment step for the next decode step that the combine launch carries
    (:func:`~qada.attention.triton_decode.combine`'s ``rider``, :mod:`qada.attention._ahead_kernel`): the kernel's
    name there, its ``MS_`` positional arguments and constants, the ``(row, KV head)`` pairs and the programs per pair
    (the state's block pairs)."""

    kernel: str
    args: tuple
    constants: dict
    pairs: int
    programs: int


def _rider_rendezvous(state: dict[str, torch.Tensor], count: torch.Tensor, d: int) -> tuple[torch.Tensor, int]:
    """``(ARRIVED, block pairs)`` of a moment step riding in the combine launch: always one program per block pair
    (``G`` does not matter without an estimate: the blocks of ``G = 1``)."""
    arrived, _, own, _ = _rendezvous(state, count, count.numel(), None, 1, d)
    return arrived, own


def current_step_rider(state: dict[str, torch.Tensor], keys: torch.Tensor, start: torch.Tensor | None,
                       end: torch.Tensor, t_local: int, t_recent: int) -> MomentRider:
    """:func:`current_step_launch` (no estimate) for rows ending one key past ``end`` (the next decode step's; its
    key, at ``end - T_recent``, is in ``keys`` already: ``t_recent >= 1``), as programs of the combine launch."""
    if t_recent < 1:
        raise ValueError(f"expected T_recent >= 1 to step the moments ahead (the key entering the bulk at the next "
                         f"step must be in the cache already) but got {t_recent}")
    b, H_kv, _, d = keys.shape
    count, mean, m2, out_mean, out_cov = (state[name] for name in ("count", "mean", "m2", "out_mean", "out_cov"))
    _contiguous(count=count, mean=mean, m2=m2, out_mean=out_mean, out_cov=out_cov)
    arrived, own = _rider_rendezvous(state, count, d)
    sizes = block_sizes(d, 1)
    args = (count, mean, m2, out_mean, out_cov, keys, end if start is None else start, end, arrived, H_kv, t_local,
            t_recent, *keys.stride(), *_row_strides(start, end), b * H_kv)
    constants = dict(MS_D=d, MS_BLOCK_T=sizes["BLOCK_T"], MS_BLOCK_D=sizes["BLOCK_D"], MS_HAS_START=start is not None)
    return MomentRider("combine_and_current_step_kernel", args, constants, b * H_kv, own)


def stored_step_rider(state: dict[str, torch.Tensor], start: torch.Tensor | None, end: torch.Tensor, *,
                      t_local: int, offset: int, first: int, min_bulk_keys: int) -> MomentRider:
    """:func:`stored_step_launch` (no estimate) for rows one key longer than ``end - start`` (the next decode
    step's), as programs of the combine launch."""
    sums = _stored_state(state)
    count, ref = sums[0], sums[-2]
    b, H_kv = count.shape
    N, d = ref.shape[1], ref.shape[2]
    arrived, own = _rider_rendezvous(state, count, d)
    sizes = block_sizes(d, 1)
    args = (*sums, end if start is None else start, end, arrived, H_kv, N, state["jump_n"].shape[1], t_local, offset,
            first, min_bulk_keys, *ref.stride(),
            *_row_strides(start, end), b * H_kv)
    constants = dict(MS_D=d, MS_BLOCK_T=sizes["BLOCK_T"], MS_BLOCK_D=sizes["BLOCK_D"], MS_HAS_START=start is not None)
    return MomentRider("combine_and_stored_step_kernel", args, constants, b * H_kv, own)
