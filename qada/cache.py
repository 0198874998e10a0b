"""qada's on-disk cache (dequantised models, reference keys): ``$QADA_CACHE_DIR`` or ``~/.cache/qada``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """``path`` if given, else ``$QADA_CACHE_DIR``, else ``~/.cache/qada``."""
    if path is not None:
        return Path(path)
    return Path(os.environ.get("QADA_CACHE_DIR") or Path.home() / ".cache" / "qada")
