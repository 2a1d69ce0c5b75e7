"""``CodeExecReward``: the fraction of the row's tests that the response's code passes.

The code is the response's last fenced code block (```` ```python ... ``` ````, or the whole
response when it has none); ``tests`` is the row's test code (``assert`` lines, ``test_*``
functions, or a ``check(...)`` script). Each call starts two sandboxes (``sandbox.py``):

- the **solution** runs the code as module ``solution`` and serves requests (``code_server.py``);
- the **judge** runs the tests, unit by unit, against proxies of the solution's names
  (``code_judge.py``) and reports each passed unit on a pipe only it holds.

Each top-level statement of ``tests`` that holds an ``assert`` is one test, and so is each
``test_*`` function (called after the rest); other statements are setup, run in order. Tests
with neither are one test. The reward is passed / total (``scoring="fraction"``) or 1.0 only
when all pass (``scoring="all"``); a crash, a timeout or a limit hit just fails tests, it is
never a reward error. Nothing the solution does (exit codes, ``SystemExit``, ``os._exit``,
patched builtins, objects equal to everything) is read as a pass: only the judge's report is.

This module does not isolate anything itself (``sandbox.py`` / ``jail.py`` do).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import select
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sluice.rewards.sandbox import Jailed, SandboxLimits, SandboxResult, check_limits, output_tail, python_argv

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_HERE = Path(__file__).resolve().parent


def extract_code(response: str) -> str:
    """The last fenced code block of ``response``, or all of it when there is none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def plan_tests(tests: str) -> list[dict[str, Any]]:
    """``tests`` split into units ``{"kind": "setup" | "test", "source", "line"}``, in run order."""
    if not isinstance(tests, str):
        raise TypeError(f"code_exec: the row's 'tests' must be a string of Python, got {type(tests).__name__}")
    try:
        tree = ast.parse(tests)
    except SyntaxError as exc:
        raise ValueError(f"code_exec: the row's 'tests' is not valid Python (line {exc.lineno}: {exc.msg})") from None
    if not tree.body:
        raise ValueError("code_exec: the row's 'tests' holds no statement to run")
    units, calls = [], []
    for stmt in tree.body:
        source = ast.get_source_segment(tests, stmt, padded=True) or ast.unparse(stmt)
        is_def = isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        asserts = not is_def and any(isinstance(node, ast.Assert) for node in ast.walk(stmt))
        units.append({"kind": "test" if asserts else "setup", "source": source, "line": stmt.lineno})
        if isinstance(stmt, ast.FunctionDef) and stmt.name.startswith("test") and not stmt.args.args:
            calls.append({"kind": "test", "source": f"{stmt.name}()", "line": stmt.lineno})
    units += calls
    if not any(unit["kind"] == "test" for unit in units):
        return [{"kind": "test", "source": tests, "line": 1}]
    return units


@dataclass(frozen=True)
class CodeScore:
    passed: int
    total: int
    solution: SandboxResult
    """The solution's sandbox (its output, and how it ended)."""
    judge: SandboxResult
    """The judge's sandbox (its stderr names each failed unit)."""


@dataclass(frozen=True)
class CodeExecReward:
    """A picklable reward: ``reward(response, tests=...) -> passed / total`` (or 1.0 / 0.0)."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    scoring: Literal["fraction", "all"] = "fraction"

    def __call__(self, response: str, *, tests: str, **_: Any) -> float:
        if self.scoring not in ("fraction", "all"):
            raise ValueError(f"code_exec: scoring must be 'fraction' or 'all', got {self.scoring!r}")
        score = self.score(response, tests)
        if self.scoring == "all":
            return 1.0 if score.passed == score.total else 0.0
        return score.passed / score.total

    def score(self, response: str, tests: str) -> CodeScore:
        """Run ``tests`` against the response's code; how many of them passed."""
        if not isinstance(response, str):
            raise TypeError(f"code_exec: the response must be a string, got {type(response).__name__}")
        plan = plan_tests(tests)
        check_limits(self.limits)
        return _judge(extract_code(response), plan, self.limits)


def _judge(code: str, plan: list[dict[str, Any]], limits: SandboxLimits) -> CodeScore:
    workdir = Path(tempfile.mkdtemp(prefix="sluice-code-"))
    pipes: list[int] = []
    try:
        (workdir / "solution.py").write_text(code)
        (workdir / "plan.json").write_text(json.dumps(plan))
        for side in ("solution", "judge"):
            (workdir / side).mkdir()
        requests_r, requests_w = _pipe(pipes)
        answers_r, answers_w = _pipe(pipes)
        report_r, report_w = _pipe(pipes)
        wire = {"/tmp/code_wire.py": _HERE / "code_wire.py"}
        sides = {
            "solution": (
                "/tmp/code_server.py",
                (requests_r, answers_w),
                {**wire, "/tmp/code_server.py": _HERE / "code_server.py", "/tmp/solution.py": workdir / "solution.py"},
            ),
            "judge": (
                "/tmp/code_judge.py",
                (requests_w, answers_r, report_w),
                {**wire, "/tmp/code_judge.py": _HERE / "code_judge.py", "/tmp/plan.json": workdir / "plan.json"},
            ),
        }
        started = time.monotonic()
        with contextlib.ExitStack() as stack:
            jailed = {}
            for side, (script, fds, files) in sides.items():
                out = stack.enter_context(open(workdir / f"{side}.out", "wb"))
                err = stack.enter_context(open(workdir / f"{side}.err", "wb"))
                argv = python_argv(script, [str(fd) for fd in fds], limits, files, workdir / side)
                jailed[side] = Jailed(argv, limits, out, err, fds)
                stack.callback(jailed[side].stop)
            for fd in (requests_r, requests_w, answers_r, answers_w, report_w):
                _close(pipes, fd)  # from here only the sandboxes hold them, the report's reader aside
            report = _read_report(report_r, started + limits.wall_s)
            timed_out = {side: j.wait(started + limits.wall_s) for side, j in jailed.items()}
            if not timed_out["judge"]:
                timed_out["solution"] = False  # it is left waiting for requests once the tests are done
        wall = time.monotonic() - started
        results = {
            side: _result(j, timed_out[side], workdir / f"{side}.out", workdir / f"{side}.err", limits, wall)
            for side, j in jailed.items()
        }
        tests = {i for i, unit in enumerate(plan) if unit["kind"] == "test"}
        passed = {int(w) for line in report.splitlines() for w in line.split()[1:2] if line.startswith("pass ")}
        return CodeScore(len(passed & tests), len(tests), results["solution"], results["judge"])
    finally:
        for fd in list(pipes):
            _close(pipes, fd)
        shutil.rmtree(workdir, ignore_errors=True)


def _pipe(pipes: list[int]) -> tuple[int, int]:
    read, write = os.pipe()
    pipes += [read, write]
    return read, write


def _close(pipes: list[int], fd: int) -> None:
    pipes.remove(fd)
    os.close(fd)


def _read_report(fd: int, deadline: float) -> str:
    """What the judge wrote on the report pipe until it closed it or ``deadline`` passed."""
    chunks = []
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _result(jailed: Jailed, timed_out: bool, out: Path, err: Path, limits: SandboxLimits, wall: float) -> SandboxResult:
    status = jailed.status(timed_out, out, err, limits.output_kb << 10)
    return SandboxResult(status, jailed.process.returncode, output_tail(out), output_tail(err), wall)
