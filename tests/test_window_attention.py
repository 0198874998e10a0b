"""The window's attention computed from the criterion's window scores (:func:`qada.functional.masses.window_attention`)
equals softmax attention over the window, sink logits and soft caps included, and the ``sdpa`` executor that takes
it from the layer step (:attr:`qada.step.DecodeStep.window_output`) gives the output it computes itself."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qada.attention  # noqa: F401  (registers every executor)
from qada.attention import EXECUTORS, GroupDecision
from qada.functional.masses import window_attention
from qada.functional.window import window_indices
from qada.models import build_run
from qada.models.layer_step import layer_step
from qada.step import DecodeStep
from qada.window import Window

WINDOW = Window(16, 4)


def random_step(b, H_kv, G, C, d, dtype, buffered, sinks, softcap, seed) -> DecodeStep:
    """A decode step on a cache of ``C`` slots; ``buffered``: rows hold ``[start, end)`` of a preallocated buffer."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, H_kv * G, d, generator=g).to(dtype)
    k = (torch.randn(b, H_kv, C, d, generator=g) * 1.5).to(dtype)
    v = torch.randn(b, H_kv, C, d, generator=g).to(dtype)
    start = end = None
    if buffered:
        end = torch.randint(1, C + 1, (b,), generator=g)
        start = (torch.rand(b, generator=g) * end).long()  # in [0, end): every row holds a token
    sink_logits = torch.randn(H_kv * G, generator=g) if sinks else None
    return DecodeStep(q, k, d**-0.5, WINDOW, start=start, end=end, values=v, sink_logits=sink_logits,
                      softcap=softcap)


def reference_window_attention(step: DecodeStep) -> torch.Tensor:
    """``[b, H, d]`` float64: each head's softmax over its row's window slots (and its sink logit), explicitly."""
    b, H, d = step.query.shape
    G = step.group_size
    idx, valid = window_indices(step.length, step.window.t_local, step.window.t_sink, step.start, step.device,
                                end=step.end)
    idx, valid = idx.expand(b, -1), valid.expand(b, -1)  # rows without bounds share one
    out = torch.zeros(b, H, d, dtype=torch.float64)
    for row in range(b):
        slots = idx[row][valid[row]]
        for head in range(H):
            keys = step.keys[row, head // G, slots].double()
            values = step.values[row, head // G, slots].double()
            scores = keys @ step.query[row, head].double() * step.scale
            if step.softcap is not None:
                scores = step.softcap * torch.tanh(scores / step.softcap)
            if step.sink_logits is not None:  # the sink's column takes its share of the mass
                scores = torch.cat([scores, step.sink_logits[head:head + 1].double()])
            weights = torch.softmax(scores, 0)[: len(slots)]
            out[row, head] = weights @ values
    return out


@given(b=st.integers(1, 3), H_kv=st.integers(1, 3), G=st.integers(1, 3), C=st.integers(1, 60),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), buffered=st.booleans(), sinks=st.booleans(),
       softcap=st.sampled_from([None, 5.0]), seed=st.integers(0, 99))
def test_window_attention_equals_softmax_over_the_window(b, H_kv, G, C, dtype, buffered, sinks, softcap, seed):
    step = random_step(b, H_kv, G, C, 8, dtype, buffered, sinks, softcap, seed)
    valid = None if step.full_rows else step.window_valid
    got = window_attention(step.local_scores, step.log_local, step.window_values, valid)
    assert got.shape == step.query.shape and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), reference_window_attention(step), atol=tolerance, rtol=tolerance)


def test_a_head_without_window_tokens_gets_zero_not_nan():
    scores = torch.randn(1, 2, 4)
    values = torch.randn(1, 1, 4, 3)
    valid = torch.zeros(1, 4, dtype=torch.bool)
    log_local = torch.full((1, 2), float("-inf"))
    assert torch.equal(window_attention(scores, log_local, values, valid), torch.zeros(1, 2, 3))


@pytest.mark.parametrize("sinks, softcap", [(False, None), (True, None), (False, 5.0)])
@pytest.mark.parametrize("buffered", [False, True])
def test_sdpa_taking_the_steps_window_output_equals_attending_itself(sinks, softcap, buffered):
    """The executor's output with the shared window attention equals its own window call, every kind of decision."""
    for seed, kind in enumerate(("mixed", "local", "dense", "one_group_local")):
        step = random_step(2, 3, 3, 70, 16, torch.float32, buffered, sinks, softcap, seed)
        g = torch.Generator().manual_seed(seed)
        local = torch.rand(2, 9, generator=g) < 0.5 if kind == "mixed" else torch.full((2, 9), kind == "local")
        if kind == "one_group_local":
            local.view(2, 3, 3)[:, 0] = True
        decision = GroupDecision(local, ~local.view(2, 3, 3).all(-1))
        executor = EXECUTORS.build("sdpa")
        expected = executor.attend(step, decision)[0]
        shared = random_step(2, 3, 3, 70, 16, torch.float32, buffered, sinks, softcap, seed)
        valid = None if shared.full_rows else shared.window_valid
        output = window_attention(shared.local_scores, shared.log_local, shared.window_values, valid)
        shared.share(window_keys=shared.window_keys, window_valid=shared.window_valid,
                     window_values=shared.window_values, t_bulk=None, real=None, window_output=output)
        assert shared.window_output is output
        torch.testing.assert_close(executor.attend(shared, decision)[0], expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("executor, expected", [("sdpa", True), ({"name": "sdpa", "step_window": False}, False),
                                               ("flex", False), ("reference", False)])
def test_the_layer_step_attends_over_the_window_for_an_executor_that_uses_it(executor, expected):
    """The run asks its layer step for the window's attention only where its executor uses it."""
    run = build_run(criterion={"name": "oracle", "tau": 0.5}, executor=executor, compile=False)
    assert run.layer_step._bound["attend_window"] is expected
    step = random_step(1, 2, 2, 40, 8, torch.float32, True, False, None, 0)
    query, keys, values = step.query[:, :, None], step.keys, step.values
    result = layer_step(query, keys, values, step.start, step.end, step.scale, torch.tensor(0), None, {},
                        criterion=run.criterion, moments=None, window=WINDOW, policy="exact",
                        attend_window=expected)
    if expected:
        torch.testing.assert_close(result.window_output.double(), reference_window_attention(step), atol=1e-5,
                                   rtol=1e-5)
    else:
        assert result.window_output is None
