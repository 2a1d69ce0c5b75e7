"""TransferQueue: sluice's Ray backend against the reference package (``transferqueue`` 0.1.11), one run.

Both sides run the same workload on this machine, one after the other, each in a private local
Ray instance: the client in the driver, 2 storage units and the controllers in separate actors.

- bulk: put, then get, of 1024 rows with token lengths uniform in 64..2048 (int64, 8.5 MB);
- small: p50 / p99 of an 8-row get;
- stream: 1 producer actor puts 4096 rows in chunks of 64 while 2 consumer actors read
  micro-batches of 8 and of 64, as one task ("split": each row to one consumer, like 2 DP
  groups) and as two tasks ("broadcast": each consumer gets every row); rows/s and latency from
  the put call to the consumer holding the row; each configuration runs 3 times on both sides
  (the median run reported), each sluice run on a fresh queue holding only its own tasks;
- floors: one trivial Ray actor round trip, and a plain memory copy of the bulk bytes.

Every returned row is checked against what was put (content, row id, length). The reference is
installed by this script into a throwaway venv (``--ref-venv``, default under /tmp) with the
project's CPU torch pin, and run by ``tq_reference.py`` configured as the project's peer study
(loopback, polling mode); its numbers are flagged when they fall outside ±30 % of that study's
medians. CPU used by other programs is recorded per section (the machine is shared).

    .venv/bin/python benchmarks/transfer_queue.py [--quick] [--skip-reference]

Prints a table and writes ``benchmarks/results/transfer_queue.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import ray
import torch
from tq_workload import ForeignLoad, make_lengths, make_rows, median_run, pct, stream_summary

from sluice.api import Partition
from sluice.queue import RayQueue
from sluice.queue.storage import PLACEMENT_BLOCK

FIELD = "prompt_ids"
HERE = Path(__file__).resolve().parent
REFERENCE_PIN = "transferqueue==0.1.11"
STUDY_MEDIANS = {  # the peer study's medians over 7 runs on this machine (its tq_official_bench.txt)
    "put_ms": 81.1,
    "get_ms": 56.0,
    "get8_p50_ms": 4.61,
    "stream split mb=8 rows/s": 885,
    "stream split mb=64 rows/s": 1059,
    "stream broadcast mb=8 rows/s": 495,
    "stream broadcast mb=64 rows/s": 1650,
}


def ensure_reference(venv: Path) -> Path:
    """The reference venv's python, creating the venv on first use (torch pinned to the CPU build)."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import transfer_queue"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"installing the reference into {venv} (one-off, ~2 min) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = HERE.parent / "constraints" / "cpu.txt"
    pins = ["torch==2.13.0", f"ray=={ray.__version__}", REFERENCE_PIN]
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(constraints), *pins], check=True)
    return python


