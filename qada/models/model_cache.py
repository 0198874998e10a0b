"""Where a dequantised GGUF is cached, and removing the entries nothing can use any more.

Each entry is a transformers model directory (float32 safetensors, about 0.5 GB for SmolLM2-135M) under
``$QADA_CACHE_DIR/models``:

* an embedded model's entry is named by the packaged file's sha256, so every install of the same package (each
  fresh virtual environment) shares one entry;
* any other GGUF's entry is named by its path, size and modification time (hashing a multi-GB file on every load
  would cost more than the load).

Every entry records its source (:data:`SOURCE_RECORD`). When a new entry is written, :func:`remove_stale_entries`
removes the entries of the same file name that nothing can use any more, so the cache holds one entry per model
rather than one per install or per edit of the file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

from qada.cache import cache_dir

__all__ = ["SOURCE_RECORD", "STALE_AFTER_S", "entry_path", "remove_stale_entries", "stale_entries",
           "write_source_record"]

#: The file, inside an entry, that names the GGUF it was made from.
SOURCE_RECORD = "qada-source.json"
#: An entry without a record (an older qada's, or a write that was stopped) is removed only after this long, so a
#: write in progress in another process is never taken away from under it.
STALE_AFTER_S = 3600.0


def entry_path(gguf: Path, sha256: str | None = None) -> Path:
    """The cache directory for ``gguf``: named by ``sha256`` (an embedded model's expected checksum) when given,
    else by the file's resolved path, size and modification time."""
    if sha256 is not None:
        key = sha256[:16]
    else:
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def write_source_record(directory: Path, gguf: Path, sha256: str | None = None) -> None:
    """Record in ``directory`` which file it was made from (its resolved path) and, for an entry named by content,
    the ``sha256`` it is named by."""
    record = {"gguf": str(gguf.resolve()), "sha256": sha256}
    (directory / SOURCE_RECORD).write_text(json.dumps(record), encoding="utf-8")


def _recorded_source(directory: Path) -> tuple[Path, bool] | None:
    """``(source path, named by content)`` from ``directory``'s record; ``None`` without a readable one."""
    try:
        record = json.loads((directory / SOURCE_RECORD).read_text(encoding="utf-8"))
        return Path(record["gguf"]), bool(record.get("sha256"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stale_entries(gguf: Path, keep: Path, sha256: str | None = None, now: float | None = None) -> list[Path]:
    """The entries besides ``keep`` (the entry of ``gguf``, named by ``sha256`` if given) that were made from a file
    named like ``gguf`` and that nothing can use:

    * complete entries whose recorded source no longer exists (a deleted virtual environment), or is ``gguf``
      itself (the file changed since, so its key did);
    * entries without a record (an older qada's, or a stopped write) older than :data:`STALE_AFTER_S`.

    An entry recorded from another file that still exists is kept: it may be another install's current model. An
    entry named by content (an embedded model's) is kept when ``keep`` is not: a GGUF loaded by its path never
    removes the entry the embedded model's name loads.
    """
    now = time.time() if now is None else now
    parent = keep.parent
    if not parent.is_dir():
        return []
    here = gguf.resolve()
    stale = []
    for entry in sorted(parent.glob(f"{gguf.stem}-*")):
        if entry == keep or not entry.is_dir():
            continue
        record = _recorded_source(entry)
        if record is not None and (entry / "config.json").is_file():
            source, by_content = record
            if (source == here or not source.exists()) and not (by_content and sha256 is None):
                stale.append(entry)
        elif now - entry.stat().st_mtime > STALE_AFTER_S:
            stale.append(entry)
    return stale


def remove_stale_entries(gguf: Path, keep: Path, sha256: str | None = None) -> list[Path]:
    """Remove :func:`stale_entries` and return them; an entry another process removes first is no error."""
    removed = stale_entries(gguf, keep, sha256)
    for entry in removed:
        shutil.rmtree(entry, ignore_errors=True)
    if removed:
        print(f"[qada] removed {len(removed)} stale cache entr{'y' if len(removed) == 1 else 'ies'} of {gguf.name} "
              f"under {keep.parent}", flush=True)
    return removed
