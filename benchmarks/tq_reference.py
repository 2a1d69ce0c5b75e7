"""The reference side of ``transfer_queue.py``: the ``transferqueue`` package (0.1.11), measured alone.

Runs in the throwaway venv that ``transfer_queue.py`` builds (it imports ``transfer_queue``, never
sluice) and prints one JSON object. Configured as the project's peer study of the package does:
a private local Ray instance, one controller and 2 storage-unit actors, ZMQ over loopback, the
controller in polling mode (its blocking mode stalls every client while one waits), consumers that
sleep 1 ms after an empty poll. Workload and checks come from ``tq_workload.py``.

    <ref venv>/bin/python benchmarks/tq_reference.py --rows 1024 --stream-rows 4096 ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind everything to 127.0.0.1
os.environ.setdefault("TQ_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")

import warnings

warnings.filterwarnings("ignore")

import ray  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from tq_workload import ForeignLoad, make_lengths, make_rows, median_run, stream_summary  # noqa: E402

FIELD = "prompt_ids"


def as_td(rows: list[torch.Tensor]) -> TensorDict:
    return TensorDict({FIELD: torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, batch_size=[len(rows)])


def unbind(td: TensorDict) -> list[torch.Tensor]:
    x = td[FIELD]
    return list(x.unbind(0)) if isinstance(x, torch.Tensor) else list(x)


def check(got: list[torch.Tensor], by_id: dict[int, torch.Tensor]) -> None:
    for r in got:
        if not torch.equal(r, by_id[int(r[0])]):
            raise RuntimeError(f"reference returned a wrong row {int(r[0])}")


@ray.remote(num_cpus=1)
class Producer:
    def __init__(self) -> None:
        tq.init()
        self.client = tq.get_client()

    def ready(self) -> bool:
        return True

    def run(self, pid: str, lengths: list[int], chunk: int, seed: int, t_start: float) -> dict:
        chunks = [(c, as_td(make_rows(lengths[c : c + chunk], seed + c, c))) for c in range(0, len(lengths), chunk)]
        while time.monotonic() < t_start:
            time.sleep(0.0005)
        put_start = {}
        for c, td in chunks:
            t0 = time.monotonic()
            self.client.put(td, partition_id=pid)
            put_start.update((c + k, t0) for k in range(td.batch_size[0]))
        return put_start


@ray.remote(num_cpus=1)
class Consumer:
    def __init__(self) -> None:
        tq.init()
        self.client = tq.get_client()

    def ready(self) -> bool:
        return True

    def run(self, pid: str, task: str, mb: int, total: int, split: bool, t_start: float, deadline: float) -> dict:
        while time.monotonic() < t_start:
            time.sleep(0.0005)
        recv: dict[int, float] = {}
        lens: dict[int, int] = {}
        while time.monotonic() < deadline:
            meta = self.client.get_meta(data_fields=[FIELD], batch_size=mb, partition_id=pid, task_name=task)
            if meta.size == 0:
                if not split and len(recv) >= total:
                    break
                if split:
                    _, status = self.client.get_consumption_status(task_name=task, partition_id=pid)
                    if status is not None and int(status.sum()) >= total:
                        break
                time.sleep(0.001)
                continue
            td = self.client.get_data(meta)
            now = time.monotonic()
            for r in unbind(td):
                recv[int(r[0])] = now
                lens[int(r[0])] = int(r.numel())
            if not split and len(recv) >= total:
                break
        return {"recv": recv, "lens": lens}


def bulk(client, args, rows, out: dict) -> None:
    td, n, by_id = as_td(rows), len(rows), {int(r[0]): r for r in rows}
    puts, gets = [], []
    for rep in range(args.warmup + args.reps):
        pid = f"a{rep}"
        t0 = time.perf_counter()
        client.put(td, partition_id=pid)
        t1 = time.perf_counter()
        meta = client.get_meta(data_fields=[FIELD], batch_size=n, partition_id=pid, task_name="bulk")
        got = client.get_data(meta)
        t2 = time.perf_counter()
        rows_back = unbind(got)
        if len(rows_back) != n:
            raise RuntimeError(f"reference get returned {len(rows_back)} rows")
        check(rows_back, by_id)
        client.clear_partition(pid)
        if rep >= args.warmup:
            puts.append(t1 - t0)
            gets.append(t2 - t1)
    out["put_s"], out["get_s"] = puts, gets


def small_gets(client, args, rows, out: dict) -> None:
    client.put(as_td(rows), partition_id="lat")
    by_id = {int(r[0]): r for r in rows}
    times = []
    for i in range(args.warmup * 5 + args.lat_iters):
        t0 = time.perf_counter()
        meta = client.get_meta(data_fields=[FIELD], batch_size=args.micro_batch, partition_id="lat", task_name="lat")
        if meta.size == 0:
            client.reset_consumption(partition_id="lat", task_name="lat")
            continue
        got = client.get_data(meta)
        t1 = time.perf_counter()
        check(unbind(got), by_id)
        if i >= args.warmup * 5:
            times.append(t1 - t0)
    client.clear_partition("lat")
    out["get8_s"] = times


def stream(args, out: dict) -> None:
    lengths = make_lengths(args.stream_rows, args.min_len, args.max_len, args.seed + 100)
    out["stream"] = {}
    for mode in ("split", "broadcast"):
        for mb in args.stream_mb:
            runs = [stream_once(args, f"s_{mode}_{mb}_{rep}", mode, mb, lengths) for rep in range(args.stream_reps)]
            out["stream"][f"{mode} mb={mb}"] = median_run(runs)


def stream_once(args, pid: str, mode: str, mb: int, lengths: list[int]) -> dict:
    prod, cons = Producer.remote(), [Consumer.remote() for _ in range(2)]
    ray.get([a.ready.remote() for a in [prod, *cons]])
    t_start = time.monotonic() + 1.0
    split = mode == "split"
    tasks = ["train", "train"] if split else ["task_a", "task_b"]
    fut_p = prod.run.remote(pid, lengths, args.stream_chunk, args.seed + 200, t_start)
    futs = [
        c.run.remote(pid, t, mb, args.stream_rows, split, t_start, t_start + args.stream_timeout)
        for c, t in zip(cons, tasks, strict=True)
    ]
    put_start, results = ray.get(fut_p), ray.get(futs)
    summary = stream_summary(f"reference {mode} mb={mb}", split, results, put_start, lengths, t_start)
    for a in [prod, *cons]:
        ray.kill(a)
    tq.get_client().clear_partition(pid)
    time.sleep(args.settle)  # the killed actors' processes exit before the next clock runs
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [
        ("rows", 1024),
        ("min-len", 64),
        ("max-len", 2048),
        ("reps", 10),
        ("warmup", 2),
        ("micro-batch", 8),
        ("lat-iters", 300),
        ("stream-rows", 4096),
        ("stream-chunk", 64),
        ("seed", 0),
    ]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--stream-mb", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--stream-timeout", type=float, default=180.0)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between stream runs")
    ap.add_argument("--stream-reps", type=int, default=3, help="runs per stream configuration (median reported)")
    args = ap.parse_args()
    lengths = make_lengths(args.rows, args.min_len, args.max_len, args.seed)
    rows = make_rows(lengths, args.seed)
    out: dict = {"version": tq.__version__, "ray": ray.__version__, "torch": torch.__version__, "load": {}}
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    conf = OmegaConf.create(
        {"controller": {"polling_mode": True}, "backend": {"SimpleStorage": {"num_data_storage_units": 2}}},
        flags={"allow_objects": True},
    )
    tq.init(conf)
    client = tq.get_client()
    out["startup_s"] = time.perf_counter() - t0
    try:
        for name, section in [
            ("bulk", lambda: bulk(client, args, rows, out)),
            ("small", lambda: small_gets(client, args, rows, out)),
            ("stream", lambda: stream(args, out)),
        ]:
            with ForeignLoad() as load:
                section()
            out["load"][name] = {"foreign_cores": load.foreign_cores, "own_cores": load.own_cores}
    finally:
        tq.close()
        ray.shutdown()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
