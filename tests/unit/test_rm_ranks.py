"""``sluice rm`` over 2 spawned ranks (gloo, ``ddp``) trains what one process trains (per-step loss,
pairwise validation accuracy and loss, final weights); a checkpoint resumes the same steps."""

import json

import pytest
import torch
from test_rm import pair_rows, write_jsonl

from sluice.config import load_config
from sluice.controller.rm import run_rm
from sluice.engines.hf_model import load_scalar_model
from tiny import save_tiny_task_model

pytestmark = pytest.mark.scale


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_ranks")
    save_tiny_task_model(root / "model")
    write_jsonl(root / "train.jsonl", pair_rows(40, 0))
    write_jsonl(root / "val.jsonl", pair_rows(10, 1))
    return root


def _run(root, name, *extra):
    overrides = [
        f"model.path={root / 'model'}", f"data.train_files={root / 'train.jsonl'}",
        f"data.val_files={root / 'val.jsonl'}", f"run.output_dir={root}", f"run.name={name}", "run.threads=1",
        "run.progress=false", "tracking.plot=false", "run.eval_every=2", "rm.steps=4", "rm.batch_size=8",
        "trainer.lr=1e-3", "trainer.micro_batch_tokens=64", *extra,
    ]  # fmt: skip
    result = run_rm(load_config(None, overrides))
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return result, records


def _series(records, kind, key):
    return [r[key] for r in records if r["kind"] == kind]


def test_two_ddp_ranks_train_what_one_process_trains(setup):
    _, one = _run(setup, "one")
    result, two = _run(setup, "ddp", "trainer.strategy=ddp", "resources.trainer.ranks=2")
    assert result.steps == 4
    for kind, key in (("train", "rm_loss"), ("train", "rm_accuracy"), ("eval", "val_loss"), ("eval", "val_accuracy")):
        assert _series(two, kind, key) == pytest.approx(_series(one, kind, key), abs=1e-5)
    single, ranked = (load_scalar_model(setup / n / "final_model").state_dict() for n in ("one", "ddp"))
    for name, tensor in single.items():
        torch.testing.assert_close(ranked[name], tensor, atol=1e-4, rtol=1e-3)


def test_a_checkpoint_resumes_the_same_steps(setup):
    _, straight = _run(setup, "resume", "run.checkpoint_every=2")
    result, resumed = _run(setup, "resume", "run.checkpoint_every=2", "run.resume=auto")
    assert result.resumed_from == 2
    losses = _series(resumed, "train", "rm_loss")
    assert len(losses) == 4 and losses == pytest.approx(_series(straight, "train", "rm_loss"), abs=1e-6)
