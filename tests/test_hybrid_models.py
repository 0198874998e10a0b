"""Hybrid and sliding-window models (tiny random Llama / Qwen2 / Mistral / Gemma-3 configs, no downloads).

Sliding-window layers pass through qada untouched (their own mask and cache); criteria, moment sources,
observers and statistics only see the global layers. Prompts are longer than the window (8 tokens) and decoding
goes beyond it, so the sliding masks and caches actually cut.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import warnings

import pytest
import torch

import qada
from qada.eval.decode import decode_greedy, prefill
from qada.models import DecisionRecorder, build_run
from qada.models.generation import make_cache
from qada.models.layer_types import layer_types
from qada.moments import BucketedMoments, BucketedMomentsData, CurrentMoments, ReferenceKeys, StoredMoments
from qada.moments.reference import collect_reference_keys, compute_bucketed_moments, load_or_build_reference
from tests.tiny_models import tiny_model

W = 8  # the sliding window of the tiny models
WINDOW = qada.Window(4, 1)  # qada's local window: far below the sequence lengths, so the bulk is never empty
ALL_SLIDING = r"every attention layer of MistralForCausalLM attends over a sliding window"

# family -> (layers, global layers, sliding layers)
LAYOUTS = {
    "llama": (2, [0, 1], []),
    "qwen2": (4, [0, 1], [2, 3]),  # max_window_layers = 2: layers 2, 3 slide
    "mistral": (2, [], [0, 1]),  # Mistral passes its window to every layer
    "gemma3": (6, [2, 5], [0, 1, 3, 4]),  # two sliding, one global
}
HYBRID = ["qwen2", "gemma3"]


@functools.cache
def model(arch: str):
    """One tiny model per family, shared by the tests (qada.apply restores it on exit)."""
    if arch == "llama":
        return tiny_model("llama")
    if arch == "qwen2":
        return tiny_model("qwen2", window=W, num_hidden_layers=4)
    return tiny_model(arch, window=W)


def batch(length: int = 20, pad: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of ``length`` ids (0 included: Gemma's pad id), the first one left-padded by ``pad``."""
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return ids, mask


def expect_warning(arch: str):
    """Mistral with a window has no global layer: attaching warns once; the others must not warn about it."""
    if arch == "mistral":
        return pytest.warns(UserWarning, match=ALL_SLIDING)
    return contextlib.nullcontext()


@torch.no_grad()
def generate(m, ids, mask, new: int, cache: str):
    # an explicit attention_mask always: Gemma's pad_token_id is 0, a random id 0 would read as padding
    return m.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_scores=True,
                      return_dict_in_generate=True, past_key_values=make_cache(m, cache, ids.shape[1] + new))


# --- layer types ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", LAYOUTS)
def test_layer_types_per_family(arch):
    num_layers, global_layers, sliding = LAYOUTS[arch]
    types_ = layer_types(model(arch))
    assert types_.num_layers == num_layers
    assert types_.global_layers == global_layers and types_.sliding == sliding
    assert types_.windows == {layer: W for layer in sliding}
    assert types_.is_hybrid == (arch in HYBRID)
    assert all(types_.is_sliding(layer) for layer in sliding)
    assert not any(types_.is_sliding(layer) for layer in global_layers)
    if arch == "llama":
        assert types_.describe() == "2 layers, all global"
    if arch == "gemma3":
        assert types_.describe() == "6 layers: 2 global [2, 5], 4 sliding (window 8)"


@pytest.mark.parametrize("arch", LAYOUTS)
def test_layer_types_with_one_kwargs_dict_for_all_layers(arch, monkeypatch):
    """Older transformers (5.17 among them) give one dict of cache arguments for every layer, not one per layer."""
    import transformers.cache_utils as cache_utils

    per_layer = cache_utils.get_layer_types_and_kwargs

    def shared(config):
        kinds, kwargs = per_layer(config)
        merged = {key: value for extra in kwargs for key, value in extra.items()}
        return kinds, merged

    monkeypatch.setattr(cache_utils, "get_layer_types_and_kwargs", shared)
    num_layers, global_layers, sliding = LAYOUTS[arch]
    types_ = layer_types(model(arch))
    assert types_.global_layers == global_layers and types_.sliding == sliding
    assert types_.windows == {layer: W for layer in sliding}


