"""``sluice sft`` on a tiny model: the packed step equals a plain per-row cross-entropy, the row
order over epochs, resume continuing the same rows, and the command end to end (metrics,
evaluation, ``final_model/``, one-line errors)."""

import json
import random

import pytest
import torch

from sluice.cli import main
from sluice.config import load_config
from sluice.config.data import DataConfig
from sluice.config.sft import SftConfig
from sluice.controller.sft import run_sft
from sluice.data.conversations import ConversationRenderer
from sluice.engines.hf_train import HFTrainEngine
from sluice.engines.lr_schedule import LrSchedule
from sluice.trainer.sft import SFT_LOSS, as_sample, batch_rows, nll_sums, sft_micro_batches, sft_step
from tiny import CHAT_TEMPLATE, chat_tokenizer, save_chat_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A random tiny Llama whose character tokenizer has ``CHAT_TEMPLATE`` as its chat template."""
    return save_chat_model(tmp_path_factory.mktemp("sft_model"))


def chats(n, seed):
    """Two-turn conversations: reverse a word, then repeat it."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 6)))
        rows.append({"messages": [
            {"role": "user", "content": word}, {"role": "assistant", "content": word[::-1]},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": word},
        ]})  # fmt: skip
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reference_grads_and_loss(model, examples):
    """Token-mean CE over trained tokens, one unpadded forward per row (no packing)."""
    model.zero_grad(set_to_none=True)
    total = sum(sum(e.train) for e in examples)
    loss_sum = torch.zeros(())
    for e in examples:
        ids = torch.tensor([e.ids])
        logits = model(input_ids=ids).logits[0, :-1]
        ce = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        loss = (ce * torch.tensor(e.train[1:], dtype=torch.float32)).sum()
        loss.backward()
        loss_sum += loss.detach()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, float(loss_sum / total)


def test_the_packed_step_equals_a_plain_per_row_cross_entropy_within_1e_5(chat_model):
    from transformers import AutoModelForCausalLM

    r = ConversationRenderer(chat_tokenizer(), DataConfig(), SftConfig(), 64)
    examples = [r.example(row, f"row {k}") for k, row in enumerate(chats(12, seed=1))]
    samples = [as_sample(e.ids, e.train, k) for k, e in enumerate(examples)]
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    engine = HFTrainEngine(model, lr=1e-3, pack_row_tokens=120)  # several rows per packed row
    plan = engine.plan_forwards(samples, 4096)
    assert sum(len(row) for chunk in plan for row in chunk) == 12 > sum(len(chunk) for chunk in plan)
    engine.begin_step()
    for mb in sft_micro_batches(samples, 200):  # several micro-batches
        engine.accumulate(mb, SFT_LOSS)
    packed = {n: p.grad.clone() / SFT_LOSS.normaliser(samples) for n, p in engine.model.named_parameters()}
    reference = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    grads, loss = reference_grads_and_loss(reference, examples)
    total = sum(sum(e.train) for e in examples)
    for name, g in grads.items():
        torch.testing.assert_close(packed[name], g / total, atol=1e-5, rtol=1e-4)
    total, count = nll_sums(engine, samples)
    assert total / count == pytest.approx(loss, abs=1e-5)
    assert sft_step(engine, samples, 200)["loss"] == pytest.approx(loss, abs=1e-5)


def test_the_row_order_is_a_seeded_permutation_per_epoch_and_a_fraction_cuts_the_last():
    epoch = [i for step in range(3) for i in batch_rows(10, 4, step, seed=3, limit=10)]
    assert sorted(epoch) == list(range(10))
    assert batch_rows(10, 4, 2, seed=3, limit=10) == batch_rows(10, 4, 2, seed=3)[:2]
    second = [i for step in range(5, 10) for i in batch_rows(10, 2, step, seed=3)]
    assert sorted(second) == list(range(10)) and second != epoch
    assert batch_rows(10, 4, 1, seed=4) != batch_rows(10, 4, 1, seed=3)


def overrides(model, data, out, name, *extra):
    return [
        f"model.path={model}", f"data.train_files={data}", f"run.output_dir={out}", f"run.name={name}",
        "trainer.lr=1e-2", "trainer.micro_batch_tokens=256", "sft.batch_size=8", "run.threads=1",
        "run.progress=false", "tracking.plot=false", "run.eval_every=0", *extra,
    ]  # fmt: skip


def train_losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["sft_loss"] for r in records if r["kind"] == "train"}


def test_resume_continues_the_same_rows_and_state(chat_model, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", chats(20, seed=2))
    args = overrides(chat_model, data, tmp_path, "r", "sft.steps=6", "run.checkpoint_every=3")
    run_sft(load_config(None, args))
    straight = train_losses(tmp_path / "r")
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step_000003"]
    result = run_sft(load_config(None, [*args, "run.resume=auto"]))  # as if killed after step 3
    resumed = train_losses(tmp_path / "r")
    assert (
        result.resumed_from == 3 and result.steps == 6 and sorted(resumed) == [1, 2, 3, 4, 5, 6]
    )  # the redone steps' lines replaced
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6)
    assert straight[6] < straight[1]


def test_sluice_sft_writes_metrics_evaluations_and_a_final_model_train_takes(chat_model, tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", chats(24, seed=3))
    val = write_jsonl(tmp_path / "val.jsonl", chats(6, seed=4))
    args = overrides(chat_model, train, tmp_path, "e", f"data.val_files={val}", "sft.epochs=2", "run.eval_every=3")
    assert main(["sft", *args, "tracking.plot=true", "tracking.trackers=[tensorboard]"]) == 0
    run_dir = tmp_path / "e"
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and list((run_dir / "tensorboard").iterdir())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 3, 6]  # 2 epochs of 24 rows in batches of 8
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert "val_loss" in capsys.readouterr().out
    cfg = load_config(None, [f"model.path={run_dir / 'final_model'}"])
    from sluice.engines.hf_model import load_causal_lm, load_tokenizer

    load_causal_lm(cfg.model.path)
    assert load_tokenizer(cfg.model.path).chat_template == CHAT_TEMPLATE


def test_a_bad_row_stops_sluice_sft_with_one_line_naming_it(chat_model, tmp_path, capsys):
    rows = chats(3, seed=5)
    rows[1] = {"messages": [{"role": "user", "content": "abc"}]}
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    assert main(["sft", *overrides(chat_model, data, tmp_path, "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {data} line 2: no assistant turn to train on (roles: user)"


def test_the_built_in_warm_start_steps_like_sluice_sft_on_the_same_rows(chat_model):
    """``tasks/warm_start`` draws its rows from a generator; each step is ``sluice sft``'s."""
    from transformers import AutoModelForCausalLM

    from sluice.data.conversations import plain_tokens
    from sluice.tasks.warm_start import sft_warm_start

    tok = chat_tokenizer(None)
    pairs = [(f"ab{'c' * k}", f"{'d' * k}ba") for k in range(1, 7)]

    def demonstration(rng):
        return pairs[rng.randrange(len(pairs))]

    warm = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    losses = sft_warm_start(warm, tok, demonstration, steps=3, batch_size=4, lr=1e-2, seed=5, warmup_steps=2)
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    engine = HFTrainEngine(model, lr=1e-2, betas=(0.9, 0.98), lr_schedule=LrSchedule("constant", 2, 3))
    rng = random.Random(5)
    for step in range(3):
        rows = [as_sample(*plain_tokens(tok, *demonstration(rng)), k) for k in range(4)]
        assert sft_step(engine, rows, 1 << 30)["loss"] == losses[step]
    for a, b in zip(warm.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
