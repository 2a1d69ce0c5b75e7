"""A pytest plugin that says where a test session's wall time goes (``benchmarks/ci_time.py``).

Loaded with ``-p ci_time_plugin`` (``benchmarks/`` on ``PYTHONPATH``); writes one JSON file to
``$SLUICE_CI_TIME_OUT`` at the end of the session: every test's setup / call / teardown seconds,
and per test the seconds spent starting and stopping Ray (``ray.init`` / ``ray.shutdown`` in the
pytest process), the lifetimes of the subprocesses it started (``subprocess.Popen``: ``sluice train``
drivers apart from the rest, such as reward pools, sandboxes and agents; interpreter, torch and
Ray start-up included) and the seconds spent building tiny models and warm starts
(``tests/tiny.py`` and ``sluice.tasks``' builders). It changes nothing a test does; it only times.
It does not see inside Ray actors or the processes a test spawns. Under pytest-xdist each worker
times its own tests and the controller writes the file.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import pytest

_current: list[str] = [""]  # the running test's node id ("" between tests: collection, session fixtures)
_spent: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
_phases: dict[str, dict[str, float]] = defaultdict(dict)
_outcomes: dict[str, str] = {}
_inside: dict[str, bool] = defaultdict(bool)  # a timed builder of this kind is running (this thread)
_reported: dict[str, dict[str, float]] = {}  # node id -> its timed costs, from its teardown report


def _charge(kind: str, seconds: float, count: bool = True) -> None:
    bucket = _spent[_current[0]]
    bucket[kind] += seconds
    if count:
        bucket[kind + "_n"] += 1


def _timed(kind: str, fn: Any) -> Any:
    if getattr(fn, "_ci_timed", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _inside[kind]:  # a timed builder called by another one (a warm start's own SFT): counted once
            return fn(*args, **kwargs)
        _inside[kind] = True
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _inside[kind] = False
            _charge(kind, time.perf_counter() - started)

    wrapper._ci_timed = True  # type: ignore[attr-defined]
    return wrapper


def _patch_ray() -> None:
    try:
        import ray
    except ImportError:
        return
    timed_init = _timed("ray_start", ray.init)

    @functools.wraps(ray.init)
    def init(*args: Any, **kwargs: Any) -> Any:
        _in_ray_start[0] = True
        try:
            return timed_init(*args, **kwargs)
        finally:
            _in_ray_start[0] = False

    ray.init = init
    ray.shutdown = _timed("ray_stop", ray.shutdown)


def _patch_builders() -> None:
    """The tiny-model and warm-start builders, wherever a test module reaches them."""
    import importlib

    for module_name, names, kind in (
        ("tiny", ("tiny_llama", "save_tiny_task_model"), "model_build"),
        ("sluice.tasks.tiny_model", ("build_tiny_llama",), "model_build"),
        ("sluice.tasks.base_model", ("ensure_base_model",), "warm_start"),
        ("sluice.tasks.warm_start", ("sft_warm_start",), "warm_start"),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in names:
            original = getattr(module, name, None)
            if original is None:
                continue
            timed = _timed(kind, original)
            for holder in list(sys.modules.values()):  # test modules that imported it by name
                # their own namespace only: getattr would run a lazy module's __getattr__ (imports)
                if getattr(holder, "__dict__", {}).get(name) is original:
                    setattr(holder, name, timed)


_popen_init = subprocess.Popen.__init__
_popen_wait = subprocess.Popen._wait  # type: ignore[attr-defined]
_popen_poll = subprocess.Popen._internal_poll  # type: ignore[attr-defined]
_in_ray_start = [False]  # Ray's own daemons (started inside ray.init) are Ray start-up, not a test's


def _init(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
    if not _in_ray_start[0]:
        self._ci_started = time.perf_counter()  # type: ignore[attr-defined]
        self._ci_owner = _current[0]  # type: ignore[attr-defined]
        argv = args[0] if args else kwargs.get("args", ())
        argv = [argv] if isinstance(argv, (str, bytes)) else list(argv)
        cli = any(str(a).endswith(("sluice.cli", "bin/sluice")) for a in argv)
        self._ci_kind = "subprocess_cli" if cli else "subprocess"  # type: ignore[attr-defined]
    _popen_init(self, *args, **kwargs)


def _ended(self: subprocess.Popen, code: Any) -> Any:
    started = getattr(self, "_ci_started", None)
    if started is not None and code is not None:
        self._ci_started = None  # type: ignore[attr-defined]
        bucket = _spent[self._ci_owner]  # type: ignore[attr-defined]
        kind = self._ci_kind  # type: ignore[attr-defined]
        bucket[kind] += time.perf_counter() - started
        bucket[kind + "_n"] += 1
    return code


def _wait(self: subprocess.Popen, *args: Any, **kwargs: Any) -> Any:
    return _ended(self, _popen_wait(self, *args, **kwargs))


def _poll(self: subprocess.Popen, *args: Any, **kwargs: Any) -> Any:
    return _ended(self, _popen_poll(self, *args, **kwargs))


def pytest_configure(config: Any) -> None:
    subprocess.Popen.__init__ = _init  # type: ignore[method-assign]
    subprocess.Popen._wait = _wait  # type: ignore[attr-defined]
    subprocess.Popen._internal_poll = _poll  # type: ignore[attr-defined]
    _patch_ray()


def pytest_collection_finish(session: Any) -> None:
    _patch_builders()  # after collection: the test modules have imported the builders' modules


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _current[0] = nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    """The test's timed costs ride on its teardown report: under pytest-xdist the worker that ran
    it measured them, and only reports reach the controller."""
    outcome = yield
    if call.when == "teardown":
        spent = _spent.pop(item.nodeid, {})
        outcome.get_result().user_properties.append(("ci_time", dict(spent)))


def pytest_runtest_logreport(report: Any) -> None:
    _phases[report.nodeid][report.when] = report.duration
    for key, value in report.user_properties:
        if key == "ci_time":
            _reported[report.nodeid] = value
    if report.when == "call" or report.outcome != "passed":
        _outcomes[report.nodeid] = report.outcome


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _current[0] = ""


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    out = os.environ.get("SLUICE_CI_TIME_OUT")
    if not out or hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes
        return
    tests = []
    for nodeid, phases in _phases.items():
        spent = _reported.get(nodeid, {})
        tests.append({"id": nodeid, "outcome": _outcomes.get(nodeid, "passed"),
                      "seconds": round(sum(phases.values()), 3),
                      **{k: round(v, 3) for k, v in phases.items()},
                      **{k: round(v, 3) for k, v in spent.items()}})  # fmt: skip
    outside = {k: round(v, 3) for k, v in _spent.get("", {}).items()}
    with open(out, "w") as fh:
        json.dump({"exitstatus": int(exitstatus), "tests": tests, "outside_tests": outside}, fh, indent=1)
