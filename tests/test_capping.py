"""Sink logits (gpt-oss's ``s_aux``) and logit soft-capping (Gemma-2's ``softcap``) in the math, the criteria and
every executor: the Gauss-Hermite bulk estimate against numerical integration and against the exact mass of
Gaussian keys (Hypothesis), and each executor against explicit softmax attention with both features."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qada.attention  # noqa: F401  (registers every executor)
from qada.attention import EXECUTORS
from qada.attention.base import GroupDecision
from qada.criteria import CRITERIA
from qada.functional.capping import (
    add_sink_logits,
    capped_log_mean_exp,
    log_mean_exp_score,
    soft_cap,
    softmax_with_sinks,
)
from qada.step import BulkMoments, DecodeStep
from qada.window import Window

TRITON = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or torch.cuda.is_available()


def integrated(mu: float, sigma: float, cap: float) -> float:
    """``log E[exp(c tanh(s / c))]``, ``s ~ N(mu, sigma^2)``, by the trapezoid rule on a fine grid (float64)."""
    if sigma < 1e-6:  # a point mass (the grid would collapse)
        return cap * math.tanh(mu / cap)
    s = torch.linspace(mu - 12 * sigma, mu + 12 * sigma, 200_001, dtype=torch.float64)
    log_density = -0.5 * ((s - mu) / sigma) ** 2 - math.log(sigma * math.sqrt(2 * math.pi))
    values = log_density + cap * torch.tanh(s / cap)
    step = float(s[1] - s[0])
    return float(torch.logsumexp(values, 0)) + math.log(step)


@settings(max_examples=60, deadline=None)
@given(mu=st.floats(-8, 8), sigma=st.floats(0, 6), cap=st.floats(5, 60))
def test_gauss_hermite_equals_numerical_integration(mu, sigma, cap):
    got = float(capped_log_mean_exp(torch.tensor([mu], dtype=torch.float64),
                                    torch.tensor([sigma**2], dtype=torch.float64), cap))
    assert got == pytest.approx(integrated(mu, sigma, cap), abs=2e-3)


@settings(max_examples=30, deadline=None)
@given(mu=st.floats(-3, 3), sigma=st.floats(0, 1.5))
def test_a_cap_far_above_the_scores_is_the_lognormal_mean(mu, sigma):
    m, v = torch.tensor([mu], dtype=torch.float64), torch.tensor([sigma**2], dtype=torch.float64)
    assert float(log_mean_exp_score(m, v, 1e4)) == pytest.approx(float(log_mean_exp_score(m, v)), abs=1e-3)
    assert float(log_mean_exp_score(m, v)) == mu + 0.5 * sigma**2


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.floats(2.0, 30.0), spread=st.floats(0.5, 3.0))
def test_the_capped_estimate_matches_the_oracle_on_gaussian_keys(seed, cap, spread):
    """Keys drawn from N(mu_K, Sigma_K) with the moments known exactly: the oracle's capped bulk mass (every score
    capped, summed) and the capped lognormal estimate agree up to sampling noise."""
    g = torch.Generator().manual_seed(seed)
    d, T = 8, 20_000
    mean = torch.randn(1, 1, d, generator=g, dtype=torch.float64) * 0.5
    root = torch.randn(d, d, generator=g, dtype=torch.float64) * spread / math.sqrt(d)
    cov = (root @ root.T)[None, None]
    keys = mean[:, :, None] + torch.randn(1, 1, T, d, generator=g, dtype=torch.float64) @ root.T
    query = torch.randn(1, 2, d, generator=g, dtype=torch.float64)
    window = Window(4, 1)
    step = DecodeStep(query, keys, d**-0.5, window, moments=BulkMoments(mean, cov), softcap=cap)
    oracle, estimate = step.log_bulk, step.log_bulk_estimate
    # sampling noise of the oracle's sum: its relative standard error, from the capped scores themselves
    weights = (step.scores - step.scores.amax(-1, keepdim=True)).exp()[:, :, step.bulk_mask[0]]
    noise = weights.std(-1) / (weights.mean(-1) * math.sqrt(weights.shape[-1]))
    assert ((oracle - estimate).abs() <= 4 * noise + 0.01).all(), (oracle, estimate, noise)


def test_sink_logits_join_the_local_mass_and_the_oracle_decides_on_capped_scores():
    g = torch.Generator().manual_seed(0)
    query, keys = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g) * 3
    sinks = torch.tensor([0.0, 3.0, -2.0, 10.0])
    step = DecodeStep(query, keys, 0.25, Window(8, 2), sink_logits=sinks, softcap=5.0)
    assert torch.allclose(step.log_local, torch.logaddexp(step.log_window, sinks[None]))
    assert step.scores.abs().max() <= 5.0
    plain = DecodeStep(query, keys, 0.25, Window(8, 2))
    assert torch.allclose(step.scores, soft_cap(plain.scores, 5.0))
    # a large sink logit makes a head local: the sink is always attended, like the window
    local = CRITERIA.build({"name": "oracle", "tau": 0.9})(step)
    assert local[:, 3].all()
    with pytest.raises(ValueError, match="sink_logits of shape"):
        DecodeStep(query, keys, 0.25, sink_logits=torch.zeros(3))
    with pytest.raises(ValueError, match="softcap"):
        DecodeStep(query, keys, 0.25, softcap=-1.0)
    assert torch.equal(add_sink_logits(step.log_window, None), step.log_window)


def explicit_attention(step: DecodeStep, local: torch.Tensor) -> torch.Tensor:
    """Every head's softmax over its set (window for local heads, all real tokens else), capped, with sinks."""
    allowed = torch.where(local[:, :, None], (~step.bulk_mask)[:, None], torch.ones_like(step.bulk_mask)[:, None])
    if step.real is not None:
        allowed = allowed & step.real[:, None]
    scores = soft_cap(torch.einsum("bhd,bhtd->bht", step.query.double(),
                                   step.keys.double().repeat_interleave(step.group_size, 1)) * step.scale,
                      step.softcap)
    probabilities = softmax_with_sinks(scores.masked_fill(~allowed, float("-inf")), step.sink_logits)
    out = torch.einsum("bht,bhtd->bhd", probabilities, step.values.double().repeat_interleave(step.group_size, 1))
    return out[:, :, None].float()


