"""The decode step of one layer: what a criterion decides on and what an executor attends with.

One :class:`DecodeStep` is built per layer and decode step by the wrapper (or by hand, on tensors). Everything
derived is computed on first access and cached, so the criterion, the executor and the observers of a step
share it: the local window is gathered once, ``T_bulk`` and ``has_bulk`` are computed once, the full scores
only if someone asks for the exact bulk mass (the oracle), the moments only if someone asks for the lognormal
estimate (QAdA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from qada.functional import (
    bulk_count,
    bulk_mask,
    gather_window,
    log_bulk_mass,
    log_local_mass,
)
from qada.functional.capping import add_sink_logits, log_mean_exp_score, soft_cap
from qada.functional.checks import check_float, check_ndim, check_positive, group_size
from qada.functional.lognormal import log_bulk_from_mean_exp, score_moments_unchecked
from qada.functional.masses import grouped_scores_unchecked
from qada.window import Window


class cached_property:  # noqa: N801 - functools' name, without its lock
    """``functools.cached_property`` without the lock Python 3.11 takes (``torch.compile`` cannot trace it): the
    value is computed on first access and kept in the instance's ``__dict__``."""

    def __init__(self, function):
        self.function = function
        self.name = function.__name__
        self.__doc__ = function.__doc__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = self.function(instance)
        instance.__dict__[self.name] = value
        return value

__all__ = ["BulkMoments", "DecodeStep", "StepContext", "check_attention_inputs"]


class BulkMoments(NamedTuple):
    """Mean ``[b, H_kv, d]`` and population covariance ``[b, H_kv, d, d]`` of the bulk keys, per KV head.

    The covariance is symmetric (the built-in sources make it ``½ (C + Cᵀ)``, exactly so): the Triton kernels read
    only its ``BLOCK_T x BLOCK_T`` blocks on and above the diagonal, so a source's asymmetry below it is ignored."""

    mean: torch.Tensor
    cov: torch.Tensor


