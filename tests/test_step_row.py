"""The layer step's statistics row in one reduction (``step_row``) is the row of its definition (``step_counts`` of
the means, the fail-safe count and ``kv_read``), exactly, and the step records each head forced dense."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qada.attention.group_policy import kv_read
from qada.models.statistics import step_counts, step_row, step_row_in_one_reduction
from qada.step import DecodeStep
from qada.window import Window


@st.composite
def decisions(draw):
    b = draw(st.integers(1, 5))
    H_kv = draw(st.integers(1, 4))
    G = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    local = torch.rand(b, H_kv * G, generator=g) < draw(st.floats(0, 1))
    read = torch.rand(b, H_kv, generator=g) < draw(st.floats(0, 1))
    length = torch.randint(0, 100_000, (b,), generator=g)
    t_local = draw(st.integers(1, 256))
    extra = draw(st.sampled_from([None, "integer"]))
    extra = None if extra is None else torch.randint(0, 5_000, (b,), generator=g).to(torch.float64)
    forced = draw(st.sampled_from([None, "some"]))
    forced = None if forced is None else (torch.rand(b, H_kv * G, generator=g) < 0.3).to(torch.float64) * 2
    return local, read, length, t_local, extra, forced


@settings(max_examples=200, deadline=None)
@given(decisions())
def test_step_row_is_step_counts_exactly(case):
    local, read, length, t_local, extra, forced = case
    expected = step_counts(local, read, None if forced is None else forced.sum(), kv_read(read, length, t_local, extra))
    got = step_row_in_one_reduction(local, read, length, t_local, extra, forced)
    assert got.dtype == torch.float64 and got.shape == (5,)
    assert torch.equal(got, expected), (got, expected)
    assert torch.equal(step_row(local, read, length, t_local, extra, forced), expected)  # (eagerly: the definition)


def test_step_row_of_rows_without_tokens_reads_nothing_but_divides_by_one():
    local = torch.zeros(2, 4, dtype=torch.bool)
    read = torch.ones(2, 2, dtype=torch.bool)
    for row in (step_row(local, read, torch.zeros(2, dtype=torch.long), 128),
                step_row_in_one_reduction(local, read, torch.zeros(2, dtype=torch.long), 128)):
        assert row.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]


def test_a_step_records_each_head_forced_dense_and_counts_them():
    step = DecodeStep(torch.randn(1, 4, 8), torch.randn(1, 2, 300, 8), 0.35, Window(32, 4))
    assert step.forced_heads is None and step.fail_safe is None
    step.note_fail_safe(torch.tensor([[True, False, False, True]]))
    step.note_fail_safe(torch.tensor([[True, False, False, False]]))  # a composed criterion may note a head twice
    assert step.forced_heads.tolist() == [[2.0, 0.0, 0.0, 1.0]]
    assert int(step.fail_safe) == 3
    step.fail_safe = torch.tensor(7)  # the run's count, set on the executor's copy of a step
    assert int(step.fail_safe) == 7


def test_compiled_step_row_is_the_one_reduction_and_the_same_row():
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    g = torch.Generator().manual_seed(0)
    local, read = torch.rand(3, 6, generator=g) < 0.5, torch.rand(3, 2, generator=g) < 0.5
    length, extra = torch.tensor([10, 5000, 300]), torch.tensor([4.0, 100.0, 0.0])
    forced = (torch.rand(3, 6, generator=g) < 0.3).to(torch.float64)
    compiled = torch.compile(step_row, backend=backend, fullgraph=True)
    assert torch.equal(compiled(local, read, length, 128, extra, forced), step_row(local, read, length, 128, extra,
                                                                                    forced))
    code = graphs[0].code
    assert "torch.arange" in code and code.count(".sum(") == 1  # the row made elementwise from one reduction
