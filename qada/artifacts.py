"""Artifacts (reference keys, bucketed moments, static head masks, QAdA corrections) as safetensors files with
checked metadata.

Every file written here carries, as safetensors string metadata:

* ``format = "qada"``, ``format_version``, ``kind`` (``reference_keys``, ``bucketed_moments``, ``head_mask``,
  ``qada_correction``);
* ``model``: the JSON :func:`model_fingerprint` of the model it was made for;
* ``window``: the JSON window settings it depends on (or ``null``);
* ``info``: JSON details (prompt kind, seed, length, ...);
* ``digest``: a SHA-256 over the tensors' names, dtypes, shapes and bytes.

Loading checks all of it and raises :class:`ArtifactError` (a ``ValueError``) for a file that is missing,
not a safetensors file, truncated, corrupted (digest mismatch), of another kind, made for another model
or window, or missing a tensor. Nothing is unpickled: safetensors holds raw tensor bytes only.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ArtifactError",
    "ArtifactInfo",
    "check_fingerprint",
    "file_sha256",
    "load_artifact",
    "load_head_mask",
    "load_qada_correction",
    "model_fingerprint",
    "read_artifact_info",
    "save_artifact",
    "save_head_mask",
    "save_qada_correction",
    "text_config",
    "verify_artifact",
]

FORMAT = "qada"
FORMAT_VERSION = "1"
KINDS = ("reference_keys", "bucketed_moments", "head_mask", "qada_correction")


class ArtifactError(ValueError):
    """An artifact cannot be used: unreadable, corrupted, incomplete, or made for another model or window."""


def text_config(config: Any) -> Any:
    """The text part of a transformers config (a multimodal config's text config; any other config itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 (64 hex digits) of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_fingerprint(config: Any, model: Any = None) -> dict[str, Any]:
    """What identifies a model's keys: architecture, sizes and RoPE parameters, from a transformers config.

    Args:
        config: a ``PretrainedConfig`` (multimodal configs use their text config).
        model: optionally the model itself; adds ``weights``, a short digest of its first key projection, so
            two models with equal configs but different weights (base vs. instruct) differ.

    Returns:
        A JSON-plain dict with ``model_type``, ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
        ``hidden_size``, ``max_positions`` and ``rope`` (``rope_parameters``, else ``rope_theta`` and
        ``rope_scaling``).
    """
    config = text_config(config)
    heads = int(config.num_attention_heads)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None)
    if rope is None:
        rope = {
            "rope_theta": getattr(config, "rope_theta", None),
            "rope_scaling": getattr(config, "rope_scaling", None),
        }
    fingerprint = {
        "model_type": getattr(config, "model_type", None) or type(config).__name__,
        "num_layers": int(config.num_hidden_layers),
        "num_heads": heads,
        "num_kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "hidden_size": int(config.hidden_size),
        "max_positions": getattr(config, "max_position_embeddings", None),
        "rope": rope,
    }
    if model is not None:
        digest = _weights_digest(model)
        if digest is not None:
            fingerprint["weights"] = digest
    return json.loads(json.dumps(fingerprint, sort_keys=True, default=str))


