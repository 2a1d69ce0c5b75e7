"""Planner validation on this machine: predicted vs measured step time of real ``sluice train`` runs.

The configurations are declared in ``benchmarks/planner_validation.yaml`` (committed before any
measurement). Three phases, each writing into one JSON file:

1. ``profile``: the built-in HF engine's decode iteration time against its running batch,
   measured in-process on the default task's warm-started model, fitted to
   ``decode_s · max(1, batch / knee)`` (``sim.fit.fit_decode``);
2. ``measure``: each configuration ``runs`` times as a real run (Ray, two actors; round-robin
   over the configurations), recording the
   step times from ``metrics.jsonl``, the load average and the CPU the rest of the machine used
   (all CPU time minus this run's process tree), sampled every half second;
3. ``predict``: calibrate on the FIRST configuration only (the trainer's cost per token from its
   step metrics; one scale factor on the profiled engine: the engine's effective iteration time
   in the real rollout process, ``drive_s / steps`` of its stats, over the profile at the same
   running batch), simulate every configuration with ``sim.simulate``, print the table of
   predicted vs measured (the calibration configuration's own row is a check, not a fit).

Replicas on this machine share the rollout worker's thread (docs/rollout.md), so r replicas are
simulated as r engines each 1/r as fast.

    .venv/bin/python benchmarks/planner_validation.py profile measure predict
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from sluice.config.models import TrainerConfig
from sluice.sim.cost_model import TrainerCost
from sluice.sim.engine import LengthModel, SimEngineConfig
from sluice.sim.fit import fit_decode
from sluice.sim.simulate import SimConfig, simulate

HERE = Path(__file__).parent
GROUP_SIZE = 8


def _task_model() -> tuple[Any, Path, Any]:
    from sluice.config import load_config
    from sluice.engines.hf_model import load_tokenizer
    from sluice.tasks import TASKS
    from sluice.tasks.base_model import ensure_base_model

    cfg = load_config(None, [])
    task = TASKS[cfg.task.name]
    model_dir = ensure_base_model(task, cfg.model.cache_dir, cfg.run.seed, cfg.task.eval_prompts)
    return task, model_dir, load_tokenizer(model_dir)


def task_lengths(count: int = 4000) -> dict[str, float]:
    """Prompt and answer token lengths of the default task, as a log-normal ``LengthModel``
    (answers are determined by the prompt: the spread is between prompts)."""
    import random

    task, _, tokenizer = _task_model()
    rng = random.Random(0)
    rows = [task.make_row(rng) for _ in range(count)]
    prompts = [len(tokenizer(r["prompt"])["input_ids"]) for r in rows]
    answers = [len(tokenizer(r["answer"])["input_ids"]) + 1 for r in rows]  # + <eos>
    logs = [math.log(a) for a in answers]
    return {"prompt_len": statistics.mean(prompts), "median": math.exp(statistics.median(logs)),
            "sigma": statistics.pstdev(logs), "max_new_tokens": task.max_new_tokens}  # fmt: skip


def profile() -> dict[str, Any]:
    """Decode iteration seconds at running batches 1..512 (the fastest of the first decode
    steps after the whole batch is admitted, over five sweeps: other processes only ever add
    time), fitted to the knee model."""
    import torch

    from sluice.api import GenerationRequest, SamplingParams
    from sluice.engines.hf_inference import HFInferenceEngine
    from sluice.engines.hf_model import load_causal_lm

    torch.set_num_threads(1)
    _, model_dir, tokenizer = _task_model()
    engine = HFInferenceEngine(load_causal_lm(model_dir), max_batch=512, admit_fraction=1.0)
    prompt = tuple(tokenizer("1234567890123456>")["input_ids"])
    batches, seconds = [], []
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) * 5:
        params = SamplingParams(max_new_tokens=8, stop_token_ids=())
        futures = [engine.submit(GenerationRequest(f"p{batch}-{i}", prompt, params, seed=i)) for i in range(batch)]
        engine.step()  # admit + prefill + first decode
        times = []
        while engine.stats()["running"] == batch and len(times) < 5:
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        while engine.has_work():
            engine.step()
        assert all(f.done() for f in futures)
        batches.append(batch)
        seconds.append(min(times))
    best = {b: min(s for bb, s in zip(batches, seconds, strict=True) if bb == b) for b in batches}
    batches, seconds = list(best), list(best.values())
    fit = fit_decode(batches, seconds)
    return {"batches": batches, "seconds": seconds, "decode_s": fit.decode_s, "knee": fit.knee, "rms_s": fit.rms_s}


def _sample_cpu(pid: int, stop: threading.Event, out: dict[str, list[float]]) -> None:
    import psutil

    def tree_cpu() -> float:
        total = 0.0
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.NoSuchProcess:
                pass
        return total

    last_all, last_own, last_t = sum(psutil.cpu_times()[:3]), tree_cpu(), time.monotonic()
    while not stop.wait(0.5):
        now_all, now_own, now_t = sum(psutil.cpu_times()[:3]), tree_cpu(), time.monotonic()
        dt = now_t - last_t
        own = max(now_own - last_own, 0.0) / dt
        out["own_cores"].append(own)
        out["other_cores"].append(max((now_all - last_all) / dt - own, 0.0))
        out["load1"].append(psutil.getloadavg()[0])
        last_all, last_own, last_t = now_all, now_own, now_t


@contextlib.contextmanager
def exclusive(lock: str | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock`` (if given) for a timed section, so jobs that take
    the same lock on a shared machine never run beside a measurement."""
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_once(overrides: list[str], steps: int, skip: int, workdir: Path) -> dict[str, Any]:
    """One real run; its per-step times and the machine's load while it ran."""
    args = [*overrides, f"run.steps={steps}", "run.eval_every=100000", "run.progress=false",
            f"run.output_dir={workdir}", "run.name=run"]  # fmt: skip
    cmd = [sys.executable, "-m", "sluice.cli", "train", *args]
    samples: dict[str, list[float]] = {"own_cores": [], "other_cores": [], "load1": []}
    stop = threading.Event()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = threading.Thread(target=_sample_cpu, args=(proc.pid, stop, samples), daemon=True)
    sampler.start()
    output, _ = proc.communicate()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"sluice train {' '.join(args)} failed:\n{output[-3000:]}")
    records = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    weights = next(r for r in records if r.get("kind") == "weights")
    ends = [r["elapsed_s"] for r in train]
    step_s = (ends[-1] - ends[skip - 1]) / (len(ends) - skip)
    return {
        "step_s": step_s,
        "step_ends": ends,
        "train": [{k: r[k] for k in ("step_s", "wait_data_s", "tokens", "samples")} for r in train],
        "engine": {k: weights[f"engine_{k}"] for k in ("steps", "generated_tokens", "drive_s")},
        **{f"{k}_mean": statistics.mean(v) if v else float("nan") for k, v in samples.items()},
    }


