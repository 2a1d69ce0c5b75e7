"""The speed guard: the default run of this tree against a pinned reference commit, alternating.

    flock /tmp/bench.lock .venv/bin/python benchmarks/regression.py                 # sync and async η=1
    flock /tmp/bench.lock .venv/bin/python benchmarks/regression.py --ref 735dfd2 --repeats 5
    flock /tmp/bench.lock .venv/bin/python benchmarks/regression.py --ref 1ca89f0 --variants sync  # the old sync loop

For each variant of ``sluice bench e2e`` (default: ``sync`` and ``async η=1``, 30 steps) it runs
the reference commit (checked out into a temporary worktree, its ``src/`` first on
``PYTHONPATH``) and this tree one after the other, ``--repeats``
times, so that both sides see the same machine; it reports the medians of trained tokens per
second of loop and of CPU seconds per step and their ratios (this tree / reference). It exits
non-zero when a variant's trained tok/s ratio falls below ``--min-ratio`` (0.95). Both trees train
one base model, passed as ``model.path`` (``--model``; default: this tree's embedded base model,
built first if missing): the embedded model's recipe changes between commits (the warm start's
recipe 2 starts the default task at 25 % instead of 38.6 %), and a reference that built its own
would train another workload. Run it before a
submission that touches the controller, rollout, trainer, queue or engines, and move
``REFERENCE`` forward only when a change is measured faster. Writes JSON; the test suite never
times anything (docs/testing.md, "The speed guard").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLUICE = ROOT / ".venv" / "bin" / "sluice"
REFERENCE = "e2c61bb"
"""The pinned reference: main before the CI-time work (issue 38 measured 735dfd2 against it)."""


def bench_once(src: Path, out: Path, overrides: list[str], variant: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}  # the tree's sources before the editable install
    runs = f"run.output_dir={out.with_suffix('')}"  # a run folder of its own: never an earlier run's checkpoints
    cmd = [str(SLUICE), "bench", "e2e", *overrides, runs, "--variants", variant, "--out", str(out)]
    subprocess.run(cmd, cwd=src.parent, env=env, check=True, stdout=subprocess.DEVNULL)
    row = json.loads(out.read_text())["rows"][0]
    steps = int(next((o.split("=", 1)[1] for o in overrides if o.startswith("run.steps=")), 30))
    cpu = row.get("cpu_s")
    roles = {f"cpu/{role}": s / steps for role, s in (row.get("cpu_by_role") or {}).items()}
    return {
        "tokens_per_s": row["trained_tokens"] / row["loop_s"],
        "loop_s": row["loop_s"],
        "cpu_s_per_step": (cpu / steps) if cpu is not None else float("nan"),
        **roles,
    }


def tree_base_model() -> Path:
    """This tree's embedded base model of the default task, built now if it is not cached."""
    from sluice.config import load_config
    from sluice.tasks import TASKS
    from sluice.tasks.base_model import ensure_base_model

    cfg = load_config(None, [])
    path = ensure_base_model(TASKS[cfg.task.name], ROOT / cfg.model.cache_dir, cfg.run.seed, cfg.task.eval_prompts)
    return Path(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default=REFERENCE, help="the reference commit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="sync,async η=1", help="`sluice bench e2e` rows, comma-separated")
    parser.add_argument("--min-ratio", type=float, default=0.95)
    parser.add_argument("--out", default="benchmarks/results/regression.json")
    parser.add_argument("--model", default=None, help="model.path of both trees (default: this tree's base model)")
    parser.add_argument("overrides", nargs="*", default=["run.steps=30"])
    args = parser.parse_args()
    model = Path(args.model) if args.model else tree_base_model()
    args.overrides = [f"model.path={model.absolute()}", *args.overrides]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {v: {"ref": [], "tree": []} for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        ref_tree = Path(tmp) / "ref"
        subprocess.run(["git", "worktree", "add", "--detach", str(ref_tree), args.ref], cwd=ROOT, check=True)
        (ref_tree / ".cache").symlink_to(ROOT / ".cache")  # the same embedded base model
        try:
            for k in range(args.repeats):
                for variant in variants:
                    for side, tree in (("ref", ref_tree), ("tree", ROOT)):
                        out = Path(tmp) / f"{side}-{variants.index(variant)}-{k}.json"
                        runs[variant][side].append(bench_once(tree / "src", out, args.overrides, variant))
                        got = runs[variant][side][-1]
                        print(f"repeat {k + 1} {variant} {side}: {got['tokens_per_s']:,.0f} tok/s, "
                              f"{got['cpu_s_per_step']:.2f} CPU-s/step", flush=True)  # fmt: skip
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(ref_tree)], cwd=ROOT, check=True)
    summary = {}
    print(f"\n| variant | ref {args.ref} tok/s | tree tok/s | tree / ref | ref CPU-s/step | tree CPU-s/step | ratio |")
    print("|---|---|---|---|---|---|---|")
    for variant, sides in runs.items():
        med = {s: {k: statistics.median(r[k] for r in rows) for k in ("tokens_per_s", "loop_s", "cpu_s_per_step")}
               for s, rows in sides.items()}  # fmt: skip
        speed = med["tree"]["tokens_per_s"] / med["ref"]["tokens_per_s"]
        cpu = med["tree"]["cpu_s_per_step"] / med["ref"]["cpu_s_per_step"]
        summary[variant] = {"medians": med, "tokens_per_s_ratio": speed, "cpu_ratio": cpu}
        print(f"| {variant} | {med['ref']['tokens_per_s']:,.0f} | {med['tree']['tokens_per_s']:,.0f} | {speed:.3f} "
              f"| {med['ref']['cpu_s_per_step']:.2f} | {med['tree']['cpu_s_per_step']:.2f} | {cpu:.3f} |")  # fmt: skip
        roles = sorted({k for rows in sides.values() for r in rows for k in r if k.startswith("cpu/")})
        for role in roles:  # where the CPU went: each process role's seconds per step (telemetry/cpu.py)
            ref, tree = (statistics.median(r.get(role, 0.0) for r in sides[s]) for s in ("ref", "tree"))
            print(f"|   {role.removeprefix('cpu/')} | | | | {ref:.3f} | {tree:.3f} | {tree - ref:+.3f} s |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    record = {"ref": args.ref, "tree": commit.stdout.strip(), "overrides": args.overrides, "runs": runs,
              "summary": summary}  # fmt: skip
    out.write_text(json.dumps(record, indent=2))
    slow = [v for v, s in summary.items() if s["tokens_per_s_ratio"] < args.min_ratio]
    print(f"wrote {out}" + (f"; below {args.min_ratio}: {', '.join(slow)}" if slow else ""))
    sys.exit(1 if slow else 0)


if __name__ == "__main__":
    main()
