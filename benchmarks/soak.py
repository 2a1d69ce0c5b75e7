"""Soak run: does a long run of the default task stay bounded in memory, disk and trace size?

Runs ``sluice train`` with the defaults (what ``make run`` runs) for ``--steps`` steps, a
checkpoint every ``--checkpoint-every`` steps (so checkpoints rotate), and at each step of
``--at`` samples, from outside the run:

- the RSS and USS of every process of the run: the driver and its descendants (Ray's GCS and
  raylet, each worker and actor, reward pools), found as the driver's process tree with psutil;
- the disk use of the run dir (checkpoints, logs) and of the run's Ray session dir (Ray's logs);
- the mean step time of the last 10 steps (a loop that slows down grows somewhere).

After the run it reads ``trace.json``'s size and the ``trace`` metrics record (events kept,
events the recorders' cap dropped: ``run.trace_max_events``). ``trace.json`` is written once, at
the run's end, so only the last column has it. Prints a table, writes JSON. It measures; it
changes nothing in the run (extra ``key=value`` overrides go to ``sluice train``).

    flock /tmp/bench.lock .venv/bin/python benchmarks/soak.py [--steps 500] [--at 50,250,500]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from harness.report import write_results

MB = 1024 * 1024


def label(proc: psutil.Process, driver: int) -> str:
    """A process's role: ``driver``, ``ray::RolloutWorker`` (a worker's class, not its method),
    ``raylet``, ``gcs_server``, a Python module or script's name, or ``mp-worker``."""
    if proc.pid == driver:
        return "driver"
    cmd = proc.cmdline()
    if not cmd:
        return proc.name()
    if cmd[0].startswith("ray::"):
        return cmd[0].split()[0].split(".")[0]
    if any("multiprocessing" in part for part in cmd):
        return "mp-worker"
    for i, part in enumerate(cmd):
        if part == "-m" and i + 1 < len(cmd):
            return cmd[i + 1].rsplit(".", 1)[-1]
        if part.endswith(".py"):
            return Path(part).stem
    return Path(cmd[0]).name


