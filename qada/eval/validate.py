"""Checks made before any work: output paths, sample counts, prompt lengths (clear one-line errors).

Each raises a ``ValueError`` (``NotADirectoryError``/``IsADirectoryError``/``PermissionError`` for paths) naming
the input, so that a bad flag fails in a second rather than after an hour of evaluation.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["check_count", "check_length_fits", "check_output_dir", "check_output_file"]


def _first_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _check_creatable(path: Path, what: str) -> None:
    """``path`` (absent) could be created: its first existing ancestor is a writable folder."""
    ancestor = _first_existing(path.parent)
    if not ancestor.is_dir():
        raise NotADirectoryError(f"{what} {str(path)!r} cannot be created: {str(ancestor)!r} is a file, not a folder")
    _check_writable_dir(ancestor, f"{what} {str(path)!r} cannot be created")


def _check_writable_dir(folder: Path, what: str) -> None:
    """Create and remove a temporary file in ``folder`` (permission bits lie for root and read-only mounts)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise PermissionError(f"{what}: cannot write in {str(folder)!r} ({error.strerror or error})") from None


def check_output_file(path: str | os.PathLike, what: str = "output file") -> Path:
    """A file we will write: not a folder, creatable or writable."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what} {str(path)!r} is a folder; give a file name")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{what} {str(path)!r} is not writable")
        _check_writable_dir(path.parent, f"{what} {str(path)!r} cannot be replaced")
    else:
        _check_creatable(path, what)
    return path


def check_output_dir(path: str | os.PathLike, what: str = "output folder") -> Path:
    """A folder we will write into: not a file, creatable or writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{what} {str(path)!r} is a file; give a folder")
    if path.is_dir():
        _check_writable_dir(path, f"{what} {str(path)!r} is not writable")
    else:
        _check_creatable(path, what)
    return path


def check_count(value: Any, what: str, minimum: int = 1) -> int:
    """An integer count of at least ``minimum`` (``--samples``, ``num_samples``...)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"expected {what} to be an integer >= {minimum} but got {value!r}")
    return value


def check_length_fits(length: int, model: Any, what: str = "--length") -> None:
    """A prompt length the model's positions can hold (``max_position_embeddings``), with room to answer."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and length >= limit:
        raise ValueError(f"{what} {length} leaves no room to answer within the model's {limit} positions "
                         "(max_position_embeddings)")
