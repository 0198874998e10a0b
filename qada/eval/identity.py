"""Run identity: a digest of everything that changes a result, the key that lets a rerun resume safely.

A results row is reused on resume only if it was written under the same identity: the model (fingerprint with
a weights digest, dtype, device type), the data (each sample's own digest; a data file's digest), the
configuration with all its parameters (criterion, moments, executor, window) and the digests of the artifact
files it names, the decode settings, the seed and template, whether the oracle is recorded, and the versions
of qada, torch and transformers. A folder written under another identity is refused with the fields that
differ: results of different runs are never mixed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from qada.artifacts import file_sha256

__all__ = [
    "ResultsMismatchError",
    "artifact_digests",
    "differences",
    "digest",
    "file_digest",
    "plain",
    "sample_digest",
]


class ResultsMismatchError(ValueError):
    """A results folder holds rows written under another run identity (other settings, data or versions)."""


def plain(value: Any) -> Any:
    """``value`` as JSON-plain data: built components by their config (``to_config``), anything else by ``str``."""
    return json.loads(json.dumps(value, default=_component_config))


def _component_config(value: Any) -> Any:
    to_config = getattr(value, "to_config", None)
    return to_config() if callable(to_config) else str(value)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=_component_config, separators=(",", ":"))


def digest(value: Any) -> str:
    """A short SHA-256 (16 hex digits) of a JSON-plain ``value`` (keys sorted)."""
    return hashlib.sha256(_canonical(value).encode()).hexdigest()[:16]


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 (16 hex digits) of a file's bytes; cached per (path, size, mtime)."""
    stat = Path(path).stat()
    return _file_digest(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime: int) -> str:
    return file_sha256(path)[:16]


def artifact_digests(spec: Any) -> dict[str, str]:
    """``{path: digest}`` for every string inside a (nested) component spec that names an existing file.

    A moment source or criterion that reads an artifact (``path: ref.safetensors``) changes its result when the
    file changes, although its spec does not.
    """
    found: dict[str, str] = {}

    def visit(value: Any) -> None:
        if isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, str) and len(value) < 4096 and ("/" in value or "." in value):
            try:
                if Path(value).is_file():
                    found[value] = file_digest(value)
            except OSError:  # a name too long or unreadable: not a file this run reads
                pass

    visit(spec)
    return found


def sample_digest(sample: Any) -> str:
    """A digest of what a sample asks and expects: task, index, prompt text, reference outputs, answer budget."""
    return digest({"task": sample.task, "index": sample.index, "input": sample.input, "outputs": sample.outputs,
                   "tokens_to_generate": sample.tokens_to_generate})


def differences(before: Mapping[str, Any], after: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Human-readable ``field: old -> new`` lines for the (nested) fields in which two identities differ."""
    lines = []
    for key in sorted(set(before) | set(after), key=str):
        old, new = before.get(key, "<absent>"), after.get(key, "<absent>")
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            lines += differences(old, new, f"{prefix}{key}.")
        elif _canonical(old) != _canonical(new):
            lines.append(f"{prefix}{key}: {_short(old)} -> {_short(new)}")
    return lines


def _short(value: Any, limit: int = 60) -> str:
    text = _canonical(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