def test_layer_types_without_a_window_are_all_global():
    assert layer_types(tiny_model("qwen2")).sliding == []
    assert layer_types(tiny_model("mistral")).sliding == []


# --- dense equals the native model ----------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("arch", LAYOUTS)
def test_dense_equals_native_generate_beyond_the_window(arch, cache):
    m = model(arch)
    ids, mask = batch()
    new = 12  # 20 + 12 tokens: well beyond the window of 8
    reference = generate(m, ids, mask, new, cache)
    with expect_warning(arch):
        with qada.apply(m, criterion="dense", moments="none", window=WINDOW) as run:
            wrapped = generate(m, ids, mask, new, cache)
    assert torch.equal(wrapped.sequences, reference.sequences)
    for got, expected in zip(wrapped.scores, reference.scores, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    num_layers, global_layers, sliding = LAYOUTS[arch]
    summary = run.summary()
    assert summary["global_layers"] == global_layers and summary["sliding_layers"] == sliding
    assert summary["decode_steps"] == (new - 1 if global_layers else 0)  # steps of the global layers
    if global_layers:
        assert summary["sparsity"] == 0.0 and summary["kv_sparsity"] == 0.0
        assert sorted(summary["sparsity_per_layer"]) == global_layers
    assert summary["sparsity_all_layers"] == pytest.approx(len(sliding) / num_layers)
    assert summary["kv_sparsity_all_layers"] == pytest.approx(len(sliding) / num_layers)


@pytest.mark.parametrize("arch", HYBRID)
def test_all_layer_sparsity_counts_sliding_layers_as_local(arch):
    m = model(arch)
    ids, mask = batch(seed=3)
    with qada.apply(m, criterion="oracle", moments="none", window=WINDOW) as run:
        generate(m, ids, mask, 6, "static")
    num_layers, global_layers, sliding = LAYOUTS[arch]
    summary = run.summary()
    per_layer = summary["sparsity_per_layer"]
    assert sorted(per_layer) == global_layers
    assert summary["sparsity"] == pytest.approx(sum(per_layer.values()) / len(global_layers))
    assert summary["sparsity_all_layers"] == pytest.approx((sum(per_layer.values()) + len(sliding)) / num_layers)
    kv = summary["kv_sparsity_per_layer"]
    assert summary["kv_sparsity_all_layers"] == pytest.approx((sum(kv.values()) + len(sliding)) / num_layers)


# --- criteria and moment sources see the global layers only ------------------------------------------------------


class WordTokenizer:
    """A word-level fake tokenizer for the reference prompt builders."""

    def encode(self, text: str) -> list[int]:
        return [sum(map(ord, word)) % 97 + 1 for word in text.split()]


def recording(cls):
    """A subclass of the moment source ``cls`` that records the layers it is asked about."""

    class Recording(cls):
        def _seen(self) -> set[int]:
            if not hasattr(self, "seen"):
                self.seen = set()
            return self.seen

        def prefill(self, layer, keys, start, window, capacity=None):
            self._seen().add(layer)
            return super().prefill(layer, keys, start, window, capacity=capacity)

        def step_state(self, layer):  # what a decode step of the layer reads and updates
            self._seen().add(layer)
            return super().step_state(layer)

    Recording.__name__ = f"Recording{cls.__name__}"
    return Recording


@functools.cache
def reference_files(arch: str, directory: str) -> tuple[str, str]:
    """A stored reference (40 keys) and bucketed moments built from it, saved under ``directory``."""
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    reference = collect_reference_keys(model(arch), ids, chunk_size=16)
    stored = reference.save(f"{directory}/{arch}-reference.safetensors")
    data = compute_bucketed_moments(reference, bucket_size=8, first=WINDOW.t_sink, min_keys=4)
    bucketed = data.save(f"{directory}/{arch}-bucketed.safetensors")
    return str(stored), str(bucketed)


def moment_source(kind: str, arch: str, directory: str):
    stored, bucketed = reference_files(arch, directory)
    if kind == "current":
        return recording(CurrentMoments)()
    if kind == "stored":
        return recording(StoredMoments)(path=stored, offset=4, min_bulk_keys=4)
    return recording(BucketedMoments)(path=bucketed, offset=4, min_bulk_keys=4, bucket_size=8)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hybrid-references"))


@pytest.mark.parametrize("kind", ["current", "stored", "bucketed"])
@pytest.mark.parametrize("criterion", ["oracle", "qada"])
@pytest.mark.parametrize("arch", HYBRID)
def test_criteria_and_moment_sources_only_see_global_layers(arch, criterion, kind, artifacts):
    m = model(arch)
    _, global_layers, _ = LAYOUTS[arch]
    ids, mask = batch(length=24, seed=5)
    source = moment_source(kind, arch, artifacts)
    recorder = DecisionRecorder(wants_oracle=True)
    prefilled = []

    class Prefills(DecisionRecorder):
        def on_prefill(self, layer, length):
            prefilled.append(layer)

    new = 6
    with qada.apply(m, criterion=criterion, moments=source, window=WINDOW, observers=[recorder, Prefills()]) as run:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warnings, no short-reference warnings
            out = generate(m, ids, mask, new, "static")
    assert out.sequences.shape == (2, 24 + new)
    assert sorted(set(prefilled)) == global_layers
    assert sorted({event.layer for event in recorder.events}) == global_layers
    assert len(recorder.events) == len(global_layers) * (new - 1)
    for event in recorder.events:
        assert event.local.shape == (2, 4)
        assert event.log_bulk_estimate is not None and bool(torch.isfinite(event.log_bulk_estimate).all())
    assert source.seen == set(global_layers)
    summary = run.summary()
    assert summary["fail_safe"] == 0
    assert sorted(summary["sparsity_per_layer"]) == global_layers
    assert 0.0 <= summary["sparsity"] <= 1.0


@pytest.mark.parametrize("arch", HYBRID)
def test_oracle_on_a_hybrid_model_is_local_on_global_layers_when_the_window_covers_everything(arch):
    """A qada window as long as the sequence: every global head is local, and the output is the dense one."""
    m = model(arch)
    ids, mask = batch(length=12, seed=2)
    reference = generate(m, ids, mask, 4, "dynamic")
    with qada.apply(m, criterion="oracle", moments="none", window=qada.Window(64, 0)) as run:
        wrapped = generate(m, ids, mask, 4, "dynamic")
    assert torch.equal(wrapped.sequences, reference.sequences)
    assert run.summary()["sparsity"] == 1.0 and run.summary()["sparsity_all_layers"] == 1.0


# --- the shared prefill ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma3"])
def test_shared_prefill_equals_native_generate_around_the_window(arch, cache):
    m = model(arch)
    new = 6
    for length in (W - 3, W, W + 1, 4 * W):  # shorter than, equal to, one more than, far beyond the window
        ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            native = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                past_key_values=make_cache(m, cache, length + new))[0, length:].tolist()
        prefilled = prefill(m, ids)
        assert decode_greedy(m, prefilled, new, cache=cache) == native, length
        run = build_run("dense", "none", window=WINDOW)
        with expect_warning(arch):  # a second decode from the same prefill: its cache stayed intact
            assert decode_greedy(m, prefilled, new, run=run, cache=cache) == native, length
        if arch != "mistral":
            assert sorted(run.summary()["sparsity_per_layer"]) == LAYOUTS[arch][1]
            assert run.summary()["sparsity"] == 0.0
        oracle = build_run("oracle", "none", window=WINDOW)
        with expect_warning(arch):
            assert len(decode_greedy(m, prefilled, new, run=oracle, cache=cache)) == new


