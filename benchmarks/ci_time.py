"""Where CI's time goes: run each target of ``.ci/run`` and print one table (issue: CI time).

    python benchmarks/ci_time.py                       # every target, in this tree
    python benchmarks/ci_time.py --clone /tmp/ci       # a fresh clone of HEAD (venvs built too)
    python benchmarks/ci_time.py --targets test-quick test
    python benchmarks/ci_time.py --show benchmarks/results/ci_time.json
    python benchmarks/ci_time.py --show RESULT.json --durations tests/durations.json

For each target: its test count, wall seconds, the summed seconds of its tests, and of those the
seconds spent starting and stopping Ray in the pytest process, in the lifetimes of the
subprocesses tests start (``sluice train`` runs, agents; interpreter and torch start-up
included), and building tiny models and warm starts (``benchmarks/ci_time_plugin.py`` measures
them); then the 20 slowest tests over all targets. Writes the JSON (``--out``). It measures only:
it never changes what a target runs. ``--durations`` writes each test's seconds for
``tests/conftest.py``, which starts the longest test files first (two workers then end
together); take them from a ``--clone`` run, where every cache is built from nothing as in CI.
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
TARGETS = ["venv", "test", "test-scale", "test-faults", "vllm-venv", "vllm-test"]
"""``.ci/run``'s targets in its order (``make test`` includes lint and typecheck)."""
PYTEST_TARGETS = {"test-quick", "test", "test-scale", "test-faults", "vllm-test"}
KINDS = ("ray_start", "ray_stop", "subprocess_cli", "subprocess", "model_build", "warm_start")


def clone(into: Path) -> Path:
    """A fresh clone of this checkout's HEAD at ``into/main``, with ``../shared`` beside it."""
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(into / "main")], check=True)
    shared = ROOT.parent / "shared"
    if shared.exists():
        (into / "shared").symlink_to(shared)
    return into / "main"


def run_target(tree: Path, target: str, scratch: Path) -> dict:
    out = scratch / f"{target}.json"
    env = dict(os.environ)
    if target in PYTEST_TARGETS:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), env.get("PYTHONPATH")]))
        env["PYTEST_ADDOPTS"] = (env.get("PYTEST_ADDOPTS", "") + " -p ci_time_plugin").strip()
        env["SLUICE_CI_TIME_OUT"] = str(out)
    started = time.perf_counter()
    done = subprocess.run(["make", "-C", str(tree), target], env=env)
    row: dict = {"target": target, "rc": done.returncode, "wall_s": round(time.perf_counter() - started, 1)}
    if out.exists():
        data = json.loads(out.read_text())
        tests = data["tests"]
        row["tests"] = len(tests)
        row["failed"] = sum(t["outcome"] == "failed" for t in tests)
        row["test_s"] = round(sum(t["seconds"] for t in tests), 1)
        outside = data["outside_tests"]
        for kind in KINDS:
            row[kind + "_s"] = round(sum(t.get(kind, 0.0) for t in tests) + outside.get(kind, 0.0), 1)
            row[kind + "_n"] = int(sum(t.get(kind + "_n", 0) for t in tests) + outside.get(kind + "_n", 0))
        row["per_test"] = tests
    print(f"# {target}: rc {row['rc']}, {row['wall_s']} s", flush=True)
    return row


def table(rows: list[dict]) -> str:
    head = "| target | tests | wall s | tests' s | Ray start+stop s (n) | `sluice` subprocess s (n) "
    lines = [head + "| other subprocess s (n) | model build s (n) | warm start s (n) |", "|" + "---|" * 9]
    for r in rows:
        if "tests" not in r:
            lines.append(f"| {r['target']} | – | {r['wall_s']} | – | – | – | – | – | – |")
            continue
        ray_s = round(r["ray_start_s"] + r["ray_stop_s"], 1)
        lines.append(
            f"| {r['target']} | {r['tests']} | {r['wall_s']} | {r['test_s']} | {ray_s} ({r['ray_start_n']}) "
            f"| {r['subprocess_cli_s']} ({r['subprocess_cli_n']}) | {r['subprocess_s']} ({r['subprocess_n']}) "
            f"| {r['model_build_s']} ({r['model_build_n']}) "
            f"| {r['warm_start_s']} ({r['warm_start_n']}) |"
        )
    total = round(sum(r["wall_s"] for r in rows), 1)
    lines.append(f"| all | {sum(r.get('tests', 0) for r in rows)} | {total} | | | | | | |")
    slow = sorted(((t["seconds"], r["target"], t) for r in rows for t in r.get("per_test", [])), key=lambda x: -x[0])
    lines += ["", "| slowest tests | target | s | Ray s | `sluice` s | other subprocess s | model s |"]
    lines.append("|---|---|---|---|---|---|---|")
    for seconds, target, t in slow[:20]:
        ray_s = round(t.get("ray_start", 0) + t.get("ray_stop", 0), 1)
        lines.append(
            f"| `{t['id']}` | {target} | {seconds:.1f} | {ray_s} | {t.get('subprocess_cli', 0):.1f} "
            f"| {t.get('subprocess', 0):.1f} "
            f"| {t.get('model_build', 0) + t.get('warm_start', 0):.1f} |"
        )
    return "\n".join(lines)


def write_durations(rows: list[dict], path: Path | None) -> None:
    """Each passed test's seconds (setup + call + teardown), by id, merged into ``path``'s."""
    if path is None:
        return
    known = json.loads(path.read_text()) if path.exists() else {}
    for row in rows:
        known.update({t["id"]: round(t["seconds"], 2) for t in row.get("per_test", []) if t["outcome"] == "passed"})
    path.write_text(json.dumps(dict(sorted(known.items())), indent=0) + "\n")
    print(f"wrote {len(known)} durations to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=None, help=f"make targets (default: {' '.join(TARGETS)})")
    ap.add_argument("--clone", type=Path, default=None, help="run in a fresh clone of HEAD made here")
    ap.add_argument("--tree", type=Path, default=None, help="run in this checkout (a clone made before)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ci_time.json")
    ap.add_argument("--show", type=Path, default=None, help="print the table of a JSON written before")
    ap.add_argument("--durations", type=Path, default=None, help="write {test id: seconds} here (tests/durations.json)")
    args = ap.parse_args()
    if args.show:
        rows = json.loads(args.show.read_text())["rows"]
        print(table(rows))
        write_durations(rows, args.durations)
        return
    tree = clone(args.clone) if args.clone else (args.tree or ROOT)
    targets = args.targets or (TARGETS if args.clone else [t for t in TARGETS if "venv" not in t])
    with tempfile.TemporaryDirectory() as scratch:
        rows = [run_target(tree, target, Path(scratch)) for target in targets]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"commit": commit.stdout.strip(), "fresh_clone": bool(args.clone),
                                    "rows": rows}, indent=1))  # fmt: skip
    print(table(rows))
    write_durations(rows, args.durations)
    sys.exit(max(r["rc"] for r in rows))


if __name__ == "__main__":
    main()
