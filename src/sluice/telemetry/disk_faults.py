"""Writes the disk refused: a full disk, a read-only or not permitted run dir, as one line.

``disk_faults(path)`` wraps the places a run writes (the run dir as a whole in ``fit``, a
checkpoint being written, the final model, a JSONL log): an error out of it that is a refused
write becomes ``DiskFault``, a ``RunStopped`` whose message names the cause and the file, e.g.
``no space left on device (ENOSPC): runs/x/metrics.jsonl``. A refused write is an ``OSError`` with
one of ``DISK_ERRNOS`` anywhere in the error's chain (``__cause__``, ``__context__``, a Ray task
error's ``cause``). Libraries that write files natively do not always raise one (``torch.save``
raises a ``RuntimeError`` about stream positions, safetensors its own error): around such writes
(``any_error=True``) any error is also diagnosed from the file system under ``path``
(``statvfs``: read-only, or less than ``FULL_BELOW`` free). The file named is the ``OSError``'s
own when it has one (``open`` sets it, ``write`` does not), else ``path``.

Nothing is retried, cleaned or deleted here: the writes it wraps are atomic or append-only, so the
run's last complete checkpoint and its logs up to it stay as they were.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from sluice.schedule.failures import RunStopped

DISK_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
"""The ``OSError`` numbers that mean the disk, not the program, refused the write."""
FULL_BELOW = 1 << 20
"""Bytes free under which a failed write is put down to a full disk."""


class DiskFault(RunStopped):
    """A write the disk refused; the message names the cause and the file."""

    def __init__(self, cause: str, file: str) -> None:
        super().__init__(
            f"{cause}: {file}; nothing else was touched (the last complete checkpoint and the logs up "
            "to it are kept): fix the disk, then resume=auto continues the run"
        )
        self.cause = cause
        self.file = file


@contextlib.contextmanager
def disk_faults(path: Path, *, any_error: bool = False) -> Iterator[None]:
    """Within: an error that is a refused write (see the module) is raised as ``DiskFault``;
    ``any_error``: also any error while the file system under ``path`` is read-only or full."""
    try:
        yield
    except DiskFault:
        raise
    except Exception as err:
        fault = diagnose(err, path, any_error=any_error)
        if fault is None:
            raise
        raise fault from err


def diagnose(err: BaseException, path: Path, *, any_error: bool = False) -> DiskFault | None:
    """``err`` as a ``DiskFault`` naming its file (else ``path``), or ``None`` if the disk did not
    refuse anything (``any_error``: nor is its file system read-only or full)."""
    refused = next((e for e in _chain(err) if isinstance(e, OSError) and e.errno in DISK_ERRNOS), None)
    if refused is not None:
        assert refused.errno is not None
        name = errno.errorcode.get(refused.errno, str(refused.errno))
        return DiskFault(f"{DISK_ERRNOS[refused.errno]} ({name})", str(refused.filename or path))
    state = filesystem_state(path) if any_error else None
    return None if state is None else DiskFault(state, str(path))


def filesystem_state(path: Path) -> str | None:
    """``read-only file system`` or ``no space left on device`` for the file system holding
    ``path`` (its nearest existing folder), else ``None``."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    if stat.f_flag & os.ST_RDONLY:
        return "read-only file system (EROFS)"
    if stat.f_bavail * stat.f_frsize < FULL_BELOW:
        return "no space left on device (ENOSPC)"
    return None


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        cause = getattr(e, "cause", None)  # ray.exceptions.RayTaskError keeps the actor's error here
        todo.extend([e.__cause__, e.__context__, cause if isinstance(cause, BaseException) else None])
