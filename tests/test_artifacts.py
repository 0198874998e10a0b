"""Safetensors artifacts: round trips, model fingerprints, and clear errors for bad files."""

from __future__ import annotations

import json

import pytest
import torch

from qada.artifacts import (
    ArtifactError,
    check_fingerprint,
    load_artifact,
    load_head_mask,
    model_fingerprint,
    read_artifact_info,
    save_artifact,
    save_head_mask,
)
from tests.tiny_models import tiny_config  # noqa: E402


def config(**overrides):
    return tiny_config("llama", vocab_size=97, max_position_embeddings=256, **overrides)


FP = model_fingerprint(config())


def test_model_fingerprint_fields():
    assert FP["model_type"] == "llama"
    assert (FP["num_layers"], FP["num_heads"], FP["num_kv_heads"], FP["head_dim"]) == (2, 4, 2, 16)
    assert FP["rope"]["rope_theta"] == 10000.0
    json.dumps(FP)  # JSON-plain
    assert model_fingerprint(config()) == FP
    theta = config(rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    assert model_fingerprint(theta)["rope"]["rope_theta"] == 1e5
    with pytest.raises(ArtifactError, match="rope"):
        check_fingerprint(FP, model_fingerprint(theta))
    with pytest.raises(ArtifactError, match="num_kv_heads: expected 2 but got 4"):
        check_fingerprint(FP, model_fingerprint(config(num_key_value_heads=4)))
    check_fingerprint(dict(FP, weights="a"), FP)  # weights compared only when both sides have them
    with pytest.raises(ArtifactError, match="weights"):
        check_fingerprint(dict(FP, weights="a"), dict(FP, weights="b"))


def test_head_mask_round_trip(tmp_path):
    mask = torch.tensor([[True, False, True, False], [False, False, True, True]])
    path = save_head_mask(tmp_path / "mask.safetensors", mask, FP, info={"alpha": 0.5})
    back, info = load_head_mask(path, FP)
    assert torch.equal(back, mask) and info.info == {"alpha": 0.5} and info.kind == "head_mask"
    with pytest.raises(ValueError, match="shape"):
        save_head_mask(tmp_path / "bad.safetensors", torch.ones(3, 4, dtype=torch.bool), FP)
    with pytest.raises(ValueError, match="bool"):
        save_head_mask(tmp_path / "bad.safetensors", torch.ones(2, 4), FP)


def test_mismatched_fingerprint_raises(tmp_path):
    path = save_head_mask(tmp_path / "mask.safetensors", torch.zeros(2, 4, dtype=torch.bool), FP)
    other = model_fingerprint(config(num_hidden_layers=3))
    with pytest.raises(ArtifactError, match="another model.*num_layers"):
        load_head_mask(path, other)


def test_generic_round_trip_and_info(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(4), "h": torch.randn(2).half()}
    path = save_artifact(tmp_path / "x.safetensors", "reference_keys", tensors, FP, {"t_local": 8}, {"n": 1})
    loaded, info = load_artifact(path, "reference_keys", required=("a", "b"), fingerprint=FP, window={"t_local": 8})
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t) and loaded[name].dtype == t.dtype
    described = read_artifact_info(path).describe()
    assert "reference_keys" in described and "a: [3, 5] F32" in described and '"t_local": 8' in described
    with pytest.raises(ArtifactError, match="missing tensor"):
        load_artifact(path, "reference_keys", required=("a", "keys"))
    with pytest.raises(ArtifactError, match="expected 'head_mask'"):
        load_artifact(path, "head_mask")
    with pytest.raises(ArtifactError, match="window"):
        load_artifact(path, "reference_keys", window={"t_local": 16})
    with pytest.raises(ValueError, match="kind"):
        save_artifact(tmp_path / "y.safetensors", "pickles", tensors, FP)


def test_truncated_corrupted_missing_and_foreign_files(tmp_path):
    path = save_artifact(tmp_path / "x.safetensors", "head_mask", {"mask": torch.ones(2, 4, dtype=torch.bool)}, FP)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 3])
    with pytest.raises(ArtifactError, match="not a readable safetensors"):
        load_head_mask(truncated)
    header_cut = tmp_path / "header_cut.safetensors"
    header_cut.write_bytes(data[:20])
    with pytest.raises(ArtifactError, match="not a readable safetensors"):
        load_head_mask(header_cut)
    corrupted = tmp_path / "corrupted.safetensors"
    corrupted.write_bytes(data[:-1] + bytes([data[-1] ^ 0x01]))
    with pytest.raises(ArtifactError, match="corrupted"):
        load_head_mask(corrupted)
    with pytest.raises(ArtifactError, match="does not exist"):
        load_head_mask(tmp_path / "nope.safetensors")
    from safetensors.torch import save_file

    save_file({"mask": torch.ones(2, 4, dtype=torch.bool)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ArtifactError, match="not a qada artifact"):
        load_head_mask(tmp_path / "plain.safetensors")
    (tmp_path / "pickle.safetensors").write_bytes(b"\x80\x04\x95" + b"\x00" * 40)
    with pytest.raises(ArtifactError):
        load_head_mask(tmp_path / "pickle.safetensors")
    assert issubclass(ArtifactError, ValueError)
