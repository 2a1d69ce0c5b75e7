"""The user's own data trains end to end: each input format, two steps of ``RLTrainer.fit()``.

JSONL with a validation set (evaluated, the long prompt filtered and counted in the run's log),
verl's parquet schema with chat-message prompts (the tokenizer's chat template and a system
prompt), a ``datasets`` ``save_to_disk`` folder, and a nested schema mapped by dotted paths; the
runs without ``data.val_files`` evaluate nothing.
"""

import json
import random

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fakes import length_reward
from sluice import RLTrainer
from sluice.config import load_config
from tiny import add_chat_template

pytestmark = pytest.mark.integration


def _digits(rng: random.Random, count: int) -> list[str]:
    return ["".join(rng.choice("0123456789") for _ in range(rng.randint(2, 5))) for _ in range(count)]


def _write(fmt: str, tmp_path, digits: list[str]) -> list[str]:
    """The data files of ``fmt`` and the overrides that read them."""
    if fmt == "jsonl":
        rows = [{"prompt": d + ">", "answer": int(d[::-1])} for d in digits]
        rows.append({"prompt": "1234567890123>", "answer": "0"})  # 14 tokens: over the 12 allowed
        (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
        return [f"data.train_files={tmp_path / 'train.jsonl'}", f"data.val_files=[{tmp_path / 'val.jsonl'}]",
                "data.max_prompt_length=12", "reward.name=exact_match", "reward.pool_size=0"]  # fmt: skip
    if fmt == "verl_parquet":
        rows = [{"data_source": "rev", "prompt": [{"role": "user", "content": d}], "ability": "digits",
                 "reward_model": {"style": "rule", "ground_truth": d[::-1]}, "extra_info": {"index": k}}
                for k, d in enumerate(digits)]  # fmt: skip
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
        return [f"data.train_files={tmp_path / 'train.parquet'}", "data.system_prompt='9'"]
    if fmt == "saved":
        datasets.Dataset.from_list([{"prompt": d + ">", "answer": d[::-1]} for d in digits]).save_to_disk(
            str(tmp_path / "saved")
        )
        return [f"data.train_files={tmp_path / 'saved'}"]
    rows = [{"q": {"text": d + ">"}, "sol": {"final": d[::-1]}, "meta": {"level": len(d)}} for d in digits]
    (tmp_path / "mapped.json").write_text(json.dumps(rows))
    return [f"data.train_files={tmp_path / 'mapped.json'}", "data.prompt_key=q.text", "data.answer_key=sol.final",
            "data.fields={level: meta.level}"]  # fmt: skip


@pytest.mark.parametrize("fmt", ["jsonl", "verl_parquet", "saved", "mapped"])
def test_each_format_trains_two_steps(tiny_task_model, tmp_path, fmt):
    model_dir = tiny_task_model
    if fmt == "verl_parquet":  # message-list prompts need the tokenizer's chat template
        model_dir = add_chat_template(tiny_task_model, tmp_path / "chat_model")
    overrides = [
        f"model.path={model_dir}",
        *_write(fmt, tmp_path, _digits(random.Random(fmt), 8)),
        "rollout.max_new_tokens=8",
        "rollout.group_size=2",
        "rollout.prompts_per_step=2",
        "run.mode=sync",
        "run.backend=local",
        "run.steps=2",
        "run.threads=1",
        "run.progress=false",
        f"run.output_dir={tmp_path / 'runs'}",
        f"run.name={fmt}",
    ]
    reward = None if fmt == "jsonl" else length_reward
    trainer = RLTrainer(load_config(None, overrides), reward=reward)
    result = trainer.fit()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    data = next(r for r in records if r["kind"] == "data")
    assert data["train_prompts"] == 8
    first = trainer.prompts.items[0]
    if fmt == "jsonl":
        assert data["train_filtered_too_long"] == 1 and data["val_prompts"] == 3
        assert first.fields["answer"] == str(int(first.prompt[:-1][::-1]))  # the int answer, as a string
        assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 2]
        assert result.base_accuracy is not None and result.final_accuracy is not None
    else:
        assert not [r for r in records if r["kind"] == "eval"] and result.base_accuracy is None
    if fmt == "verl_parquet":
        assert first.prompt.startswith("<bos>9-") and first.prompt.endswith(">")
        assert first.fields["data_source"] == "rev"
    if fmt == "mapped":
        assert first.fields["level"] == len(first.prompt) - 1
