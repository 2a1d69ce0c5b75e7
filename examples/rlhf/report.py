"""The RLHF example's numbers and plot, from its two runs' ``metrics.jsonl``.

    python examples/rlhf/report.py [--rm runs/rm --rl runs/rlhf --out results]   # -> results.json, results.png

``results.json``: the reward model's pairwise accuracy on the validation pairs (``sluice rm``), the
policy's held-out exact-match accuracy (the hidden rule) before and after RL with the reward
model as its only reward, and per step the mean reward-model score of the trained samples beside
each evaluation's accuracy. ``results.png`` draws both against the step, so a reward model
that is over-optimised (score up, rule down) shows. It runs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rm", default="runs/rm", help="the sluice rm run, under examples/rlhf")
    parser.add_argument("--rl", default="runs/rlhf", help="the sluice train run, under examples/rlhf")
    parser.add_argument("--out", default="results", help="NAME.json and NAME.png in examples/rlhf")
    args = parser.parse_args()
    rm = records(HERE / args.rm / "metrics.jsonl")
    rl = records(HERE / args.rl / "metrics.jsonl")
    rm_evals = [r for r in rm if r["kind"] == "eval"]
    train = [r for r in rl if r["kind"] == "train"]
    evals = [r for r in rl if r["kind"] == "eval"]
    results = {
        "command": "bash examples/rlhf/run.sh",
        "runs": [args.rm, args.rl],
        "rm_val_pairwise_accuracy": rm_evals[-1]["val_accuracy"],
        "rm_val_pairwise_accuracy_before": rm_evals[0]["val_accuracy"],
        "rm_steps": rm_evals[-1]["step"],
        "heldout_exact_match_base": evals[0]["accuracy"],
        "heldout_exact_match_final": evals[-1]["accuracy"],
        "heldout_gain_points": 100 * (evals[-1]["accuracy"] - evals[0]["accuracy"]),
        "rl_steps": train[-1]["step"],
        "rl_minutes": rl[-1]["elapsed_s"] / 60,
        "rm_score_mean_by_step": {r["step"]: r["rm_score_mean"] for r in train},
        "heldout_exact_match_by_step": {r["step"]: r["accuracy"] for r in evals},
    }
    (HERE / f"{args.out}.json").write_text(json.dumps(results, indent=2) + "\n")
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot([r["step"] for r in train], [r["rm_score_mean"] for r in train], color="tab:blue")
    left.set_xlabel("RL step")
    left.set_ylabel("reward-model score (the training reward)", color="tab:blue")
    right = left.twinx()
    right.plot([r["step"] for r in evals], [100 * r["accuracy"] for r in evals], "o-", color="tab:red")
    right.set_ylabel("held-out exact match, % (the hidden rule)", color="tab:red")
    left.set_title("RLHF on reverse_digits: reward model vs the rule it learned")
    fig.tight_layout()
    fig.savefig(HERE / f"{args.out}.png", dpi=100)
    print(json.dumps({k: v for k, v in results.items() if not k.endswith("_by_step")}, indent=2))


if __name__ == "__main__":
    main()
