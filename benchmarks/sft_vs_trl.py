"""``sluice sft`` against TRL's ``SFTTrainer``: the same model, rows, tokens and epochs, on this machine.

The rows are the gsm8k_style example's (``examples/gsm8k_style/make_data.py``) as TRL's
conversational prompt / completion JSONL (the user turn, the worked solution as the assistant
turn); the model its tiny Qwen2 with a BPE tokenizer and ChatML template (``make_model.py``),
randomly initialised once and loaded by both. Both train the completion tokens only with AdamW
(betas 0.9 / 0.99, no weight decay, clip 1.0, constant lr) in float32 on one torch thread, the
same rows per step and epochs; they differ in what each framework does: sluice packs rows without
padding (``trainer.micro_batch_tokens``), TRL pads each batch to its longest row (its
padding-free packing needs flash attention, which CPUs lack). Row order is each one's own seeded
shuffle. TRL runs in ``.venv-trl`` (``harness/trl_sft.py``), sluice in this process.

Reported: the validation loss (token-mean completion NLL over every validation row, measured the
same way on both sides), the training tokens (prompt + completion, no padding) per second of
training, and their ratios. Prints a table, writes JSON (``benchmarks/results/sft_vs_trl.json``).

    flock /tmp/bench.lock .venv/bin/python benchmarks/sft_vs_trl.py [--train 1000] [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from harness.report import write_results

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples" / "gsm8k_style"))

import make_data  # noqa: E402
import make_model  # noqa: E402


def write_rows(rows: list[dict], path: Path) -> Path:
    """verl rows as TRL's conversational prompt / completion JSONL."""
    with path.open("w") as f:
        for row in rows:
            completion = [{"role": "assistant", "content": row["extra_info"]["answer"]}]
            f.write(json.dumps({"prompt": row["prompt"], "completion": completion}) + "\n")
    return path


def prepare(work: Path, train: int, val: int, vocab: int) -> tuple[Path, Path, Path]:
    train_rows, val_rows = make_data.make_splits(train, val, seed=0)
    tokenizer = make_model.train_tokenizer(
        [m["content"] for r in train_rows for m in r["prompt"]] + [r["extra_info"]["answer"] for r in train_rows],
        vocab,
    )
    model_dir = work / "model"
    make_model.build_model(tokenizer, make_model.ModelSpec(), seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, write_rows(train_rows, work / "train.jsonl"), write_rows(val_rows, work / "val.jsonl")


def run_sluice(model: Path, train: Path, val: Path, args: argparse.Namespace, work: Path) -> dict:
    from sluice.config import load_config
    from sluice.controller.sft import run_sft

    overrides = [
        f"model.path={model}", f"data.train_files={train}", f"data.val_files={val}",
        f"run.output_dir={work}", "run.name=sluice", "run.threads=1", "run.progress=false",
        "run.eval_every=0", "tracking.plot=false", f"trainer.lr={args.lr}", "trainer.betas=[0.9,0.99]",
        f"trainer.micro_batch_tokens={args.micro_batch_tokens}", f"sft.batch_size={args.batch}",
        f"sft.epochs={args.epochs}", "sft.train_on=completion", "sft.max_length=512",
    ]  # fmt: skip
    started = time.perf_counter()
    run_sft(load_config(None, overrides))
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (work / "sluice" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in steps)
    tokens = sum(r["tokens"] for r in steps)
    val_loss = _sluice_val_loss(model, work / "sluice" / "final_model", train, val)
    return {
        "val_loss": val_loss,
        "train_loss": steps[-1]["sft_loss"],
        "steps": len(steps),
        "train_seconds": seconds,
        "wall_seconds": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
    }


def _sluice_val_loss(model: Path, final: Path, train: Path, val: Path) -> float:
    """The final model's validation loss (token-mean NLL over the rendered validation rows)."""
    from sluice.config import load_config
    from sluice.controller.sft import load_sft_data
    from sluice.trainer.sections import train_engine
    from sluice.trainer.sft import nll_sums

    cfg = load_config(None, [f"model.path={final}", f"data.train_files={train}", f"data.val_files={val}"])
    data = load_sft_data(cfg, final)
    total, count = nll_sums(train_engine(final, cfg.trainer, 1.0, 1), data.val)
    return total / count


def run_trl(model: Path, train: Path, val: Path, args: argparse.Namespace, work: Path) -> dict:
    out = work / "trl.json"
    command = [
        str(REPO / ".venv-trl" / "bin" / "python"), str(REPO / "benchmarks" / "harness" / "trl_sft.py"),
        "--model", str(model), "--train", str(train), "--val", str(val), "--out", str(out),
        "--workdir", str(work / "trl"), "--epochs", str(args.epochs), "--batch", str(args.batch),
        "--lr", str(args.lr), "--max-length", "512",
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=1000, help="training rows")
    parser.add_argument("--val", type=int, default=200, help="validation rows")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=32, help="rows per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / "results" / "sft_vs_trl_work")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sft_vs_trl.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    model, train, val = prepare(args.work, args.train, args.val, args.vocab)
    trl = run_trl(model, train, val, args, args.work)
    sluice = run_sluice(model, train, val, args, args.work)
    rows = [{"framework": "trl", **trl}, {"framework": "sluice", **sluice}]
    print(f"{'framework':<10}{'steps':>7}{'val loss':>10}{'train s':>9}{'tokens':>9}{'tokens/s':>10}")
    for r in rows:
        print(
            f"{r['framework']:<10}{r['steps']:>7}{r['val_loss']:>10.4f}{r['train_seconds']:>9.1f}"
            f"{r['tokens']:>9.0f}{r['tokens_per_s']:>10.0f}"
        )
    gap = sluice["val_loss"] / trl["val_loss"] - 1
    speedup = sluice["tokens_per_s"] / trl["tokens_per_s"]
    print(f"val loss sluice/trl - 1: {100 * gap:+.2f} %   tokens/s sluice/trl: {speedup:.2f}x")
    write_results(args.out, argparse.Namespace(**{k: str(v) for k, v in vars(args).items()}), rows,
                  val_loss_gap=gap, speedup=speedup, torch_threads=1)  # fmt: skip


if __name__ == "__main__":
    main()
