"""The tail-aware estimate (issue 23): eq. 7 plus an exact set of heavy tokens and top pages."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qada.criteria import CRITERIA, DecodeStep, QAdACriterion, TailBudgetCriterion, TailCriterion
from qada.functional import lognormal_log_bulk_from_moments
from qada.functional.tail import (
    heavy_votes,
    page_bounds,
    page_extrema,
    page_slots,
    tail_log_bulk,
    update_page_extrema,
)
from qada.moments import BulkMoments
from qada.window import Window
from tests.helpers import population_moments

WINDOW = Window(8, 2)


def case(seed: int, b: int = 2, H_kv: int = 2, G: int = 2, T: int = 40, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, H_kv, T, d, generator=g)
    query = torch.randn(b, H_kv * G, d, generator=g)
    queries = torch.randn(b, H_kv * G, T, d, generator=g)
    return keys, query, queries


def step_on(keys, query, start=None, window=WINDOW, moments=None):
    bulk = torch.zeros(keys.shape[0], keys.shape[2], dtype=torch.bool)
    b, T = keys.shape[0], keys.shape[2]
    first = torch.zeros(b, dtype=torch.long) if start is None else start
    for r in range(b):
        bulk[r, int(first[r]) + window.t_sink: T - window.t_recent] = True
    if moments is None:
        rows = [population_moments(keys[r: r + 1][:, :, bulk[r]]) for r in range(b)]
        moments = BulkMoments(torch.cat([m.mean for m in rows]), torch.cat([m.cov for m in rows]))
    return DecodeStep(query, keys, 0.4, window, start=start, moments=moments)


def prepared(criterion, keys, queries, start=None):
    criterion.observe_prefill(0, keys, queries, 0.4, start, WINDOW)
    return criterion


# --- the math ---------------------------------------------------------------------------------------------------
@settings(max_examples=40, derandomize=True)
@given(seed=st.integers(0, 10_000), T=st.integers(1, 50), P=st.integers(1, 9), filled=st.data())
def test_page_extrema_equal_a_loop_and_bound_every_score(seed, T, P, filled):
    keys, query, _ = case(seed, T=T)
    n = filled.draw(st.integers(1, T))
    kmin, kmax = page_extrema(keys, P, filled=n)
    bounds = page_bounds(query, kmin, kmax, 0.4)
    scores = 0.4 * torch.einsum("bkgd,bktd->bkgt", query.view(2, 2, 2, -1), keys).reshape(2, 4, T)
    for p in range(-(-n // P)):
        chunk = keys[:, :, p * P: min((p + 1) * P, n)]
        assert torch.equal(kmin[:, :, p], chunk.amin(2)) and torch.equal(kmax[:, :, p], chunk.amax(2))
        page_max = scores[:, :, p * P: min((p + 1) * P, n)].amax(-1)
        assert (bounds[:, :, p] >= page_max - 1e-5).all()  # an upper bound on every score of the page


@settings(max_examples=30, derandomize=True)
@given(seed=st.integers(0, 10_000), T=st.integers(2, 40), P=st.integers(1, 8))
def test_appending_keys_one_by_one_equals_the_extrema_of_the_whole(seed, T, P):
    keys, _, _ = case(seed, T=T)
    first = T // 2
    kmin, kmax = page_extrema(keys[:, :, :first], P)
    n_pages = -(-T // P)
    kmin = torch.cat([kmin, torch.full((2, 2, n_pages - kmin.shape[2], 8), float("inf"))], 2)
    kmax = torch.cat([kmax, torch.full((2, 2, n_pages - kmax.shape[2], 8), float("-inf"))], 2)
    for slot in range(first, T):
        update_page_extrema(kmin, kmax, keys[:, :, slot], torch.full((2,), slot), P)
    whole = page_extrema(keys, P)
    assert torch.equal(kmin, whole[0]) and torch.equal(kmax, whole[1])


@settings(max_examples=50, derandomize=True)
@given(seed=st.integers(0, 10_000), t_bulk=st.lists(st.integers(0, 500), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_an_empty_exact_set_is_eq7_bit_for_bit(seed, t_bulk, dtype):
    g = torch.Generator().manual_seed(seed)
    b = len(t_bulk)
    mu_s, var_s = torch.randn(b, 4, generator=g, dtype=dtype), torch.rand(b, 4, generator=g, dtype=dtype)
    t = torch.tensor(t_bulk)
    got = tail_log_bulk(torch.full((b, 4), float("-inf")), torch.zeros(b, 4, dtype=torch.long), mu_s, var_s, t)
    assert torch.equal(got, lognormal_log_bulk_from_moments(mu_s, var_s, t))


def test_the_rest_counts_only_the_tokens_outside_the_exact_set():
    mu_s, var_s = torch.tensor([[0.5]]), torch.tensor([[0.2]])
    got = tail_log_bulk(torch.tensor([[3.0]]), torch.tensor([[4]]), mu_s, var_s, torch.tensor([10]))
    assert got.item() == pytest.approx(math.log(math.exp(3.0) + 6 * math.exp(0.5 + 0.1)), rel=1e-6)
    everything = tail_log_bulk(torch.tensor([[3.0]]), torch.tensor([[10]]), mu_s, var_s, torch.tensor([10]))
    assert everything.item() == pytest.approx(3.0)  # E = the whole bulk: the exact mass alone


def test_page_slots_and_votes():
    assert page_slots(torch.tensor([[0, 2]]), 3).tolist() == [[0, 1, 2, 6, 7, 8]]
    keys, _, queries = case(3, T=12)
    votes = heavy_votes(queries[:, :, -4:], keys, 0.4, torch.arange(8, 12))
    assert votes.shape == (2, 2, 12)
    assert torch.allclose(votes.sum(-1), torch.full((2, 2), 2.0 * 4))  # each of G*w queries spreads mass 1
    start = torch.tensor([0, 5])
    padded = heavy_votes(queries[:, :, -4:], keys, 0.4, torch.arange(8, 12), start)
    assert (padded[1, :, :5] == 0).all() and torch.allclose(padded.sum(-1), torch.full((2, 2), 8.0))


# --- the criteria -----------------------------------------------------------------------------------------------
@settings(max_examples=25, derandomize=True)
@given(seed=st.integers(0, 10_000), T=st.integers(9, 60), tau=st.sampled_from([0.2, 0.5, 0.8]),
       padded=st.booleans())
def test_no_exact_set_decides_as_qada_bit_for_bit(seed, T, tau, padded):
    keys, query, queries = case(seed, T=T)
    start = torch.tensor([0, min(3, T - 1)]) if padded else None
    tail = prepared(TailCriterion(tau=tau, heavy=0, pages=0), keys, queries, start)
    a, b = step_on(keys, query, start), step_on(keys, query, start)
    assert torch.equal(tail.log_bulk(a), QAdACriterion(tau=tau).log_bulk(b))
    assert torch.equal(tail(a), QAdACriterion(tau=tau)(b))


@settings(max_examples=25, derandomize=True)
@given(seed=st.integers(0, 10_000), T=st.integers(11, 60), P=st.integers(1, 8), heavy=st.integers(0, 6))
def test_an_exact_set_covering_the_bulk_is_the_oracle(seed, T, P, heavy):
    keys, query, queries = case(seed, T=T)
    tail = prepared(TailCriterion(tau=0.5, heavy=heavy, observe=4, page_size=P, pages=-(-T // P)), keys, queries)
    step = step_on(keys, query)
    assert torch.allclose(tail.log_bulk(step).float(), step.log_bulk, atol=1e-5)


def test_a_planted_needle_flips_the_decision():
    """One bulk key aligned with the query holds the bulk's mass: eq. 7 over the whole bulk misses it and calls the
    heads local; the tail-aware estimate finds it (heavy set and pages alike) and calls them dense."""
    g = torch.Generator().manual_seed(0)
    T, d = 200, 16
    keys = 0.1 * torch.randn(1, 1, T, d, generator=g)
    query = torch.zeros(1, 1, d)
    query[0, 0, 0] = 8.0
    keys[0, 0, :2, 0] = keys[0, 0, -6:, 0] = 3.0  # the window: scores 9.6, log A_local ~ 11.7
    keys[0, 0, 100, 0] = 6.0  # the needle: score 19.2; eq. 7 over 190 bulk keys: ~6.3
    queries = query[:, :, None].expand(1, 1, T, d).clone()
    for name, options in {"heavy set": dict(heavy=4, pages=0), "pages": dict(heavy=0, pages=2, page_size=8)}.items():
        tail = prepared(TailCriterion(tau=0.5, observe=4, **options), keys, queries)
        assert not tail(step_on(keys, query)).any(), name
    assert QAdACriterion(tau=0.5)(step_on(keys, query)).all()


def test_the_budget_rule_ranks_by_the_tail_aware_estimate():
    keys, query, queries = case(5, T=50)
    budget = prepared(TailBudgetCriterion(sparsity=0.5, heavy=3, observe=4, page_size=4, pages=2), keys, queries)
    step = step_on(keys, query)
    local = budget(step)
    assert local.sum(-1).tolist() == [2, 2]
    score = step.log_local - budget.tail_log_bulk(step)
    assert (score[local].min() >= score[~local].max() - 1e-6) or local.sum() == 0
    assert "qada_tail" in CRITERIA and "qada_tail_budget" in CRITERIA


@pytest.mark.parametrize("bad, match", [
    (dict(heavy=-1), "heavy to be an int >= 0"),
    (dict(page_size=0), "page_size to be an int >= 1"),
    (dict(pages=1.5), "pages to be an int >= 0"),
    (dict(heavy=4, observe=0), "observe >= 1"),
    (dict(tau=2.0), "tau"),
])  # fmt: skip
def test_bad_parameters_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        TailCriterion(**bad)


def test_a_step_without_a_prefill_is_a_clear_error():
    keys, query, _ = case(1)
    with pytest.raises(RuntimeError, match="no prefill seen"):
        TailCriterion()(step_on(keys, query))
