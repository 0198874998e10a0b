"""``qada moments build`` / ``qada moments info`` with a tiny random Llama and a fake word-level tokenizer.

The model loader ``qada.models.loading.load_model`` is replaced by one returning the tiny model, so the CLI's
own plumbing (prompt, chunked forward, artifact) is what runs; the embedded model is exercised in a slow test.
"""

from __future__ import annotations

import sys
import types

import pytest

from qada.artifacts import read_artifact_info
from qada.cli import main
from qada.moments import BucketedMomentsData, ReferenceKeys


class WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return [sum(map(ord, word)) % 97 for word in text.split()]


@pytest.fixture
def tiny_loader(monkeypatch):
    from tests.tiny_models import tiny_model

    model = tiny_model("llama", vocab_size=97, max_position_embeddings=256, sharpen=False)
    calls = []

    def load_model(path=None, dtype=None, device=None):  # the CLI passes --dtype and --device
        calls.append(path)
        return model, WordTokenizer()

    module = types.ModuleType("qada.models.loading")
    module.load_model = load_model
    monkeypatch.setitem(sys.modules, "qada.models.loading", module)
    return model, calls


def test_build_and_info_reference_keys(tmp_path, tiny_loader, capsys):
    model, calls = tiny_loader
    out = tmp_path / "ref.safetensors"
    argv = ["moments", "build", "--length", "150", "--chunk-size", "64", "--out", str(out), "--seed", "2"]
    assert main(argv + ["--model", "tiny"]) == 0
    assert calls == ["tiny"]
    reference = ReferenceKeys.load(out)
    assert reference.keys.shape == (2, 2, 150, 16)
    assert reference.info == {"prompt": "random_words", "seed": 2, "model_path": "tiny", "length": 150}
    capsys.readouterr()
    assert main(["moments", "info", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "kind:    reference_keys" in printed and "keys: [2, 2, 150, 16] F32" in printed
    assert "num_kv_heads: 2" in printed and 'prompt: "random_words"' in printed


def test_build_bucketed(tmp_path, tiny_loader, capsys):
    out = tmp_path / "b.safetensors"
    argv = ["moments", "build", "--prompt", "text", "--length", "200", "--buckets", "64", "--out", str(out)]
    assert main(argv) == 0
    data = BucketedMomentsData.load(out, first=16)
    assert data.ends.tolist() == [64, 128, 192, 200] and data.cov.shape == (2, 4, 2, 16, 16)
    assert read_artifact_info(out).kind == "bucketed_moments"


def test_info_on_a_bad_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    assert main(["moments", "info", str(bad)]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


@pytest.mark.slow
def test_build_on_the_embedded_model(tmp_path):
    pytest.importorskip("qada.models.loading")
    out = tmp_path / "ref.safetensors"
    assert main(["moments", "build", "--length", "600", "--chunk-size", "256", "--out", str(out)]) == 0
    reference = ReferenceKeys.load(out)
    assert reference.keys.shape == (30, 3, 600, 64)
    assert reference.fingerprint["rope"]["rope_theta"] == 100000.0
