"""Paper-scale predictions: the simulator's speed-up of asynchronous (η = 1) over synchronous
training for a 7B model on 64-1024 GPUs, to set beside the five papers' reported figures.

Every row is ``sim.simulate`` of the cost model's H800 replicas and trainer (``sim.cost_model``,
default efficiencies, no profiling) under the real controller: AReaL's setting of 3/4 of the
devices for generation, a global batch of 512 prompts x 16 samples, response lengths log-normal
(median 2,500 tokens) clipped at 8,192, GRPO with one extra forward (proximal log-probs).
Simulated seconds, exact; JSON in ``benchmarks/results/paper_scale.json``.

To keep the event count tractable in Python, each row simulates a 1/``--slice`` share of the
cluster with the same share of the batch (replicas and data-parallel training are independent
at these sizes, so the step time is unchanged; the one thing lost is that the longest response
of a smaller batch is a little shorter).

    .venv/bin/python benchmarks/paper_scale.py [--steps 4] [--gpus 64,256,1024]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from sluice.sim.cost_model import DEVICES, MODELS
from sluice.sim.engine import LengthModel
from sluice.sim.planner import Candidate, Cluster, Workload, sim_config
from sluice.sim.simulate import simulate

LENGTHS = LengthModel(median=2500, prompt_sigma=0.6, sample_sigma=0.5)
REPLICA_DEVICES = {"qwen2.5-7b": 1, "qwen2.5-32b": 2}
MICRO_BATCH = {"qwen2.5-7b": 32768, "qwen2.5-32b": 16384}
MODES = (("sync", 0), ("async", 1))


def row(model: str, gpus: int, steps: int, share: int) -> dict[str, Any]:
    sliced = gpus // share
    rollout = sliced * 3 // 4
    cand = Candidate(rollout, sliced - rollout, REPLICA_DEVICES[model], MICRO_BATCH[model])
    cluster = Cluster(DEVICES["H800"], sliced)
    out: dict[str, Any] = {"model": model, "gpus": gpus, "replicas": cand.replicas, "train_gpus": cand.train_devices}
    for mode, eta in MODES:
        workload = Workload(MODELS[model], prompts_per_step=512 // share, group_size=16, prompt_len=512,
                            lengths=LENGTHS, max_new_tokens=8192, mode=mode, eta=eta)  # fmt: skip
        started = time.perf_counter()
        result = simulate(sim_config(workload, cluster, cand, steps=steps))
        key = mode if mode != "async" else f"async_eta{eta}"
        out[key] = {**result.summary(), "sim_wall_s": time.perf_counter() - started}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gpus", default="64,256,1024")
    parser.add_argument("--slice", type=int, default=8, help="simulate 1/slice of the cluster and batch")
    parser.add_argument("--models", default="qwen2.5-7b")
    parser.add_argument("--out", default="benchmarks/results/paper_scale.json")
    args = parser.parse_args()
    rows = []
    print(f"{'model':<12} {'GPUs':>5} {'sync s':>8} {'η=1 s':>8} {'η=1 ×':>6} {'gen busy sync':>13} "
          f"{'gen busy η=1':>12}")  # fmt: skip
    for model in args.models.split(","):
        for gpus in (int(g) for g in args.gpus.split(",")):
            r = row(model, gpus, args.steps, args.slice)
            rows.append(r)
            sync, a1 = r["sync"]["step_s"], r["async_eta1"]["step_s"]
            print(f"{model:<12} {gpus:>5} {sync:>8.1f} {a1:>8.1f} {sync / a1:>6.2f} "
                  f"{r['sync']['generation_utilisation']:>13.0%} {r['async_eta1']['generation_utilisation']:>12.0%}",
                  flush=True)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
