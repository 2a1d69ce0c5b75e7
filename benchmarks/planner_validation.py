"""Planner validation on this machine: predicted vs measured step time of real ``sluice train`` runs.

The configurations are declared in ``benchmarks/planner_validation.yaml`` (committed before any
measurement). Three phases, each writing into one JSON file:

1. ``profile`` (``planner_validation_profile.py``): the built-in HF engine's decode iteration
   time against its running batch, measured in-process on the default task's warm-started model,
   fitted to ``decode_s · max(1, batch / knee)`` (``harness/fit.py``'s ``fit_decode``); and the run's own
   trainer worker training whole steps alone (seconds per token with nothing decoding beside it);
2. ``measure``: each configuration ``runs`` times as a real run (Ray, two actors; round-robin
   over the configurations), recording the
   step times from ``metrics.jsonl``, the load average and the CPU the rest of the machine used
   (all CPU time minus this run's process tree), sampled every half second, and from the run's
   trace how long its micro-batches took beside generation and with none running;
3. ``predict``: calibrate on the FIRST configuration only (the trainer's cost per token from its
   step metrics, where it shares the CPU with decoding; its speed-up when alone is that rate
   over the profiled trainer's; one scale factor on the profiled engine: the engine's effective
   iteration time in the real rollout process, ``drive_s / steps`` of its stats, over the profile
   at the same running batch; the response lengths the profile's policy sampled, per prompt, as
   an empirical distribution scaled to the calibration runs' mean response), simulate every
   configuration with ``sim.simulate`` over the prompt draws ``SEEDS`` (the prediction is their
   mean step time), print the table of predicted vs measured (the calibration configuration's
   own row is a check, not a fit).

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
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from planner_validation_profile import profile_decode, profile_trainer, task_lengths

from sluice.config.models import TrainerConfig
from sluice.sim.cost_model import TrainerCost
from sluice.sim.engine import LengthModel, SimEngineConfig
from sluice.sim.simulate import SimConfig, SimResult, simulate
from sluice.telemetry.trace import read_chrome_trace, resolve_spans

HERE = Path(__file__).parent
GROUP_SIZE = 8
SEEDS = (0, 1, 2, 3)
"""The simulator's prompt draws a prediction averages over (round 5 on; rounds 0-4: seed 0 alone)."""


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
    trace = workdir / "run" / "trace.json"
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
        "microbatches": microbatch_overlap(read_chrome_trace(trace)) if trace.is_file() else {},
        **{f"{k}_mean": statistics.mean(v) if v else float("nan") for k, v in samples.items()},
    }


