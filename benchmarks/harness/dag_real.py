"""Real training, single vs multi controller: the rows of ``benchmarks/dag.py --real``.

Each row is one ``sluice train`` of the default task (``run.backend=ray``, ``run.mode=async``,
default η) in a subprocess of its own (so a fresh Ray each), started as
``flock LOCK timeout T sluice train ...``: one row per acquisition of the shared benchmark lock.
Two sections: ``scaling`` (a short run: ``single`` with its one rollout worker, ``multi`` with
1, 2 and 4 rollout workers) and ``acceptance`` (the full default length, ``single`` and ``multi``
with 2 workers, one row per seed). A row is read back from the run's ``metrics.jsonl`` and
``trace.json``: the loop time (the base evaluation's record to the ``cpu`` record written when
the loop ends), the periodic evaluations inside it (the trace's ``eval`` spans), trained tokens,
final accuracy, the driver's sample bytes and the CPU seconds by role.

Deliberately not here: the synthetic data-path table (``benchmarks/dag.py``), any assertion
(the acceptance numbers are reported, not checked), and changes to the runs' configs beyond
the overrides each row names.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from staleness import read_records

ROOT = Path(__file__).resolve().parents[2]
LOCK = "/tmp/bench.lock"
ROLES = {
    "driver": ("driver",),
    "rollout": ("RolloutWorker", "ShardRolloutWorker"),
    "trainer": ("TrainerWorker",),
    "gate": ("StepGate",),
    "queue": ("StorageActor", "ControllerActor"),
}
"""Table roles -> the ``cpu`` record's process roles (``telemetry/cpu.py``); the rest is ``other``
(Ray's daemons, the reward pool, the weight registry)."""


@dataclass(frozen=True)
class RowSpec:
    section: str  # "scaling" | "acceptance"
    controller: str  # "single" | "multi"
    workers: int
    steps: int
    eval_every: int
    seed: int
    repeat: int = 0  # a scaling row run again (same config, its own run folder)

    @property
    def name(self) -> str:
        again = f"_r{self.repeat}" if self.repeat else ""
        return f"{self.section}_{self.controller}_w{self.workers}_n{self.steps}_s{self.seed}{again}"

    def overrides(self, runs_dir: Path) -> list[str]:
        return [
            "run.backend=ray",
            "run.mode=async",
            f"run.controller={self.controller}",
            f"resources.rollout.workers={self.workers}",
            f"run.steps={self.steps}",
            f"run.eval_every={self.eval_every}",
            f"run.seed={self.seed}",
            "run.progress=false",
            f"run.output_dir={runs_dir}",
            f"run.name={self.name}",
        ]


def plan(scaling_steps: int, steps: int, seeds: int, quick: bool, repeats: int = 1) -> list[RowSpec]:
    """Every row, in run order: the scaling section (``repeats`` rounds of single and multi with
    1, 2, 4 workers), then per seed single and multi (2 workers)."""
    if quick:
        scaling_steps, steps, seeds, repeats = 3, 3, 1, 1
    configs = (("single", 1), ("multi", 1), ("multi", 2), ("multi", 4))
    n = scaling_steps
    scaling = [RowSpec("scaling", c, w, n, n, 0, r) for r in range(repeats) for c, w in configs]
    if quick:  # the acceptance rows are single and multi already: one multi row here
        scaling = scaling[1:2]
    every = min(20, steps)
    pairs = (("single", 1), ("multi", 2))
    return scaling + [RowSpec("acceptance", c, w, steps, every, s) for s in range(seeds) for c, w in pairs]


def sluice_argv(spec: RowSpec, runs_dir: Path) -> list[str]:
    """The ``sluice train`` command of one row (this interpreter's environment)."""
    return [str(Path(sys.executable).parent / "sluice"), "train", *spec.overrides(runs_dir)]


def reproduce(spec: RowSpec, runs_dir: Path) -> str:
    """The row's command as a reader would type it from the repository root."""
    return "PYTHONPATH=$PWD/src .venv/bin/sluice train " + shlex.join(spec.overrides(runs_dir))


def run_row(spec: RowSpec, runs_dir: Path, timeout_s: int) -> dict[str, Any]:
    """Run one row under the benchmark lock and read it back; raises when the run failed."""
    run_dir = runs_dir / spec.name
    runs_dir.mkdir(parents=True, exist_ok=True)
    log = runs_dir / f"{spec.name}.log"
    argv = ["flock", LOCK, "timeout", str(timeout_s), *sluice_argv(spec, runs_dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    started = time.time()
    with log.open("w") as out:
        done = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"{spec.name}: exit {done.returncode} (log {log}):\n{tail}")
    row = summarise(spec, run_dir)
    return row | {"command": reproduce(spec, runs_dir), "wall_s_with_lock_wait": round(time.time() - started, 1)}


def summarise(spec: RowSpec, run_dir: Path) -> dict[str, Any]:
    """One table row from a finished run's ``metrics.jsonl`` and ``trace.json``."""
    records = read_records(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    cpu = next(r for r in records if r["kind"] == "cpu")
    driver = next(r for r in records if r["kind"] == "driver")
    shards = next((r for r in records if r["kind"] == "shards"), None)
    groups = next(r for r in records if r["kind"] == "fates")["groups_trained"]
    loop_start = evals[0]["elapsed_s"] if evals else train[0]["elapsed_s"] - train[0]["step_s"]
    loop_s = cpu["elapsed_s"] - loop_start
    eval_s = periodic_eval_seconds(run_dir / "trace.json")
    trained = sum(r["trained_tokens"] for r in train)
    return {
        "name": spec.name,
        **asdict(spec),
        "steps_trained": len(train),
        "loop_s": round(loop_s, 2),
        "periodic_eval_s": round(eval_s, 2),
        "train_s": round(loop_s - eval_s, 2),
        "trained_tokens": trained,
        "trained_tokens_per_s": round(trained / max(loop_s - eval_s, 1e-9), 1),
        "base_accuracy": evals[0]["accuracy"] if evals else None,
        "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "accuracy_curve": [[r["step"], r["accuracy"]] for r in evals],
        "driver_sample_bytes": driver["sample_bytes"],
        "driver_sample_bytes_per_step": driver["sample_bytes"] / max(len(train), 1),
        "groups_trained": groups,
        "samples_logged": _lines(run_dir / "samples.jsonl"),
        "driver_sample_bytes_per_trained_group": driver["sample_bytes"] / max(groups, 1),
        "cpu_s": cpu_by_role(cpu),
        "cpu_records": {k: v for k, v in cpu.items() if k.startswith("cpu_")},
        "shards": {k: v for k, v in shards.items() if k.startswith("shard")} if shards else None,
        "run_dir": str(run_dir),
    }


def _lines(path: Path) -> int:
    """Records in a JSONL file (0 when it does not exist)."""
    return len(path.read_text().splitlines()) if path.exists() else 0


def reread(row: dict[str, Any]) -> dict[str, Any]:
    """A kept row summarised anew from its run folder (after this module learned a new column)."""
    keys = ("section", "controller", "workers", "steps", "eval_every", "seed")
    fresh = summarise(RowSpec(*(row[k] for k in keys), row.get("repeat", 0)), Path(row["run_dir"]))
    return row | fresh


def cpu_by_role(cpu: dict[str, Any]) -> dict[str, float]:
    """The ``cpu`` record's seconds summed into the table's roles, ``other`` and ``total``."""
    out = {role: 0.0 for role in (*ROLES, "other")}
    for key, seconds in cpu.items():
        if not key.startswith("cpu_") or key == "cpu_total":
            continue
        name = key.removeprefix("cpu_")
        role = next((r for r, names in ROLES.items() if name in names), "other")
        out[role] += seconds
    return {k: round(v, 2) for k, v in out.items()} | {"total": cpu["cpu_total"]}


def periodic_eval_seconds(trace: Path) -> float:
    """Seconds of the evaluations between the base and the final one: the trace's ``eval`` spans
    merged into intervals (workers evaluating at once count once), less the first and the last."""
    if not trace.exists():
        return 0.0
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "eval" and "dur" in e)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(end - start for start, end in merged[1:-1]) / 1e6


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def acceptance(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median final accuracy and trained tokens/s per controller over the acceptance seeds,
    multi − single in points and multi / single in throughput."""
    out: dict[str, Any] = {}
    for c in ("single", "multi"):
        mine = [r for r in rows if r["section"] == "acceptance" and r["controller"] == c]
        out[c] = {
            "seeds": [r["seed"] for r in mine],
            "final_accuracy": [r["final_accuracy"] for r in mine],
            "median_accuracy": _median([r["final_accuracy"] for r in mine if r["final_accuracy"] is not None]),
            "median_tokens_per_s": _median([r["trained_tokens_per_s"] for r in mine]),
        }
    s, m = out["single"], out["multi"]
    if s["median_accuracy"] is not None and m["median_accuracy"] is not None:
        out["multi_minus_single_points"] = round(100 * (m["median_accuracy"] - s["median_accuracy"]), 2)
        out["within_3_points"] = abs(out["multi_minus_single_points"]) <= 3
    if s["median_tokens_per_s"] and m["median_tokens_per_s"]:
        out["tokens_per_s_ratio"] = round(m["median_tokens_per_s"] / s["median_tokens_per_s"], 3)
    return out


def _acc(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f} %"


def _bytes(n: float) -> str:
    return f"{n / 2**10:,.1f} KiB" if n >= 2**10 else f"{n:.0f} B"


def scaling_medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (controller, rollout workers) of the scaling section: its repeats' median loop seconds
    and trained tokens/s, and that throughput over single's."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in (r for r in rows if r["section"] == "scaling"):
        cells.setdefault((r["controller"], r["workers"]), []).append(r)
    out = [
        {
            "controller": c,
            "workers": w,
            "repeats": len(group),
            "median_loop_s": statistics.median(r["loop_s"] for r in group),
            "median_tokens_per_s": statistics.median(r["trained_tokens_per_s"] for r in group),
        }
        for (c, w), group in cells.items()
    ]
    single = next((m["median_tokens_per_s"] for m in out if m["controller"] == "single"), None)
    return [m | {"vs_single": round(m["median_tokens_per_s"] / single, 3) if single else None} for m in out]


def format_scaling(rows: list[dict[str, Any]]) -> str:
    head = (
        "| controller | rollout workers | repeat | loop s | trained tok/s | final acc | driver sample bytes "
        "(per step; per trained group; samples logged) | CPU-s driver / rollout / trainer / gate / queue / other |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    scaling = [r for r in rows if r["section"] == "scaling"]
    for r in sorted(scaling, key=lambda r: (r["controller"] != "single", r["workers"], r.get("repeat", 0))):
        cpu = r["cpu_s"]
        roles = " / ".join(f"{cpu[k]:.1f}" for k in ("driver", "rollout", "trainer", "gate", "queue", "other"))
        lines.append(
            f"| {r['controller']} | {r['workers']} | {r.get('repeat', 0)} | {r['loop_s']:.1f} "
            f"| {r['trained_tokens_per_s']:,.0f} | {_acc(r['final_accuracy'])} "
            f"| {_bytes(r['driver_sample_bytes'])} ({_bytes(r['driver_sample_bytes_per_step'])}; "
            f"{r['driver_sample_bytes_per_trained_group']:.0f} B; {r.get('samples_logged', '–')}) | {roles} |"
        )
    lines += ["", "| controller | rollout workers | repeats | median loop s | median trained tok/s | vs single |"]
    lines.append("|---|---|---|---|---|---|")
    for m in scaling_medians(rows):
        ratio = "–" if m["vs_single"] is None else f"{m['vs_single']:.2f}×"
        lines.append(
            f"| {m['controller']} | {m['workers']} | {m['repeats']} | {m['median_loop_s']:.1f} "
            f"| {m['median_tokens_per_s']:,.0f} | {ratio} |"
        )
    return "\n".join(lines)


def format_acceptance(rows: list[dict[str, Any]]) -> str:
    head = (
        "| controller | rollout workers | seed | base acc | final acc | loop s (eval s) | trained tok/s "
        "| driver sample bytes (per step) | CPU-s total |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in (r for r in rows if r["section"] == "acceptance"):
        lines.append(
            f"| {r['controller']} | {r['workers']} | {r['seed']} | {_acc(r['base_accuracy'])} "
            f"| {_acc(r['final_accuracy'])} | {r['loop_s']:.1f} ({r['periodic_eval_s']:.1f}) "
            f"| {r['trained_tokens_per_s']:,.0f} | {_bytes(r['driver_sample_bytes'])} "
            f"({_bytes(r['driver_sample_bytes_per_step'])}) | {r['cpu_s']['total']:.1f} |"
        )
    summary = acceptance(rows)
    for c in ("single", "multi"):
        s = summary[c]
        if s["seeds"]:
            lines.append(
                f"| **{c} median** | | {len(s['seeds'])} seeds | | **{_acc(s['median_accuracy'])}** | "
                f"| **{s['median_tokens_per_s']:,.0f}** | | |"
            )
    if "multi_minus_single_points" in summary:
        lines.append("")
        lines.append(f"multi − single (median final accuracy): {summary['multi_minus_single_points']:+.1f} points")
    if "tokens_per_s_ratio" in summary:
        lines.append(f"multi / single (median trained tokens/s): {summary['tokens_per_s_ratio']:.2f}×")
    return "\n".join(lines)