def measure(spec: dict[str, Any], data: dict[str, Any], out: Path, lock: str | None = None) -> list[dict[str, Any]]:
    """Round-robin: run 1 of every configuration, then run 2 of each, ...: a drift in the
    machine's load then falls on every configuration alike. Each run is saved as it ends (an
    interrupted measurement keeps its runs; ``--rounds`` stops after fewer rounds)."""
    runs: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in spec["configs"]}
    for i in range(spec["runs"]):
        for config in spec["configs"]:
            with tempfile.TemporaryDirectory(prefix="sluice-val-") as tmp, exclusive(lock):
                run = run_once(config["overrides"], spec["steps"], spec["skip"], Path(tmp))
            runs[config["name"]].append(run)
            print(f"{config['name']:<20} run {i}: {run['step_s']:.2f} s/step, load {run['load1_mean']:.1f}, "
                  f"other processes {run['other_cores_mean']:.2f} cores", flush=True)  # fmt: skip
            data["measured"] = _rows(spec, runs)
            out.write_text(json.dumps(data, indent=2))
    return _rows(spec, runs)


def _rows(spec: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for c in spec["configs"]:
        done = runs[c["name"]]
        median = statistics.median(r["step_s"] for r in done) if done else float("nan")
        rows.append({"name": c["name"], "overrides": c["overrides"], "runs": done, "measured_s": median})
    return rows


def _overrides(config: dict[str, Any]) -> dict[str, int]:
    return {k.split(".")[-1]: int(v) for k, v in (o.split("=") for o in config["overrides"])}


def sim_config(config: dict[str, Any], engine: SimEngineConfig, trainer: TrainerCost, spec: dict[str, Any],
               lengths: dict[str, float]) -> SimConfig:  # fmt: skip
    """The simulated twin of a declared configuration: as many steps as measured, the same skip."""
    steps, skip = spec["steps"], spec["skip"]
    o = _overrides(config)
    replicas = o.get("replicas", 1)
    shared = SimEngineConfig(**{**vars(engine), "decode_s": engine.decode_s * replicas})  # one thread, shared
    return SimConfig(
        shared, trainer, replicas=replicas, prompts_per_step=o["prompts_per_step"], group_size=GROUP_SIZE,
        max_new_tokens=int(lengths["max_new_tokens"]), prompt_len=round(lengths["prompt_len"]),
        mode="async", eta=o["max_staleness"], steps=steps, warmup_steps=skip,
    )  # fmt: skip


def calibrate(data: dict[str, Any], spec: dict[str, Any]) -> tuple[SimEngineConfig, TrainerCost, dict[str, float]]:
    """Each stage's cost from its own measurements in the FIRST configuration's runs, never by
    fitting the step time (a stage that is not the bottleneck leaves the step time unchanged, so
    a fit could not tell its cost): the trainer's seconds per token, and the engine's effective
    iteration time in the rollout process against the profile at the same running batch."""
    lengths, prof = data["lengths"], data["profile"]
    first = data["measured"][0]
    steps = [s for run in first["runs"] for s in run["train"][spec["skip"] :]]
    # Seconds per trained token: the trainer's busy time (the step minus its wait for data) over
    # tokens, as a mean, because the step time it must reproduce is a mean. One configuration's
    # steps vary too little in tokens to separate a fixed cost from the slope: proportional.
    per_token = statistics.mean(
        (s["step_s"] - s["wait_data_s"]) / (s["tokens"] + s["samples"] * lengths["prompt_len"]) for s in steps
    )
    trainer = TrainerCost(token_s=per_token, micro_batch_tokens=TrainerConfig().micro_batch_tokens)
    # The engine: wall seconds per driven iteration (the rollout thread's rewards and queue writes
    # included) over the profile's fit at the run's mean running batch.
    engines = [run["engine"] for run in first["runs"]]
    iteration_s = sum(e["drive_s"] for e in engines) / sum(e["steps"] for e in engines)
    batch = sum(e["generated_tokens"] for e in engines) / sum(e["steps"] for e in engines)
    scale = iteration_s / (prof["decode_s"] * max(1.0, batch / prof["knee"]))
    d = prof["decode_s"] * scale
    # Response lengths: the task's answer-length spread, scaled so the mean equals the mean
    # response the calibration runs sampled (a policy at temperature 1 overshoots the answers).
    sample_sigma = 0.05
    measured_mean = sum(s["tokens"] for s in steps) / sum(s["samples"] for s in steps)
    median = measured_mean / math.exp((lengths["sigma"] ** 2 + sample_sigma**2) / 2)
    model = LengthModel(median, lengths["sigma"], sample_sigma)
    engine = SimEngineConfig(decode_s=d, knee=max(1, round(prof["knee"])), max_running=512,
                             prefill_s_per_token=d / prof["knee"], load_s=0.01, lengths=model)  # fmt: skip
    calib = {"engine_scale": scale, "engine_iteration_s": iteration_s, "engine_mean_batch": batch,
             "train_token_s": per_token, "response_mean": measured_mean, "length_median": median}  # fmt: skip
    return engine, trainer, calib


def predict(data: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    engine, trainer, calib = calibrate(data, spec)
    data["calibration"] = calib
    rows = []
    for config, measured in zip(spec["configs"], data["measured"], strict=True):
        if not measured["runs"]:
            continue
        result = simulate(sim_config(config, engine, trainer, spec, data["lengths"]))
        err = result.step_s / measured["measured_s"] - 1
        runs = measured["runs"]
        rows.append({"name": config["name"], "predicted_s": result.step_s, "measured_s": measured["measured_s"],
                     "error": err, "runs_s": [r["step_s"] for r in runs],
                     "load1": statistics.mean(r["load1_mean"] for r in runs),
                     "other_cores": statistics.mean(r["other_cores_mean"] for r in runs),
                     "trainer_utilisation": result.trainer_utilisation})  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'configuration':<20} {'predicted s':>11} {'measured s':>10} {'error':>7}  {'runs s':<20} "
          f"{'load1':>5} {'others':>6}")  # fmt: skip
    for i, r in enumerate(rows):
        runs = ", ".join(f"{s:.2f}" for s in r["runs_s"])
        tag = " (calibration)" if i == 0 else ""
        print(f"{r['name']:<20} {r['predicted_s']:>11.2f} {r['measured_s']:>10.2f} {r['error']:>+7.1%}  {runs:<20} "
              f"{r['load1']:>5.1f} {r['other_cores']:>6.2f}{tag}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phases", nargs="+", choices=["profile", "measure", "predict"])
    parser.add_argument("--spec", default=str(HERE / "planner_validation.yaml"))
    parser.add_argument("--out", default=str(HERE / "results" / "planner_validation.json"))
    parser.add_argument("--configs", type=int, help="measure only the first N declared configurations")
    parser.add_argument("--rounds", type=int, help="runs per configuration (default: the spec's)")
    parser.add_argument(
        "--lock",
        help="a file to flock exclusively during the profile and each measured run "
        "(serialises the measurement with other jobs that take the same lock)",
    )
    args = parser.parse_args()
    spec = yaml.safe_load(Path(args.spec).read_text())
    if args.configs:
        spec["configs"] = spec["configs"][: args.configs]
    if args.rounds:
        spec["runs"] = args.rounds
    out = Path(args.out)
    data: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    for phase in args.phases:
        if phase == "profile":
            with exclusive(args.lock):
                data["lengths"] = task_lengths()
                data["profile"] = profile()
            print(f"engine: decode {data['profile']['decode_s'] * 1e3:.2f} ms flat to a batch of "
                  f"{data['profile']['knee']:.0f}; lengths {data['lengths']}")  # fmt: skip
        elif phase == "measure":
            data["measured"] = measure(spec, data, out, args.lock)
        else:
            data["rows"] = predict(data, spec)
            print_table(data["rows"])
            print(f"calibration: {data['calibration']}")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