def run_reference(python: Path, args: argparse.Namespace) -> dict:
    # run from a copy outside benchmarks/, where this file would shadow the package ``transfer_queue``
    work = python.parent.parent / "bench"
    work.mkdir(exist_ok=True)
    for name in ("tq_reference.py", "tq_workload.py"):
        shutil.copy(HERE / name, work / name)
    cmd = [str(python), str(work / "tq_reference.py")]
    for name in ("rows", "reps", "warmup", "lat_iters", "stream_rows"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cmd += ["--stream-mb", *map(str, args.stream_mb), "--settle", str(args.settle)]
    cmd += ["--stream-reps", str(args.stream_reps)]
    env = {**os.environ, "PYTHONPATH": str(work)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"reference run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_batch(batch, by_id: dict[int, torch.Tensor], base: int) -> None:
    """Every row equals what was put, under the index it was put at."""
    for index, row in zip(batch.indices, batch.columns[FIELD], strict=True):
        rid = int(row[0])
        if index != base + rid or not torch.equal(row, by_id[rid]):
            raise RuntimeError(f"sluice returned a wrong row at index {index}")


def sluice_bulk(q: RayQueue, args, rows, out: dict) -> None:
    n, by_id = len(rows), {int(r[0]): r for r in rows}
    puts, gets = [], []
    for rep in range(args.warmup + args.reps):
        base = 1_000_000 + rep * n
        indices = list(range(base, base + n))
        t0 = time.perf_counter()
        q.put(indices, {FIELD: rows})
        t1 = time.perf_counter()
        batch = q.get("bulk", [FIELD], n, timeout=60)
        t2 = time.perf_counter()
        if len(batch) != n:
            raise RuntimeError(f"sluice get returned {len(batch)} rows")
        check_batch(batch, by_id, base)
        q.clear(indices)
        if rep >= args.warmup:
            puts.append(t1 - t0)
            gets.append(t2 - t1)
    out["put_s"], out["get_s"] = puts, gets


def sluice_small(q: RayQueue, args, rows, out: dict) -> None:
    n, by_id = len(rows), {int(r[0]): r for r in rows}
    need = (args.warmup * 5 + args.lat_iters) * args.micro_batch
    bases = [2_000_000 + k * n for k in range(-(-need // n))]
    for base in bases:
        q.put(list(range(base, base + n)), {FIELD: rows})
    times = []
    for i in range(args.warmup * 5 + args.lat_iters):
        t0 = time.perf_counter()
        batch = q.get("lat", [FIELD], args.micro_batch, timeout=60)
        t1 = time.perf_counter()
        check_batch(batch, by_id, max(b for b in bases if b <= batch.indices[0]))
        if i >= args.warmup * 5:
            times.append(t1 - t0)
    for base in bases:
        q.clear(list(range(base, base + n)))
    out["get8_s"] = times


@ray.remote(num_cpus=1)
class Producer:
    def ready(self, q: RayQueue, warm: list[int]) -> bool:
        """Connect and set up the transport before the clock runs (the reference's actors do in init);
        the ``warm`` rows are big enough to travel through shared memory, one per unit per consumer."""
        q.put(warm, {FIELD: [torch.zeros(20_000, dtype=torch.int64) for _ in warm]})
        return True

    def run(self, q: RayQueue, part: Partition, base: int, lengths: list[int], chunk: int, seed: int, t0: float):
        chunks = [(c, make_rows(lengths[c : c + chunk], seed + c, c)) for c in range(0, len(lengths), chunk)]
        while time.monotonic() < t0:
            time.sleep(0.0005)
        put_start = {}
        for c, rows in chunks:
            start = time.monotonic()
            q.put(list(range(base + c, base + c + len(rows))), {FIELD: rows}, partition=part)
            put_start.update((c + k, start) for k in range(len(rows)))
        return put_start


@ray.remote(num_cpus=1)
class Consumer:
    def ready(self, q: RayQueue, task: str, part: int, warm: list[int]) -> bool:
        """Connect before the clock runs: a read of its ``warm`` rows (one on each unit) maps the
        units' shared memory, and a read of the (still unknown) partition returns at once."""
        torch.zeros(1)  # rows arrive as tensors: load torch now, as the reference's actors do at init
        if len(q.get(task, [FIELD], len(warm), indices=warm, timeout=30)) != len(warm):
            raise RuntimeError("warm-up rows not served")
        return not q.get(task, [FIELD], 1, partition=part, timeout=0).done

    def run(self, q: RayQueue, task: str, part: int, base: int, mb: int, t0: float, timeout: float) -> dict:
        while time.monotonic() < t0:
            time.sleep(0.0005)
        recv: dict[int, float] = {}
        lens: dict[int, int] = {}
        while True:  # the partition says when it is done: no polling, no end-of-stream guess
            batch = q.get(task, [FIELD], mb, partition=part, timeout=timeout)
            now = time.monotonic()
            for index, row in zip(batch.indices, batch.columns[FIELD], strict=True):
                if index != base + int(row[0]):
                    raise RuntimeError(f"stream: row {index} holds row id {int(row[0])}")
                recv[int(row[0])] = now
                lens[int(row[0])] = int(row.numel())
            if batch.done or len(batch) == 0:
                return {"recv": recv, "lens": lens}


def sluice_stream(args, out: dict) -> None:
    """Each configuration ``--stream-reps`` times (the median run reported), each run on a queue of
    its own (2 units, its 1 or 2 tasks' controllers): a put notifies every controller whose task
    reads the column, and the workload has only these tasks."""
    lengths = make_lengths(args.stream_rows, 64, 2048, args.seed + 100)
    out["stream"] = {}
    for k, (mode, mb) in enumerate((m, b) for m in ("split", "broadcast") for b in args.stream_mb):
        label = f"{mode} mb={mb}"
        runs = [stream_once(args, k, mode, mb, lengths) for _ in range(args.stream_reps)]
        out["stream"][label] = median_run(runs)


def stream_once(args, k: int, mode: str, mb: int, lengths: list[int]) -> dict:
    part, base = Partition(k, args.stream_rows), 10_000_000 * (k + 1)
    tasks = [f"s{k}"] * 2 if mode == "split" else [f"s{k}a", f"s{k}b"]
    q = RayQueue.create(num_storage_units=2, tasks={task: [FIELD] for task in tasks})
    prod, cons = Producer.remote(), [Consumer.remote() for _ in range(2)]
    warm = [[base - 1024 + c, base - 1024 + PLACEMENT_BLOCK + c] for c in range(2)]  # 2 blocks: both units
    ray.get(prod.ready.remote(q, warm[0] + warm[1]))
    ray.get([c.ready.remote(q, t, part.id, w) for c, t, w in zip(cons, tasks, warm, strict=True)])
    q.clear(warm[0] + warm[1])  # started and connected before the clock runs
    t0 = time.monotonic() + 1.0
    fut_p = prod.run.remote(q, part, base, lengths, args.stream_chunk, args.seed + 200, t0)
    futs = [c.run.remote(q, t, part.id, base, mb, t0, 180.0) for c, t in zip(cons, tasks, strict=True)]
    put_start, results = ray.get(fut_p), ray.get(futs)
    summary = stream_summary(f"sluice {mode} mb={mb}", mode == "split", results, put_start, lengths, t0)
    for actor in [prod, *cons]:
        ray.kill(actor)
    q.shutdown()
    time.sleep(args.settle)  # the killed actors' processes exit before the next clock runs
    return summary


@ray.remote(num_cpus=0)
class Echo:
    def ping(self) -> None:
        return None


def floors(rows: list[torch.Tensor], out: dict) -> None:
    echo = Echo.remote()
    ray.get(echo.ping.remote())
    rtt = []
    for _ in range(300):
        t0 = time.perf_counter()
        ray.get(echo.ping.remote())
        rtt.append(time.perf_counter() - t0)
    src = torch.cat(rows).numpy()
    dst = np.empty_like(src)
    copies = []
    for _ in range(30):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
    out["ray_rtt_s"], out["memcpy_s"] = rtt, copies
    ray.kill(echo)


def run_sluice(args, rows) -> dict:
    out: dict = {"load": {}}
    t0 = time.perf_counter()
    # Ray workers inherit this: the stream actors import tq_workload
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    q = RayQueue.create(num_storage_units=2, tasks={"bulk": [FIELD], "lat": [FIELD]})
    out["startup_s"] = time.perf_counter() - t0
    try:
        sections = [
            ("bulk", lambda: sluice_bulk(q, args, rows, out)),
            ("small", lambda: sluice_small(q, args, rows, out)),
            ("stream", lambda: sluice_stream(args, out)),
            ("floors", lambda: floors(rows, out)),
        ]
        for name, section in sections:
            with ForeignLoad() as load:
                section()
            out["load"][name] = {"foreign_cores": load.foreign_cores, "own_cores": load.own_cores}
    finally:
        q.shutdown()
        ray.shutdown()
    return out


def summarise(s: dict, ref: dict | None, payload: int, n: int) -> tuple[list[tuple], dict]:
    """Table rows (metric, sluice, reference, ratio, target, met) and the checks."""
    med = statistics.median
    mine = {
        "put_ms": med(s["put_s"]) * 1e3,
        "get_ms": med(s["get_s"]) * 1e3,
        "get8_p50_ms": pct(s["get8_s"], 0.5) * 1e3,
        "get8_p99_ms": pct(s["get8_s"], 0.99) * 1e3,
        **{f"stream {k} rows/s": v["rows_per_s"] for k, v in s["stream"].items()},
        **{f"stream {k} lat p50 ms": v["latency_p50_s"] * 1e3 for k, v in s["stream"].items()},
    }
    theirs = {}
    if ref is not None:
        theirs = {
            "put_ms": med(ref["put_s"]) * 1e3,
            "get_ms": med(ref["get_s"]) * 1e3,
            "get8_p50_ms": pct(ref["get8_s"], 0.5) * 1e3,
            "get8_p99_ms": pct(ref["get8_s"], 0.99) * 1e3,
            **{f"stream {k} rows/s": v["rows_per_s"] for k, v in ref["stream"].items()},
            **{f"stream {k} lat p50 ms": v["latency_p50_s"] * 1e3 for k, v in ref["stream"].items()},
        }
    rtt = pct(s["ray_rtt_s"], 0.5) * 1e3
    checks: dict = {"reference_outside_30pct": {}}
    rows = []
    for key, value in mine.items():
        other = theirs.get(key)
        faster = other / value if other and not key.endswith("rows/s") else (value / other if other else None)
        target, met = "", None
        if key in ("put_ms", "get_ms") or key.endswith("rows/s"):
            target, met = ">= 5x", faster is not None and faster >= 5
        elif key == "get8_p50_ms":
            target = f"<= 0.5x ref, <= 2.5x RTT ({2.5 * rtt:.2f} ms)"
            met = faster is not None and faster >= 2 and value <= 2.5 * rtt
        if other is not None and key in STUDY_MEDIANS:
            ratio = other / STUDY_MEDIANS[key]
            if not 0.7 <= ratio <= 1.3:
                checks["reference_outside_30pct"][key] = round(ratio, 2)
        if met is not None:
            checks[key] = met
        rows.append((key, value, other, faster, target, met))

    def rates(res: dict) -> str:
        put, get = med(res["put_s"]), med(res["get_s"])
        return f"{n / put:,.0f} / {n / get:,.0f} rows/s, {payload / put / 1e6:,.0f} / {payload / get / 1e6:,.0f} MB/s"

    rows.append(("bulk put / get throughput", rates(s), rates(ref) if ref else None, None, "", None))
    rows.append(("floor: Ray actor round trip p50 ms", rtt, None, None, "", None))
    rows.append(("floor: memcpy of the bulk bytes ms", med(s["memcpy_s"]) * 1e3, None, None, "", None))
    return rows, checks


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"
    return str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lat-iters", type=int, default=300)
    ap.add_argument("--stream-rows", type=int, default=4096)
    ap.add_argument("--stream-chunk", type=int, default=64)
    ap.add_argument("--stream-mb", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between stream runs")
    ap.add_argument("--stream-reps", type=int, default=3, help="runs per stream configuration (median reported)")
    ap.add_argument("--ref-venv", type=Path, default=Path("/tmp/sluice-tq-ref"))
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--quick", action="store_true", help="few repetitions, short stream (a smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "transfer_queue.json")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.warmup, args.lat_iters, args.stream_rows, args.stream_mb = 3, 1, 50, 512, [8]
        args.stream_reps, args.settle = 1, 0.5
    lengths = make_lengths(args.rows, 64, 2048, args.seed)
    rows = make_rows(lengths, args.seed)
    payload = sum(lengths) * 8
    print(f"TransferQueue benchmark  {time.strftime('%Y-%m-%d %H:%M:%S')}  loadavg {os.getloadavg()}")
    print(f"workload: {args.rows} rows, lengths 64..2048 (mean {statistics.mean(lengths):.0f}), {payload / 1e6:.2f} MB")
    ref = None
    if not args.skip_reference:
        python = ensure_reference(args.ref_venv)
        print("running the reference ...", flush=True)
        ref = run_reference(python, args)
    print("running sluice ...", flush=True)
    mine = run_sluice(args, rows)
    table, checks = summarise(mine, ref, payload, args.rows)
    print()
    header = ("metric", "sluice", f"reference {ref['version'] if ref else ''}", "sluice faster", "target", "met")
    widths = [max(len(fmt(r[i]) if i else r[i]) for r in [header, *table]) for i in range(6)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for r in table:
        cells = [r[0], fmt(r[1]), fmt(r[2]), f"{r[3]:.1f}x" if r[3] else "-", r[4], fmt(r[5])]
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)))
    for side, res in (("sluice", mine), ("reference", ref)):
        for name, load in (res or {}).get("load", {}).items():
            print(f"CPU of other programs during {side} {name}: {load['foreign_cores']:.2f} cores")
    if checks["reference_outside_30pct"]:
        print(f"FLAG: reference numbers outside ±30% of the study: {checks['reference_outside_30pct']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{os.cpu_count()} cores, python {platform.python_version()}, ray {ray.__version__}",
        "args": {k: str(v) for k, v in vars(args).items()},
        "table": [list(map(str, r)) for r in table],
        "checks": checks,
        "sluice": mine,
        "reference": ref,
    }
    args.out.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
