"""The shared dense prefill records the prompt's last queries, so that runs started from its cache (eval, sweep,
analyze) give the tail-aware criteria the heavy set a prefill with qada attached gives them (issue 23)."""

import pytest
import torch

from qada.eval.decode import decode_greedy, prefill
from qada.models import apply, build_run
from qada.models.prompt_queries import recording_queries
from tests.tiny_models import tiny_model

WINDOW = {"t_local": 16, "t_sink": 4}  # random models attend almost uniformly: mixed decisions at tau 0.15
TAIL = {"name": "qada_tail", "tau": 0.15, "heavy": 8, "observe": 6, "page_size": 8, "pages": 2}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return tiny_model(request.param)


def ids(T: int = 120, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(seed))


class QuerySpy:
    """Keeps the queries a criterion's ``observe_prefill`` receives."""

    def __init__(self, criterion):
        self.criterion, self.seen = criterion, {}
        original = criterion.observe_prefill

        def spy(layer, keys, queries, scale, *args, **kwargs):
            self.seen[layer] = (queries, scale)
            return original(layer, keys, queries, scale, *args, **kwargs)

        criterion.observe_prefill = spy


def test_recording_changes_nothing_and_keeps_the_last_queries(model):
    prompt = ids()
    plain = prefill(model, prompt)
    recorded = prefill(model, prompt, keep_queries=6)
    assert plain.queries is None
    torch.testing.assert_close(recorded.last_logits, plain.last_logits, rtol=0, atol=0)
    for a, b in zip(plain.cache.layers, recorded.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert sorted(recorded.queries.queries) == list(range(model.config.num_hidden_layers))
    H, d = model.config.num_attention_heads, model.config.head_dim
    assert all(q.shape == (1, H, 6, d) for q in recorded.queries.queries.values())
    assert model.config._attn_implementation == "sdpa", "the attention implementation is restored"


def test_the_recorded_queries_are_those_an_attached_prefill_sees(model):
    prompt = ids()
    recorded = prefill(model, prompt, keep_queries=6).queries
    with apply(model, criterion=TAIL, moments="current", window=WINDOW) as run:
        spy = QuerySpy(run.criterion)
        model(input_ids=prompt, use_cache=True)
    assert spy.seen, "the attached prefill reached the criterion"
    for layer, (queries, scale) in spy.seen.items():
        torch.testing.assert_close(recorded.queries[layer], queries[:, :, -6:], rtol=1e-6, atol=1e-6)
        assert recorded.scales[layer] == pytest.approx(scale)


def test_a_run_from_the_shared_prefill_has_the_attached_prefills_heavy_set(model):
    prompt = ids()
    with apply(model, criterion=TAIL, moments="current", window=WINDOW) as attached:
        model(input_ids=prompt, use_cache=True)
    shared = build_run(TAIL, "current", "sdpa", WINDOW)
    tokens = decode_greedy(model, prefill(model, prompt, keep_queries=6), 4, run=shared)
    assert len(tokens) == 4
    index, reference = shared.criterion._index.layers, attached.criterion._index.layers
    assert sorted(index) == sorted(reference) and index
    for layer in index:
        assert torch.equal(index[layer].heavy_valid, reference[layer].heavy_valid)
        assert index[layer].heavy_valid.any(), "the heavy set is not empty"
        assert torch.equal(index[layer].heavy[index[layer].heavy_valid],
                           reference[layer].heavy[reference[layer].heavy_valid])


def test_decoding_from_the_shared_prefill_equals_generate_with_qada_attached(model):
    prompt = ids(seed=3)
    tokens = decode_greedy(model, prefill(model, prompt, keep_queries=6), 10, run=build_run(TAIL, "current", "sdpa",
                                                                                              WINDOW))
    with apply(model, criterion=TAIL, moments="current", window=WINDOW) as run:
        fresh = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                               do_sample=False, pad_token_id=0)
    assert tokens == fresh[0, prompt.shape[1]:].tolist()
    assert 0 < run.summary()["sparsity"] < 1


@pytest.mark.parametrize("keep", [0, 3])
def test_too_few_recorded_queries_are_a_clear_error(model, keep):
    with pytest.raises(ValueError, match="last 6 queries per layer"):
        decode_greedy(model, prefill(model, ids(), keep_queries=keep), 4, run=build_run(TAIL, "current", "sdpa",
                                                                                         WINDOW))


def test_criteria_without_a_heavy_set_need_no_queries(model):
    pages_only = {**TAIL, "heavy": 0}
    assert build_run(pages_only, "current", "sdpa", WINDOW).criterion.prompt_queries() == 0
    assert build_run({"name": "any_of", "criteria": ["local", TAIL]}, "current").criterion.prompt_queries() == 6
    assert len(decode_greedy(model, prefill(model, ids()), 3, run=build_run(pages_only, "current", "sdpa",
                                                                           WINDOW))) == 3


def test_bad_keep_and_nested_recordings_are_clear_errors(model):
    with pytest.raises(ValueError, match="keep"):
        with recording_queries(model, 0):
            pass
    with recording_queries(model, 2):
        with pytest.raises(RuntimeError, match="do not nest"):
            with recording_queries(model, 2):
                pass
    assert model.config._attn_implementation == "sdpa"
