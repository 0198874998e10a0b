"""The decoder wrapper on tiny random Llama / Qwen2 / Mistral models (GQA), no downloads."""

import pytest
import torch
from transformers import AttentionInterface

import qada
from qada.functional import local_index_set
from qada.models import DecisionRecorder, Observer, StaleStateError, UnsupportedModelError, apply, enable
from qada.window import Window
from tests.tiny_models import tiny_model

ARCHS = ["llama", "qwen2", "mistral"]
WINDOW = Window(32, 4)


def greedy(model, ids, mask=None, steps=10, **kwargs):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0, **kwargs,
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_criterion_equals_the_unwrapped_model(arch):
    model = tiny_model(arch)
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    reference = greedy(model, ids, steps=50)
    with apply(model, criterion="dense", moments=None, executor="sdpa") as run:
        wrapped = greedy(model, ids, steps=50)
    assert torch.equal(reference.sequences, wrapped.sequences)
    for ref, got in zip(reference.logits, wrapped.logits, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    assert run.summary()["decode_steps"] == 49 and run.summary()["sparsity"] == 0.0


def _hand_local_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Independent sink+recent attention: explicit index set, explicit softmax, for decode; causal for prefill."""
    b, H, q_len, d = query.shape
    G = H // key.shape[1]
    k = key.repeat_interleave(G, dim=1)
    v = value.repeat_interleave(G, dim=1)
    T = k.shape[2]
    scores = (query @ k.transpose(-1, -2)) * scaling
    allowed = torch.ones(q_len, T, dtype=torch.bool).tril(T - q_len)
    if q_len == 1:
        allowed = torch.zeros(1, T, dtype=torch.bool)
        allowed[0, local_index_set(T, WINDOW.t_local, WINDOW.t_sink)] = True
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2), None


@pytest.mark.parametrize("arch", ARCHS)
def test_all_local_equals_hand_computed_sink_plus_recent_attention(arch):
    model = tiny_model(arch)
    ids = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(2))
    AttentionInterface.register("test_hand_local", _hand_local_attention)
    model.set_attn_implementation("test_hand_local")
    try:
        reference = greedy(model, ids, steps=20)
    finally:
        model.set_attn_implementation("sdpa")
    with apply(model, criterion="local", moments=None, window=WINDOW) as run:
        wrapped = greedy(model, ids, steps=20)
    for ref, got in zip(reference.logits, wrapped.logits, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert run.summary()["sparsity"] == 1.0
    # and it really differs from dense attention
    dense = greedy(model, ids, steps=20)
    assert not torch.allclose(dense.logits[-1], wrapped.logits[-1], atol=1e-3)


@pytest.mark.parametrize("criterion", ["qada", "oracle", "local"])
def test_padded_batch_equals_row_by_row(criterion):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, 128, (n,), generator=g) for n in (120, 75, 40)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    spec = dict(criterion=criterion, moments="current" if criterion == "qada" else None, window=WINDOW)
    with apply(model, **spec) as run:
        batch = greedy(model, ids, mask, steps=12).sequences[:, width:]
        batch_sparsity = run.summary()["sparsity"]
        singles = [greedy(model, r[None], steps=12).sequences[0, len(r):] for r in rows]
    for i, single in enumerate(singles):
        assert torch.equal(batch[i], single), f"row {i} differs from running it alone"
    if criterion != "local":
        assert 0.0 < batch_sparsity < 1.0, "the comparison should exercise both local and dense heads"


def test_context_manager_restores_the_model_even_after_an_error():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with apply(model, criterion="local", moments=None):
            assert model.config._attn_implementation == "qada"
            raise RuntimeError("boom")
    assert model.config._attn_implementation == before
    ids = torch.randint(1, 128, (1, 20))
    model(ids)  # runs with the restored implementation
    run = enable(model, criterion="dense", moments=None)
    with pytest.raises(UnsupportedModelError, match="already enabled"):
        enable(model, criterion="dense", moments=None)
    run.remove()
    assert model.config._attn_implementation == before


def test_observers_see_exactly_one_decision_per_layer_and_step():
    model = tiny_model("llama", num_hidden_layers=3)
    ids = torch.randint(1, 128, (2, 100))
    recorder = DecisionRecorder(wants_oracle=True)
    with apply(model, criterion="qada", moments="current", window=WINDOW, observers=[recorder]):
        greedy(model, ids, steps=8)
    keys = [(e.layer, e.step) for e in recorder.events]
    assert sorted(keys) == [(layer, step) for layer in range(3) for step in range(7)]
    event = recorder.events[-1]
    assert event.local.shape == (2, 4) and event.oracle_ratio.shape == (2, 4)
    assert ((event.oracle_ratio >= 0) & (event.oracle_ratio <= 1)).all()
    assert event.log_bulk_estimate is not None and torch.isfinite(event.log_bulk_estimate).all()
    # QAdA's recorded decision is its threshold test on the recorded estimate
    log_ratio = event.log_local - torch.logaddexp(event.log_local, event.log_bulk_estimate)
    assert torch.equal(event.local, log_ratio >= torch.log(torch.tensor(0.6)))


def test_the_time_spent_in_observers_is_counted_apart():
    import time

    class Slow(Observer):
        def on_decision(self, event):
            time.sleep(0.01)

    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 40))
    with apply(model, criterion="qada", moments="current", window=WINDOW, observers=[Slow()]) as run:
        greedy(model, ids, steps=4)  # 3 decode steps of 2 layers: 6 decisions
        assert 0.06 <= run.fanout.seconds < 1.0
        run.reset_stats()
        assert run.fanout.seconds == 0.0


def test_recording_is_off_by_default():
    class Counter(Observer):
        calls = 0

        def on_decision(self, event):
            Counter.calls += 1

    model = tiny_model("llama")
    with apply(model, criterion="qada", moments="current", window=WINDOW) as run:
        greedy(model, torch.randint(1, 128, (1, 60)), steps=3)
    assert run.observers == [] and Counter.calls == 0


def test_sampling_and_config_forms(tmp_path):
    model = tiny_model("qwen2")
    ids = torch.randint(1, 128, (1, 70))
    config = tmp_path / "qada.yaml"
    config.write_text("criterion: {name: qada, tau: 0.5}\nmoments: {name: current}\nexecutor: reference\n"
                      "window: {t_local: 32, t_sink: 4}\n")
    with apply(model, config=config) as run:
        torch.manual_seed(0)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=6,
                             pad_token_id=0)
    assert out.shape == (1, 76)
    assert run.criterion.tau == 0.5 and run.executor.registry_name == "reference" and run.window == WINDOW
    with pytest.raises(ValueError, match="unknown config key"):
        enable(model, config={"criterion": "qada", "executer": "sdpa"})
    with pytest.raises(ValueError, match="unknown criterion"):
        enable(model, criterion="qadaa", moments=None)


def test_fail_safe_fallbacks_are_counted():
    model = tiny_model("llama")

    from qada.moments import BulkMoments, CurrentMoments

    class BrokenMoments(CurrentMoments):
        def step(self, state, keys, start, end, window):  # the decode step's moments
            m = super().step(state, keys, start, end, window)
            return BulkMoments(torch.full_like(m.mean, float("nan")), m.cov)

    with apply(model, criterion="qada", moments=BrokenMoments(), window=WINDOW) as run:
        greedy(model, torch.randint(1, 128, (1, 80)), steps=4)
    summary = run.summary()
    assert summary["sparsity"] == 0.0
    assert summary["fail_safe"] == 2 * 3 * 4  # layers x steps x heads


def test_unsupported_models_get_a_clear_error():
    class NotRouted(torch.nn.Module):
        pass

    with pytest.raises(UnsupportedModelError, match="does not route its attention"):
        enable(NotRouted(), criterion="dense", moments=None)


@pytest.mark.parametrize("sliding_window", [50, 4096])
def test_mistral_with_a_sliding_window_passes_through(sliding_window):
    """Mistral passes its window to every layer: all of them pass through untouched (also beyond the window,
    no longer refused), qada warns that it has no global layer, and the tokens and logits are the native ones."""
    model = tiny_model("mistral", sliding_window=sliding_window)
    ids = torch.randint(1, 128, (1, 80))
    reference = greedy(model, ids, steps=5)
    with pytest.warns(UserWarning, match="every attention layer of MistralForCausalLM attends over a sliding window"):
        with apply(model, criterion="dense", moments=None) as run:
            wrapped = greedy(model, ids, steps=5)
    assert torch.equal(wrapped.sequences, reference.sequences)
    for ref, got in zip(reference.logits, wrapped.logits, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    summary = run.summary()
    assert summary["global_layers"] == [] and summary["sliding_layers"] == [0, 1]
    assert summary["decode_steps"] == 0 and summary["sparsity_all_layers"] == 1.0


def test_cache_cropping_is_refused():
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 60))
    with apply(model, criterion="qada", moments="current", window=WINDOW):
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
        model(ids[:, :1], past_key_values=cache, use_cache=True)
        cache.crop(-6)
        with pytest.raises(StaleStateError, match="cache went from 61 to 56"):
            model(ids[:, :1], past_key_values=cache, use_cache=True)
        # a new prompt (prefill) starts over cleanly
        model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)


def test_resumed_generation_on_an_existing_cache_matches_one_long_prompt():
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 100))
    spec = dict(criterion="qada", moments="current", window=WINDOW)
    with apply(model, **spec):
        cache = DynamicCache(config=model.config)
        model(ids[:, :70], past_key_values=cache, use_cache=True)
        resumed = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=8, do_sample=False, pad_token_id=0)
        fresh = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                               do_sample=False, pad_token_id=0)
    assert torch.equal(resumed, fresh)


def test_top_level_api():
    assert qada.apply is apply and qada.enable is enable


def test_beam_search_reordering_is_refused_with_per_row_moments():
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 80), generator=torch.Generator().manual_seed(5))
    with apply(model, criterion="qada", moments="current", window=WINDOW):
        with pytest.raises(StaleStateError, match="reordered"):
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=4, max_new_tokens=12,
                           do_sample=False, pad_token_id=0)
    # criteria that keep no per-row state follow reordered rows correctly: beam search equals the unwrapped model
    reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=3, max_new_tokens=6,
                               do_sample=False, pad_token_id=0)
    with apply(model, criterion="dense", moments=None):
        beams = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=3, max_new_tokens=6,
                               do_sample=False, pad_token_id=0)
    assert torch.equal(beams, reference)


@pytest.mark.parametrize("executor", [{"name": "sdpa"}, {"name": "flex", "compile": False}, {"name": "triton"},
                                      {"name": "sdpa", "group_policy": "promote"}])
def test_every_executor_inside_the_wrapper_equals_the_reference(executor):
    """A padded GQA batch decoded with each executor gives the reference executor's logits and tokens."""
    if executor["name"] == "triton":
        pytest.importorskip("triton")
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 128, (2, 90), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :25] = 0
    policy = executor.get("group_policy", "exact")
    spec = dict(criterion={"name": "oracle", "tau": 0.3}, moments=None, window=WINDOW)
    with apply(model, executor={"name": "reference", "group_policy": policy}, **spec) as ref_run:
        reference = greedy(model, ids, mask, steps=5)
    with apply(model, executor=executor, **spec) as run:
        got = greedy(model, ids, mask, steps=5)
    assert torch.equal(got.sequences, reference.sequences)
    for ref, out in zip(reference.logits, got.logits, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert run.summary()["sparsity"] == pytest.approx(ref_run.summary()["sparsity"])
    assert 0 < run.summary()["sparsity"] < 1
