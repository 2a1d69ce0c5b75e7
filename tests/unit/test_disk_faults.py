"""A write the disk refused is one line naming the cause and the file (``telemetry/disk_faults.py``),
whatever wraps the ``OSError``; other errors pass through untouched."""

import errno
import os
from types import SimpleNamespace

import pytest

from sluice.cli import main
from sluice.telemetry import disk_faults as faults
from sluice.telemetry.disk_faults import DiskFault, diagnose, disk_faults
from tiny import tiny_run_overrides


def test_a_refused_write_names_its_file_or_the_wrapped_path(tmp_path):
    full = diagnose(OSError(errno.ENOSPC, "No space left on device"), tmp_path / "metrics.jsonl")
    assert full is not None and str(full).startswith(f"no space left on device (ENOSPC): {tmp_path / 'metrics.jsonl'};")
    ro = diagnose(OSError(errno.EROFS, "Read-only file system", "/x/run.lock"), tmp_path)
    assert ro is not None and str(ro).startswith("read-only file system (EROFS): /x/run.lock;")
    assert diagnose(ValueError("a bug"), tmp_path) is None
    assert diagnose(OSError(errno.ENOENT, "No such file"), tmp_path) is None  # not the disk's refusal


def test_a_refused_write_is_found_inside_a_wrapping_error(tmp_path):
    try:
        try:
            raise OSError(errno.EACCES, "Permission denied", "/ro/final_model/model.safetensors")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        fault = diagnose(outer, tmp_path)
    assert fault is not None and "permission denied (EACCES): /ro/final_model/model.safetensors" in str(fault)
    ray_style = RuntimeError("ray task failed")
    ray_style.cause = OSError(errno.EDQUOT, "Disk quota exceeded")  # RayTaskError keeps the actor's error here
    assert "disk quota exceeded (EDQUOT)" in str(diagnose(ray_style, tmp_path))


def test_any_error_of_a_native_write_on_a_full_disk_is_put_down_to_it(tmp_path, monkeypatch):
    """torch.save on a full disk raises ``RuntimeError: ... unexpected pos``: no errno to go by."""
    stat = os.statvfs(tmp_path)
    full = SimpleNamespace(f_flag=stat.f_flag, f_bavail=0, f_frsize=stat.f_frsize)
    monkeypatch.setattr(faults.os, "statvfs", lambda _: full)
    full_disk = pytest.raises(DiskFault, match=r"^no space left on device \(ENOSPC\): ")
    with full_disk, disk_faults(tmp_path / "step_000004", any_error=True):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    untouched = pytest.raises(RuntimeError, match="unexpected pos")  # not around a native write
    with untouched, disk_faults(tmp_path):
        raise RuntimeError("unexpected pos 576 vs 534")


def test_a_read_only_run_dir_is_one_line_and_exit_1(tiny_task_model, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "ro"
    real_mkdir = type(run_dir).mkdir

    def read_only(self, *args, **kwargs):
        if self == run_dir:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(type(run_dir), "mkdir", read_only)
    args = [*tiny_run_overrides(tiny_task_model, tmp_path, "ro"), "run.backend=local", "reward.pool_size=0"]
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: read-only file system (EROFS): {run_dir};"), err