def microbatch_overlap(events: list[dict[str, Any]]) -> dict[str, float]:
    """The trainer's micro-batches split by how much of each ran while some group was generating
    (beside decoding: over 95 %; alone: under 5 %): count and seconds per sample of each kind.
    A check of the contention the profile measures, from the run's own trace; not used to predict."""
    _, spans = resolve_spans(events)
    generating = sorted((s.start_us, s.end_us) for s in spans if s.name == "generate" and s.ph == "X")
    busy: list[tuple[float, float]] = []
    for start, end in generating:  # the union of the groups' generate spans
        if busy and start <= busy[-1][1]:
            busy[-1] = (busy[-1][0], max(busy[-1][1], end))
        else:
            busy.append((start, end))
    out = {f"{kind}_{k}": 0.0 for kind in ("alone", "beside") for k in ("count", "seconds", "samples")}
    for s in spans:
        if s.name != "train_microbatch" or s.ph != "X" or s.end_us <= s.start_us:
            continue
        beside = sum(max(0.0, min(s.end_us, b) - max(s.start_us, a)) for a, b in busy) / (s.end_us - s.start_us)
        kind = "beside" if beside > 0.95 else "alone" if beside < 0.05 else None
        if kind:
            out[f"{kind}_count"] += 1
            out[f"{kind}_seconds"] += (s.end_us - s.start_us) / 1e6
            out[f"{kind}_samples"] += s.args.get("samples", 0)
    return out


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
    # The engine: wall seconds per driven iteration (the rollout thread's rewards and queue writes
    # included) over the profile's fit at the run's mean running batch.
    engines = [run["engine"] for run in first["runs"]]
    iteration_s = sum(e["drive_s"] for e in engines) / sum(e["steps"] for e in engines)
    batch = sum(e["generated_tokens"] for e in engines) / sum(e["steps"] for e in engines)
    scale = iteration_s / (prof["decode_s"] * max(1.0, batch / prof["knee"]))
    d = prof["decode_s"] * scale
    measured_mean = sum(s["tokens"] for s in steps) / sum(s["samples"] for s in steps)
    model = length_model(data, measured_mean)
    engine = SimEngineConfig(decode_s=d, knee=max(1, round(prof["knee"])), max_running=512,
                             prefill_s_per_token=d / prof["knee"], load_s=0.01, lengths=model)  # fmt: skip
    alone = data["profile_trainer"]["token_s"]
    trainer, simulated = calibrate_trainer(per_token, alone, sim_config(spec["configs"][0], engine,
                                           TrainerCost(token_s=per_token), spec, lengths))  # fmt: skip
    calib = {"engine_scale": scale, "engine_iteration_s": iteration_s, "engine_mean_batch": batch,
             "train_token_s_measured": per_token, "train_token_s_alone": alone, "train_token_s": trainer.token_s,
             "alone_speedup": trainer.alone_speedup, "train_token_s_simulated": simulated,
             "response_mean": measured_mean, "length_median": model.median,
             "length_sample_sigma": model.sample_sigma, "length_prompts": len(model.prompt_lengths)}  # fmt: skip
    return engine, trainer, calib


def length_model(data: dict[str, Any], measured_mean: float) -> LengthModel:
    """Response lengths, scaled so their mean equals the calibration runs' mean response. From the
    responses the profile's policy sampled (``response_lengths``: per prompt, as an empirical
    distribution of the prompts' typical lengths, their geometric means, with the spread within a
    prompt as the per-sample sigma): the task's prompts come in a short and a long kind, which a
    log-normal cannot hold, and an η = 0 step waits for the longest response of each replica's
    share. A profile without them (before round 5): the task's answers as a log-normal."""
    groups = data.get("profile_trainer", {}).get("response_lengths")
    if not groups:
        sigma, sample_sigma = data["lengths"]["sigma"], 0.05
        return LengthModel(measured_mean / math.exp((sigma**2 + sample_sigma**2) / 2), sigma, sample_sigma)
    logs = [[math.log(max(n, 1)) for n in g] for g in groups]
    typical = sorted(math.exp(statistics.mean(g)) for g in logs)
    sample_sigma = math.sqrt(statistics.mean(statistics.variance(g) for g in logs if len(g) > 1))
    scale = measured_mean / (statistics.mean(typical) * math.exp(sample_sigma**2 / 2))
    prompt_lengths = tuple(t * scale for t in typical)
    return LengthModel(statistics.median(prompt_lengths), 0.0, sample_sigma, prompt_lengths=prompt_lengths)


def simulate_seeds(config: SimConfig) -> list[SimResult]:
    """``config`` simulated with each of ``SEEDS`` (the prompts the simulator draws, and so their
    lengths, differ by seed; one draw of 16 prompts a step is a noisy estimate of the expected step)."""
    return [simulate(replace(config, seed=seed)) for seed in SEEDS]


