"""One program in a fresh code sandbox, for the sandbox's tests and ``benchmarks/sandbox.py``:
``run_sandboxed`` writes ``source`` as ``/tmp/main.py`` and runs it under ``SandboxLimits`` with the
product's jail (``sluice.rewards.sandbox``). A run's rewards score through ``code_exec.py`` instead.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from sluice.rewards.sandbox import Jailed, SandboxLimits, SandboxResult, check_limits, output_tail, python_argv

DEFAULT_LIMITS = SandboxLimits()


def run_sandboxed(source: str, limits: SandboxLimits = DEFAULT_LIMITS) -> SandboxResult:
    """Run ``source`` as ``/tmp/main.py`` in a fresh sandbox under ``limits``."""
    check_limits(limits)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-sandbox-"))  # 0700, holds the host's side only
    try:
        (workdir / "main.py").write_text(source)
        (workdir / "cwd").mkdir()
        argv = python_argv("/tmp/main.py", [], limits, {"/tmp/main.py": workdir / "main.py"}, workdir / "cwd")
        out_path, err_path = workdir / "stdout", workdir / "stderr"
        started = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            jailed = Jailed(argv, limits, out, err, ())
            try:
                timed_out = jailed.wait(started + limits.wall_s)
            finally:
                jailed.stop()
        status = jailed.status(timed_out, out_path, err_path, limits.output_kb << 10)
        wall = time.monotonic() - started
        return SandboxResult(status, jailed.process.returncode, output_tail(out_path), output_tail(err_path), wall)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