# --- reference keys and the stored / bucketed sources on hybrid models ------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma3"])
def test_reference_keys_of_a_hybrid_model_match_its_own_forward(arch):
    from transformers import DynamicCache

    m = model(arch)
    num_layers, global_layers, _ = LAYOUTS[arch]
    N = 5 * W + 3
    ids = torch.randint(1, 128, (1, N), generator=torch.Generator().manual_seed(11))
    reference = collect_reference_keys(m, ids, chunk_size=W - 1)  # chunks shorter than the window
    assert reference.keys.shape == (num_layers, 2, N, 16)
    with torch.no_grad():
        own = DynamicCache(config=m.config)  # the model's own cache: sliding layers keep their window only
        m(input_ids=ids, past_key_values=own, use_cache=True)
        full = DynamicCache()  # every key of every layer, one forward
        m(input_ids=ids, past_key_values=full, use_cache=True)
    for layer in global_layers:  # what the moment sources read: the model's own keys
        torch.testing.assert_close(reference.keys[layer], own.layers[layer].keys[0], atol=1e-4, rtol=1e-4)
    for layer in range(num_layers):
        torch.testing.assert_close(reference.keys[layer], full.layers[layer].keys[0], atol=1e-4, rtol=1e-4)
        kept = own.layers[layer].keys.shape[2]  # the sliding layers' last keys agree with the own cache too
        torch.testing.assert_close(reference.keys[layer, :, N - kept:], own.layers[layer].keys[0], atol=1e-4,
                                   rtol=1e-4)
    # the sliding masks matter: with a window beyond the prompt, the deeper layers' keys differ
    wide = tiny_model(arch, window=4 * N, **({"num_hidden_layers": 4} if arch == "qwen2" else {}))
    wide_keys = collect_reference_keys(wide, ids, chunk_size=W - 1).keys
    assert not torch.allclose(wide_keys[-1], reference.keys[-1], atol=1e-3)


