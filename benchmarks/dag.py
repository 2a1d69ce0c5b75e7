"""Multi- vs single-controller: real training first (``--real``, the default), then the DAG
runtime's synthetic data path (``--synthetic``).

**Real training** (``harness/dag_real.py``): the default task on Ray, ``run.mode=async``, each
row a ``sluice train`` in its own subprocess under ``flock /tmp/bench.lock`` (one row per lock):
a scaling table (``--scaling-steps`` steps: single, and multi with 1, 2 and 4 rollout workers)
and an acceptance table (``--steps`` steps, single and multi with 2 workers, ``--seeds`` seeds;
median final accuracy, multi − single, multi / single trained tokens/s). Writes
``benchmarks/results/dag_real.json`` after every row (``--quick``: ``dag_real_quick.json``);
``--resume`` keeps its finished rows, ``--repeats`` runs the scaling rows more than once.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/dag.py [--quick] [--resume] [--seeds 3] [--steps 60]

**Synthetic data path**: multi-controller (workers move their own rows through the TransferQueue)
against the single-controller variant (the driver gathers every generated row and scatters each
node's shards by value), one run, same DAG, same node functions.

The DAG: ``gen`` (W/2 workers, ``synthetic_generate``: int32 token rows, no model) → ``score``
(W/2 workers, ``token_checksum``: reads every token it gets) in separate pools; each step is 16
groups × 4 samples; W ∈ {2, 4, 8} workers, 1k → 32k tokens per sample. Both variants run η = 0
(a step's rows are all generated before they are scored), so only the data path differs. Time is
the wall time of ``run()`` after every actor is up and has warmed its data path (``ready()``), over
``--steps`` steps; the driver's bytes are counted at its transport. Every run's checksums are
verified against the generator's formula. Each variant runs in a fresh Ray session. Beside the
time, each row has the CPU seconds per step every kind of process burnt during ``run()`` (from
``/proc``: the driver, the DAG workers, the queue's storage units and controllers, the gate, Ray's
own processes): on a machine with fewer cores than processes, a step cannot take less than its CPU
over the core count.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/dag.py --synthetic [--quick] [--cells 8x32768,2x1024]

Prints a table and writes ``benchmarks/results/dag.json`` (``--cells`` implies ``--synthetic``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import ray
from distflow.data_nodes import SYNTHETIC_GENERATE, TOKEN_CHECKSUM, IndexPrompts
from distflow.runtime import MultiControllerRun, SingleControllerRun
from distflow.worker import RuntimeSettings
from harness import dag_real
from harness.report import write_results

from sluice.dag import compile_dag, parse_dag

GROUPS, GROUP_SIZE = 16, 4
OUT = Path(__file__).resolve().parent / "results" / "dag.json"
REAL_OUT = OUT.with_name("dag_real.json")


def dag(workers: int, tokens: int) -> dict:
    half = max(1, workers // 2)
    return {
        "name": "data_path",
        "nodes": [
            {"id": "gen", "role": "rollout", "type": "generate", "reads": ["prompt"], "writes": ["response_ids"],
             "function": SYNTHETIC_GENERATE, "parallel": half, "resources": {"pool": "gen"},
             "options": {"group_size": GROUP_SIZE, "tokens": tokens}},
            {"id": "score", "role": "reward", "type": "compute", "reads": ["response_ids"], "writes": ["checksum"],
             "function": TOKEN_CHECKSUM, "parallel": half, "resources": {"pool": "score"}},
        ],
    }  # fmt: skip


def expected_checksum(row: int, tokens: int) -> int:
    return int(((np.arange(tokens, dtype=np.int64) + row) % 50_000).sum())


ROLES = {"ray::DagWorker": "workers", "ray::StorageActor": "storage", "ray::ControllerActor": "controllers",
         "ray::ServedGate": "gate"}  # fmt: skip


def cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of this machine's processes, by role (empty where there is no ``/proc``)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")[0].decode(errors="replace").strip()
        except OSError:  # the process ended meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick
        role = "driver" if int(pid) == os.getpid() else ROLES.get(cmd, "ray" if "ray" in cmd else "other")
        out[role] = out.get(role, 0.0) + seconds
    return out


def measure(kind: type, workers: int, tokens: int, steps: int) -> dict:
    plan = compile_dag(parse_dag(dag(workers, tokens)), "disaggregated")
    settings = RuntimeSettings(GROUPS, GROUP_SIZE, steps, IndexPrompts(GROUPS * steps), max_staleness=0)
    run = kind(plan, settings, storage_units=max(1, workers // 2))
    try:
        run.ready()  # every actor is up: the clock measures the data path
        before = run.transport.counts.total
        cpu_before = cpu_by_role()
        started = time.perf_counter()
        result = run.run()
        elapsed = time.perf_counter() - started
        cpu_after = cpu_by_role()
        if kind is MultiControllerRun:
            run.queue.register_task("verify", ["checksum"])
            batch = run.queue.get("verify", ["checksum"], 1 << 20, timeout=10)
            got = dict(zip(batch.indices, batch.columns["checksum"], strict=True))
        else:
            got = None
    finally:
        run.close()
    rows = steps * GROUPS * GROUP_SIZE
    if got is not None:
        wrong = [r for r in range(0, rows, 37) if got.get(r) != expected_checksum(r, tokens)]
        if len(got) != rows or wrong:
            raise AssertionError(f"multi-controller checksums wrong: {len(got)} rows, rows {wrong[:5]} differ")
    return {
        "variant": "multi" if kind is MultiControllerRun else "single",
        "workers": workers,
        "tokens": tokens,
        "steps": steps,
        "seconds": elapsed,
        "tokens_per_s": rows * tokens / elapsed,
        "driver_bytes": result.driver.total - before,
        "driver_sample_bytes": result.driver.sample,
        "step_bytes": rows // steps * tokens * 4,
        "step_ms": elapsed / steps * 1000,
        "cpu_ms_per_step": {
            role: round((cpu_after[role] - cpu_before.get(role, 0.0)) / steps * 1000, 2)
            for role in sorted(cpu_after)
            if cpu_after[role] > cpu_before.get(role, 0.0)
        },
    }


def in_own_session(kind: type, workers: int, tokens: int, steps: int) -> dict:
    """``measure`` in a Ray session of its own: a variant does not inherit the memory state the
    other left behind (after the single-controller run's object-store traffic, the next run's
    page faults cost several times as much CPU here)."""
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             object_store_memory=1024**3)  # fmt: skip
    try:
        return measure(kind, workers, tokens, steps)
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="real training runs (the default)")
    parser.add_argument("--synthetic", action="store_true", help="the synthetic data-path table instead")
    parser.add_argument("--quick", action="store_true", help="real: 3 steps, 1 seed, 3 rows; synthetic: 4 cells")
    parser.add_argument("--steps", type=int, default=None, help="real: acceptance steps (60); synthetic: 10")
    parser.add_argument("--scaling-steps", type=int, default=20, help="real: steps of the scaling rows")
    parser.add_argument("--seeds", type=int, default=3, help="real: acceptance seeds per controller")
    parser.add_argument("--repeats", type=int, default=1, help="real: rounds of the scaling rows")
    parser.add_argument("--resume", action="store_true", help="real: keep the finished rows --out holds")
    parser.add_argument("--reread", action="store_true", help="real: kept rows read anew from their runs")
    parser.add_argument("--runs-dir", default="runs/bench_dag_real", help="real: run folders")
    parser.add_argument("--timeout", type=int, default=1200, help="real: seconds per row (lock wait apart)")
    parser.add_argument("--out", default=None, help="where the JSON goes")
    parser.add_argument("--cells", default="", help="only these cells, e.g. 8x32768,2x1024 (workers x tokens)")
    args = parser.parse_args()
    if args.synthetic or args.cells:
        synthetic(args, Path(args.out or OUT), 10 if args.steps is None else args.steps)
    else:
        quick_out = REAL_OUT.with_name("dag_real_quick.json")  # a smoke check never replaces the study's JSON
        real(args, Path(args.out or (quick_out if args.quick else REAL_OUT)), 60 if args.steps is None else args.steps)


def real(args: argparse.Namespace, out: Path, steps: int) -> None:
    """The real-training tables: every row run (or kept with ``--resume``), JSON after each."""
    specs = dag_real.plan(args.scaling_steps, steps, args.seeds, args.quick, args.repeats)
    runs_dir = Path(args.runs_dir)
    kept = json.loads(out.read_text())["rows"] if args.resume and out.exists() else []
    rows = [dag_real.reread(r) if args.reread else r for r in kept if r["name"] in {s.name for s in specs}]
    done = {r["name"] for r in rows}
    print(f"{len(specs) - len(done)} rows to run, {len(done)} kept from {out}", flush=True)
    load = os.getloadavg()

    def save(rows: list[dict]) -> None:
        extra = {"machine": platform.node(), "cpus": os.cpu_count(), "loadavg_before": load, "src_commit": _head("src")}
        scaling = dag_real.scaling_medians(rows)
        write_results(out, args, rows, acceptance=dag_real.acceptance(rows), scaling=scaling, **extra)

    for spec in (s for s in specs if s.name not in done):
        print(f"{spec.name}: {dag_real.reproduce(spec, runs_dir)}", flush=True)
        row = dag_real.run_row(spec, runs_dir, args.timeout) | {"loadavg_after": os.getloadavg(), "commit": _head()}
        rows.append(row)
        print(
            f"  loop {row['loop_s']:.1f} s, {row['trained_tokens_per_s']:,.0f} trained tok/s, final acc "
            f"{row['final_accuracy']}, driver sample bytes {row['driver_sample_bytes']:,.0f} "
            f"({row['driver_sample_bytes_per_step']:,.0f}/step), CPU-s {row['cpu_s']}",
            flush=True,
        )
        rows.sort(key=lambda r: [s.name for s in specs].index(r["name"]))
        save(rows)
    if args.reread:
        save(rows)
    print("\nReal training, scaling (multi vs single):\n" + dag_real.format_scaling(rows))
    print("\nReal training, acceptance:\n" + dag_real.format_acceptance(rows))


def _head(path: str = ".") -> str:
    """The last commit that touched ``path`` (the whole tree: HEAD)."""
    git = ["git", "log", "-1", "--format=%h", "--", path]
    return subprocess.run(git, capture_output=True, text=True).stdout.strip()


def synthetic(args: argparse.Namespace, out: Path, steps: int) -> None:
    """The synthetic data-path table (``measure`` per cell, each variant in its own Ray session)."""
    workers = (2, 8) if args.quick else (2, 4, 8)
    tokens = (1024, 32768) if args.quick else (1024, 8192, 32768)
    cells = [(w, t) for w in workers for t in tokens]
    if args.cells:
        cells = [(int(w), int(t)) for w, t in (c.split("x") for c in args.cells.split(","))]
    steps = 4 if args.quick else steps
    load = os.getloadavg()
    rows = []
    for w, t in cells:
        pair = {kind: in_own_session(kind, w, t, steps) for kind in (SingleControllerRun, MultiControllerRun)}
        multi, single = pair[MultiControllerRun], pair[SingleControllerRun]
        multi["speedup"] = single["seconds"] / multi["seconds"]
        rows += [single, multi]
        print(
            f"workers {w}  tokens {t:>6}: single {single['tokens_per_s'] / 1e6:7.2f} M tok/s "
            f"({single['driver_sample_bytes'] / 2**20:8.1f} MiB sample data via driver)  multi "
            f"{multi['tokens_per_s'] / 1e6:7.2f} M tok/s ({multi['driver_sample_bytes']} B)  "
            f"multi/single {multi['speedup']:.2f}x",
            flush=True,
        )
        for row in (single, multi):
            cpu = row["cpu_ms_per_step"]
            print(f"    {row['variant']:6} {row['step_ms']:6.1f} ms/step; CPU ms/step: {sum(cpu.values()):.1f} = "
                  + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()), flush=True)  # fmt: skip
    print()
    print(
        "| workers | tokens/sample | single M tok/s | multi M tok/s | multi/single | driver sample B: single | multi |"
    )
    print("|---|---|---|---|---|---|---|")
    for single, multi in zip(rows[::2], rows[1::2], strict=True):
        print(
            f"| {multi['workers']} | {multi['tokens']:,} | {single['tokens_per_s'] / 1e6:.2f} | "
            f"{multi['tokens_per_s'] / 1e6:.2f} | {multi['speedup']:.2f}× | "
            f"{single['driver_sample_bytes'] / 2**20:.1f} MiB | {multi['driver_sample_bytes']} B |"
        )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"machine": platform.node(), "cpus": os.cpu_count(), "groups": GROUPS, "group_size": GROUP_SIZE,
            "steps": steps, "commit": commit, "loadavg_before": load, "loadavg_after": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    print(f"load average before {load[0]:.2f}, after {meta['loadavg_after'][0]:.2f}; commit {commit}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
