"""Stored and bucketed reference moments, reference key collection from a tiny random Llama."""

from __future__ import annotations

import hashlib
import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qada.artifacts import ArtifactError, model_fingerprint
from qada.moments import (
    MOMENT_SOURCES,
    BucketedMoments,
    BucketedMomentsData,
    ReferenceKeys,
    StoredMoments,
    collect_reference_keys,
    reference_bulk_end,
)
from qada.moments.reference import (
    bucket_ends,
    compute_bucketed_moments,
    load_or_build_reference,
    processor_name,
    reference_build_conditions,
    reference_cache_file,
    reference_length,
)
from qada.window import Window

WINDOW = Window(16, 4)


def explicit(ref: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``[H, d]`` and population covariance of ``ref[:, lo:hi]`` (``ref [H, N, d]``), float64."""
    x = ref[:, lo:hi].double()
    mean = x.mean(1)
    c = x - mean[:, None]
    return mean, c.transpose(1, 2) @ c / x.shape[1]


@pytest.fixture
def reference() -> ReferenceKeys:
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 600, 4, generator=g) * 2 + 30
    return ReferenceKeys(keys, {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4}, {"prompt": "test"})


def cache(b: int, T: int) -> torch.Tensor:
    return torch.zeros(b, 2, T, 4)


def test_reference_bulk_end_rule():
    n = torch.tensor([10, 16, 17, 100, 150, 300])
    end = reference_bulk_end(n, WINDOW, offset=100, first=4, min_bulk_keys=64)
    # no bulk -> empty; short -> the prompt's own bulk positions [4, 4 + n - 16); long -> n - offset
    assert end.tolist() == [4, 4, 5, 88, 138, 200]
    assert (end - 4 <= (n - 16).clamp(min=0)).all()  # never more keys than the prompt's own bulk


def test_stored_picks_rows_first_to_n_minus_offset(reference):
    source = MOMENT_SOURCES.build("stored", offset=100)
    source.set_reference(reference)
    start = torch.tensor([0, 40, 130])
    T = 400
    mean, cov = source.moments(1, cache(3, T), start, WINDOW)
    for r in range(3):
        n = T - int(start[r])
        hi = n - 100 if n - 100 - 4 >= 64 else 4 + n - 16
        m, c = explicit(reference.keys[1], 4, hi)
        torch.testing.assert_close(mean[r].double(), m, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(cov[r].double(), c, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("include_sinks", [False, True])
def test_stored_streaming_equals_fresh_lookup(reference, include_sinks):
    streamed = StoredMoments(offset=50, include_sinks=include_sinks)
    streamed.set_reference(reference)
    start = torch.tensor([0, 90])
    streamed.prefill(0, cache(2, 100), start, WINDOW)
    for T in range(100, 600):
        streamed.append(0, cache(2, T), start, WINDOW)
        got = streamed.moments(0, cache(2, T), start, WINDOW)
        if T % 97 == 0 or T == 599:
            fresh = StoredMoments(offset=50, include_sinks=include_sinks)
            fresh.set_reference(reference)
            want = fresh.moments(0, cache(2, T), start, WINDOW)
            torch.testing.assert_close(got.mean, want.mean, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.cov, want.cov, rtol=1e-4, atol=1e-4)
    first = 0 if include_sinks else 4
    m, c = explicit(reference.keys[0], first, 599 - 50)
    torch.testing.assert_close(got.cov[0].double(), c, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.mean[0].double(), m, rtol=1e-5, atol=1e-4)


def test_stored_short_rows_zero_and_warning_once(reference):
    source = StoredMoments(offset=10)
    source.set_reference(reference)
    mean, cov = source.moments(0, cache(2, 12), None, WINDOW)
    assert torch.all(mean == 0) and torch.all(cov == 0)  # no bulk
    with pytest.warns(UserWarning, match="shorter"):
        mean, _ = source.moments(0, cache(1, 700), None, WINDOW)
    m, _ = explicit(reference.keys[0], 4, 600)
    torch.testing.assert_close(mean[0].double(), m, rtol=1e-5, atol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source.moments(0, cache(1, 701), None, WINDOW)


def test_stored_validation_and_missing_reference(reference):
    for bad in ({"offset": -1}, {"min_bulk_keys": -2}, {"prompt": "poetry"}, {"length": 0}, {"seed": 1.5}):
        with pytest.raises(ValueError, match="expected"):
            StoredMoments(**bad)
    with pytest.raises(RuntimeError, match="prepare"):
        StoredMoments().moments(0, cache(1, 300), None, WINDOW)
    source = StoredMoments()
    source.set_reference(reference)
    with pytest.raises(ValueError, match="KV heads"):
        source.moments(0, torch.zeros(1, 3, 300, 4), None, WINDOW)


@pytest.mark.parametrize("keys", [3, 4])
def test_stored_reference_without_a_bulk_is_an_error(keys):
    """A reference with no key past the window's ``t_sink`` (where its bulk starts) gives no prompt a bulk: the
    analysis path and the prefill say so, as the bucketed source does, instead of an index error (fewer keys) or zero
    moments for a prompt with a bulk (as many)."""
    source = StoredMoments(offset=0, min_bulk_keys=1)
    source.set_reference(ReferenceKeys(torch.randn(1, 2, keys, 4)))
    with pytest.raises(ValueError, match=f"longer than its bulk start 4 .* got {keys} keys"):
        source.moments(0, cache(1, 40), None, WINDOW)
    with pytest.raises(ValueError, match="longer than its bulk start 4"):
        source.prefill(0, cache(1, 40), None, WINDOW, capacity=50)
    source = StoredMoments(offset=0, min_bulk_keys=1)
    source.set_reference(ReferenceKeys(torch.randn(1, 2, 5, 4)))  # one bulk key: moments, no error
    with pytest.warns(UserWarning, match="shorter"):
        assert source.moments(0, cache(1, 40), None, WINDOW).mean.abs().sum() > 0


def test_bucket_ends_grid():
    assert bucket_ends(2000, 512, 16, 64) == [80, 144, 272, 512, 1024, 1536, 2000]
    assert bucket_ends(1024, 512, 0, 64) == [64, 128, 256, 512, 1024]
    with pytest.raises(ValueError, match="bucket_size"):
        bucket_ends(100, 0, 0)


def test_bucketed_picks_largest_bucket_below_target(reference):
    data = compute_bucketed_moments(reference, bucket_size=100, first=4, min_keys=64)
    assert data.ends.tolist() == [68, 100, 200, 300, 400, 500, 600]
    source = MOMENT_SOURCES.build("bucketed", offset=50, bucket_size=100)
    source.set_data(data)
    start = torch.tensor([0, 100, 200, 380, 250])
    T = 450  # n = 450, 350, 250, 70, 200 -> targets 400, 300, 200, 4 + 54 (short), 150
    index = source.bucket_index(cache(5, T), start, WINDOW)
    assert data.ends[index[:3]].tolist() == [400, 300, 200]
    assert index[3] == 0  # below the smallest bucket: the smallest one
    assert data.ends[index[4]] == 100
    mean, cov = source.moments(1, cache(5, T), start, WINDOW)
    for r, hi in enumerate([400, 300, 200, 68, 100]):
        m, c = explicit(reference.keys[1], 4, hi)
        torch.testing.assert_close(mean[r].double(), m, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(cov[r].double(), c, rtol=1e-4, atol=1e-4)
    mean, _ = source.moments(0, cache(1, 10), None, WINDOW)
    assert torch.all(mean == 0)
    with pytest.raises(ValueError, match="bulk starts"):
        source.moments(0, cache(1, 300), None, Window(16, 8))
    with pytest.raises(ValueError, match="bucket_size"):
        BucketedMoments(bucket_size=0)


def test_reference_and_bucketed_round_trip(tmp_path, reference):
    path = reference.save(tmp_path / "ref.safetensors")
    loaded = ReferenceKeys.load(path, reference.fingerprint)
    assert torch.equal(loaded.keys, reference.keys) and loaded.info == {"prompt": "test"}
    data = compute_bucketed_moments(reference, 128, 4)
    data.save(tmp_path / "b.safetensors")
    back = BucketedMomentsData.load(tmp_path / "b.safetensors", reference.fingerprint, first=4)
    assert torch.equal(back.ends, data.ends) and torch.equal(back.cov, data.cov) and back.first == 4
    with pytest.raises(ArtifactError, match="window"):
        BucketedMomentsData.load(tmp_path / "b.safetensors", first=0)
    with pytest.raises(ArtifactError, match="bucketed_moments"):
        ReferenceKeys.load(tmp_path / "b.safetensors")
    source = StoredMoments(path=str(path))
    assert source.to_config()["path"] == str(path)


# --- reference keys from a tiny model --------------------------------------------------------------------


def tiny_llama():
    from tests.tiny_models import tiny_model

    return tiny_model("llama", vocab_size=97, max_position_embeddings=256, sharpen=False)


def test_collect_reference_keys_chunked_equals_single_forward():
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 45), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    full = torch.stack([layer.keys[0] for layer in out.past_key_values.layers])
    seen = []
    chunked = collect_reference_keys(model, ids, chunk_size=16, progress=seen.append)
    single = collect_reference_keys(model, ids[0], chunk_size=None)
    assert chunked.keys.shape == (2, 2, 45, 16) and seen == [16, 32, 45]
    torch.testing.assert_close(single.keys, full, rtol=0, atol=0)
    torch.testing.assert_close(chunked.keys, full, rtol=1e-5, atol=1e-5)
    assert chunked.fingerprint["num_kv_heads"] == 2 and "weights" in chunked.fingerprint


class WordTokenizer:
    """A fake word-level tokenizer: one id per whitespace-separated word (hash of the word)."""

    def encode(self, text: str) -> list[int]:
        return [sum(map(ord, word)) % 97 for word in text.split()]


def test_prepare_builds_caches_and_reloads(tmp_path, monkeypatch):
    monkeypatch.setenv("QADA_CACHE_DIR", str(tmp_path))
    model = tiny_llama()
    source = StoredMoments(length=200, chunk_size=64)
    source.prepare(model, WordTokenizer())
    files = list(tmp_path.glob("reference-llama-*-random_words-n200-s0.safetensors"))
    assert len(files) == 1 and source.reference.keys.shape == (2, 2, 200, 16)
    again = StoredMoments(length=200)
    again.prepare(model, None)  # cached: no tokenizer needed
    assert torch.equal(again.reference.keys, source.reference.keys)
    bucketed = BucketedMoments(length=200, bucket_size=64, offset=20)
    bucketed.prepare(model, None, WINDOW)
    assert bucketed.data.ends.tolist() == [64, 128, 192, 200]
    assert len(list(tmp_path.glob("bucketed-*.safetensors"))) == 1
    other = tiny_llama()
    with torch.no_grad():
        other.model.layers[0].self_attn.k_proj.weight.add_(1.0)  # same config, other weights
    with pytest.raises(ArtifactError, match="weights"):
        StoredMoments(path=str(files[0])).prepare(other, None)
    with pytest.raises(ValueError, match="tokenizer"):
        StoredMoments(length=100).prepare(model, None)


def test_load_or_build_reference_shares_the_sources_cache(tmp_path):
    model = tiny_llama()
    reference = load_or_build_reference(model, WordTokenizer(), length=120, seed=1, cache_dir=tmp_path, chunk_size=50)
    fingerprint = model_fingerprint(model.config, model)
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    file = tmp_path / f"reference-llama-{key}-random_words-n120-s1.safetensors"  # the name caches already use
    assert reference_cache_file("reference", fingerprint, "random_words", 120, 1, tmp_path) == file
    assert list(tmp_path.iterdir()) == [file]
    assert reference.keys.dtype == torch.float16 and reference.keys.shape == (2, 2, 120, 16)
    assert reference.info["prompt"] == "random_words" and reference.info["seed"] == 1
    # how it was built, since its keys depend on it (low-precision reductions round by thread count and device)
    processor = processor_name(torch.device("cpu"))
    assert processor and processor != "unknown"  # (this machine's /proc/cpuinfo, or platform.processor())
    built = f"cpu float32 ({processor}), torch {torch.__version__}, {torch.get_num_threads()} threads"
    assert reference.info["built"] == reference_build_conditions(model) == built
    source = StoredMoments(length=120, seed=1, cache_dir=str(tmp_path))
    assert "built" not in source.describe()  # (not prepared yet)
    source.prepare(model, None)  # loads the same file
    assert torch.equal(source.reference.keys, reference.keys)
    assert source.describe()["built"] == built and source.describe()["file"] == file.name
    assert source.resolved_length(model) == reference_length(model, 120) == 120
    assert StoredMoments().resolved_length(model) == min(model.config.max_position_embeddings, 32768)
    # every source of a process shares one loaded copy and what is derived from it (a sweep's many stored-moment
    # configurations would otherwise hold one float32 reference and one set of checkpoints each)
    other = StoredMoments(length=120, seed=1, cache_dir=str(tmp_path))
    other.prepare(model, None)
    assert other.reference is source.reference
    cpu = torch.device("cpu")
    assert other._on(cpu)[0] is source._on(cpu)[0]
    keys = torch.randn(1, 2, 300, 16)
    window = Window(64, 4)
    torch.testing.assert_close(source.moments(0, keys, None, window).cov, other.moments(0, keys, None, window).cov)
    ref, shift = source._on(cpu)
    assert other._checkpoints(0, ref[0], shift[0]) is source._checkpoints(0, ref[0], shift[0])


@settings(max_examples=30, deadline=None)
@given(
    T=st.integers(1, 700),
    starts=st.lists(st.integers(0, 700), min_size=1, max_size=3),
    offset=st.integers(0, 300),
    t_local=st.integers(1, 40),
    sink_frac=st.floats(0, 1),
    include_sinks=st.booleans(),
)
def test_stored_matches_explicit_rows(T, starts, offset, t_local, sink_frac, include_sinks):
    g = torch.Generator().manual_seed(T)
    ref = torch.randn(1, 1, 500, 3, generator=g) + 5
    window = Window(t_local, int(sink_frac * t_local))
    source = StoredMoments(offset=offset, include_sinks=include_sinks, min_bulk_keys=20)
    source.set_reference(ReferenceKeys(ref))
    start = torch.tensor(starts).clamp(max=T - 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mean, cov = source.moments(0, torch.zeros(len(starts), 1, T, 3), start, window)
    first = 0 if include_sinks else window.t_sink
    for r, s in enumerate(start.tolist()):
        n = T - s
        t_bulk = max(0, n - t_local)
        hi = n - offset if n - offset - first >= 20 else first + t_bulk
        hi = min(hi, 500) if t_bulk > 0 else first
        if hi <= first:
            assert torch.all(mean[r] == 0) and torch.all(cov[r] == 0)
        else:
            m, c = explicit(ref[0], first, hi)
            torch.testing.assert_close(mean[r].double(), m, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cov[r].double(), c, rtol=1e-4, atol=1e-4)


def test_jumps_are_answered_from_prefix_checkpoints(reference):
    """A new prompt (a long jump of the range) uses the checkpoints: O(C d²), equal to the explicit moments."""
    source = StoredMoments(offset=100)
    source.set_reference(reference)
    ref = reference.keys[1].float()
    for T in (550, 130, 700, 420):  # up, down, past the reference (clamped), down again: all jumps > C
        source.reset()
        mean, cov = source.moments(1, cache(2, T), torch.tensor([0, 40]), WINDOW)
        for row, start in enumerate((0, 40)):
            end = int(reference_bulk_end(torch.tensor([T - start]), WINDOW, 100, 4)[0].clamp(max=600))
            want_mean, want_cov = explicit(ref, 4, end)
            torch.testing.assert_close(mean[row].double(), want_mean, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(cov[row].double(), want_cov, rtol=1e-4, atol=1e-4)
    every, p1, p2 = source._checkpoints(1, *[t[1] for t in source._on(torch.device("cpu"))])
    assert every < 400 and p1.shape[1] == p2.shape[1] == -(-600 // every) + 1
    # then one key per step, incrementally, still equal
    for T in range(421, 426):
        mean, _ = source.moments(1, cache(2, T), torch.tensor([0, 40]), WINDOW)
        end = int(reference_bulk_end(torch.tensor([T]), WINDOW, 100, 4)[0])
        torch.testing.assert_close(mean[0].double(), explicit(ref, 4, end)[0], rtol=1e-5, atol=1e-4)
