"""Crash-safe file writes: write a temporary file in the same folder, fsync it, then rename.

``os.replace`` is atomic on POSIX and Windows, so a reader sees either the old file or the
complete new one, never a half-written file, even if the writer is killed mid-write.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

TMP_SUFFIX = ".partial"


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; on success it replaces ``path``.

    On an exception the temporary file is removed and ``path`` is left untouched.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files; mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (UTF-8)."""
    atomic_write_bytes(path, text.encode("utf-8"))
