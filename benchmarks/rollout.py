"""Rollout scheduling benchmark: the real controller, LLMProxy and GroupRunner on SimEngines.

Part (b) of the rollout issue's benchmark. Every variant runs sluice's own ``AsyncController``,
``GroupLedger``, ``LLMProxy``, ``GroupRunner`` (queue / batch scheduling, dynamic filter,
redundant groups) and the single-turn workflow, over ``SimEngine`` replicas and a simulated
trainer (``sim.SimPipeline``), on the virtual clock: results are exact and reproducible, and
times are simulated seconds. Three experiments, parameters after
``shared/research/paper_tables.md`` §1.6, §1.7 and DESIGN.md's weight update modes:

- R3 queue scheduling (ROLL Flash §5.1.1): batch rollout vs queue scheduling vs queue scheduling
  + 16 redundant prompts, 8 prompts × 8 samples, DAPO zero-signal filter, reward latency;
- R4 prompt replication (§5.1.2): prompts × samples 32×16, 64×16, 16×32, with vs without;
- weight update modes at η = 1: interrupt vs defer vs staggered (step time, exposed sync time).

Parts (a) (real engines' tokens/s) and (c) (length-ranker recall) belong in ``PARTS`` beside
``b`` as their own functions.

    .venv/bin/python benchmarks/rollout.py [--steps 20] [--part b]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from sluice.controller.async_loop import AsyncController
from sluice.controller.ledger import GroupLedger
from sluice.controller.staleness import StalenessGate
from sluice.rollout.filters import zero_signal
from sluice.sim import LengthModel, SimEngine, SimEngineConfig, run_virtual
from sluice.sim.pipeline import SimPipeline, SimTrainerConfig, stalled_together_s
from sluice.sim.task import SimReward, sim_prompts

# One replica ≈ one inference GPU running a ~7B model: ~30 ms per decode iteration up to a
# batch of 64, linear beyond; 128 sequences at most (ROLL's max_running_requests default).
# Response lengths: log-normal, p99 / p50 ≈ 20 (ROLL Flash's long tail), median 60 tokens so that
# batch rollout lands near the paper's 125 s per step.
LENGTHS = LengthModel(median=60, prompt_sigma=0.5, sample_sigma=1.2)
ENGINE = SimEngineConfig(decode_s=0.03, knee=64, max_running=128, prefill_s_per_token=1e-5, load_s=0.0, lengths=LENGTHS)
# Prompt replication needs a binding KV budget and strongly prompt-correlated lengths (hard
# prompts are long for all their samples): 32 sequences per replica, most spread between prompts.
SMALL_KV = replace(ENGINE, knee=16, max_running=32, lengths=LengthModel(median=60, prompt_sigma=1.0, sample_sigma=0.8))


def run_variant(
    *,
    steps: int,
    prompts_per_step: int,
    group_size: int,
    replicas: int,
    engine: SimEngineConfig,
    max_new_tokens: int,
    eta: int = 0,
    redundant: int = 0,
    scheduling: str = "queue",
    filtered: bool = False,
    signal_fraction: float = 1.0,
    reward_latency_s: float = 0.0,
    reward_workers: int | None = None,
    prompt_replication: bool = True,
    weight_update: str = "interrupt",
    stagger: int = 1,
    trainer: SimTrainerConfig | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """One variant: ``steps`` training steps of the real async loop; per-step times in sim seconds."""
    engines = [SimEngine(engine) for _ in range(replicas)]
    pipeline = SimPipeline(
        engines,
        sim_prompts(2048, signal_fraction=signal_fraction, seed=seed),
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        weight_update=weight_update,  # type: ignore[arg-type]
        trainer=trainer,
        reward=SimReward(reward_latency_s, workers=reward_workers),
        group_filter=zero_signal if filtered else None,
        scheduling=scheduling,  # type: ignore[arg-type]
        prompt_replication=prompt_replication,
        stagger=stagger,
        seed=seed,
    )
    ledger = GroupLedger(StalenessGate(prompts_per_step, eta), redundant_groups=redundant)
    controller = AsyncController(pipeline, ledger, prompts_per_step)
    ends: list[float] = []
    exposed: list[float] = []

    async def after_step(version: int, chosen: list[int], metrics: dict[str, float]) -> bool:
        ends.append(asyncio.get_running_loop().time())
        exposed.append(controller.sync_metrics.get("exposed_weight_sync_s", 0.0))
        return True

    run_virtual(controller.run(steps, after_step))
    durations = [b - a for a, b in zip([0.0, *ends], ends, strict=False)]
    counters = ledger.counters()
    tokens = sum(e.stats()["generated_tokens"] for e in engines)
    return {
        "step_s": sum(durations) / len(durations),
        "steps": len(durations),
        "exposed_sync_s": stalled_together_s(engines) / len(durations),
        "controller_exposed_sync_s": sum(exposed[:-1]) / max(len(exposed) - 1, 1),
        "tokens_per_step": tokens / len(durations),
        "discarded_groups": {k: v for k, v in counters.items() if k.startswith("discarded_") and k.endswith("_groups")},
        "discarded_samples": {
            k: v for k, v in counters.items() if k.startswith("discarded_") and not k.endswith("_groups")
        },
        "staleness": dict(sorted(ledger.staleness.items())),
        "rerouted": pipeline.proxy.stats().get("rerouted", 0.0),
    }


def queue_scheduling(steps: int) -> list[dict[str, Any]]:
    """R3: 8 prompts × 8 samples, zero-signal filter, reward latency; paper: 125 → 58 → 37 s."""
    common = dict(
        steps=steps, prompts_per_step=8, group_size=8, replicas=4, engine=ENGINE, max_new_tokens=8192,
        filtered=True, signal_fraction=0.5, reward_latency_s=2.0, reward_workers=8,
    )  # fmt: skip
    rows = []
    for name, extra, paper in (
        ("batch rollout", dict(scheduling="batch"), 125.0),
        ("queue scheduling", dict(), 58.0),
        ("queue + 16 redundant", dict(redundant=16), 37.0),
    ):
        rows.append({"experiment": "R3", "variant": name, "paper_s": paper, **run_variant(**common, **extra)})
    return rows


def prompt_replication(steps: int) -> list[dict[str, Any]]:
    """R4: prompts × samples with vs without replication; paper speed-ups 1.30x, 1.84x, 1.95x."""
    rows = []
    for prompts, n, paper in ((32, 16, (116.0, 89.0)), (64, 16, (149.0, 81.0)), (16, 32, (162.0, 83.0))):
        for replicate in (False, True):
            result = run_variant(
                steps=max(steps // 2, 1), prompts_per_step=prompts, group_size=n, replicas=4, engine=SMALL_KV,
                max_new_tokens=8192, prompt_replication=replicate,
            )  # fmt: skip
            name = f"{prompts}x{n} {'with' if replicate else 'without'} replication"
            rows.append({"experiment": "R4", "variant": name, "paper_s": paper[replicate], **result})
    return rows


def weight_modes(steps: int) -> list[dict[str, Any]]:
    """Interrupt vs defer vs staggered at η = 1: generation overlaps training; loading weights
    stalls a replica 5 s."""
    engine = replace(ENGINE, load_s=5.0)
    trainer = SimTrainerConfig(per_sample_s=0.15, step_s=5.0)
    rows = []
    for mode, stagger in (("interrupt", 1), ("defer", 1), ("staggered", 1), ("staggered", 2)):
        result = run_variant(
            steps=steps, prompts_per_step=16, group_size=8, replicas=4, engine=engine, max_new_tokens=8192,
            eta=1, weight_update=mode, stagger=stagger, trainer=trainer,
        )  # fmt: skip
        name = f"{mode} ({stagger} at a time)" if mode == "staggered" else mode
        rows.append({"experiment": "weights", "variant": name, "paper_s": None, **result})
    return rows


def part_b(steps: int) -> list[dict[str, Any]]:
    return queue_scheduling(steps) + prompt_replication(steps) + weight_modes(steps)


PARTS: dict[str, Callable[[int], list[dict[str, Any]]]] = {"b": part_b}


def _print(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'exp':<8} {'variant':<32} {'step s':>8} {'vs first':>8} {'paper s':>8} {'exposed s':>9}  discarded samples"
    )
    print(head)
    first: dict[str, float] = {}
    for r in rows:
        key = r["experiment"] + r["variant"].split(" ")[0] if r["experiment"] == "R4" else r["experiment"]
        base = first.setdefault(key, r["step_s"])
        paper = "" if r["paper_s"] is None else f"{r['paper_s']:.0f}"
        discards = ", ".join(f"{k[10:]}={v:.0f}" for k, v in r["discarded_samples"].items() if "run_end" not in k)
        print(
            f"{r['experiment']:<8} {r['variant']:<32} {r['step_s']:>8.1f} {base / r['step_s']:>7.2f}x "
            f"{paper:>8} {r['exposed_sync_s']:>9.2f}  {discards}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--part", choices=sorted(PARTS), action="append")
    parser.add_argument("--out", default="benchmarks/results/rollout.json")
    args = parser.parse_args()
    results = {}
    for part in args.part or sorted(PARTS):
        rows = PARTS[part](args.steps)
        _print(rows)
        results[part] = rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "parts": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
