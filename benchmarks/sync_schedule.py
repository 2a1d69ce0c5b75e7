"""The sync schedule on the one runtime against the old one-process sync loop, same machine, one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/sync_schedule.py [--old 1ca89f0] [--repeats 3]

``run.mode: sync`` used to be its own loop (``controller/sync_loop.py``: engines, chain and
buffer in the driver); it is now the barrier schedule of the pipeline's workers (``run.backend:
local``: the same process, the rollout worker on the event loop, the trainer in a thread). This
checks the move cost nothing: it checks the old commit out into a temporary worktree and runs
``sluice bench e2e --variants sync`` from it and from this tree alternately, ``--repeats`` times
each, and reports trained tokens per second of loop, the median of each side and their ratio
(target ≥ 0.95). ``--variant 'async η=1'`` compares another row the same way. Prints a table and
writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLUICE = ROOT / ".venv" / "bin" / "sluice"


def bench_once(src: Path, out: Path, overrides: list[str], variant: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}  # the tree's sources before the editable install
    cmd = [str(SLUICE), "bench", "e2e", *overrides, "--variants", variant, "--out", str(out)]
    subprocess.run(cmd, cwd=src.parent, env=env, check=True, stdout=subprocess.DEVNULL)
    row = json.loads(out.read_text())["rows"][0]
    return {"tokens_per_s": row["trained_tokens"] / row["loop_s"], "loop_s": row["loop_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="1ca89f0", help="commit with the old one-process sync loop")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", default="sync", help="the `sluice bench e2e` row to compare, e.g. 'async η=1'")
    parser.add_argument("--out", default="benchmarks/results/sync_schedule.json")
    parser.add_argument("overrides", nargs="*", default=["run.steps=30"])
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), args.old], cwd=ROOT, check=True)
        (old_tree / ".cache").symlink_to(ROOT / ".cache")  # the same embedded base model
        try:
            for k in range(args.repeats):
                for side, tree in (("old", old_tree), ("new", ROOT)):
                    out = Path(tmp) / f"{side}{k}.json"
                    runs[side].append(bench_once(tree / "src", out, args.overrides, args.variant))
                    print(f"repeat {k + 1} {side}: {runs[side][-1]['tokens_per_s']:,.0f} trained tok/s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=True)
    median = {side: statistics.median(r["tokens_per_s"] for r in rows) for side, rows in runs.items()}
    print("\n| side | trained tok/s per repeat | median |\n|---|---|---|")
    for side, rows in runs.items():
        each = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in rows)
        print(f"| {side} | {each} | {median[side]:,.0f} |")
    ratio = median["new"] / median["old"]
    print(f"\nnew / old = {ratio:.3f} (target >= 0.95)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"old": args.old, "variant": args.variant, "overrides": args.overrides, "runs": runs, "ratio": ratio}
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
