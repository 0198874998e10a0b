"""A preallocated cache (transformers' ``StaticCache``) decodes exactly like a growing one (``DynamicCache``)."""

import pytest
import torch
from transformers import DynamicCache, StaticCache

import qada
from qada.models import StaleStateError
from tests.tiny_models import tiny_model

WINDOW = {"t_local": 64, "t_sink": 4}
NEW = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module", params=["left-padded batch", "one row"])
def batch(request):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (2, 300), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left padding
    if request.param == "one row":  # no padding: transformers passes no mask at the prefill
        return ids[:1, 37:], mask[:1, 37:]
    return ids, mask


def _generate(model, batch, cache: str, **spec):
    ids, mask = batch
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    if cache == "static":
        kwargs["past_key_values"] = StaticCache(config=model.config, max_cache_len=ids.shape[1] + NEW + 11)
    if not spec:
        return model.generate(ids, **kwargs)[:, ids.shape[1] :], None
    with qada.apply(model, window=WINDOW, **spec) as run:
        out = model.generate(ids, **kwargs)
    return out[:, ids.shape[1] :], run.summary()


SPECS = {
    "dense": dict(criterion="dense", moments=None),
    "local": dict(criterion="local", moments=None),
    "oracle": dict(criterion={"name": "oracle", "tau": 0.2}, moments=None),
    "qada_current": dict(criterion={"name": "qada", "tau": 0.2}, moments="current"),
    "static": dict(criterion={"name": "static", "mask": [[True, False, True, True], [False, True, True, False]]},
                   moments=None),
    "qada_reference_executor": dict(criterion={"name": "qada", "tau": 0.2}, moments="current", executor="reference"),
}


def test_dense_tokens_are_the_same_with_a_static_and_a_dynamic_cache(model, batch):
    dynamic, _ = _generate(model, batch, "dynamic")
    static, _ = _generate(model, batch, "static")
    assert torch.equal(dynamic, static)


@pytest.mark.parametrize("name", SPECS)
def test_every_criterion_decodes_the_same_with_a_static_cache(model, batch, name):
    dynamic, dynamic_summary = _generate(model, batch, "dynamic", **SPECS[name])
    static, static_summary = _generate(model, batch, "static", **SPECS[name])
    assert torch.equal(dynamic, static)
    for key in ("sparsity", "kv_sparsity", "decode_steps", "fail_safe"):
        assert dynamic_summary[key] == static_summary[key], key
    assert static_summary["decode_steps"] == NEW - 1


def test_qada_dense_criterion_gives_the_native_tokens_with_either_cache(model, batch):
    native, _ = _generate(model, batch, "dynamic")
    for cache in ("dynamic", "static"):
        wrapped, summary = _generate(model, batch, cache, **SPECS["dense"])
        assert torch.equal(native, wrapped), cache
        assert summary["sparsity"] == 0.0


def test_decoding_from_a_prefilled_static_cache(model, batch):
    """The evaluator's path: prefill once (unwrapped), then decode with qada attached to the copied cache."""
    from qada.eval.decode import prefill_from_cache
    from qada.models import attach, build_run

    ids, mask = batch
    results = {}
    for kind in ("dynamic", "static"):
        cache = DynamicCache(config=model.config) if kind == "dynamic" else StaticCache(
            config=model.config, max_cache_len=ids.shape[1] + 8)
        with torch.no_grad():
            out = model(input_ids=ids[:1, -263:], past_key_values=cache, use_cache=True)
        run = build_run({"name": "qada", "tau": 0.2}, "current", "sdpa", WINDOW)
        attach(model, run)
        try:
            prefill_from_cache(run, cache)
            token, tokens = out.logits[:, -1].argmax(-1, keepdim=True), []
            with torch.no_grad():
                for _ in range(4):
                    logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
                    token = logits[:, -1].argmax(-1, keepdim=True)
                    tokens.append(int(token))
        finally:
            run.remove()
        results[kind] = (tokens, run.summary()["sparsity"])
    assert results["dynamic"] == results["static"]


def test_a_full_static_cache_fails_loudly(model, batch):
    """Writing past the capacity is transformers' IndexError (before qada runs), never a silent wrong answer."""
    ids, mask = batch
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 2)
    with qada.apply(model, window=WINDOW, criterion="dense", moments=None), pytest.raises(IndexError,
                                                                                          match="out of bounds"):
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                       past_key_values=cache)


def test_a_cropped_dynamic_cache_is_still_refused(model, batch):
    ids, _ = batch
    cache = DynamicCache(config=model.config)
    with qada.apply(model, window=WINDOW, criterion={"name": "qada", "tau": 0.2}, moments="current"):
        with torch.no_grad():
            model(input_ids=ids[:1], past_key_values=cache, use_cache=True)
            cache.crop(-10)
            n = ids.shape[1]
            with pytest.raises(StaleStateError, match=f"cache went from {n} to {n - 9}"):
                model(input_ids=ids[:1, :1], past_key_values=cache, use_cache=True)
