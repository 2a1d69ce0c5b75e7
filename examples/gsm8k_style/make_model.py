"""Build the example's base model from ``train.parquet``: a BPE tokenizer with a chat template, a tiny
Qwen2, a short SFT warm start; saved as a Hugging Face folder that ``model.path`` loads.

    python examples/gsm8k_style/make_model.py --data examples/gsm8k_style/data --out examples/gsm8k_style/model

The SFT demonstrations are deliberately imperfect so that RL has headroom: for three of the five
templates (``SHORTCUT``) 70 % of the demonstrations stop after the first step and box that
intermediate number, for the other two 30 % do. The warm-started model can solve every template
(sampling finds the full solution often enough) but its greedy answer follows the shortcut on
most of them. The SFT loop itself is sluice's (``sluice.tasks.warm_start``: cross-entropy on the
response tokens and the closing ``<|im_end|>``), in fp32 (``--bf16`` autocasts to bf16: faster only on
CPUs with AMX; on others bf16 is emulated and many times slower). It does not run RL and
downloads nothing. At the end it prints the base model's greedy validation accuracy, measured with
sluice's evaluator and the ``math_verify`` reward on the first ``--eval-rows`` rows of
``test.parquet``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from sluice.config import DataConfig
from sluice.data import PromptBuilder, in_memory
from sluice.engines.hf_inference import HFInferenceEngine
from sluice.engines.hf_model import load_causal_lm
from sluice.rewards import math_verify_reward
from sluice.rollout.evaluate import evaluate
from sluice.tasks.warm_start import sft_warm_start

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""ChatML, as Qwen2 uses it (without Qwen's default system message); ``<|im_end|>`` is the eos."""

SHORTCUT = {"shopping": 0.7, "distance": 0.7, "marbles": 0.7, "ages": 0.3, "sharing": 0.3}
"""Share of each template's SFT demonstrations that box the first step's result instead."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the tiny Qwen2 (tied embeddings, grouped-query attention)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512


@dataclass(frozen=True)
class SftSpec:
    steps: int = 1000
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 20


def read_rows(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``texts``, digits always single tokens (arithmetic stays
    learnable), the ChatML markers as special tokens and ``CHAT_TEMPLATE``. Nothing is added
    around encoded text (no bos): a rendered chat is exactly its tokens."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD, padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast, spec: ModelSpec, seed: int) -> Qwen2ForCausalLM:
    """A randomly initialised ``Qwen2ForCausalLM`` for ``tokenizer`` (vocabulary padded to a multiple of 8)."""
    config = Qwen2Config(
        vocab_size=-(-len(tokenizer) // 8) * 8,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **asdict(spec),
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def render_prompt(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def shortcut_solution(solution: str) -> str:
    """The solution's first sentence, then its last number boxed: a plausible early stop."""
    first = re.split(r"(?<=\.) ", solution)[0]
    return f"{first} The answer is \\boxed{{{re.findall(r'[0-9]+', first)[-1]}}}."


def demonstrations(
    rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerFast, shortcut: dict[str, float]
) -> Callable[[random.Random], tuple[str, str]]:
    """``sft_warm_start``'s source: a random train row as (rendered prompt, demonstrated solution)."""
    prompts = [render_prompt(tokenizer, row["prompt"]) for row in rows]

    def draw(rng: random.Random) -> tuple[str, str]:
        i = rng.randrange(len(rows))
        info = rows[i]["extra_info"]
        solution = info["answer"]
        if rng.random() < shortcut.get(info["template"], 0.0):
            solution = shortcut_solution(solution)
        return prompts[i], solution

    return draw


def greedy_accuracy(model_dir: Path, rows: list[dict[str, Any]], max_new_tokens: int) -> float:
    """Share of ``rows`` whose greedy response ``math_verify`` scores 1 (sluice's evaluator, fp32)."""
    from sluice.engines.hf_model import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    items = PromptBuilder(DataConfig(chat_template="on"), tokenizer).build(in_memory(rows, "test row")).items
    engine = HFInferenceEngine(load_causal_lm(model_dir), max_batch=64)
    return evaluate(engine, items, tokenizer, math_verify_reward, max_new_tokens).accuracy


def build(
    data_dir: Path,
    out: Path,
    *,
    vocab_size: int = 1024,
    spec: ModelSpec | None = None,
    sft: SftSpec | None = None,
    shortcut: dict[str, float] | None = None,
    seed: int = 0,
    bf16: bool = False,
    log_every: int = 25,
) -> dict[str, Any]:
    """Tokenizer, model and SFT from ``data_dir/train.parquet``, saved to ``out``; returns a summary."""
    spec, sft = spec or ModelSpec(), sft or SftSpec()
    rows = read_rows(data_dir / "train.parquet")
    started = time.perf_counter()
    corpus = [m["content"] for r in rows for m in r["prompt"]] + [r["extra_info"]["answer"] for r in rows]
    tokenizer = train_tokenizer(corpus, vocab_size)
    model = build_model(tokenizer, spec, seed)

    def on_step(step: int, loss: float) -> None:
        if log_every and (step % log_every == 0 or step == sft.steps):
            print(f"sft step {step}/{sft.steps} loss {loss:.3f} ({time.perf_counter() - started:.0f}s)", flush=True)

    sft_started = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        losses = sft_warm_start(
            model,
            tokenizer,
            demonstrations(rows, tokenizer, SHORTCUT if shortcut is None else shortcut),
            steps=sft.steps,
            batch_size=sft.batch_size,
            lr=sft.lr,
            warmup_steps=sft.warmup_steps,
            seed=seed + 7,
            on_step=on_step,
        )
    summary = {
        "vocab_size": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_seconds": round(time.perf_counter() - sft_started, 1),
        "sft_final_loss": round(losses[-1], 4) if losses else None,
        "model": asdict(spec),
        "sft": asdict(sft),
    }
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "gsm8k_style_base.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    here = Path(__file__).parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=here / "data", help="folder with train.parquet, test.parquet")
    parser.add_argument("--out", type=Path, default=here / "model", help="output model folder")
    parser.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size")
    parser.add_argument("--steps", type=int, default=SftSpec.steps, help="SFT steps")
    parser.add_argument("--batch", type=int, default=SftSpec.batch_size, help="SFT demonstrations per step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: on a shared machine two spin-wait)")
    parser.add_argument("--eval-rows", type=int, default=200, help="test rows for the base accuracy (0: skip)")
    parser.add_argument("--max-new-tokens", type=int, default=80, help="greedy response limit of that evaluation")
    parser.add_argument("--bf16", action="store_true", help="SFT under bf16 autocast (only where the CPU has AMX)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    summary = build(
        args.data, args.out, vocab_size=args.vocab, sft=SftSpec(steps=args.steps, batch_size=args.batch), seed=args.seed
    )
    if args.eval_rows:
        started = time.perf_counter()
        rows = read_rows(args.data / "test.parquet")[: args.eval_rows]
        summary["base_greedy_accuracy"] = greedy_accuracy(args.out, rows, args.max_new_tokens)
        summary["eval_rows"], summary["eval_seconds"] = len(rows), round(time.perf_counter() - started, 1)
        (args.out / "gsm8k_style_base.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
