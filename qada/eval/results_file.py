"""Crash-safe per-sample results: whole rows, a lock against a second writer, repair of a torn last line.

A results file is JSON lines. Every row is written with one ``write`` of the whole line on a file opened for
appending, then flushed to disk (``fsync``): a crash leaves at most a torn *last* line, which the next writer
cuts off (with a warning) before it appends, so that pair simply runs again. A failed write (disk full) is
rolled back to the last whole row. An exclusive ``flock`` on ``<file>.lock`` keeps a second process from
writing the same file; it gets :class:`ResultsLockedError` at once. Summary files are written whole (temporary
file + rename) and are always valid JSON: :func:`json_safe` turns a non-finite number into ``null``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["ResultsFile", "ResultsLockedError", "json_safe", "read_rows", "repair_torn_line", "write_json"]


class ResultsLockedError(RuntimeError):
    """Another process is writing the same results file."""


def repair_torn_line(path: str | os.PathLike) -> int:
    """Cut a torn last line (no final newline) off ``path``; returns the number of bytes removed (0 if whole)."""
    path = Path(path)
    if not path.is_file():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as handle:
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) == b"\n":
            return 0
        # find the last newline, reading backwards in blocks
        end, keep = size, 0
        while end > 0:
            start = max(0, end - 65536)
            handle.seek(start)
            block = handle.read(end - start)
            cut = block.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())
    removed = size - keep
    warnings.warn(f"{path}: removed a torn last line ({removed} bytes) left by an interrupted write; "
                  "that result runs again", stacklevel=2)
    return removed


def read_rows(path: str | os.PathLike, required: tuple[str, ...] = ()) -> Iterator[dict]:
    """The rows of a results file. A torn last line is skipped (it is repaired before the next append); any other
    line that is not a JSON object with the ``required`` fields is an error naming the line."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    torn = not data.endswith(b"\n") and data != b""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if torn and number == len(lines):
            return
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path}, line {number}: not a JSON line; the results file is corrupted (move it "
                             "away to start afresh)") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {number}: expected a JSON object but got {type(row).__name__}")
        missing = [name for name in required if name not in row]
        if missing:
            raise ValueError(f"{path}, line {number}: a results row without {missing}; the file is not qada's or "
                             "is corrupted")
        yield row


class ResultsFile:
    """Appends whole rows to ``path`` while holding its lock (use as a context manager).

    >>> with ResultsFile(tmp / "results-rank0.jsonl") as results:  # doctest: +SKIP
    ...     results.append({"sample": "niah/0", "score": 100.0})
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock_fd: int | None = None
        self._fd: int | None = None

    def __enter__(self) -> ResultsFile:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock (or raise :class:`ResultsLockedError`), repair a torn last line, open for appending."""
        self.acquire_lock()
        repair_torn_line(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def acquire_lock(self) -> None:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ResultsLockedError(f"another process (pid {holder}) is writing {self.path}; wait for it to "
                                     "finish or use another output") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def probe(self) -> None:
        """Fail now (:class:`ResultsLockedError`) if another process holds the lock; takes nothing, creates nothing."""
        if not self.lock_path.exists():
            return
        self.acquire_lock()
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            import fcntl

            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def append(self, row: dict) -> None:
        """Write ``row`` as one whole line and flush it to disk; on failure the file is left at its last whole row."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is not open: use `with ResultsFile(path) as results:`")
        line = (json.dumps(json_safe(row), allow_nan=False) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            written = 0
            while written < len(line):
                written += os.write(self._fd, line[written:])
            os.fsync(self._fd)
        except OSError as error:
            try:
                os.ftruncate(self._fd, size)
            except OSError:
                pass
            reason = "the disk is full" if error.errno == errno.ENOSPC else error.strerror or str(error)
            raise OSError(error.errno, f"could not write a result to {self.path}: {reason}; the finished rows are "
                                       "kept and a rerun resumes from them") from None


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) replaced by ``None`` and every built component (an object
    with ``to_config``) by its config, recursively (valid JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    to_config = getattr(value, "to_config", None)
    if callable(to_config) and not isinstance(value, type):
        return json_safe(to_config())
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: str | os.PathLike, value: Any, indent: int | None = 2) -> Path:
    """Write ``value`` as valid JSON (non-finite numbers -> ``null``) whole: a temporary file, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(json_safe(value), indent=indent, allow_nan=False))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path