def calibrate_trainer(per_token: float, alone_token_s: float, twin: SimConfig) -> tuple[TrainerCost, float]:
    """The trainer beside decoding and alone. The calibration runs' seconds per token are mostly,
    not only, beside decoding: take the contended rate that makes the calibration configuration's
    simulated trainer (``twin``, which does the share of its work the simulator finds alone at the
    profiled rate) spend the measured seconds per token after the warm-up. Returns it and the
    simulated seconds per token it reaches."""
    contended, simulated = per_token, per_token
    for _ in range(8):  # the alone share barely moves with the rate: a few fixed-point steps
        trainer = TrainerCost(token_s=contended, micro_batch_tokens=TrainerConfig().micro_batch_tokens,
                              alone_speedup=contended / alone_token_s)  # fmt: skip
        spans = []
        for result in simulate_seeds(replace(twin, trainer=trainer)):
            warm = sum(result.step_times[: twin.warmup_steps]) * 1e6
            spans += [e for e in result.events
                      if e.get("ph") == "X" and e["name"] == "train_microbatch" and e["ts"] >= warm]  # fmt: skip
        simulated = sum(e["dur"] for e in spans) / 1e6 / sum(e["args"]["tokens"] for e in spans)
        contended *= per_token / simulated
    return trainer, simulated


def predict(data: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, Any]]:
    engine, trainer, calib = calibrate(data, spec)
    data["calibration"] = calib
    rows = []
    for config, measured in zip(spec["configs"], data["measured"], strict=True):
        if not measured["runs"]:
            continue
        results = simulate_seeds(sim_config(config, engine, trainer, spec, data["lengths"]))
        predicted = statistics.mean(r.step_s for r in results)
        err = predicted / measured["measured_s"] - 1
        runs = measured["runs"]
        rows.append({"name": config["name"], "predicted_s": predicted, "measured_s": measured["measured_s"],
                     "error": err, "runs_s": [r["step_s"] for r in runs],
                     "predicted_seeds_s": [r.step_s for r in results],
                     "load1": statistics.mean(r["load1_mean"] for r in runs),
                     "other_cores": statistics.mean(r["other_cores_mean"] for r in runs),
                     "trainer_utilisation": statistics.mean(r.trainer_utilisation for r in results),
                     **_microbatch_rates([r.get("microbatches", {}) for r in runs])})  # fmt: skip
    return rows


def _microbatch_rates(runs: list[dict[str, float]]) -> dict[str, float]:
    """The runs' micro-batches alone and beside generation (``microbatch_overlap``): seconds per
    sample of each kind over all the runs, and how many there were."""
    out = {}
    for kind in ("alone", "beside"):
        samples = sum(r.get(f"{kind}_samples", 0.0) for r in runs)
        out[f"mb_{kind}_count"] = sum(r.get(f"{kind}_count", 0.0) for r in runs)
        out[f"mb_{kind}_s_per_sample"] = (
            sum(r.get(f"{kind}_seconds", 0.0) for r in runs) / samples if samples else math.nan
        )
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'configuration':<20} {'predicted s':>11} {'measured s':>10} {'error':>7}  {'runs s':<20} "
          f"{'load1':>5} {'others':>6}  micro-batch ms/sample alone (n), beside (n)")  # fmt: skip
    for i, r in enumerate(rows):
        runs = ", ".join(f"{s:.2f}" for s in r["runs_s"])
        tag = " (calibration)" if i == 0 else ""
        mb = (f"{r['mb_alone_s_per_sample'] * 1e3:.2f} ({r['mb_alone_count']:.0f}), "
              f"{r['mb_beside_s_per_sample'] * 1e3:.2f} ({r['mb_beside_count']:.0f})")  # fmt: skip
        print(f"{r['name']:<20} {r['predicted_s']:>11.2f} {r['measured_s']:>10.2f} {r['error']:>+7.1%}  {runs:<20} "
              f"{r['load1']:>5.1f} {r['other_cores']:>6.2f}  {mb}{tag}")  # fmt: skip


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
                data["profile"] = profile_decode()
                data["profile_trainer"] = profile_trainer(_overrides(spec["configs"][0])["prompts_per_step"])
            print(f"engine: decode {data['profile']['decode_s'] * 1e3:.2f} ms flat to a batch of "
                  f"{data['profile']['knee']:.0f}; trainer alone {data['profile_trainer']['token_s'] * 1e3:.4f} ms "
                  f"per token; lengths {data['lengths']}")  # fmt: skip
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