def _weights_digest(model: Any) -> str | None:
    named = list(model.named_parameters()) if hasattr(model, "named_parameters") else []
    if not named:
        return None
    chosen = next((p for n, p in named if "k_proj" in n), named[0][1])
    data = chosen.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def check_fingerprint(expected: Mapping[str, Any], found: Mapping[str, Any], what: str = "artifact") -> None:
    """Raise :class:`ArtifactError` naming every field where ``found`` differs from ``expected``.

    ``weights`` is compared only when both sides have it.
    """
    expected, found = _plain(expected), _plain(found)
    keys = set(expected) | set(found)
    if not ("weights" in expected and "weights" in found):
        keys.discard("weights")
    diffs = [
        f"{k}: expected {expected.get(k)!r} but got {found.get(k)!r}"
        for k in sorted(keys)
        if expected.get(k) != found.get(k)
    ]
    if diffs:
        raise ArtifactError(f"{what} was made for another model ({'; '.join(diffs)})")


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _digest(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class ArtifactInfo:
    """What a file holds: its kind, model fingerprint, window, details and tensor shapes/dtypes."""

    path: str
    kind: str
    model: dict[str, Any]
    window: dict[str, Any] | None
    info: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], str]]

    def describe(self) -> str:
        lines = [f"file:    {self.path}", f"kind:    {self.kind}", "model:"]
        lines += [f"  {k}: {json.dumps(v)}" for k, v in self.model.items()]
        lines.append(f"window:  {json.dumps(self.window)}")
        lines.append("info:")
        lines += [f"  {k}: {json.dumps(v)}" for k, v in self.info.items()]
        lines.append("tensors:")
        lines += [f"  {name}: {list(shape)} {dtype}" for name, (shape, dtype) in self.tensors.items()]
        return "\n".join(lines)


