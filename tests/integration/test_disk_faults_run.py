"""A disk that fills up mid-run, end to end on a tiny real model: the run stops with one line naming
the cause and the file (exit 1), the last complete checkpoint is kept, and ``resume=auto`` on a
disk with room trains every admitted sample exactly once."""

import errno
from pathlib import Path

import pytest
from test_resume import _run, trained_ids

from sluice.cli import main
from sluice.runtime.pipelines import LocalPipeline

pytestmark = pytest.mark.integration

SYNC = ["run.mode=sync", "run.backend=local", "run.checkpoint_every=2", "run.keep_checkpoints=2"]


def _fill_the_disk_at(where, monkeypatch):
    """Step 3's trained-ids line is cut short by ENOSPC (``log``), or step 4's checkpoint is
    (``checkpoint``: the trainer's files, written natively, as the OS refuses them)."""
    if where == "log":
        real_open = Path.open

        full = []

        class FullDisk:  # step 3's trained-ids line takes a few bytes, then no log gets any more
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, text):
                if '"step": 3,' in text and not full:
                    full.append(self.f.write(text[:25]))
                    self.f.flush()
                if full:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return self.f.write(text)

        def open_(self, mode="r", *args, **kwargs):
            f = real_open(self, mode, *args, **kwargs)
            return FullDisk(f) if self.suffix == ".jsonl" and mode == "a" else f

        monkeypatch.setattr(Path, "open", open_)
        return "trained_ids.jsonl"
    real_save = LocalPipeline.save_state

    async def save_state(self, path):
        if "step_000004" in path:
            raise OSError(errno.ENOSPC, "No space left on device", f"{path}/model.safetensors")
        await real_save(self, path)

    monkeypatch.setattr(LocalPipeline, "save_state", save_state)
    return "step_000004/trainer/model.safetensors"


@pytest.mark.parametrize("where", ["log", "checkpoint"])
def test_a_full_disk_mid_run_is_one_line_and_resume_trains_every_sample_once(
    tiny_task_model, tmp_path, monkeypatch, capsys, where
):
    named = _fill_the_disk_at(where, monkeypatch)
    assert main(["train", *_run(tiny_task_model, tmp_path, "full", *SYNC, "run.steps=4")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no space left on device (ENOSPC): ") and named in err[0], err
    ckpts = tmp_path / "full" / "checkpoints"
    assert (ckpts / "step_000002" / "COMPLETE").is_file()  # nothing lost
    monkeypatch.undo()  # room again
    assert main(["train", *_run(tiny_task_model, tmp_path, "full", *SYNC, "run.steps=4", "resume=auto")]) == 0
    ids, steps = trained_ids(tmp_path / "full")
    assert steps == [1, 2, 3, 4] and set(ids.values()) == {1} and len(ids) == 4 * 4 * 4
