"""Issue 15, artifacts: a damaged, forged or inconsistent artifact file is refused with one clear
:class:`~qada.artifacts.ArtifactError` (a ``ValueError``) naming the problem, from Python and from
``qada moments info`` (exit status 2, no traceback). One :class:`~tests.bad_inputs.Case` per kind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qada.artifacts import (
    ArtifactError,
    load_artifact,
    load_head_mask,
    read_artifact_info,
    save_artifact,
    verify_artifact,
)
from qada.moments import BucketedMomentsData, ReferenceKeys
from tests.bad_inputs import Case, CliCase, check_case, check_cli_case, ids

L, J, H, D = 2, 3, 2, 4
FP = {"model_type": "llama", "num_layers": L, "num_heads": 4, "num_kv_heads": H, "head_dim": D}


def bucketed(tmp: Path, name: str = "b.safetensors", window: object = "default", **tensors) -> Path:
    """A small bucketed-moments artifact (valid unless ``tensors`` or ``window`` replace a part)."""
    torch.manual_seed(0)
    x = torch.randn(L, J, H, D, 32)
    parts = {"ends": torch.tensor([40, 80, 120]), "mean": torch.zeros(L, J, H, D),
             "cov": x @ x.transpose(-1, -2) / 32, **tensors}
    return save_artifact(tmp / name, "bucketed_moments", parts, FP,
                         window={"first": 16} if window == "default" else window)


def with_cov(change) -> dict:
    torch.manual_seed(0)
    x = torch.randn(L, J, H, D, 32)
    cov = x @ x.transpose(-1, -2) / 32
    change(cov)
    return {"cov": cov}


def negative_eigenvalue(cov: torch.Tensor) -> None:
    cov[1, 2, 0] -= 3 * torch.eye(D) * cov[1, 2, 0].diagonal().max()


def asymmetric(cov: torch.Tensor) -> None:
    cov[0, 1, 1, 0, 3] += 0.5 * cov[0, 1, 1].abs().max()


def forged(tmp: Path, **changes: str | None) -> Path:
    """A copy of a valid artifact whose metadata fields are replaced (``None``: removed)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = bucketed(tmp, "source.safetensors")
    with safe_open(str(source), "pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for key, value in changes.items():
        if value is None:
            metadata.pop(key)
        else:
            metadata[key] = value
    save_file(tensors, str(tmp / "forged.safetensors"), metadata=metadata)
    return tmp / "forged.safetensors"


def bit_flipped(tmp: Path) -> Path:
    path = bucketed(tmp)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # a bit of the last tensor's bytes
    path.write_bytes(bytes(data))
    return path


def reference_with_nan(tmp: Path) -> Path:
    keys = torch.randn(L, H, 50, D)
    keys[1, 0, 7, 2] = float("nan")
    return save_artifact(tmp / "ref.safetensors", "reference_keys", {"keys": keys}, FP)


CASES = [
    # --- bucketed moments: content -----------------------------------------------------------------------------
    Case("artifact_bucketed_cov_not_psd",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp, **with_cov(negative_eigenvalue))), ArtifactError,
         r"covariances to be positive semi-definite but matrix \[1, 2, 0\] has eigenvalue -"),
    Case("artifact_bucketed_cov_not_symmetric",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp, **with_cov(asymmetric))), ArtifactError,
         r"covariances to be symmetric"),
    Case("artifact_bucketed_cov_nan",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp, **with_cov(lambda c: c[0, 0, 0, 1].fill_(float("nan")))
                                                       )), ArtifactError, r"covariances to be finite"),
    Case("artifact_bucketed_mean_inf",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp, mean=torch.full((L, J, H, D), float("inf")))),
         ArtifactError, r"finite means"),
    Case("artifact_bucketed_negative_end",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp, ends=torch.tensor([-5, 80, 120]))), ArtifactError,
         r"bucket ends beyond the bulk start 16 but got \[-5, 80, 120\]"),
    Case("artifact_bucketed_unordered_ends",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp, ends=torch.tensor([80, 40, 120]))), ArtifactError,
         r"strictly increasing bucket ends but got \[80, 40, 120\]"),
    Case("artifact_bucketed_end_before_bulk_start",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp, ends=torch.tensor([10, 80, 120]))), ArtifactError,
         r"bucket ends beyond the bulk start 16 but got \[10, 80, 120\]"),
    Case("artifact_bucketed_float_ends",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp, ends=torch.tensor([40.0, 80.0, 120.0]))), ArtifactError,
         r"integer bucket ends but got torch.float32"),
    Case("artifact_bucketed_ends_of_another_length",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp, ends=torch.tensor([40, 80]))), ArtifactError,
         r"inconsistent bucketed moments \(expected ends \[J\], mean \[L, J, H_kv, d\]"),
    Case("artifact_bucketed_window_without_first",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp, window=None)), ArtifactError,
         r"no integer bulk start 'first' in its window metadata \(got None\)"),
    Case("artifact_bucketed_for_another_bulk_start",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp), first=0), ArtifactError,
         r"was made for window \{'first': 16\}; expected \{'first': 0\}"),
    Case("artifact_bucketed_valid_loads", lambda tmp: BucketedMomentsData.load(bucketed(tmp), FP, 16),
         check=lambda data: None if data.ends.tolist() == [40, 80, 120] else pytest.fail(str(data.ends))),
    # --- other kinds: content ------------------------------------------------------------------------------------
    Case("artifact_reference_keys_nan", lambda tmp: ReferenceKeys.load(reference_with_nan(tmp)), ArtifactError,
         r"holds keys that are not finite floats"),
    Case("artifact_head_mask_not_bool",
         lambda tmp: load_head_mask(save_artifact(tmp / "m.safetensors", "head_mask", {"mask": torch.ones(L, 4)}, FP)),
         ArtifactError, r"holds a mask torch.float32 \[2, 4\]; expected bool \[2, 4\]"),
    Case("artifact_missing_tensor",
         lambda tmp: load_artifact(save_artifact(tmp / "k.safetensors", "reference_keys", {"k": torch.ones(1)}, FP),
                                   "reference_keys", required=("keys",)),
         ArtifactError, r"missing tensor\(s\) \['keys'\]"),
    Case("artifact_for_another_model",
         lambda tmp: BucketedMomentsData.load(bucketed(tmp), {**FP, "num_layers": 30}), ArtifactError,
         r"made for another model \(num_layers: expected 30 but got 2\)"),
    Case("artifact_of_another_kind", lambda tmp: ReferenceKeys.load(bucketed(tmp)), ArtifactError,
         r"holds 'bucketed_moments'; expected 'reference_keys'"),
    # --- the file and its metadata ---------------------------------------------------------------------------------
    Case("artifact_bit_flip", lambda tmp: verify_artifact(bit_flipped(tmp)), ArtifactError,
         r"is corrupted: its tensors do not match their digest"),
    Case("artifact_path_is_a_directory", lambda tmp: read_artifact_info(tmp), ArtifactError,
         r"is a directory; expected a \.safetensors file"),
    Case("artifact_path_missing", lambda tmp: read_artifact_info(tmp / "nope.safetensors"), ArtifactError,
         r"does not exist"),
    Case("artifact_model_not_json", lambda tmp: read_artifact_info(forged(tmp, model="{oops")), ArtifactError,
         r"broken metadata: field 'model' is not JSON"),
    Case("artifact_model_json_list", lambda tmp: BucketedMomentsData.load(forged(tmp, model="[1, 2]"), FP),
         ArtifactError, r"broken metadata: field 'model' is list; expected a JSON object"),
    Case("artifact_model_missing", lambda tmp: read_artifact_info(forged(tmp, model=None)), ArtifactError,
         r"broken metadata: field 'model' is missing"),
    Case("artifact_info_json_string", lambda tmp: read_artifact_info(forged(tmp, info='"x"')), ArtifactError,
         r"broken metadata: field 'info' is str; expected a JSON object"),
    Case("artifact_window_json_list", lambda tmp: read_artifact_info(forged(tmp, window="[16]")), ArtifactError,
         r"broken metadata: field 'window' is list; expected a JSON object or null"),
    Case("artifact_digest_missing", lambda tmp: BucketedMomentsData.load(forged(tmp, digest=None)), ArtifactError,
         r"broken metadata: field 'digest' is missing"),
    Case("artifact_digest_malformed", lambda tmp: read_artifact_info(forged(tmp, digest="abc")), ArtifactError,
         r"broken metadata: field 'digest' is not a SHA-256 hex digest"),
    Case("artifact_kind_missing", lambda tmp: read_artifact_info(forged(tmp, kind=None)), ArtifactError,
         r"broken metadata: field 'kind' is missing"),
    Case("artifact_kind_unknown", lambda tmp: read_artifact_info(forged(tmp, kind="pickles")), ArtifactError,
         r"broken metadata: field 'kind' is 'pickles'; expected one of"),
    Case("artifact_format_version_from_the_future",
         lambda tmp: read_artifact_info(forged(tmp, format_version="99")), ArtifactError,
         r"format version '99'; expected '1'; it was written by a newer qada"),
]


