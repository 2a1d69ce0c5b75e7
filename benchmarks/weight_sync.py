"""Weight sync time: the Ray object store vs a torch.distributed broadcast group (gloo on CPU).

Two Ray actors, a trainer (publishes) and an engine (fetches and copies into its own parameter
buffers, as ``update_weights`` does), on one node. Per model size and backend, each of
``--versions`` versions is published, then fetched the moment ``publish`` returns (as the
controller does after a training step). Columns, medians over the versions:

- ``publish s``: the trainer is blocked (object store: pack + ``ray.put`` + register; broadcast:
  one copy into the send buffer, the transfer runs in the background);
- ``fetch s``: the engine waits after being asked for the version (object store: the ``ray.get``;
  broadcast: whatever of the transfer is still left) plus the copy into its parameters;
- ``sync s``: from the start of ``publish`` to the engine holding the weights;
- ``overlapped``: the engine fetches only after a simulated training step (``--step-s``), as when
  version ``v`` is published while step ``v + 1`` already trains: the fetch's remaining wait.

Prints a table and writes JSON. ``.venv/bin/python benchmarks/weight_sync.py [--sizes 1 16 64]``
(millions of float32 parameters).

``--vllm`` (in ``.venv-vllm``) adds the vLLM engine's side, both ``vllm.weight_transfer`` modes
and the broadcast group into vLLM's worker (``--vllm-transfers``) in the same run: per model
(``--vllm-models``), the seconds per weight update that the engine stands closed when it reloads
a tmpfs folder, tensors sent in memory, or buckets received from the group
(``harness/vllm_weight_sync.py`` defines the columns). ``--sizes`` with no value skips the Ray
rows: ``.venv-vllm/bin/python benchmarks/weight_sync.py --vllm --sizes``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ray
import torch
from harness.report import write_results

from sluice.trainer.rendezvous import free_tcp_address
from sluice.weights import BroadcastWeightSync, ObjectStoreWeightSync


def _state(millions: float, seed: int) -> dict[str, torch.Tensor]:
    """A Llama-shaped state dict of about ``millions`` M float32 parameters (square 512-wide layers)."""
    g = torch.Generator().manual_seed(seed)
    layers = max(1, round(millions * 1e6 / (512 * 512)))
    return {f"layers.{i}.weight": torch.randn(512, 512, generator=g) for i in range(layers)}


class Trainer:
    def __init__(self, sync: Any, millions: float) -> None:
        torch.set_num_threads(1)
        self.sync, self.weights = sync, _state(millions, 0)

    def publish(self, version: int) -> tuple[float, float]:
        for t in self.weights.values():  # an optimizer step changes every weight
            t.add_(1.0)
        start = time.time()
        self.sync.publish(self.weights, version)
        return start, time.time()

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.weights.values()))


class Engine:
    def __init__(self, sync: Any, millions: float) -> None:
        torch.set_num_threads(1)
        self.sync, self.params = sync, _state(millions, 1)

    def fetch(self, version: int) -> tuple[float, float]:
        start = time.time()
        weights = self.sync.fetch(version)
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(weights[name])
        return start, time.time()

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.params.values()))


def measure(backend: str, millions: float, versions: int, step_s: float) -> dict[str, Any]:
    if backend == "broadcast":
        group = BroadcastWeightSync(free_tcp_address(), receivers=1, backend="gloo")
        trainer_sync: Any = group.publisher()
        engine_sync: Any = group.receiver(1)
    else:
        trainer_sync = engine_sync = ObjectStoreWeightSync(name=f"bench-weights-{millions}", keep=2)
    trainer = ray.remote(num_cpus=0)(Trainer).remote(trainer_sync, millions)
    engine = ray.remote(num_cpus=0)(Engine).remote(engine_sync, millions)
    rows: dict[str, list[float]] = {"publish_s": [], "fetch_s": [], "sync_s": [], "overlapped_fetch_s": []}
    try:
        for version in range(1, 2 * versions + 2):
            start, published = ray.get(trainer.publish.remote(version))
            overlapped = version > versions + 1
            if overlapped:
                time.sleep(step_s)
            asked, done = ray.get(engine.fetch.remote(version))
            if version == 1:  # the first version also pays the group's rendezvous / actor warm-up
                continue
            if overlapped:
                rows["overlapped_fetch_s"].append(done - asked)
                continue
            rows["publish_s"].append(published - start)
            rows["fetch_s"].append(done - asked)
            rows["sync_s"].append(done - start)
        same = ray.get(trainer.checksum.remote()) == ray.get(engine.checksum.remote())
    finally:
        ray.kill(trainer)
        ray.kill(engine)
        if backend == "object_store":
            trainer_sync.shutdown()
    mb = sum(t.numel() * 4 for t in _state(millions, 0).values()) / 2**20
    return {
        "backend": backend, "params_m": millions, "mb": round(mb, 1), "identical": same,
        **{k: round(statistics.median(v), 4) for k, v in rows.items()},
    }  # fmt: skip


def print_vllm(rows: list[dict[str, Any]]) -> None:
    print(f"{'vLLM model':<10} {'MB':>6} {'transfer':<9} {'stage s':>8} {'load s':>8} {'exposed s':>9} "
          f"{'vs first':>9} {'files':>5}  greedy ok")  # fmt: skip
    base: dict[str, float] = {}
    for r in rows:
        ref = base.setdefault(r["model"], r["exposed_s"])
        print(
            f"{r['model']:<10} {r['mb']:>6.1f} {r['mode']:<9} {r['stage_s']:>8.4f} {r['load_s']:>8.4f} "
            f"{r['exposed_s']:>9.4f} {ref / r['exposed_s']:>8.2f}x {r['files']:>5.0f}  {r['greedy_ok']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="*", default=[1.0, 16.0, 64.0])
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=2.0, help="simulated training step for 'overlapped'")
    parser.add_argument("--vllm", action="store_true", help="add the vLLM rows (needs .venv-vllm)")
    parser.add_argument("--vllm-models", nargs="+", default=["tiny", "small", "medium"])
    parser.add_argument("--vllm-transfers", nargs="+", default=["folder", "memory", "broadcast"])
    parser.add_argument("--out", default="benchmarks/results/weight_sync.json")
    args = parser.parse_args()
    vllm_rows = []
    if args.vllm:  # first: vLLM's engine processes are spawned before Ray starts any
        from harness.vllm_weight_sync import measure_vllm

        vllm_rows = [measure_vllm(m, t, args.versions) for m in args.vllm_models for t in args.vllm_transfers]
        print_vllm(vllm_rows)
    rows = ray_rows(args) if args.sizes else []
    write_results(args.out, args, rows, vllm_rows=vllm_rows)


def ray_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=2 * 1024**3, log_to_driver=False)
    rows = [measure(b, m, args.versions, args.step_s) for m in args.sizes for b in ("object_store", "broadcast")]
    head = ("backend", "MB", "publish s", "fetch s", "sync s", "vs store", "overlapped")
    print(f"{head[0]:<13} {head[1]:>6} {head[2]:>9} {head[3]:>8} {head[4]:>8} {head[5]:>8} {head[6]:>10}  same")
    base: dict[float, float] = {}
    for r in rows:
        ref = base.setdefault(r["params_m"], r["sync_s"])
        print(
            f"{r['backend']:<13} {r['mb']:>6.0f} {r['publish_s']:>9.4f} {r['fetch_s']:>8.4f} {r['sync_s']:>8.4f} "
            f"{ref / r['sync_s']:>7.2f}x {r['overlapped_fetch_s']:>10.4f}  {r['identical']}"
        )
    ray.shutdown()
    return rows


if __name__ == "__main__":
    main()
