"""A compiled model takes qada's decode step into its graph on the CPU (:mod:`qada.models.inline_step`).

* the same tokens and statistics as eager decoding, for the paper's criterion, a tail-aware one and a budget, with the
  default (host-skipping) CPU executor and without host skips, over rows with left padding;
* the layer step then never runs as a compiled function of its own (it is in the model's graph); with
  ``run.inline = False`` (the default) it does (the whole step one operator), with the same tokens;
* a second sequence on the same cache and compiled forward compiles nothing new;
* :meth:`~qada.models.run.QAdARun.inlines`: only when asked (``run.inline = True``), on the CPU, with qada's own
  components, a compiled layer step and no soft cap.
"""

from __future__ import annotations

import pytest
import torch
from test_buffer_decode import (  # noqa: F401  (the model and reference fixtures)
    WINDOW,
    count_buffer_steps,
    greedy_compiled,
    make_run,
    model,
    moments,
    prompt,
    reference,
)
from transformers import StaticCache

from qada.criteria import QAdACriterion
from qada.models import attach, build_run

CONFIGS = [
    ({"name": "qada", "tau": 0.3}, "stored", "sdpa"),
    ({"name": "qada_tail", "tau": 0.3, "heavy": 4, "observe": 4, "page_size": 2, "pages": 2}, "stored", "sdpa"),
    ({"name": "qada_budget", "sparsity": 0.6}, "current", {"name": "sdpa", "host_skip": False}),
]
STEPS = 6


def compiling_run(criterion, source, executor, reference):  # noqa: F811
    """:func:`make_run` with its layer step compiled (the tests' default is eager) and ``inline`` on."""
    run = build_run(criterion=criterion, moments=moments(source, reference), executor=executor, window=WINDOW,
                    compile=True)
    run.inline = True
    return run


@pytest.mark.parametrize("criterion, source, executor", CONFIGS, ids=["qada", "qada_tail", "qada_budget"])
def test_the_step_traced_inline_equals_eager(model, reference, criterion, source, executor):  # noqa: F811
    torch._dynamo.reset()
    eager = greedy_compiled(model, make_run(criterion, source, executor, reference), STEPS,
                            {"backend": "eager", "disable": True})
    run = compiling_run(criterion, source, executor, reference)
    assert run.inlines(torch.device("cpu"))
    separate: list = []
    with count_buffer_steps(separate):
        compiled = greedy_compiled(model, run, STEPS, {"fullgraph": True})
    assert separate == []  # the layer step ran inside the model's graph, never as a function of its own
    assert torch.equal(compiled[0], eager[0])
    for key in ("sparsity", "kv_sparsity", "kv_read", "decode_steps", "fail_safe"):
        assert compiled[1][key] == pytest.approx(eager[1][key])
    assert 0.0 < compiled[1]["sparsity"] < 1.0


def test_inline_off_calls_the_whole_step_as_one_operator(model, reference):  # noqa: F811
    torch._dynamo.reset()
    criterion, source, executor = CONFIGS[0]
    inline = greedy_compiled(model, compiling_run(criterion, source, executor, reference), STEPS, {"fullgraph": True})
    torch._dynamo.reset()
    run = compiling_run(criterion, source, executor, reference)
    run.inline = False
    assert not run.inlines(torch.device("cpu"))
    separate: list = []
    with count_buffer_steps(separate):
        opaque = greedy_compiled(model, run, STEPS, {"fullgraph": True})
    assert len(separate) == STEPS * model.config.num_hidden_layers
    assert torch.equal(opaque[0], inline[0])
    assert opaque[1]["sparsity"] == pytest.approx(inline[1]["sparsity"])


def test_a_second_sequence_compiles_nothing_new(model, reference):  # noqa: F811
    """One run, one cache, one compiled forward over two prompts: the second decodes with the first's graph (the
    per-layer state tensors are rewritten in place at its prefill, not replaced)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    criterion, source, executor = CONFIGS[1]
    run = compiling_run(criterion, source, executor, reference)
    counter = CompileCounterWithBackend("inductor")
    forward = torch.compile(model.forward, backend=counter, fullgraph=True)
    ids, mask = prompt(3)
    capacity = ids.shape[1] + STEPS + 3
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    attach(model, run)
    try:
        for seed in (3, 5):
            ids, mask = prompt(seed)
            cache.reset()
            run.reset_stats()
            full_mask = torch.cat([mask, torch.ones(2, capacity - ids.shape[1], dtype=mask.dtype)], 1)
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
                for _ in range(STEPS):
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    out = forward(input_ids=token, attention_mask=full_mask, past_key_values=cache, use_cache=True)
            assert 0.0 < run.summary()["sparsity"] < 1.0
            if seed == 3:
                first = counter.frame_count
    finally:
        run.remove()
    assert first == 1 and counter.frame_count == 1


class HostReadingCriterion(QAdACriterion):
    """A user's criterion (defined outside qada): it might read the host, so a traced model keeps it opaque."""


def test_what_inlines():
    cpu = torch.device("cpu")

    def run(criterion="qada", moments="stored", compile=True, inline=True):
        built = build_run(criterion=criterion, moments=moments, compile=compile)
        if inline is not None:
            built.inline = inline
        return built

    assert run().inlines(cpu)
    assert not run(inline=None).inlines(cpu)  # off by default
    assert not run(inline=False).inlines(cpu)
    assert not run().inlines(torch.device("cuda"))
    assert not run().inlines(cpu, softcap=30.0)
    assert not run(compile=False).inlines(cpu)
    assert not run(criterion=HostReadingCriterion()).inlines(cpu)
    assert not run(criterion={"name": "any_of", "criteria": [HostReadingCriterion(), "local"]}).inlines(cpu)
    assert run(criterion="dense", moments="none").inlines(cpu)


def test_row_bounds_as_traced_equal_the_eager_ones():
    """The min/max form the traced step uses gives the argmax form's ``(start, end)`` for any row of one run of keys,
    an empty row included, from bool and additive masks."""
    from qada.models.guards import _last_query_allowed, bounds_by_min_max, row_bounds

    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        b, T = (int(x) for x in torch.randint(1, 40, (2,), generator=generator))
        b = b % 4 + 1
        mask = torch.zeros(b, 1, 1, T, dtype=torch.bool)
        for row in range(b):
            first = int(torch.randint(0, T, (1,), generator=generator))
            last = int(torch.randint(first, T + 1, (1,), generator=generator))
            mask[row, 0, 0, first:last] = True
        for kind in (mask, torch.where(mask, 0.0, float("-inf"))):
            start, end = row_bounds(kind, T)
            traced = bounds_by_min_max(_last_query_allowed(kind))
            assert torch.equal(traced[0], start) and torch.equal(traced[1], end)
