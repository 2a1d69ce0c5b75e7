"""``sluice sft`` over 2 spawned ranks (gloo): ``ddp`` and ``fsdp2`` train what one process trains
(per-step loss, validation loss, final weights), and a sharded checkpoint resumes the same steps."""

import json
import random

import pytest
import torch

from sluice.config import load_config
from sluice.controller.sft import run_sft
from sluice.engines.hf_model import load_causal_lm
from tiny import save_chat_model

pytestmark = pytest.mark.scale


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_ranks")
    save_chat_model(root / "model")
    rng = random.Random(0)
    for name, n in (("train", 24), ("val", 6)):
        words = ["".join(rng.choice("abcdef") for _ in range(rng.randint(2, 7))) for _ in range(n)]
        rows = [{"prompt": w, "completion": w[::-1]} for w in words]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _run(root, name, *extra):
    overrides = [
        f"model.path={root / 'model'}", f"data.train_files={root / 'train.jsonl'}",
        f"data.val_files={root / 'val.jsonl'}", f"run.output_dir={root}", f"run.name={name}", "run.threads=1",
        "run.progress=false", "tracking.plot=false", "run.eval_every=2", "sft.steps=4", "sft.batch_size=8",
        "trainer.lr=1e-2", "trainer.micro_batch_tokens=64", *extra,
    ]  # fmt: skip
    result = run_sft(load_config(None, overrides))
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return result, records


def _series(records, kind, key):
    return [r[key] for r in records if r["kind"] == kind]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_train_what_one_process_trains(setup, strategy):
    _, one = _run(setup, "one")
    result, two = _run(setup, strategy, f"trainer.strategy={strategy}", "resources.trainer.ranks=2")
    assert result.steps == 4
    for kind, key in (("train", "sft_loss"), ("eval", "val_loss")):
        assert _series(two, kind, key) == pytest.approx(_series(one, kind, key), abs=1e-5)
    single, ranked = (load_causal_lm(setup / n / "final_model").state_dict() for n in ("one", strategy))
    for name, tensor in single.items():
        torch.testing.assert_close(ranked[name], tensor, atol=1e-4, rtol=1e-3)  # Adam amplifies float32 rounding


def test_a_sharded_checkpoint_resumes_the_same_steps(setup):
    ranks = ["trainer.strategy=fsdp2", "resources.trainer.ranks=2", "run.checkpoint_every=2"]
    _, straight = _run(setup, "fsdp2_resume", *ranks)
    result, resumed = _run(setup, "fsdp2_resume", *ranks, "run.resume=auto")
    assert result.resumed_from == 2  # the newest checkpoint (none is written at the last step)
    losses = _series(resumed, "train", "sft_loss")
    assert len(losses) == 4 and losses == pytest.approx(_series(straight, "train", "sft_loss"), abs=1e-6)
