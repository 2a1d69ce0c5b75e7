"""Do the slowest tests still catch a broken mechanism? Apply each one-line mutation of
``benchmarks/mutations.json`` to a scratch copy of ``src/`` and run the test it targets there
(docs/testing.md, "Run no more than the assertion needs").

    python benchmarks/mutations.py                 # every mutation, one after the other
    python benchmarks/mutations.py --only resume   # those whose test id contains "resume"

Each entry names a test id, a file under ``src/``, an exact text that occurs once in it, its
replacement (one line that breaks the mechanism the test guards) and what that breaks (a file under
``benchmarks/``, such as ``distflow/``, is mutated in a copy of ``benchmarks/``). The test
runs with the mutated copy first on ``PYTHONPATH`` (inherited by Ray workers, spawned ranks and
``sluice`` subprocesses); a mutation passes this check when the test *fails* (pytest exit code 1),
not when it errors out at import or collection. The working tree is never touched. Prints a table
and writes ``benchmarks/results/mutations.json``; exits non-zero when a mutation survives.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "benchmarks" / "mutations.json"


def mutate(scratch: Path, spec: dict) -> None:
    shutil.copytree(ROOT / "src", scratch / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    if spec["file"].startswith("benchmarks/"):  # benchmark-only code the tests import (distflow/, harness/)
        skip = shutil.ignore_patterns("__pycache__", "results")
        shutil.copytree(ROOT / "benchmarks", scratch / "benchmarks", ignore=skip)
    target = scratch / spec["file"]
    text = target.read_text()
    count = text.count(spec["old"])
    if count != 1:
        raise SystemExit(f"{spec['file']}: the text to mutate occurs {count} times, not once: {spec['old']!r}")
    target.write_text(text.replace(spec["old"], spec["new"]))


def last_failure_line(output: str) -> str:
    """The line pytest marks as the failure (``E   ...``), or its summary line."""
    errors = [line.strip() for line in output.splitlines() if line.startswith("E ")]
    if errors:
        return errors[0][:200]
    summary = [line for line in output.splitlines() if "failed" in line or "passed" in line]
    return summary[-1][:200] if summary else output.strip().splitlines()[-1][:200]


def check(spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="sluice-mutant-") as scratch:
        mutate(Path(scratch), spec)
        env = dict(os.environ)
        mutated = [f"{scratch}/src", f"{scratch}/benchmarks" if spec["file"].startswith("benchmarks/") else ""]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*mutated, env.get("PYTHONPATH")]))
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", spec["test"]]
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as timed_out:
            code, output = -1, f"timed out after {timeout:.0f} s: {(timed_out.stdout or b'')[-500:]!r}"
    return {
        **spec,
        "exit_code": code,
        "caught": code == 1,
        "seconds": round(time.perf_counter() - started, 1),
        "failure": last_failure_line(output),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", type=Path, default=SPECS, help="the mutations' JSON list")
    ap.add_argument("--only", default="", help="run the mutations whose test id contains this text")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mutations.json")
    args = ap.parse_args()
    specs = [s for s in json.loads(args.specs.read_text()) if args.only in s["test"]]
    results = []
    for spec in specs:
        result = check(spec, args.timeout)
        print(f"{'caught ' if result['caught'] else 'SURVIVED'} {result['seconds']:6.1f} s  {spec['test']}", flush=True)
        results.append(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print("\n| test | mutation (file: what it breaks) | caught | failure |\n|---|---|---|---|")
    for r in results:
        test = r["test"].split("::", 1)[1]
        print(f"| `{test}` | `{r['file']}`: {r['breaks']} | {'yes' if r['caught'] else '**no**'} | `{r['failure']}` |")
    sys.exit(0 if all(r["caught"] for r in results) else 1)


if __name__ == "__main__":
    main()