def info_argv(make):
    return lambda tmp: ["moments", "info", make(tmp)]


CLI_CASES = [
    CliCase("artifact_cli_info_bit_flip", info_argv(bit_flipped),
            r"qada moments: error: .* is corrupted: its tensors do not match their digest"),
    CliCase("artifact_cli_info_cov_not_psd", info_argv(lambda tmp: bucketed(tmp, **with_cov(negative_eigenvalue))),
            r"positive semi-definite"),
    CliCase("artifact_cli_info_directory", info_argv(lambda tmp: tmp), r"is a directory"),
    CliCase("artifact_cli_info_forged_model", info_argv(lambda tmp: forged(tmp, model="[1]")),
            r"field 'model' is list"),
    CliCase("artifact_cli_info_not_safetensors",
            info_argv(lambda tmp: (tmp / "x.safetensors").write_bytes(b"not a file") and tmp / "x.safetensors"),
            r"not a readable safetensors file"),
    # `qada moments build`: refused before the model loads (a missing --model would fail otherwise)
    CliCase("artifact_cli_build_unknown_prompt",
            lambda tmp: ["moments", "build", "--prompt", "poem", "--out", tmp / "r.safetensors", "--model", tmp / "no"],
            r"expected --prompt in \['random_words', 'single_word', 'text'\] but got 'poem'"),
    CliCase("artifact_cli_build_out_is_a_directory",
            lambda tmp: ["moments", "build", "--out", tmp, "--model", tmp / "no"], r"--out .* is a directory"),
    CliCase("artifact_cli_build_negative_t_sink",
            lambda tmp: ["moments", "build", "--buckets", "64", "--t-sink", "-1", "--out", tmp / "b.safetensors",
                         "--model", tmp / "no"], r"expected --t-sink >= 0 but got -1"),
    CliCase("artifact_cli_build_length_zero",
            lambda tmp: ["moments", "build", "--length", "0", "--out", tmp / "r.safetensors"],
            r"argument --length: expected an integer >= 1 but got 0"),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_bad_input(case, tmp_path):
    check_case(case, tmp_path)


@pytest.mark.parametrize("case", CLI_CASES, ids=ids(CLI_CASES))
def test_bad_command_line(case, tmp_path, capsys):
    check_cli_case(case, tmp_path, capsys)


def test_info_prints_a_valid_artifact_after_checking_it(tmp_path, capsys):
    from tests.bad_inputs import run_cli

    result = run_cli(["moments", "info", bucketed(tmp_path)], capsys)
    assert result.code == 0, result.err
    assert "kind:    bucketed_moments" in result.out and "checked: digest and content OK" in result.out