EXECUTOR_SPECS = ["reference", {"name": "sdpa", "host_skip": True}, {"name": "sdpa", "host_skip": False},
                  {"name": "flex", "compile": False}, {"name": "triton", "block_size": 16}]


@pytest.mark.parametrize("features", ["sinks", "softcap", "both"])
@pytest.mark.parametrize("spec", EXECUTOR_SPECS, ids=lambda s: s if isinstance(s, str) else str(s))
def test_every_executor_attends_with_sinks_and_soft_capping(spec, features):
    if isinstance(spec, dict) and spec["name"] == "triton" and not TRITON:
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    pytest.importorskip("triton") if isinstance(spec, dict) and spec["name"] == "triton" else None
    g = torch.Generator().manual_seed(1)
    b, H, H_kv, C, d = 2, 4, 2, 48, 16
    query = torch.randn(b, H, d, generator=g)
    keys, values = torch.randn(b, H_kv, C, d, generator=g) * 2, torch.randn(b, H_kv, C, d, generator=g)
    sinks = torch.tensor([0.5, 2.0, -1.0, 4.0]) if features in ("sinks", "both") else None
    cap = 3.0 if features in ("softcap", "both") else None
    start, end = torch.tensor([0, 5]), torch.tensor([40, 48])  # left padding, and a buffer not yet full
    step = DecodeStep(query, keys, d**-0.5, Window(8, 2), start=start, end=end, values=values, sink_logits=sinks,
                      softcap=cap)
    local = torch.tensor([[True, True, False, True], [False, False, True, True]])
    read = ~local.view(b, H_kv, 2).all(-1)
    executor = EXECUTORS.build(spec)
    out, _ = executor.attend(step, GroupDecision(local, read))
    expected = explicit_attention(step, local)
    assert torch.allclose(out.float(), expected, atol=2e-5), (out, expected)


def test_the_compiled_layer_step_equals_eager_with_sinks_and_soft_capping():
    """The tiny gpt-oss (sinks) and Gemma-2 (soft cap) decode with the same tokens whether the layer step is traced
    by torch.compile (fullgraph, aot_eager) or run eagerly."""
    from family_matrix import STEPS, WINDOW, _decode, tiny_family_model

    import qada

    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(2))
    for family in ("gpt_oss", "gemma2"):
        model = tiny_family_model(family)  # hybrid: a sliding layer and a global one
        results = []
        for compile in (False, "aot_eager"):
            with torch.no_grad(), qada.apply(model, criterion={"name": "qada", "tau": 0.5}, moments="current",
                                             window=WINDOW, compile=compile) as run:
                tokens, logits = _decode(model, ids, "static")
                results.append((tokens, logits, run.summary(), run.layer_step.eager_reason))
        (eager_tokens, eager_logits, eager_summary, _), (tokens, logits, summary, eager_reason) = results
        assert eager_reason is None and summary["decode_steps"] == STEPS, (family, eager_reason)
        assert torch.equal(tokens, eager_tokens) and torch.allclose(logits, eager_logits, atol=1e-4)
        assert summary["sparsity"] == pytest.approx(eager_summary["sparsity"])
