"""``sluice rm`` on a tiny model: the Bradley–Terry step equals a plain per-pair loss, the rows of
each TRL form, the command end to end (pairwise accuracy, ``final_model/`` a reward model whose
scores are a direct ``transformers`` forward), and one-line errors."""

import json
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from sluice.cli import main
from sluice.config import load_config
from sluice.controller.rm import load_rm_data, reward_model_engine
from sluice.data import DatasetError, in_memory
from sluice.data.preferences import PreferenceRenderer
from sluice.engines.hf_model import load_scalar_model, load_tokenizer
from sluice.engines.model_folder import check_reward_model_dir
from sluice.rewards.reward_model import RewardModelWorker, rm_input_ids
from sluice.trainer.rm import pair_chunks, pairwise_step
from tiny import chat_tokenizer


def pair_rows(n, seed):
    """Reversed digits; the rejected answer carries a ``-`` prefix (the rule the model learns)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        d = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
        rows.append({"prompt": d + ">", "chosen": d[::-1], "rejected": "-" + d[::-1]})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rm_args(model, tmp_path, *extra):
    train = write_jsonl(tmp_path / "train.jsonl", pair_rows(128, 0))
    val = write_jsonl(tmp_path / "val.jsonl", pair_rows(32, 1))
    return [
        f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]", "rm.batch_size=16",
        "trainer.lr=1e-3", f"run.output_dir={tmp_path}/runs", "run.name=rm", "run.progress=false",
        "tracking.plot=false", "run.threads=1", *extra,
    ]  # fmt: skip


def test_pairwise_step_is_the_plain_bradley_terry_loss(tiny_task_model, tmp_path):
    """One step in token-budget chunks = mean of -log σ(r_c - r_r) with one forward per sequence:
    the same loss and the same gradients."""
    cfg = load_config(None, rm_args(tiny_task_model, tmp_path, "trainer.micro_batch_tokens=40"))
    data = load_rm_data(cfg, tiny_task_model)
    pairs = data.train[:12]
    assert len(pair_chunks(pairs, 40)) > 2  # several forwards
    engine = reward_model_engine(tiny_task_model, cfg, 1)
    reference = load_scalar_model(tiny_task_model, new_head=True)
    reference.load_state_dict(engine.model.state_dict())

    def score(ids):
        return reference(input_ids=torch.tensor([ids])).logits[0, 0]

    loss = sum(-F.logsigmoid(score(c) - score(r)) for c, r in pairs) / len(pairs)
    loss.backward()
    engine.grad_clip = None
    out = pairwise_step(engine, pairs, 40, int(engine.model.config.pad_token_id))
    assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    for (name, p), (_, q) in zip(engine.model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name


def test_rm_trains_and_writes_a_reward_model(tiny_task_model, tmp_path):
    assert main(["rm", *rm_args(tiny_task_model, tmp_path, "rm.steps=16", "run.eval_every=8")]) == 0
    records = [json.loads(line) for line in (tmp_path / "runs/rm/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 8, 16]
    assert evals[-1]["val_accuracy"] >= 0.9
    assert evals[-1]["val_loss"] < 0.5 * evals[0]["val_loss"]
    final = tmp_path / "runs/rm/final_model"
    check_reward_model_dir(final)  # a ...ForSequenceClassification with one label
    tokenizer = load_tokenizer(final)
    texts = [("123>", "321"), ("123>", "-321"), ("98765>", "56789")]
    rows = [rm_input_ids(tokenizer, p, r, templated=False) for p, r in texts]
    assert rows[0] == [*tokenizer("123>")["input_ids"], *tokenizer("321", add_special_tokens=False)["input_ids"], 2]
    direct = AutoModelForSequenceClassification.from_pretrained(final)
    expected = [float(direct(input_ids=torch.tensor([row])).logits[0, 0]) for row in rows]
    assert RewardModelWorker(final, token_budget=64).score(rows) == pytest.approx(expected, abs=1e-5)
    assert expected[0] > expected[1]  # the rule it learned


def test_pairs_of_each_trl_form(tmp_path):
    """Plain text with a prompt, implicit plain text, conversations (whole, or after a prompt)."""
    tok = chat_tokenizer()
    cfg = load_config(None, ["data.chat_template=auto"])
    renderer = PreferenceRenderer(tok, cfg.data, cfg.rm)
    conv = {"chosen": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}],
            "rejected": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ab"}]}  # fmt: skip
    after = {"prompt": [{"role": "user", "content": "ab"}], "chosen": [{"role": "assistant", "content": "ba"}],
             "rejected": [{"role": "assistant", "content": "ab"}]}  # fmt: skip
    rows = renderer.build(in_memory([conv, after, {"prompt": "ab", "chosen": "ba", "rejected": "ab"}])).pairs
    assert rows[0].chosen == rows[1].chosen == rows[2].chosen == ("<u>ab<a>", "ba")
    assert rows[0].rejected == ("<u>ab<a>", "ab")
    ids = rm_input_ids(tok, *rows[0].chosen, templated=True)
    assert tok.decode(ids) == "<u>ab<a>ba<eos>"  # the template's own text, the response, eos
    plain = PreferenceRenderer(tok, load_config(None, ["data.chat_template=off"]).data, cfg.rm)
    assert plain.build(in_memory([{"chosen": "ab", "rejected": "ba"}])).pairs[0].chosen == ("", "ab")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "ab", "chosen": "ba"}, "row 1: no rejected response at 'rejected'"),
        ({"prompt": "ab", "chosen": "ba", "rejected": "ba"}, "the chosen and the rejected response are the same"),
        ({"chosen": [{"role": "user", "content": "ab"}], "rejected": "x"}, "must end with an assistant message"),
        ({"prompt": "ab", "chosen": " ", "rejected": "x"}, "row 1: the response at 'chosen' is empty"),
    ],
)
def test_bad_pairs_are_one_line(row, message):
    cfg = load_config(None, [])
    with pytest.raises(DatasetError, match=message):
        PreferenceRenderer(chat_tokenizer(), cfg.data, cfg.rm).build(in_memory([row]))


def test_rm_errors_are_one_line(tiny_task_model, tmp_path, capsys):
    assert main(["rm", *rm_args(tiny_task_model, tmp_path, "trainer.strategy=fsdp2")]) == 2
    assert "trainer.strategy: sluice rm runs single or ddp" in capsys.readouterr().err
    assert main(["rm", *rm_args(tiny_task_model, tmp_path, "rm.max_length=8", "rm.long_rows=error")]) == 2
    err = capsys.readouterr().err
    assert "train.jsonl line" in err and "over rm.max_length (8)" in err and len(err.strip().splitlines()) == 1
