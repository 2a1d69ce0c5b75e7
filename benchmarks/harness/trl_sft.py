"""TRL's ``SFTTrainer`` on given rows and model: the baseline of ``benchmarks/sft_vs_trl.py``.

Runs in a virtual environment of its own (``.venv-trl``: ``pip install trl`` with the repo's torch
constraint; TRL is never a sluice dependency), so it imports nothing from sluice. Trains on
prompt / completion JSONL rows (completion-only loss, no packing: TRL's padding-free packing
needs flash attention, absent on CPU), then measures the validation loss as the token mean of
the completion tokens' NLL (TRL's ``labels``) over every validation row (the same definition as sluice's
``val_loss``) and writes one JSON record.

    .venv-trl/bin/python benchmarks/harness/trl_sft.py --model M --train T --val V --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer


def validation_loss(model: torch.nn.Module, rows) -> float:
    """Token-mean NLL of the completion tokens, one unpadded forward per row."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            mask = (torch.tensor(row["labels"][1:]) != -100).float()  # TRL's completion-only labels
            logits = model(input_ids=ids).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            total += float((nll * mask).sum())
            count += int(mask.sum())
    return total / max(count, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--model", "--train", "--val", "--out", "--workdir"):
        parser.add_argument(name, required=True)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = load_dataset("json", data_files={"train": args.train, "val": args.val})
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = SFTConfig(
        output_dir=args.workdir, num_train_epochs=args.epochs, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        max_length=args.max_length, completion_only_loss=True, packing=False, report_to=[],
        save_strategy="no", eval_strategy="no", logging_steps=10, seed=0, use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False,  # its default recomputes
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=data["train"], eval_dataset=data["val"], processing_class=tokenizer
    )
    train_tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    started = time.perf_counter()
    out = trainer.train()
    wall = time.perf_counter() - started
    record = {
        "val_loss": validation_loss(trainer.model, trainer.eval_dataset),
        "train_loss": out.training_loss,
        "steps": out.global_step,
        "train_seconds": out.metrics["train_runtime"],
        "wall_seconds": wall,
        "tokens": train_tokens * args.epochs,
        "tokens_per_s": train_tokens * args.epochs / out.metrics["train_runtime"],
        "trained_tokens_per_epoch": sum(sum(x != -100 for x in r) for r in trainer.train_dataset["labels"]),
        "rows": len(trainer.train_dataset),
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