def save_artifact(
    path: str | os.PathLike,
    kind: str,
    tensors: Mapping[str, torch.Tensor],
    fingerprint: Mapping[str, Any],
    window: Mapping[str, Any] | None = None,
    info: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``tensors`` with qada metadata to ``path`` (atomically: a temporary file, then a rename)."""
    from safetensors.torch import save_file

    if kind not in KINDS:
        raise ValueError(f"expected an artifact kind in {KINDS} but got {kind!r}")
    plain = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "model": json.dumps(_plain(fingerprint), sort_keys=True),
        "window": json.dumps(_plain(window) if window is not None else None, sort_keys=True),
        "info": json.dumps(_plain(info or {}), sort_keys=True),
        "digest": _digest(plain),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(plain, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _open_metadata(path: Path) -> tuple[dict[str, str], dict[str, tuple[tuple[int, ...], str]]]:
    from safetensors import safe_open

    if path.is_dir():
        raise ArtifactError(f"artifact {str(path)!r} is a directory; expected a .safetensors file")
    if not path.is_file():
        raise ArtifactError(f"artifact {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            shapes = {}
            for name in f.keys():
                sl = f.get_slice(name)
                shapes[name] = (tuple(sl.get_shape()), str(sl.get_dtype()))
    except Exception as error:  # safetensors raises its own error types for truncated/garbled files
        raise ArtifactError(f"artifact {str(path)!r} is not a readable safetensors file ({error})") from error
    if metadata.get("format") != FORMAT:
        raise ArtifactError(f"artifact {str(path)!r} is not a qada artifact (no 'format: qada' metadata)")
    version = metadata.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, str) and version.isdigit() and int(version) > int(FORMAT_VERSION)
        hint = "; it was written by a newer qada: upgrade qada to read it" if newer else ""
        raise ArtifactError(
            f"artifact {str(path)!r} has format version {version!r}; expected {FORMAT_VERSION!r}{hint}"
        )
    return metadata, shapes


#: The JSON metadata fields and the types they must decode to (``window`` may also be ``null``).
_JSON_FIELDS = {"model": dict, "window": (dict, type(None)), "info": dict}


def _metadata_field(path: Path, metadata: Mapping[str, str], name: str) -> Any:
    """One metadata field, present and of the right type (JSON fields decoded), else :class:`ArtifactError`."""
    if name not in metadata:
        raise ArtifactError(f"artifact {str(path)!r} has broken metadata: field {name!r} is missing")
    value: Any = metadata[name]
    if name in _JSON_FIELDS:
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ArtifactError(f"artifact {str(path)!r} has broken metadata: field {name!r} is not JSON ({error})"
                                ) from None
        if not isinstance(value, _JSON_FIELDS[name]):
            expected = "a JSON object" + (" or null" if name == "window" else "")
            raise ArtifactError(f"artifact {str(path)!r} has broken metadata: field {name!r} is "
                                f"{type(value).__name__}; expected {expected}")
    elif name == "kind" and value not in KINDS:
        raise ArtifactError(f"artifact {str(path)!r} has broken metadata: field 'kind' is {value!r}; expected one "
                            f"of {list(KINDS)}")
    elif name == "digest" and not (len(value) == 64 and all(c in "0123456789abcdef" for c in value)):
        raise ArtifactError(f"artifact {str(path)!r} has broken metadata: field 'digest' is not a SHA-256 hex digest")
    return value


def read_artifact_info(path: str | os.PathLike) -> ArtifactInfo:
    """The metadata and tensor shapes of an artifact, without loading its tensors."""
    path = Path(path)
    metadata, shapes = _open_metadata(path)
    kind, model, window, info, _ = (_metadata_field(path, metadata, k)
                                    for k in ("kind", "model", "window", "info", "digest"))
    return ArtifactInfo(str(path), kind, model, window, info, shapes)


def verify_artifact(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], ArtifactInfo]:
    """Read every tensor of an artifact and check them against the stored digest: ``(tensors, info)``.

    Raises :class:`ArtifactError` for a file that is unreadable, has broken metadata, or whose tensor bytes do
    not match their digest (a flipped bit, a partial copy).
    """
    from safetensors.torch import load_file

    info = read_artifact_info(path)
    try:
        tensors = load_file(info.path)
    except Exception as error:
        raise ArtifactError(f"artifact {info.path!r} could not be read ({error})") from error
    metadata, _ = _open_metadata(Path(info.path))
    if _digest(tensors) != metadata.get("digest"):
        raise ArtifactError(f"artifact {info.path!r} is corrupted: its tensors do not match their digest")
    return tensors, info


def load_artifact(
    path: str | os.PathLike,
    kind: str,
    required: Iterable[str] = (),
    fingerprint: Mapping[str, Any] | None = None,
    window: Mapping[str, Any] | None = None,
    verify: bool = True,
) -> tuple[dict[str, torch.Tensor], ArtifactInfo]:
    """Load and check an artifact: ``(tensors on CPU, info)``.

    Args:
        kind: the expected kind.
        required: tensor names that must be present.
        fingerprint: if given, the file's model fingerprint must equal it (see :func:`check_fingerprint`).
        window: if given, the file's window metadata must equal it.
        verify: recompute the digest (detects corrupted tensor bytes).
    """
    from safetensors.torch import load_file

    info = read_artifact_info(path)
    if info.kind != kind:
        raise ArtifactError(f"artifact {info.path!r} holds {info.kind!r}; expected {kind!r}")
    missing = sorted(set(required) - set(info.tensors))
    if missing:
        raise ArtifactError(f"artifact {info.path!r} is missing tensor(s) {missing}; it has {sorted(info.tensors)}")
    if fingerprint is not None:
        check_fingerprint(fingerprint, info.model, what=f"artifact {info.path!r}")
    if window is not None and _plain(window) != info.window:
        raise ArtifactError(f"artifact {info.path!r} was made for window {info.window!r}; expected {_plain(window)!r}")
    if verify:
        return verify_artifact(info.path)[0], info
    try:
        tensors = load_file(info.path)
    except Exception as error:
        raise ArtifactError(f"artifact {info.path!r} could not be read ({error})") from error
    return tensors, info


# --- static head masks ------------------------------------------------------------------------------------


def save_head_mask(
    path: str | os.PathLike,
    mask: torch.Tensor,
    fingerprint: Mapping[str, Any],
    info: Mapping[str, Any] | None = None,
) -> Path:
    """Save an ``[L, H]`` bool mask (True = local) for the static criterion."""
    mask = torch.as_tensor(mask)
    if mask.ndim != 2 or mask.dtype != torch.bool:
        raise ValueError(f"expected a bool mask of shape [layers, heads] but got {mask.dtype} {tuple(mask.shape)}")
    L, H = mask.shape
    if fingerprint.get("num_layers") not in (None, L) or fingerprint.get("num_heads") not in (None, H):
        raise ValueError(
            f"expected a mask of shape [{fingerprint.get('num_layers')}, {fingerprint.get('num_heads')}] "
            f"for this model but got {list(mask.shape)}"
        )
    return save_artifact(path, "head_mask", {"mask": mask}, fingerprint, info=info)


def load_head_mask(
    path: str | os.PathLike, fingerprint: Mapping[str, Any] | None = None
) -> tuple[torch.Tensor, ArtifactInfo]:
    """Load an ``[L, H]`` bool head mask; checks the model fingerprint when one is given."""
    tensors, info = load_artifact(path, "head_mask", required=("mask",), fingerprint=fingerprint)
    mask = tensors["mask"]
    L, H = info.model.get("num_layers"), info.model.get("num_heads")
    if mask.dtype != torch.bool or mask.ndim != 2 or (L is not None and tuple(mask.shape) != (L, H)):
        raise ArtifactError(
            f"artifact {info.path!r} holds a mask {mask.dtype} {list(mask.shape)}; expected bool [{L}, {H}]"
        )
    return mask, info


# --- QAdA corrections -------------------------------------------------------------------------------------


def _correction_problem(slope: Any, offset: Any, count: Any, L: Any, H: Any) -> str | None:
    """What is wrong with a correction's tensors (``None`` if nothing): shapes, dtypes, finiteness."""
    for name, t in (("slope", slope), ("offset", offset)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.ndim != 2:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            return f"expected {name} as a floating [layers, heads] tensor but got {got}"
    if slope.shape != offset.shape:
        return f"expected slope and offset of one shape but got {list(slope.shape)} and {list(offset.shape)}"
    if L is not None and H is not None and tuple(slope.shape) != (L, H):
        return f"expected slope and offset of shape [{L}, {H}] for this model but got {list(slope.shape)}"
    if not (torch.isfinite(slope).all() and torch.isfinite(offset).all()):
        return "expected finite slope and offset but got NaN or inf"
    if count is not None and (not isinstance(count, torch.Tensor) or count.shape != slope.shape
                              or (count.dtype.is_floating_point and not torch.isfinite(count).all())
                              or bool((count < 0).any())):
        return "expected count as a non-negative [layers, heads] tensor like slope"
    return None


def save_qada_correction(
    path: str | os.PathLike,
    slope: torch.Tensor,
    offset: torch.Tensor,
    fingerprint: Mapping[str, Any],
    count: torch.Tensor | None = None,
    info: Mapping[str, Any] | None = None,
) -> Path:
    """Save a per-head correction of the lognormal estimate (``qada_calibrated``): ``slope, offset [L, H]``, finite,
    and optionally the ``count [L, H]`` of samples behind each head; ``info`` says what it was fitted on."""
    L, H = fingerprint.get("num_layers"), fingerprint.get("num_heads")
    problem = _correction_problem(slope, offset, count, L, H)
    if problem:
        raise ValueError(problem)
    tensors = {"slope": slope.float(), "offset": offset.float()}
    if count is not None:
        tensors["count"] = count.long()
    return save_artifact(path, "qada_correction", tensors, fingerprint, info=info)


def load_qada_correction(
    path: str | os.PathLike, fingerprint: Mapping[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor, ArtifactInfo]:
    """``(slope [L, H], offset [L, H], info)`` of a correction artifact; checks the model fingerprint when one is
    given, and always the shapes (against the file's own model) and that every value is finite."""
    tensors, info = load_artifact(path, "qada_correction", required=("slope", "offset"), fingerprint=fingerprint)
    problem = _correction_problem(tensors["slope"], tensors["offset"], tensors.get("count"),
                                  info.model.get("num_layers"), info.model.get("num_heads"))
    if problem:
        raise ArtifactError(f"artifact {info.path!r} holds a broken correction: {problem}")
    return tensors["slope"], tensors["offset"], info
