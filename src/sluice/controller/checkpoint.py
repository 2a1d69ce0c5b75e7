"""Checkpoint folders of a run: atomic writes, which ones are complete, which one a resume picks.

A checkpoint is ``<run dir>/checkpoints/step_NNNNNN/`` with ``trainer/`` (the train engine's HF
folder, optimizer and RNG, written by whoever holds the trainer), ``driver.pkl`` (the driver's
state, ``controller/resume.py``) and ``COMPLETE`` (a JSON manifest of every file with its size
and SHA-256, written last; ``verify_checkpoint`` checks them before a resume unpickles anything). It is built in
a ``.tmp-`` folder, every file and folder fsynced, then renamed into place and the parent
fsynced: a crash at any point leaves either the whole checkpoint or a temp folder that resume
ignores (and the next write removes). Only the newest ``keep`` complete checkpoints stay.

This module knows files, not what the state means; it does not capture or restore anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

from sluice.config import ConfigError

CHECKPOINTS_DIR = "checkpoints"
COMPLETE = "COMPLETE"
DRIVER_STATE = "driver.pkl"
TRAINER_DIR = "trainer"
_PREFIX = "step_"
_TMP = ".tmp-"
RESUMABLE_FIELDS = frozenset(
    {
        "steps",
        "resume",
        "max_minutes",
        "progress",
        "checkpoint_every",
        "keep_checkpoints",
        "eval_every",
        "trace",
        "ray_address",
        "failure_budget",
        "failure_window",
        "stall_timeout_s",
    }
)
"""``run.*`` fields a resumed run may change (they steer the run, not its computation)."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from; the message names its path."""


class CheckpointStore:
    """The checkpoints of one run directory."""

    def __init__(self, run_dir: str | Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.keep = keep

    def begin(self, version: int) -> Path:
        """A fresh temp folder for the checkpoint of ``version`` (leftovers of crashed writes go)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{_TMP}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f"{_TMP}{_PREFIX}{version:06d}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, version: int) -> Path:
        """Seal ``tmp`` (manifest, fsync) and rename it into place; prune old checkpoints."""
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        sums = {name: _sha256(tmp / name) for name in files}
        sizes = {name: (tmp / name).stat().st_size for name in files}
        (tmp / COMPLETE).write_text(json.dumps({"version": version, "files": files, "bytes": sizes, "sha256": sums}))
        _fsync_tree(tmp)
        final = self.root / f"{_PREFIX}{version:06d}"
        if final.exists():  # a resumed run writing the step again: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        self.prune()
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob(f"{_PREFIX}*") if p.is_dir() and incomplete_reason(p) is None]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def drop_newer_than(self, version: int) -> None:
        """A resume from an older checkpoint abandons the newer ones (``resume=auto`` must not
        pick them later)."""
        for path in self.complete():
            if int(path.name.removeprefix(_PREFIX)) > version:
                shutil.rmtree(path)

    def prune(self) -> None:
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old)


def incomplete_reason(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or ``None`` if it is one."""
    manifest = path / COMPLETE
    if not manifest.is_file():
        return f"no {COMPLETE} manifest (the write did not finish, or it is not a checkpoint folder)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"unreadable {COMPLETE} manifest"
    missing = [name for name in files if not (path / name).is_file()]
    if DRIVER_STATE not in files or missing:
        return f"files missing: {missing or [DRIVER_STATE]}"
    return None


def verify_checkpoint(path: Path) -> None:
    """Every file the manifest lists has its recorded size and SHA-256, before anything in it is
    unpickled (the driver state, DCP's metadata); raises ``CheckpointError`` naming the file."""
    manifest = json.loads((path / COMPLETE).read_text())
    if "sha256" not in manifest:
        raise CheckpointError(f"run.resume: {path} has no checksums in {COMPLETE} (written by an older sluice)")
    for name, digest in manifest["sha256"].items():
        file = path / name
        if not file.is_file() or file.stat().st_size != manifest["bytes"][name] or _sha256(file) != digest:
            raise CheckpointError(f"run.resume: {file} does not match the checksum in {path / COMPLETE}")


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve_resume(spec: str | None, run_dir: str | Path) -> Path | None:
    """The checkpoint ``run.resume`` names: ``auto`` → the run dir's newest complete one (``None``
    if there is none); a path → that folder, which must be complete; ``None`` → no resume."""
    if spec is None or spec == "":
        return None
    if spec == "auto":
        return CheckpointStore(run_dir).latest()
    path = Path(spec)
    reason = incomplete_reason(path) if path.is_dir() else "not a folder"
    if reason is not None:
        raise CheckpointError(f"run.resume: {path} is not a complete checkpoint: {reason}")
    return path


def write_driver_state(folder: Path, state: Any) -> None:
    with (folder / DRIVER_STATE).open("wb") as f:
        pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)


def read_driver_state(folder: Path) -> Any:
    """The driver state of a complete checkpoint (a pickle this code wrote: trusted input only)."""
    with (folder / DRIVER_STATE).open("rb") as f:
        return pickle.load(f)


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted names of config fields that differ, except the ``RESUMABLE_FIELDS`` of ``run``."""
    flat_saved, flat_current = _flatten(saved), _flatten(current)
    keys = sorted(set(flat_saved) | set(flat_current))
    allowed = {f"run.{name}" for name in RESUMABLE_FIELDS}
    return [k for k in keys if k not in allowed and flat_saved.get(k) != flat_current.get(k)]


def log_sizes(paths: dict[str, Path]) -> dict[str, int]:
    """Bytes of each append-only log now (a resume cuts them back to this)."""
    return {name: p.stat().st_size if p.is_file() else 0 for name, p in paths.items()}


def truncate_log(path: Path, size: int) -> None:
    """Drop what a killed run appended to ``path`` after its checkpoint (lines of redone steps)."""
    if path.is_file() and path.stat().st_size > size:
        with path.open("r+b") as f:
            f.truncate(size)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
