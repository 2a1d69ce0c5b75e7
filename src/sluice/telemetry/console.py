"""The console of a ``sluice train`` run: sluice's own lines on the terminal, the rest in ``run.log``.

Inside ``run_console(run_dir)`` the terminal shows sluice's log records (warning and up), its
progress and results, and any library's *error* records; ``<run dir>/run.log`` keeps every log
record from info up (Ray's, transformers', sluice's), Python warnings (``logging.captureWarnings``:
transformers' ``FutureWarning`` s) and whatever native code writes to file descriptor 2 (Ray's
C++ core worker in the driver, e.g. its ``core_worker.cc ... max_restarts`` line): fd 2 points at
the log file while ``sys.stderr`` is a copy of the terminal, so Python's own error output still
reaches the user. Nothing is dropped; it only goes where it belongs.

It deliberately does not touch worker processes' output (Ray writes it to its session's log files;
the run starts Ray with ``log_to_driver=False``, ``runtime/ray_pipeline.ensure_ray``) or stdout.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RUN_LOG = "run.log"
"""The run's log file, in its run dir (appended to: a resumed run continues it)."""

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _OwnLines(logging.Filter):
    """sluice's records, and any library's errors: what the terminal shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.partition(".")[0] == "sluice" or record.levelno >= logging.ERROR


@contextmanager
def run_console(run_dir: str | Path) -> Iterator[Path]:
    """Route this process's diagnostics for the block (see the module docstring); the log's path."""
    path = Path(run_dir) / RUN_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)  # native writes (Ray's C++ core worker) and child processes' stderr
    os.close(log_fd)
    stderr, sys.stderr = sys.stderr, terminal
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter(_FORMAT))
    to_terminal = logging.StreamHandler(terminal)
    to_terminal.setLevel(logging.WARNING)
    to_terminal.addFilter(_OwnLines())
    to_terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    kept = [h for h in handlers if getattr(h, "stream", None) not in (stderr, sys.__stderr__)]  # e.g. pytest's
    root.handlers, root.level = [*kept, to_file, to_terminal], logging.INFO
    logging.captureWarnings(True)
    try:
        yield path
    finally:
        logging.captureWarnings(False)
        root.handlers, root.level = handlers, level
        to_file.close()
        terminal.flush()
        os.dup2(terminal.fileno(), 2)
        sys.stderr = stderr
        terminal.close()
