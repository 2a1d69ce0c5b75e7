"""The console of a ``sluice train`` / ``sluice eval`` run: sluice's own lines on the terminal,
everything else in ``<run dir>/run.log``.

Inside ``run_console(run_dir)`` file descriptor 2 and ``sys.stderr`` point at the log file, so
whatever writes to stderr goes there: native code (Ray's C++ core worker in the driver, e.g. its ``core_worker.cc
... max_restarts`` line), child processes, libraries' own handlers and progress bars
(transformers, tqdm). Python warnings become log records (``logging.captureWarnings``:
transformers' ``FutureWarning`` s), and the root logger writes every record from info up (Ray's
"Started a local Ray instance" and token-auth warning included) to the log. The terminal, a copy
of the old fd 2 that ``run_console`` yields, gets sluice's records (warning and up) and any error
record that reaches the root logger; the CLI prints its own lines to it (stdout is untouched:
progress and results). Nothing is dropped; it only goes where it belongs. After the block, fd 2
is the terminal again, so the CLI's ``error: ...`` line reaches the user.

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
from typing import TextIO

RUN_LOG = "run.log"
"""The run's log file, in its run dir (appended to: a resumed run continues it)."""

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _OwnLines(logging.Filter):
    """sluice's records, and any library's errors: what the terminal shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.partition(".")[0] == "sluice" or record.levelno >= logging.ERROR


@contextmanager
def run_console(run_dir: str | Path) -> Iterator[TextIO]:
    """Route this process's diagnostics for the block (see the module docstring); yields the
    terminal's stream (``<run dir>/run.log``: ``RUN_LOG``)."""
    path = Path(run_dir) / RUN_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    stderr, sys.stderr = sys.stderr, open(path, "a", buffering=1, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter(_FORMAT))
    to_terminal = logging.StreamHandler(terminal)
    to_terminal.setLevel(logging.WARNING)
    to_terminal.addFilter(_OwnLines())
    to_terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    kept = [h for h in handlers if getattr(h, "stream", None) not in (stderr, sys.__stderr__)]  # e.g. pytest's
    root.handlers = [*kept, to_file, to_terminal]
    root.setLevel(logging.INFO)  # setLevel, not the attribute: it clears the loggers' cached levels
    logging.captureWarnings(True)
    try:
        yield terminal
    finally:
        logging.captureWarnings(False)
        root.handlers = handlers
        root.setLevel(level)
        to_file.close()
        sys.stderr.close()
        sys.stderr = stderr
        terminal.flush()
        os.dup2(terminal.fileno(), 2)
        terminal.close()
