"""Crash-safe file writes: write a temporary file in the same folder, fsync it, then rename.

``os.replace`` is atomic on POSIX and Windows, so a reader sees either the old file or the
complete new one, never a half-written file, even if the writer is killed mid-write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import IO, Iterator

TMP_SUFFIX = ".partial"
STALE_PARTIAL_S = 600  # a temporary file this old belongs to a writer that was killed
LOW_SPACE_BYTES = 64 * 2**20


class DiskFullError(OSError):
    """A write ran out of space; the message says the previous file is intact."""


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; on success it replaces ``path``.

    On an exception the temporary file is removed and ``path`` is left untouched.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files; mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # make the rename itself survive a power cut
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, Exception) and _out_of_space(e, path.parent):
            kept = f"{path} was left as it was" if path.exists() else f"nothing was written to {path}"
            raise DiskFullError(
                errno.ENOSPC,
                f"no space left on the device while writing {path} ({type(e).__name__}: {e}); {kept}. "
                f"Fix: free space in {path.parent} (e.g. delete old runs) or write elsewhere, then run again.",
            ) from e
        raise


def _out_of_space(err: Exception, folder: Path) -> bool:
    """ENOSPC, or a library error (torch.save: "unexpected pos") raised while the disk is nearly full."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(folder).free < LOW_SPACE_BYTES
    except OSError:
        return False


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_stale_partials(path: str | os.PathLike, older_than_s: float = STALE_PARTIAL_S) -> list[Path]:
    """Delete temporary files left by killed writers of ``path`` (older than ``older_than_s``).

    A writer killed with SIGKILL cannot clean up after itself; its ``.partial`` file can be as large
    as a checkpoint. Fresh ones are left alone: they may belong to a writer still at work.
    """
    path = Path(path)
    removed = []
    now = time.time()
    for old in path.parent.glob(f".{path.name}.*{TMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            if now - old.stat().st_mtime > older_than_s:
                old.unlink()
                removed.append(old)
    return removed


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """An exclusive advisory lock on ``<path>.lock`` (POSIX ``flock``; a no-op where there is none).

    The lock goes with the open file, so a process that dies holding it releases it.
    """
    try:
        import fcntl
    except ImportError:  # Windows: no flock; writers there are not concurrent in this series
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
