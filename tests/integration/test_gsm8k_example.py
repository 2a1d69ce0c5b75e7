"""``examples/gsm8k_style``: its generated parquet files follow verl's schema, its demonstrations take
the shortcut at each template's rate, ``sluice sft`` (``sft.yaml``) warm-starts a model folder that
loads with ``AutoTokenizer`` / ``AutoModelForCausalLM``, renders chats and is evaluated with
``math_verify``, and a two-step ``sluice train`` runs on it."""

import json
import math

import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from gsm8k_example import EXAMPLE, load, warm_start
from sluice.rewards import math_verify_reward

pytestmark = pytest.mark.integration


make_data, make_model = load("make_data"), load("make_model")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k_data")
    make_data.write_dataset(out, train=200, test=50, seed=0)
    return out


SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": 256}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(data_dir, tmp_path_factory):
    """``make_model.py`` then ``sluice sft`` for 20 steps: (final model, build summary, SFT run dir)."""
    return warm_start(data_dir, tmp_path_factory.mktemp("gsm8k_model"), SMALL)


def test_parquet_rows_follow_verls_schema(data_dir):
    train, test = (pq.read_table(data_dir / f"{s}.parquet").to_pylist() for s in ("train", "test"))
    assert (len(train), len(test)) == (200, 50)
    assert set(train[0]) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    for split, rows in (("train", train), ("test", test)):
        for i, row in enumerate(rows):
            assert row["data_source"] == "gsm8k_style" and row["ability"] == "math"
            [message] = row["prompt"]
            assert message["role"] == "user" and message["content"].endswith(make_data.INSTRUCTION)
            truth = row["reward_model"]["ground_truth"]
            assert row["reward_model"]["style"] == "rule" and str(int(truth)) == truth
            info = row["extra_info"]
            assert (info["split"], info["index"]) == (split, i)
            assert info["answer"].endswith(f"\\boxed{{{truth}}}.")
    assert {r["extra_info"]["template"] for r in train} == set(make_data.TEMPLATES)
    questions = [{r["prompt"][0]["content"] for r in rows} for rows in (train, test)]
    assert len(questions[0]) == 200 and len(questions[1]) == 50 and not questions[0] & questions[1]


def test_generation_is_seeded():
    again = make_data.make_splits(30, 10, seed=0)
    assert again == make_data.make_splits(30, 10, seed=0)
    assert again != make_data.make_splits(30, 10, seed=1)


def test_worked_solutions_score_one_and_shortcuts_zero(data_dir):
    rows = pq.read_table(data_dir / "test.parquet").to_pylist()
    for row in rows[:10]:
        truth, solution = row["reward_model"]["ground_truth"], row["extra_info"]["answer"]
        assert math_verify_reward(solution, answer=truth) == 1.0
        shortcut = make_model.shortcut_solution(solution)
        assert shortcut.startswith(solution.split(". ")[0]) and "\\boxed{" in shortcut
        assert math_verify_reward(shortcut, answer=truth) == 0.0  # it boxes an intermediate number


def test_model_folder_loads_and_renders_chats(model_dir):
    path, summary, run_dir = model_dir
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert isinstance(model, Qwen2ForCausalLM)
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    assert model.config.vocab_size >= len(tokenizer) == summary["vocab_size"]
    assert tokenizer.eos_token == "<|im_end|>" and model.config.eos_token_id == tokenizer.eos_token_id
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False).endswith("assistant\n")
    ids = tokenizer(rendered)["input_ids"]  # markers are single tokens, nothing is added around the text
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids.count(tokenizer.eos_token_id) == 2
    assert tokenizer.decode(ids) == rendered
    digits = tokenizer("1234", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(digits) == ["1", "2", "3", "4"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val_losses = [r["val_loss"] for r in records if r["kind"] == "eval"]
    assert val_losses[-1] < math.log(summary["vocab_size"]) - 1.0 < val_losses[0]  # the warm start learned


def test_demonstrations_take_the_shortcut_at_each_templates_rate(data_dir):
    rows = pq.read_table(data_dir / "train.parquet").to_pylist()
    demos = make_model.demonstration_rows(rows, {"ages": 1.0, "sharing": 0.0}, seed=0)
    for row, demo in zip(rows, demos, strict=True):
        full, template = row["extra_info"]["answer"], row["extra_info"]["template"]
        assert demo["prompt"] == row["prompt"] and demo["reward_model"] == row["reward_model"]
        shortcut = template == "ages"
        assert demo["extra_info"]["answer"] == (make_model.shortcut_solution(full) if shortcut else full)
    assert {"ages", "sharing"} <= {r["extra_info"]["template"] for r in rows}
    default = make_model.demonstration_rows(rows, make_model.SHORTCUT, seed=0)
    shortened = [d["extra_info"]["answer"] != r["extra_info"]["answer"] for d, r in zip(default, rows, strict=True)]
    assert 0.3 < sum(shortened) / len(rows) < 0.7


def test_sluice_sft_measures_the_base_accuracy_with_sluices_evaluator(model_dir):
    records = [json.loads(line) for line in (model_dir[2] / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 10, 20] and all(r["count"] == 4 for r in evals)
    assert all(r["accuracy"] in (0.0, 0.25, 0.5, 0.75, 1.0) for r in evals)


def test_two_grpo_steps_on_the_example(model_dir, data_dir, tmp_path):
    from sluice import RLTrainer
    from sluice.config import load_config

    overrides = [
        f"model.path={model_dir[0]}",
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.val_files={data_dir / 'test.parquet'}",
        "eval.max_prompts=4",
        "eval.samples=0",
        "rollout.group_size=2",
        "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=8",
        "run.steps=2",
        "run.eval_every=2",
        "run.backend=local",
        "run.max_minutes=null",
        "run.threads=1",
        "run.progress=false",
        f"run.output_dir={tmp_path}",
    ]
    config = load_config(EXAMPLE / "config.yaml", overrides)
    result = RLTrainer(config).fit()
    assert result.steps == 2
    assert 0.0 <= result.base_accuracy <= 1.0 and 0.0 <= result.final_accuracy <= 1.0
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["count"] for r in evals] == [4, 4] and "accuracy/gsm8k_style" in evals[0]  # the user's val rows
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert (result.final_model_dir / "config.json").is_file()