def processes(driver: psutil.Process) -> list[dict[str, Any]]:
    """Every live process of the run: pid, start time, role, RSS and USS in MB. A process that
    ends while it is read is left out: it holds no memory any more."""
    rows = []
    for proc in [driver, *driver.children(recursive=True)]:
        try:
            with proc.oneshot():
                mem, started, role = proc.memory_full_info(), proc.create_time(), label(proc, driver.pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        rows.append({"pid": proc.pid, "started": started, "label": role, "rss_mb": mem.rss / MB})
        rows[-1]["uss_mb"] = mem.uss / MB
    return sorted(rows, key=lambda r: (r["label"] != "driver", r["label"], r["pid"]))


def ray_sessions(driver: int) -> list[Path]:
    """The Ray session dirs a driver started (Ray names them after its pid; logs live there)."""
    root = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"
    return sorted(root.glob(f"session_*_{driver}"))


def leftovers(seen: dict[int, float]) -> list[str]:
    """Processes of the run (pid and start time seen in a sample) still running after it ended."""
    out = []
    for pid, started in seen.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started:
                out.append(f"{pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return out


def du_mb(path: Path) -> float:
    """Bytes under ``path`` (files only, links not followed), in MB; 0 if it does not exist."""
    if path.is_file():
        return path.stat().st_size / MB
    total = 0
    for f in path.rglob("*") if path.exists() else ():
        try:
            if f.is_file() and not f.is_symlink():
                total += f.stat().st_size
        except FileNotFoundError:  # a checkpoint rotated away while it was walked
            continue
    return total / MB


def disk(run_dir: Path, sessions: list[Path]) -> dict[str, float]:
    parts = {name: du_mb(run_dir / name) for name in ("checkpoints", "metrics.jsonl", "trained_ids.jsonl")}
    return {
        "run_dir_mb": du_mb(run_dir),
        **{f"{k}_mb": v for k, v in parts.items()},
        "ray_session_mb": sum(map(du_mb, sessions)),
    }


class Metrics:
    """Follows the run's ``metrics.jsonl`` as it grows: the elapsed time of each finished step."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0
        self.step_at: dict[int, float] = {0: 0.0}
        self.records: list[dict[str, Any]] = []

    def poll(self) -> int:
        """Read the lines written since the last call; the newest finished step."""
        if self.path.exists():
            with self.path.open() as f:
                f.seek(self.offset)
                chunk = f.read()
            whole = chunk[: chunk.rfind("\n") + 1]  # a line still being written waits for next time
            self.offset += len(whole.encode())
            for line in whole.splitlines():
                record = json.loads(line)
                self.records.append(record)
                if record["kind"] == "train":
                    self.step_at[record["step"]] = record["elapsed_s"]
        return max(self.step_at)

    def step_s(self, step: int, last: int = 10) -> float:
        """Mean seconds per step over the ``last`` steps up to ``step``."""
        first = max(step - last, min(self.step_at))
        return (self.step_at[step] - self.step_at[first]) / max(step - first, 1)


def soak(args: argparse.Namespace) -> dict[str, Any]:
    name = f"soak-{args.steps}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.output_dir) / name
    overrides = [f"run.steps={args.steps}", f"run.checkpoint_every={args.checkpoint_every}", "run.progress=false",
                 f"run.output_dir={args.output_dir}", f"run.name={name}", *args.overrides]  # fmt: skip
    run_dir.mkdir(parents=True)
    log = (run_dir.parent / f"{name}.log").open("w")
    print(f"sluice train {' '.join(overrides)}  (log: {log.name})", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "train", *overrides], stdout=log, stderr=log)
    driver, metrics = psutil.Process(proc.pid), Metrics(run_dir / "metrics.jsonl")
    samples: list[dict[str, Any]] = []
    todo, seen = sorted(args.at), dict[int, float]()
    while todo and proc.poll() is None:
        step = metrics.poll()
        if step >= todo[0]:
            rows = processes(driver)
            seen.update((r["pid"], r["started"]) for r in rows)
            samples.append({"step": step, "elapsed_s": metrics.step_at[step], "step_s": metrics.step_s(step),
                            "processes": rows, "disk": disk(run_dir, ray_sessions(proc.pid))})  # fmt: skip
            print(f"step {step}: {len(rows)} processes, {sum(r['rss_mb'] for r in rows):.0f} MB RSS", flush=True)
            todo = [s for s in todo if s > step]
        time.sleep(args.poll_s)
    rc = proc.wait()
    metrics.poll()
    if rc != 0 or todo:
        tail = Path(log.name).read_text().splitlines()[-20:]
        raise SystemExit(f"the run ended with rc {rc} before steps {todo}; its log ends:\n" + "\n".join(tail))
    trace = next((r for r in metrics.records if r["kind"] == "trace"), {})
    final = {"trace_json_mb": du_mb(run_dir / "trace.json"), "trace": trace,
             "disk": disk(run_dir, ray_sessions(proc.pid)), "leftover_processes": leftovers(seen)}  # fmt: skip
    return {"run_dir": str(run_dir), "log": log.name, "samples": samples, "final": final}


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measured quantity (a process's RSS, a disk part, the trace), a column per step."""
    samples, rows = result["samples"], []
    keys = sorted(
        {(r["label"], r["pid"]) for s in samples for r in s["processes"]}, key=lambda k: (k[0] != "driver", k)
    )
    for role, pid in sorted(keys, key=lambda k: (k[0] != "driver", k)):
        for unit in ("rss_mb", "uss_mb"):
            at = {s["step"]: next((r[unit] for r in s["processes"] if r["pid"] == pid), None) for s in samples}
            rows.append({"what": f"{role} [{pid}] {unit[:3].upper()} MB", **at})
    for unit in ("rss_mb", "uss_mb"):
        rows.append(
            {
                "what": f"all processes {unit[:3].upper()} MB",
                **{s["step"]: sum(r[unit] for r in s["processes"]) for s in samples},
            }
        )
    rows.append({"what": "processes", **{s["step"]: len(s["processes"]) for s in samples}})
    for key in samples[0]["disk"]:
        rows.append({"what": f"disk {key.removesuffix('_mb')} MB", **{s["step"]: s["disk"][key] for s in samples}})
    rows.append({"what": "step s (last 10)", **{s["step"]: s["step_s"] for s in samples}})
    last, final = samples[-1]["step"], result["final"]
    rows.append({"what": "trace.json MB (end)", last: final["trace_json_mb"]})
    for key in ("events", "dropped_events"):
        rows.append({"what": f"trace {key} (end)", last: final["trace"].get(key)})
    return rows


def print_table(rows: list[dict[str, Any]], steps: list[int]) -> None:
    print(f"{'':<44}" + "".join(f"{'step ' + str(s):>12}" for s in steps))
    for row in rows:
        cells = [row.get(s) for s in steps]
        print(f"{row['what']:<44}" + "".join(f"{'—' if c is None else f'{c:.1f}':>12}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--at", default="50,250,500", help="steps to sample at, comma separated")
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--output-dir", default="/tmp/sluice-soak", help="parent of the run dir and its log")
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for sluice train")
    args = parser.parse_args()
    args.at = sorted({int(s) for s in args.at.split(",")})
    if args.at[-1] > args.steps:
        parser.error(f"--at {args.at[-1]} is past --steps {args.steps}")
    result = soak(args)
    rows = table(result)
    steps = [s["step"] for s in result["samples"]]
    print_table(rows, steps)
    final = result["final"]
    left = final["leftover_processes"]
    print(
        f"after the run: {len(left)} of its processes left, run dir {final['disk']['run_dir_mb']:.1f} MB",
        *left,
        sep="\n",
    )
    write_results(args.out, args, rows, **result)


if __name__ == "__main__":
    main()