@pytest.mark.parametrize("arch", HYBRID)
def test_stored_and_bucketed_sources_build_their_reference_on_a_hybrid_model(arch, tmp_path):
    pytest.importorskip("long_context_eval")  # the reference prompt corpus
    m = model(arch)
    num_layers = LAYOUTS[arch][0]
    reference = load_or_build_reference(m, WordTokenizer(), "random_words", length=48, cache_dir=tmp_path,
                                        chunk_size=16)
    assert reference.keys.shape == (num_layers, 2, 48, 16)
    assert ReferenceKeys.load(next(tmp_path.glob("reference-*.safetensors"))).keys.shape == reference.keys.shape
    ids, mask = batch(length=30, seed=9)
    for source in (StoredMoments(length=48, offset=4, min_bulk_keys=4, cache_dir=str(tmp_path), chunk_size=16),
                   BucketedMoments(length=48, offset=4, min_bulk_keys=4, cache_dir=str(tmp_path), chunk_size=16,
                                   bucket_size=8)):
        recorder = DecisionRecorder()
        with qada.apply(m, criterion="qada", moments=source, window=WINDOW, observers=[recorder],
                        tokenizer=WordTokenizer()) as run:
            generate(m, ids, mask, 5, "dynamic")
        assert {event.layer for event in recorder.events} == set(LAYOUTS[arch][1])
        assert run.summary()["fail_safe"] == 0
    assert len(list(tmp_path.glob("bucketed-*.safetensors"))) == 1


@pytest.fixture
def gemma_loader(monkeypatch):
    calls = []

    def load_model(path=None, dtype=None, device=None):  # the CLI passes --dtype and --device
        calls.append(path)
        return model("gemma3"), WordTokenizer()

    module = types.ModuleType("qada.models.loading")
    module.load_model = load_model
    monkeypatch.setitem(sys.modules, "qada.models.loading", module)
    return calls


def test_moments_build_cli_on_a_hybrid_model(tmp_path, gemma_loader, capsys):
    pytest.importorskip("long_context_eval")
    from qada.cli import main

    out = tmp_path / "ref.safetensors"
    assert main(["moments", "build", "--length", "40", "--chunk-size", "16", "--out", str(out)]) == 0
    assert gemma_loader == [None]
    assert ReferenceKeys.load(out).keys.shape == (6, 2, 40, 16)
    buckets = tmp_path / "b.safetensors"
    assert main(["moments", "build", "--length", "40", "--buckets", "8", "--out", str(buckets)]) == 0
    data = BucketedMomentsData.load(buckets, first=16)
    assert data.mean.shape[0] == 6 and data.ends.tolist()[-1] == 40
    capsys.readouterr()
