"""Agentic rollout benchmark: the real controller, LLMProxy and EnvRunner on SimEngine + SimEnv.

Every row runs sluice's own ``Controller``, ``GroupLedger``, ``LLMProxy``, ``EnvRunner``
(episode loops, environment-level async or barrier, redundant episodes, timeouts) and a local
TransferQueue over a ``SimEngine`` replica and ``SimEnv`` environments (``sim.SimAgenticPipeline``),
on the virtual clock: results are exact and reproducible, times are simulated seconds per
training step (η = 0, so a step is one batch's rollout). Parameters after
``shared/research/paper_tables.md`` §1.4–1.5 (ROLL Flash §5.2):

- (a) environment-level async vs a lockstep barrier: 512 episodes per step (64 groups × 8),
  22 turns, env step latency Gaussian(10 s, σ) clipped at 0 for σ = 5, 10, 15, a small fixed
  LLM time per turn (0.5 s). Paper at σ = 10: 892 s → 362 s;
- (b) redundant environments: 4 turns, Gaussian(10 s, 5 s). A no-failure row; then a fail-slow
  probability (per env step) and delay calibrated on 32×8 to the paper's 243 s; with that
  calibration fixed, 36×9 and 36×12 are predictions (paper ≈ 45 s). Also fail-stop rows: envs
  that hang, with a step timeout.

    .venv/bin/python benchmarks/agentic.py [--steps-a 2] [--steps-b 12] [--part a|b]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.sim_agentic import SimAgenticPipeline
from harness.sim_env import SimEnvConfig

from sluice.controller.loop import Controller
from sluice.controller.push import PushAdmission
from sluice.schedule.ledger import GroupLedger
from sluice.schedule.staleness import StalenessGate
from sluice.sim import LengthModel, SimEngine, SimEngineConfig, run_virtual

# The LLM is never the bottleneck here: one replica whose decode time does not grow with the
# batch, 20 tokens per turn at 25 ms = 0.5 s per model turn.
ENGINE = SimEngineConfig(
    decode_s=0.025,
    knee=8192,
    max_running=8192,
    prefill_s_per_token=0.0,
    load_s=0.0,
    lengths=LengthModel(median=20, prompt_sigma=0.0, sample_sigma=0.0),
)
PAPER_A = {10.0: (892.0, 362.0)}
CALIBRATION_P = (0.001, 0.002, 0.004)
"""Fail-slow probability per env step, tried on 32×8."""
CALIBRATION_D = (150.0, 200.0, 300.0)
"""Fail-slow extra delay (s), tried on 32×8."""
PAPER_BASELINE_S = 243.0


def run_variant(
    *,
    steps: int,
    groups: int,
    group_size: int,
    env: SimEnvConfig,
    num_env_groups: int | None = None,
    group_redundancy: int = 0,
    mode: str = "async",
    step_timeout_s: float | None = None,
) -> dict[str, Any]:
    """``steps`` training steps of ``groups`` groups; step times in simulated seconds."""
    pipeline = SimAgenticPipeline(
        [SimEngine(ENGINE)],
        env,
        group_size=group_size,
        group_redundancy=group_redundancy,
        mode=mode,
        step_timeout_s=step_timeout_s,
    )
    redundant = (num_env_groups or groups) - groups
    ledger = GroupLedger(StalenessGate(groups, 0), redundant_groups=redundant)
    controller = Controller(pipeline, PushAdmission(pipeline, ledger, groups))
    ends: list[float] = []

    async def after_step(version: int, chosen: list[int], metrics: dict[str, float]) -> bool:
        ends.append(asyncio.get_running_loop().time())
        return True

    run_virtual(controller.run(steps, after_step))
    durations = [b - a for a, b in zip([0.0, *ends], ends, strict=False)]
    counts = pipeline.env_runner.counts
    return {
        "step_s": sum(durations) / len(durations),
        "step_s_each": durations,
        "episodes": dict(sorted(counts.items())),
        "discarded_groups": {k: v for k, v in ledger.counters().items() if k.endswith("_groups")},
    }


def env_level_async(steps: int) -> list[dict[str, Any]]:
    """(a): barrier vs env-level async at σ = 5, 10, 15."""
    rows = []
    for std in (5.0, 10.0, 15.0):
        env = SimEnvConfig(turns=22, latency_mean_s=10.0, latency_std_s=std, success_rate=0.5)
        paper = PAPER_A.get(std, (None, None))
        for mode, paper_s in (("barrier", paper[0]), ("async", paper[1])):
            result = run_variant(steps=steps, groups=64, group_size=8, env=env, mode=mode)
            rows.append({"experiment": "a", "family": f"σ={std:.0f}", "variant": f"σ={std:.0f} {mode}",
                         "paper_s": paper_s, **result})  # fmt: skip
    return rows


def redundancy(steps: int) -> list[dict[str, Any]]:
    """(b): no-failure rows, the fail-slow calibration on 32×8, then the predictions."""
    base = SimEnvConfig(turns=4, latency_mean_s=10.0, latency_std_s=5.0, success_rate=0.5)
    shapes = (("32x8", 32, 0), ("36x9", 36, 1), ("36x12", 36, 4))
    rows = []
    for name, env_groups, extra in shapes:
        result = run_variant(steps=steps, groups=32, group_size=8, env=base, num_env_groups=env_groups,
                             group_redundancy=extra)  # fmt: skip
        rows.append({"experiment": "b", "family": "none", "variant": f"{name} no failures", "paper_s": None, **result})
    fits = []
    for p in CALIBRATION_P:
        for delay in CALIBRATION_D:
            env = SimEnvConfig(**{**base.__dict__, "fail_slow_prob": p, "fail_slow_s": delay})
            fits.append((p, delay, run_variant(steps=steps, groups=32, group_size=8, env=env)))
    p, delay, fitted = min(fits, key=lambda fit: abs(fit[2]["step_s"] - PAPER_BASELINE_S))
    calibration = [{"fail_slow_prob": q, "fail_slow_s": d, "step_s": r["step_s"]} for q, d, r in fits]
    slow = SimEnvConfig(**{**base.__dict__, "fail_slow_prob": p, "fail_slow_s": delay})
    label = f"fail-slow p={p:g} +{delay:.0f}s"
    rows.append({"experiment": "b", "family": "slow", "variant": f"32x8 {label} (fit)", "paper_s": PAPER_BASELINE_S,
                 "calibration": calibration, **fitted})  # fmt: skip
    for name, env_groups, extra in shapes[1:]:
        result = run_variant(steps=steps, groups=32, group_size=8, env=slow, num_env_groups=env_groups,
                             group_redundancy=extra)  # fmt: skip
        rows.append({"experiment": "b", "family": "slow", "variant": f"{name} {label} (predicted)", "paper_s": 45.0,
                     **result})  # fmt: skip
    stop = SimEnvConfig(**{**base.__dict__, "fail_stop_prob": 0.002})
    for name, env_groups, extra in (shapes[0], shapes[2]):
        result = run_variant(steps=steps, groups=32, group_size=8, env=stop, num_env_groups=env_groups,
                             group_redundancy=extra, step_timeout_s=60.0)  # fmt: skip
        rows.append({"experiment": "b", "family": "stop", "variant": f"{name} fail-stop p=0.002, timeout 60s",
                     "paper_s": None, **result})  # fmt: skip
    return rows


PARTS: dict[str, Callable[[int], list[dict[str, Any]]]] = {"a": env_level_async, "b": redundancy}


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"{'exp':<4} {'variant':<46} {'step s':>8} {'vs first':>8} {'paper s':>8}  episodes failed / aborted")
    first: dict[str, float] = {}
    for r in rows:
        base = first.setdefault(r["experiment"] + r["family"], r["step_s"])
        paper = "" if r["paper_s"] is None else f"{r['paper_s']:.0f}"
        e = r["episodes"]
        failed = e.get("episodes_env_timeout", 0) + e.get("episodes_env_error", 0)
        aborted = e.get("episodes_aborted_straggler", 0)
        print(
            f"{r['experiment']:<4} {r['variant']:<46} {r['step_s']:>8.1f} {base / r['step_s']:>7.2f}x "
            f"{paper:>8}  {failed} / {aborted}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-a", type=int, default=2)
    parser.add_argument("--steps-b", type=int, default=12)
    parser.add_argument("--part", choices=sorted(PARTS), action="append")
    parser.add_argument("--out", default="benchmarks/results/agentic.json")
    args = parser.parse_args()
    results = {}
    for part in args.part or sorted(PARTS):
        rows = PARTS[part](args.steps_a if part == "a" else args.steps_b)
        _print(rows)
        results[part] = rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "parts": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