@dataclass(eq=False)
class DecodeStep:
    """One decode query per row and head against the cache of one layer.

    Attributes:
        query: ``[b, H, d]`` RoPE-rotated decode queries (one per row and query head).
        keys: ``[b, H_kv, T, d]`` the layer's cache, the current token included (``H = G * H_kv``).
        scale: attention scaling (the module's own, normally ``1/sqrt(d)``), a finite float > 0.
        window: the local window sizes.
        layer: layer index: an int, or (inside the run's layer step, which serves every layer) a 0-d long tensor;
            per-layer data reaches a criterion through ``states``, not by indexing with it on the host.
        step: decode step since the prefill (for observers).
        start: ``[b]`` integer index of each row's first real token (left padding), ``None`` for no padding.
        end: ``[b]`` integer one past each row's last token on a preallocated cache (``keys`` is then the whole
            buffer, ``T`` its slots, and the slots ``>= end_r`` hold no token of row ``r``); ``None``: every row
            ends at ``T``. A device tensor, never read on the host: shapes stay fixed while the cache fills.
        moments: bulk key moments, or a zero-argument callable returning them (called at most once).
        values: ``[b, H_kv, T, d]`` the cached values (executors need them; criteria do not).
        states: the criteria's per-layer tensors by :attr:`~qada.criteria.HeadCriterion.state_key`
            (:meth:`~qada.criteria.HeadCriterion.layer_states`), passed in by the run; ``None``: a step built by
            hand, whose criteria build them from ``layer`` (:meth:`~qada.criteria.HeadCriterion.state`).
        sink_logits: ``[H]`` learned sink logit of each query head (gpt-oss's ``s_aux``): one more score in every
            softmax's denominator, always attended (:mod:`qada.functional.capping`); ``None``: none.
        softcap: logit soft-cap ``c`` (Gemma-2): every score is ``c tanh(s / c)``; ``None``: no cap.

    Derived, cached on first access: ``t_bulk``, ``has_bulk`` ``[b]``; ``window_keys`` / ``window_values``
    ``[b, H_kv, W, d]`` with ``window_valid [b, W]``; ``local_scores [b, H, W]``; ``log_local [b, H]``;
    ``log_window [b, H]`` (the window's mass alone, without the sink logits); ``scores [b, H, T]`` (capped),
    ``bulk_mask [b, T]``, ``log_bulk [b, H]`` (exact, O(T)); ``bulk_moments``,
    ``score_moments`` and ``log_bulk_estimate [b, H]`` (paper eqs. 5-7, O(d²)).
    """

    query: torch.Tensor
    keys: torch.Tensor
    scale: float
    window: Window = field(default_factory=Window)
    layer: int = 0
    step: int = 0
    start: torch.Tensor | None = None
    end: torch.Tensor | None = None
    moments: BulkMoments | Callable[[], BulkMoments] | None = None
    values: torch.Tensor | None = None
    states: dict[str, dict[str, torch.Tensor]] | None = None
    sink_logits: torch.Tensor | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        check_float("query", self.query)
        check_float("keys", self.keys)
        check_ndim("query", self.query, 3, "[batch, heads, head_dim]")
        check_ndim("keys", self.keys, 4, "[batch, kv_heads, length, head_dim]")
        b, H, d = self.query.shape
        if self.keys.shape[0] != b or self.keys.shape[3] != d:
            raise ValueError(f"expected keys of shape [{b}, kv_heads, length, {d}] but got {tuple(self.keys.shape)}")
        group_size(H, self.keys.shape[1])
        if not isinstance(self.window, Window):
            raise TypeError(f"expected window to be a qada.Window but got {type(self.window).__name__}")
        check_positive("scale", self.scale)
        if self.values is not None:
            check_float("values", self.values)
            if self.values.shape != self.keys.shape:
                raise ValueError(
                    f"expected values of shape {tuple(self.keys.shape)} like keys but got {tuple(self.values.shape)}"
                )
        if self.sink_logits is not None:
            check_float("sink_logits", self.sink_logits)
            if self.sink_logits.shape != (H,):
                raise ValueError(f"expected sink_logits of shape [{H}] (one per query head) but got "
                                 f"{tuple(self.sink_logits.shape)}")
        if self.softcap is not None:
            check_positive("softcap", self.softcap)
        self.start = _row_positions("start", self.start, b, self.query.device)
        self.end = _row_positions("end", self.end, b, self.query.device)

    @classmethod
    def from_attention(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        window: Window | tuple[int, int] | None = None,
        scale: float | None = None,
        start: torch.Tensor | None = None,
        **fields,
    ) -> DecodeStep:
        """A step from attention-layout tensors, checked: ``query [b, H, 1, d]``, ``key, value [b, H_kv, T, d]``
        of one dtype and device.

        ``window`` defaults to ``Window()`` (or a ``(t_local, t_sink)`` pair), ``scale`` to ``1/sqrt(d)``;
        ``start [b]`` is each row's first real token (``0 <= start_r < T``, not checked: no host sync).
        """
        check_attention_inputs(query, key, value)
        window = Window() if window is None else window if isinstance(window, Window) else Window(*window)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return cls(query[:, :, 0], key, scale, window, start=start, values=value, **fields)

    @classmethod
    def checked_already(cls, query: torch.Tensor, keys: torch.Tensor, scale: float, window: Window, layer: int,
                        step: int, start: torch.Tensor | None, end: torch.Tensor | None,
                        moments: BulkMoments | None, values: torch.Tensor | None,
                        sink_logits: torch.Tensor | None = None, softcap: float | None = None) -> DecodeStep:
        """A step of tensors that a step built the usual way already checked (the run's executor-facing copy of
        its layer step: same tensors, ``start`` / ``end`` already long tensors on the query's device), without
        checking them again: some 30 us less per layer and step."""
        self = cls.__new__(cls)
        self.__dict__.update(query=query, keys=keys, scale=scale, window=window, layer=layer, step=step, start=start,
                             end=end, moments=moments, values=values, states=None, sink_logits=sink_logits,
                             softcap=softcap)
        return self

    # --- sizes -------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.query.shape[0]

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def group_size(self) -> int:
        """Query heads per KV head ``G``."""
        return self.num_heads // self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.query.shape[2]

    @property
    def length(self) -> int:
        """Cache length ``T`` (padding included; the buffer's slots on a preallocated cache)."""
        return self.keys.shape[2]

    @property
    def full_rows(self) -> bool:
        """Whether every row is the whole cache (no left padding, no unfilled slots): masks change nothing."""
        return self.start is None and self.end is None

    @property
    def plain_softmax(self) -> bool:
        """Whether attention is a plain softmax of the scores (no soft cap, no sink logits)."""
        return self.softcap is None and self.sink_logits is None

    @property
    def device(self) -> torch.device:
        return self.query.device

    @cached_property
    def starts(self) -> torch.Tensor:
        """``[b]`` long: each row's first real token (zeros without padding)."""
        if self.start is None:
            return torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        return self.start

    @cached_property
    def t_bulk(self) -> torch.Tensor:
        """``[b]`` bulk size of each row."""
        if self.full_rows:  # every row is the whole cache: one fill, no index arithmetic
            size = max(self.length - self.window.t_local, 0)
            return torch.full((self.batch_size,), size, dtype=torch.long, device=self.device)
        return bulk_count(self.length, self.window.t_local, self.window.t_sink, self.starts, end=self.end)

    @cached_property
    def has_bulk(self) -> torch.Tensor:
        """``[b]`` bool, False where the row has at most ``T_local`` real tokens."""
        return self.t_bulk > 0

    @cached_property
    def real(self) -> torch.Tensor | None:
        """``[b, T]`` bool, True on real tokens (not padding, not an unfilled slot); ``None`` for full rows."""
        if self.full_rows:
            return None
        position = torch.arange(self.length, device=self.device)[None, :]
        real = position >= self.starts[:, None]
        return real if self.end is None else real & (position < self.end[:, None])

    @property
    def real_if_computed(self) -> torch.Tensor | None:
        """:attr:`real` where something computed it already (a criterion, :meth:`share`), else ``None``: not computed
        here. The layer step returns it so, leaving the mask to the executor that needs it."""
        return self.__dict__.get("real")

    # --- local window (gathered once per step) -----------------------------------------------------------
    @cached_property
    def _window_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_window(self.keys, self.window.t_local, self.window.t_sink, self.start, self.end)

    @property
    def window_keys(self) -> torch.Tensor:
        """``[b, H_kv, W, d]`` keys of the local window, ``W = min(T, T_local)``."""
        return self._window_keys[0]

    @property
    def window_valid(self) -> torch.Tensor:
        """``[b, W]`` bool: the window slots holding a real token of the row's local set."""
        return self._window_keys[1]

    @cached_property
    def window_values(self) -> torch.Tensor:
        """``[b, H_kv, W, d]`` values of the local window (needs ``values``)."""
        if self.values is None:
            raise RuntimeError("this step has no values: build it with values=... (executors need them)")
        return gather_window(self.values, self.window.t_local, self.window.t_sink, self.start, self.end)[0]

    @cached_property
    def local_scores(self) -> torch.Tensor:
        """``[b, H, W]`` float32 scores of the local window (soft-capped when the step has a ``softcap``)."""
        return soft_cap(grouped_scores_unchecked(self.query, self.window_keys, self.scale), self.softcap)

    @cached_property
    def log_window(self) -> torch.Tensor:
        """``[b, H]`` log of the window's attention mass (without the sink logits)."""
        if self.full_rows:  # every window slot is valid: the mask would change nothing
            return torch.logsumexp(self.local_scores, dim=-1)
        return log_local_mass(self.local_scores, self.window_valid)

    @cached_property
    def log_local(self) -> torch.Tensor:
        """``[b, H]`` ``log A_local``: the window's mass plus the head's sink logit, if any (always attended)."""
        return add_sink_logits(self.log_window, self.sink_logits)

    # --- exact bulk (oracle) -----------------------------------------------------------------------------
    @cached_property
    def scores(self) -> torch.Tensor:
        """``[b, H, T]`` float32 scores over the whole cache (O(T d)): only the oracle asks for them (slots that
        hold no token of the row are not masked here: ``bulk_mask`` and ``window_valid`` exclude them), soft-capped
        when the step has a ``softcap``."""
        return soft_cap(grouped_scores_unchecked(self.query, self.keys, self.scale), self.softcap)

    @cached_property
    def bulk_mask(self) -> torch.Tensor:
        """``[b, T]`` bool, True on each row's bulk."""
        return bulk_mask(self.length, self.window.t_local, self.window.t_sink, self.starts, end=self.end)

    @cached_property
    def log_bulk(self) -> torch.Tensor:
        """``[b, H]`` exact ``log A_bulk`` (``-inf`` without a bulk)."""
        return log_bulk_mass(self.scores, self.bulk_mask)

    # --- lognormal estimate (QAdA) -----------------------------------------------------------------------
    @property
    def has_moments(self) -> bool:
        return self.moments is not None

    @cached_property
    def bulk_moments(self) -> BulkMoments:
        if self.moments is None:
            raise RuntimeError("this step has no moment source: a criterion that needs moments needs one")
        return self.moments() if callable(self.moments) else self.moments

    @cached_property
    def score_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu_s, sigma_s^2)``, each ``[b, H]``: mean and variance of the bulk scores (paper eqs. 5-6)."""
        mean, cov = self.bulk_moments
        b, H_kv, d = self.batch_size, self.num_kv_heads, self.head_dim
        if mean.shape != (b, H_kv, d) or cov.shape != (b, H_kv, d, d):
            raise ValueError(
                f"expected moments mean [{b}, {H_kv}, {d}] and cov [{b}, {H_kv}, {d}, {d}] but got mean "
                f"{tuple(mean.shape)} and cov {tuple(cov.shape)}"
            )
        return score_moments_unchecked(self.query, mean, cov, self.scale)

    @cached_property
    def log_bulk_estimate(self) -> torch.Tensor:
        """``[b, H]`` lognormal estimate ``log T_bulk + mu_s + sigma_s^2/2`` (paper eq. 7); under a soft cap
        ``log T_bulk + log E[exp(c tanh(s / c))]`` (:func:`~qada.functional.capping.log_mean_exp_score`): from
        :attr:`log_mean_exp_bulk`."""
        return log_bulk_from_mean_exp(self.log_mean_exp_bulk, self.t_bulk)

    @cached_property
    def log_mean_exp_bulk(self) -> torch.Tensor:
        """``[b, H]`` ``log E[exp(s)]`` of one bulk score under the lognormal model (capped when the step has a
        ``softcap``): ``mu_s + sigma_s^2 / 2`` without a cap; the value given by :meth:`take_log_mean_exp` where
        one was."""
        mu_s, var_s = self.score_moments
        return log_mean_exp_score(mu_s, var_s, self.softcap)

    def take_log_mean_exp(self, log_mean_exp: torch.Tensor) -> None:
        """Take :attr:`log_mean_exp_bulk` (``[b, H]`` float32) as computed elsewhere from this step's moments and
        queries (the moment step's launch, :class:`~qada.attention.moment_step.BulkEstimate`), instead of from
        :attr:`score_moments` here: a criterion that reads only the estimate then computes no score moments."""
        self.__dict__["log_mean_exp_bulk"] = log_mean_exp

    # --- bookkeeping -------------------------------------------------------------------------------------
    def share(self, *, window_keys: torch.Tensor, window_valid: torch.Tensor, window_values: torch.Tensor,
              t_bulk: torch.Tensor | None, real: torch.Tensor | None, window_output: torch.Tensor | None = None,
              host_plan: torch.Tensor | None = None) -> None:
        """Take the derived values the run's layer step computed for this very step
        (:class:`qada.models.step_parts.LayerStepResult`): ``window_keys``/``window_values`` ``[b, H_kv, W, d]``,
        ``window_valid [b, W]``, ``t_bulk [b]`` and ``real [b, T]`` (or ``None``), as this step would compute them;
        the executor then does not compute them again. A ``None`` window or ``t_bulk`` (a step whose kernels read the
        rows' bounds themselves, :mod:`qada.models.fused_step`) or ``real`` is not taken: the step computes it on
        demand. ``window_output [b, H, d]``: every head's attention over the window, where the layer step computed it
        (:attr:`window_output`). ``host_plan``: what a host-skipping executor reads of the decision, packed
        (:attr:`host_plan`)."""
        if window_keys is not None:
            self.__dict__["_window_keys"] = (window_keys, window_valid)
        if window_values is not None:
            self.__dict__["window_values"] = window_values
        if t_bulk is not None:
            self.__dict__["t_bulk"] = t_bulk
        if real is not None:
            self.__dict__["real"] = real
        if window_output is not None:
            self.__dict__["window_output"] = window_output
        if host_plan is not None:
            self.__dict__["host_plan"] = host_plan

    @property
    def window_output(self) -> torch.Tensor | None:
        """``[b, H, d]`` every head's attention over its window, where the layer step computed it from the scores
        the criterion computed anyway (:func:`~qada.functional.masses.window_attention`, :meth:`share`), else
        ``None``: an executor that uses it attends over the window no more."""
        return self.__dict__.get("window_output")

    @property
    def host_plan(self) -> torch.Tensor | None:
        """The ``int64`` vector of the step's decision and rows' bounds that the host-skipping ``sdpa`` executor
        reads (:func:`~qada.attention.sdpa.pack_host_plan`), where the layer step packed it (:meth:`share`), else
        ``None``: the executor packs it itself."""
        return self.__dict__.get("host_plan")

    def attend_also(self, slots: torch.Tensor, valid: torch.Tensor, scores: torch.Tensor) -> None:
        """A criterion read these bulk tokens exactly: local heads attend over them besides the window
        (:mod:`qada.functional.extra_set`). ``slots, valid [b, H, n]`` (each query head its own, in ``[0, T)``) and
        their ``scores [b, H, n]`` as the criterion computed them (soft-capped where the step has a cap), so that
        their keys are not read twice; the run merges them into local heads' output."""
        self.__dict__["extra_set"] = (slots, valid, scores)

    @property
    def extra_set(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(slots, valid, scores)`` of :meth:`attend_also`, or ``None``."""
        return self.__dict__.get("extra_set")

    def note_fail_safe(self, forced_dense: torch.Tensor) -> None:
        """Count heads forced dense because a value was NaN/inf (``forced_dense [b, H]`` bool; kept on the device, no
        sync): :attr:`forced_heads` records them, :attr:`fail_safe` counts them."""
        noted = self.__dict__.get("forced_heads")
        self.__dict__["forced_heads"] = forced_dense if noted is None else noted.to(torch.int64) + forced_dense

    @property
    def forced_heads(self) -> torch.Tensor | None:
        """``[b, H]`` the heads forced dense (:meth:`note_fail_safe`): bool, or how often each was (int64) where
        noted more than once; ``None``: never. The layer step's statistics count them in the same reduction as the
        rest of its row."""
        return self.__dict__.get("forced_heads")

    @property
    def fail_safe(self) -> torch.Tensor | None:
        """0-d: the heads forced dense (:meth:`note_fail_safe`), or the count the run set (the executor's copy of a
        step, for observers); ``None``: none noted."""
        if "fail_safe" in self.__dict__:
            return self.__dict__["fail_safe"]
        heads = self.forced_heads
        return None if heads is None else heads.sum()

    @fail_safe.setter
    def fail_safe(self, count: torch.Tensor | None) -> None:
        self.__dict__["fail_safe"] = count


def _row_positions(name: str, value: torch.Tensor | None, b: int, device: torch.device) -> torch.Tensor | None:
    """``value`` (``None``, or an integer tensor ``[b]`` of one position per row) as a long tensor on ``device``;
    anything else is a clear error."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"expected {name} to be an integer tensor of shape [{b}] but got {got}")
    if value.shape != (b,):
        raise ValueError(f"expected {name} of shape [{b}] but got {tuple(value.shape)}")
    return value.to(device=device, dtype=torch.long)


StepContext = DecodeStep
"""The name criteria used before the step object was shared with executors; the same class."""


def check_attention_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise unless ``query [b, H, 1, d]`` and ``key, value [b, H_kv, T >= 1, d]`` fit (shapes, GQA, dtype, device)."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        check_float(name, tensor)
    check_ndim("query", query, 4, "[batch, heads, 1, head_dim]")
    check_ndim("key", key, 4, "[batch, kv_heads, length, head_dim]")
    b, H, q_len, d = query.shape
    if q_len != 1:
        raise ValueError(
            f"expected query of shape [batch, heads, 1, head_dim] (one decode step) but got {tuple(query.shape)}"
        )
    if key.shape[0] != b or key.shape[3] != d or key.shape[2] < 1:
        raise ValueError(
            f"expected key of shape [{b}, kv_heads, length >= 1, {d}] to match query {tuple(query.shape)} "
            f"but got {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"expected value of shape {tuple(key.shape)} like key but got {tuple(value.shape)}")
    group_size(H, key.shape[1])
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"expected query, key and value of one dtype but got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if key.device != query.device or value.device != query.device:
        raise ValueError(
            f"expected query, key and value on one device but got {query.device}, {key.device}, {value.device}"
        )
