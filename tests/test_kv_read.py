"""``kv_read`` (issue 23): the K/V a decode step reads, as a fraction of dense attention's, the criterion's own
reads (the tail-aware exact set and page extrema) included."""

from __future__ import annotations

import pytest
import torch
from test_buffer_decode import greedy, make_run
from test_buffer_decode import model as model  # noqa: F401  (fixture)
from test_buffer_decode import reference as reference  # noqa: F401  (fixture)

from qada.attention.group_policy import kv_read
from qada.criteria import CRITERIA
from qada.step import DecodeStep
from qada.window import Window


def test_kv_read_counts_bulks_windows_and_extra_reads():
    read = torch.tensor([[True, False]])
    length = torch.tensor([1000])
    assert kv_read(read, length, 100).item() == pytest.approx((2000 + 200) / 4000)
    assert kv_read(read, length, 100, torch.tensor([50.0])).item() == pytest.approx((2050 + 250) / 4000)
    assert kv_read(torch.tensor([[False]]), torch.tensor([50]), 100).item() == 1.0  # the window is the whole row
    rows = kv_read(torch.tensor([[True], [False]]), torch.tensor([300, 100]), 10)  # weighted by each row's bytes
    assert rows.item() == pytest.approx((600 + 20) / (600 + 200))


def test_the_tail_criteria_count_their_exact_set_and_page_extrema():
    criterion = CRITERIA.build({"name": "qada_tail", "heavy": 4, "observe": 2, "page_size": 8, "pages": 2})
    step = DecodeStep(torch.randn(3, 6, 16), torch.randn(3, 2, 100, 16), 0.25, Window(16, 2))
    n_pages = 13  # ceil(100 / 8)
    assert criterion.extra_reads(step).tolist() == [4 + 3 * 2 * 8 + 2 * n_pages] * 3
    composed = CRITERIA.build({"name": "any_of", "criteria": [{"name": "qada_tail", "heavy": 4, "observe": 2,
                                                               "page_size": 8, "pages": 2}, "qada"]})
    assert composed.extra_reads(step).tolist() == criterion.extra_reads(step).tolist()
    assert CRITERIA.build("qada").extra_reads(step) is None


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_a_run_reports_kv_read(model, reference, cache):
    summaries = {name: greedy(model, make_run(spec, moments, "sdpa", reference), cache)[2]
                 for name, spec, moments in (("dense", "dense", "none"), ("local", "local", "none"),
                                             ("qada", {"name": "qada", "tau": 0.3}, "stored"),
                                             ("local+tail", {"name": "any_of", "criteria": [
                                                 "local", {"name": "qada_tail", "heavy": 2, "observe": 2,
                                                           "page_size": 2, "pages": 1}]}, "stored"))}
    assert summaries["dense"]["kv_read"] == pytest.approx(1.0)
    assert summaries["local"]["kv_read"] < summaries["qada"]["kv_read"] < 1.0
    assert set(summaries["qada"]["kv_read_per_layer"]) == set(summaries["qada"]["sparsity_per_layer"])
    # the same decisions (every head local), plus what the tail criterion reads to decide: its exact set's keys and
    # the page extrema (2 + 3 * 1 * 2 + 2 * ceil(C / 2) vectors per KV head and step)
    assert summaries["local+tail"]["sparsity"] == summaries["local"]["sparsity"] == 1.0
    assert summaries["local+tail"]["kv_read"] > summaries["local"]["kv_read"] + 0.1
