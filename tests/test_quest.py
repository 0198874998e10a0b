"""Local heads that attend to what they read (window ∪ E) and the Quest baseline (issue 32): the merge is exact,
window ∪ (the whole bulk) is dense attention, Quest's reads are what a hand count says, both decode inside a model
(eager and compiled alike)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import greedy_step_logits, tiny_model

import qada
from qada.attention import EXECUTORS
from qada.attention.base import GroupDecision
from qada.criteria import CRITERIA
from qada.functional.extra_set import attend_extra, extra_scores, merge_extra
from qada.step import DecodeStep
from qada.window import Window


def case(seed=0, sinks=False):
    g = torch.Generator().manual_seed(seed)
    b, H, H_kv, T, d = 2, 4, 2, 40, 16
    query = torch.randn(b, H, d, generator=g)
    keys, values = torch.randn(b, H_kv, T, d, generator=g) * 2, torch.randn(b, H_kv, T, d, generator=g)
    sink_logits = torch.tensor([0.5, 1.0, -1.0, 2.0]) if sinks else None
    return DecodeStep(query, keys, d**-0.5, Window(8, 2), values=values, sink_logits=sink_logits)


@pytest.mark.parametrize("sinks", [False, True])
def test_window_plus_the_whole_bulk_is_dense_attention(sinks):
    step = case(sinks=sinks)
    b, H = step.batch_size, step.num_heads
    local = torch.ones(b, H, dtype=torch.bool)
    executor = EXECUTORS.build("reference")
    window_out, _ = executor.attend(step, GroupDecision(local, torch.zeros(b, 2, dtype=torch.bool)))
    bulk = step.bulk_mask.nonzero()[:, 1].view(b, -1)  # [b, T_bulk]: every bulk slot
    slots = bulk[:, None].expand(b, H, bulk.shape[1])
    everything = torch.ones_like(slots, dtype=torch.bool)
    extra, log_extra = attend_extra(step.values, slots, everything,
                                    extra_scores(step.query, step.keys, slots, step.scale))
    merged = merge_extra(window_out, step.log_local, extra, log_extra, local)
    dense, _ = executor.attend(step, GroupDecision(~local, torch.ones(b, 2, dtype=torch.bool)))
    assert torch.allclose(merged, dense, atol=1e-5)
    # dense heads keep the executor's output
    assert torch.equal(merge_extra(dense, step.log_local, extra, log_extra, ~local), dense)


def test_an_empty_extra_set_leaves_the_window_output():
    step = case(1)
    local = torch.ones(2, 4, dtype=torch.bool)
    out, _ = EXECUTORS.build("reference").attend(step, GroupDecision(local, torch.zeros(2, 2, dtype=torch.bool)))
    slots = torch.zeros(2, 4, 3, dtype=torch.long)
    empty = torch.zeros_like(slots, dtype=torch.bool)
    extra, log_extra = attend_extra(step.values, slots, empty, extra_scores(step.query, step.keys, slots, step.scale))
    assert torch.isinf(log_extra).all() and torch.equal(merge_extra(out, step.log_local, extra, log_extra, local), out)


def test_quest_reads_what_a_hand_count_says():
    quest = CRITERIA.build({"name": "quest", "pages": 2, "page_size": 4})
    step = case(2)
    assert quest.budget is None and CRITERIA.build({"name": "quest", "budget": 10, "page_size": 4}).pages == 2
    reads = quest.extra_reads(step)
    # per KV head: 2 extrema per page (10 pages of 4 for 40 tokens), keys and values of G * k * P page tokens
    assert torch.equal(reads, torch.full((2,), 2 * 10 + 2 * (2 * 2 * 4), dtype=torch.float64))
    with pytest.raises(ValueError, match="heavy must be 0"):
        CRITERIA.build({"name": "quest", "heavy": 4, "observe": 4})
    with pytest.raises(ValueError, match="budget"):
        CRITERIA.build({"name": "quest", "budget": 0})


def test_quest_decides_every_head_local_and_attends_over_its_pages():
    step = case(3)
    quest = CRITERIA.build({"name": "quest", "pages": 2, "page_size": 4})
    quest.observe_prefill(0, step.keys[:, :, :-1], None, None, None, step.window, None)
    local = quest(step)
    assert local.all()
    slots, valid, scores = step.extra_set
    assert slots.shape[:2] == (2, 4) and slots.shape[2] >= 8 and valid.any()
    bulk = step.bulk_mask
    rows = torch.arange(2)[:, None, None]
    assert bulk[rows, slots][valid].all()  # only bulk tokens, never the window's


@pytest.mark.parametrize("criterion", [
    {"name": "quest", "pages": 2, "page_size": 4},
    {"name": "qada_tail", "tau": 0.3, "heavy": 4, "observe": 4, "page_size": 4, "pages": 2, "attend_exact": True},
])
def test_attending_over_what_was_read_decodes_inside_a_model_compiled_as_eagerly(criterion):
    from transformers import StaticCache

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(4))
    outputs = []
    for compile in (False, "aot_eager"):
        with torch.no_grad(), qada.apply(model, criterion=criterion, moments="current",
                                         window={"t_local": 8, "t_sink": 2}, compile=compile) as run:
            logits = greedy_step_logits(model, ids, StaticCache(config=model.config, max_cache_len=60), 5)
            outputs.append((logits, run.summary(), run.layer_step.eager_reason))
    (eager, eager_summary, _), (compiled, summary, reason) = outputs
    assert reason is None and torch.allclose(eager, compiled, atol=1e-4)
    assert summary["kv_read"] == pytest.approx(eager_summary["kv_read"]) and 0 < summary["kv_read"] < 1
    if criterion["name"] == "quest":
        assert summary["sparsity"] == 1.0


@pytest.mark.parametrize("criterion", [
    {"name": "quest", "pages": 2, "page_size": 4},
    {"name": "qada_tail", "tau": 0.3, "heavy": 4, "observe": 4, "page_size": 4, "pages": 2, "attend_exact": True},
    {"name": "qada_tail_budget", "sparsity": 0.6, "per_group": True, "heavy": 4, "observe": 4, "page_size": 4,
     "pages": 2, "attend_exact": True, "super_page": 2, "super_pages": 2},
])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_the_extra_set_merged_in_the_layer_step_decodes_as_merged_after_the_executor(criterion, cache):
    """With the window's attention from the layer step (``sdpa``'s default) the step merges window ∪ E itself and
    nothing is merged after the executor; the logits equal the executor attending over the window itself and
    merging after it (``step_window=False``) and the reference executor, eager and compiled."""
    from transformers import DynamicCache, StaticCache

    from qada.models.layer_step import LayerStep

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(5))
    merged_after = []
    original = LayerStep.merge

    def counting(self, buffered, output, result):
        merged_after.append(result.extra_output is not None)
        return original(self, buffered, output, result)

    outputs = {}
    LayerStep.merge = counting
    try:
        for executor in ("sdpa", {"name": "sdpa", "step_window": False}, "reference"):
            for compile in (False, "aot_eager"):
                merged_after.clear()
                made = (StaticCache(config=model.config, max_cache_len=60) if cache == "static" else DynamicCache())
                with torch.no_grad(), qada.apply(model, criterion=criterion, moments="current", executor=executor,
                                                 window={"t_local": 8, "t_sink": 2}, compile=compile) as run:
                    logits = greedy_step_logits(model, ids, made, 5)
                    outputs[str(executor), compile] = logits, run.summary()
                # the step merges for sdpa's default alone; the others merge after their executor, at every step
                assert merged_after and all(merged_after) == (executor != "sdpa") and any(merged_after) == all(
                    merged_after)
    finally:
        LayerStep.merge = original
    reference, reference_summary = outputs["reference", False]
    assert 0 < reference_summary["sparsity"]
    for (executor, compile), (logits, summary) in outputs.items():
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4, msg=f"{executor} compile={compile}")
        assert summary["sparsity"] == pytest.approx(reference_summary["sparsity"])
