"""Checkpoint folders of a run: atomic writes, which ones are complete, which run they belong to.

A checkpoint is ``<run dir>/checkpoints/step_NNNNNN/`` with ``trainer/`` (the train engine's HF
folder, optimizer and RNG, written by whoever holds the trainer), ``driver.json`` (the driver's
state, ``controller/resume.py``, in ``state_codec``'s JSON) and ``COMPLETE``, written last: a
JSON manifest with the checkpoint format version, the run id, the data files' SHA-256, and every
file's size and SHA-256 (``verify_checkpoint`` checks them before a resume reads anything, DCP's
pickled metadata included). It is built in a ``.tmp-<run id>-`` folder, every file and folder
fsynced, renamed into place, the parent fsynced, and read back and verified before any older
checkpoint is pruned: a crash at any point leaves either the whole checkpoint or a temp folder
that resume ignores (and this run's next write removes).

One run per run dir: a fresh run records its id in ``<run dir>/run.json`` and refuses a run dir
that already holds checkpoints; pruning, dropping and temp-folder cleanup touch only this run id's
folders. A checkpoint that fails verification, or is not believed (its parts disagree:
``controller/consistency.py``), is renamed ``step_NNNNNN.rejected`` (kept, never deleted, out of
every listing).

This module knows files, not what the state means; it does not capture or restore anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sluice.config import ConfigError
from sluice.controller import state_codec

CHECKPOINTS_DIR = "checkpoints"
COMPLETE = "COMPLETE"
DRIVER_STATE = "driver.json"
TRAINER_DIR = "trainer"
RUN_FILE = "run.json"
FORMAT_VERSION = 2
"""The checkpoint layout this sluice writes and reads (1: ``driver.pkl``, no run id; 2: JSON)."""
_PREFIX = "step_"
_NAME = re.compile(r"step_(\d{6})")
_TMP = ".tmp-"
_REJECTED = ".rejected"
RUN_CONTROL = (
    "run.steps",
    "run.resume",
    "run.max_minutes",
    "run.progress",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.trace",
    "run.trace_max_events",
    "run.ray_address",
    "run.failure_budget",
    "run.failure_window",
    "run.stall_timeout_s",
    "run.max_restarts",
)
RESUMABLE: dict[str, tuple[str, ...]] = {
    "learning rate and schedule": ("trainer.lr", "trainer.lr_schedule", "trainer.lr_warmup_steps"),
    "evaluation": ("eval.*", "run.eval_every"),
    "tracking": ("tracking.*",),
    "run control": RUN_CONTROL,
}
"""What a resumed run may change, by kind (``section.*``: every key of the section): they steer
the run, what it reports, or the rate its optimizer steps at from the checkpoint on (the train
engine applies the new ``lr`` and schedule at the checkpoint's update count). Anything else
would make the continuation a different run than the checkpoint's, so it is refused."""


def may_change_on_resume(key: str) -> bool:
    """Whether the dotted config ``key`` is one a resume may change (``RESUMABLE``)."""
    return any(key == name or (name.endswith(".*") and key.startswith(name[:-1])) for names in RESUMABLE.values()
               for name in names)  # fmt: skip


def resumable_text() -> str:
    """``RESUMABLE`` in one line, for the refusal's message."""
    return "; ".join(f"{kind} ({', '.join(names)})" for kind, names in RESUMABLE.items())


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from; the message names its path."""


class CheckpointStore:
    """The checkpoints of one run (``run_id``) in its run directory."""

    def __init__(
        self, run_dir: str | Path, keep: int = 2, run_id: str = "", data: Mapping[str, str] | None = None
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS_DIR
        self.keep = keep
        self.run_id = run_id
        self.data = dict(data or {})
        """The data files' SHA-256 (``data_fingerprint``), recorded in every manifest."""

    def begin(self, version: int) -> Path:
        """A fresh temp folder for the checkpoint of ``version`` (this run's crashed writes go)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{self._tmp_prefix}*"):
            shutil.rmtree(stale)
        tmp = self.root / f"{self._tmp_prefix}{_PREFIX}{version:06d}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, version: int, believe: Callable[[Path], None] | None = None) -> Path:
        """Seal ``tmp`` (manifest, fsync), rename it into place, verify it as written and
        ``believe`` it (its parts agree: ``consistency.py``); only then prune this run's older
        checkpoints. One that fails is set aside (``*.rejected``, a step it replaced put back),
        nothing is pruned, and the ``CheckpointError`` propagates."""
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "format": FORMAT_VERSION,
            "run_id": self.run_id,
            "version": version,
            "data": self.data,
            "files": files,
            "bytes": {name: (tmp / name).stat().st_size for name in files},
            "sha256": {name: _sha256(tmp / name) for name in files},
        }
        (tmp / COMPLETE).write_text(json.dumps(manifest, indent=1))
        _fsync_tree(tmp)
        final = self.root / f"{_PREFIX}{version:06d}"
        replaced = None
        if final.exists():  # this run writing a step again replaces it, after the new one verified
            if run_id_of(final) == self.run_id:
                replaced = self.root / f"{self._tmp_prefix}replaced-{final.name}"
                os.replace(final, replaced)
            else:  # not this run's: kept, out of the way
                set_aside(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        try:  # deliberately: a checkpoint not believed leaves every older one where it was
            verify_checkpoint(final)
            if believe is not None:
                believe(final)
        except CheckpointError:
            set_aside(final)
            if replaced is not None:
                os.replace(replaced, final)
            raise
        if replaced is not None:
            shutil.rmtree(replaced)
        self.prune()
        return final

    def complete(self) -> list[Path]:
        """This run's complete checkpoints, oldest first."""
        return [p for p in complete_checkpoints(self.root) if run_id_of(p) == self.run_id]

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def drop_newer_than(self, version: int) -> None:
        """A resume from an older checkpoint abandons this run's newer ones (``resume=auto`` must
        not pick them later). Call only once the resumed checkpoint verified."""
        for path in self.complete():
            if step_of(path) > version:
                shutil.rmtree(path)

    def prune(self) -> None:
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old)

    @property
    def _tmp_prefix(self) -> str:
        return f"{_TMP}{self.run_id}-"


def step_of(path: Path) -> int:
    return int(path.name.removeprefix(_PREFIX))


def checkpoint_folders(root: Path) -> list[Path]:
    """Every ``step_NNNNNN`` folder under ``root`` (complete or not, any run), oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _NAME.fullmatch(p.name)), key=lambda p: p.name)


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete ones of ``checkpoint_folders`` (any run), oldest first."""
    return [p for p in checkpoint_folders(root) if incomplete_reason(p) is None]


def read_manifest(path: Path) -> dict[str, Any]:
    """``path``'s ``COMPLETE`` manifest; a checkpoint of another format version is an error naming
    the version found and the one this sluice reads."""
    try:
        manifest = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"run.resume: {path / COMPLETE} is unreadable ({err})") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != FORMAT_VERSION:
        written = "none (written by a sluice before format versions)" if found is None else found
        raise CheckpointError(
            f"run.resume: {path} has checkpoint format version {written}; this sluice reads format version "
            f"{FORMAT_VERSION} (resume it with the sluice that wrote it, or start a new run.name)"
        )
    return manifest


def run_id_of(path: Path) -> str | None:
    """The run id in ``path``'s manifest (``None``: none, unreadable, or another format)."""
    try:
        return str(read_manifest(path)["run_id"])
    except (CheckpointError, KeyError):
        return None


def incomplete_reason(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or ``None`` if it is one (of any format)."""
    manifest = path / COMPLETE
    if not manifest.is_file():
        return f"no {COMPLETE} manifest (the write did not finish, or it is not a checkpoint folder)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"unreadable {COMPLETE} manifest"
    missing = [name for name in files if not (path / name).is_file()]
    return f"files missing: {missing}" if missing else None


def verify_checkpoint(path: Path) -> None:
    """The format version, and every file the manifest lists with its recorded size and SHA-256,
    before anything in it is read (the driver state, DCP's pickled metadata); raises
    ``CheckpointError`` naming the file."""
    manifest = read_manifest(path)
    if DRIVER_STATE not in manifest["files"]:
        raise CheckpointError(f"run.resume: {path} has no {DRIVER_STATE}")
    for name in manifest["files"]:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"run.resume: {file} is missing (listed in {path / COMPLETE})")
        if file.stat().st_size != manifest["bytes"][name]:
            size = file.stat().st_size
            raise CheckpointError(f"run.resume: {file} has {size} bytes, {manifest['bytes'][name]} were written")
        if _sha256(file) != manifest["sha256"][name]:
            raise CheckpointError(f"run.resume: {file} does not match the checksum in {path / COMPLETE}")


def set_aside(path: Path) -> Path:
    """Rename a checkpoint folder out of every listing (``step_NNNNNN.rejected``, numbered if
    taken) without deleting anything; the new path."""
    target = path.with_name(path.name + _REJECTED)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{_REJECTED}-{n}")
    os.replace(path, target)
    return target


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def open_run(run_dir: Path, resume: str | None) -> tuple[str, list[Path]]:
    """This run's id and the checkpoints to try, newest first (``[]``: start fresh).

    ``resume`` ``None``: a fresh run, refused if the run dir holds any checkpoint; it gets a new
    id, written to ``run.json``. ``auto``: the complete checkpoints of the run the newest one
    belongs to, newest first (a checkpoint of another format version is an error), or fresh if
    there are none (with the id in ``run.json``, if a run that never checkpointed left one). A
    path: that checkpoint, which must be complete; the run continues its run id, in a run dir that
    holds no other run's checkpoints."""
    root = run_dir / CHECKPOINTS_DIR
    recorded = _recorded_run_id(run_dir)
    if resume is None or resume == "":
        held = checkpoint_folders(root) + sorted(root.glob(f"{_TMP}*"))
        if held:
            raise CheckpointError(
                f"run.resume: {run_dir} already holds checkpoints ({held[-1].name}, run "
                f"{recorded or 'unknown'}); pass resume=auto to continue that run, or choose another run.name"
            )
        return _record_run_id(run_dir, uuid.uuid4().hex), []
    if resume == "auto":
        done = complete_checkpoints(root)
        ids = [str(read_manifest(p).get("run_id")) for p in reversed(done)]  # a format mismatch stops here
        run_id = ids[0] if ids else recorded or uuid.uuid4().hex
        return _record_run_id(run_dir, run_id), [p for p, i in zip(reversed(done), ids, strict=True) if i == run_id]
    path = Path(resume)
    reason = incomplete_reason(path) if path.is_dir() else "not a folder"
    if reason is not None:
        raise CheckpointError(f"run.resume: {path} is not a complete checkpoint: {reason}")
    run_id = str(read_manifest(path).get("run_id"))
    others = {str(read_manifest(p).get("run_id")) for p in complete_checkpoints(root)} - {run_id}
    if others:
        raise CheckpointError(
            f"run.resume: {run_dir} holds checkpoints of another run ({sorted(others)[0]}) than {path} "
            f"({run_id}); resume it into its own run dir or choose another run.name"
        )
    return _record_run_id(run_dir, run_id), [path]


def _recorded_run_id(run_dir: Path) -> str | None:
    file = run_dir / RUN_FILE
    if not file.is_file():
        return None
    try:
        return str(json.loads(file.read_text())["run_id"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f'run.resume: {file} is unreadable (it should hold {{"run_id": ...}})') from None


def _record_run_id(run_dir: Path, run_id: str) -> str:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_FILE).write_text(json.dumps({"run_id": run_id}) + "\n")
    return run_id


def data_fingerprint(paths: Sequence[str]) -> dict[str, str]:
    """SHA-256 of every data file (each file of a ``datasets`` folder), by path."""
    out: dict[str, str] = {}
    for spec in paths:
        top = Path(spec)
        files = sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top]
        out.update({str(f): _sha256(f) for f in files if f.is_file()})
    return out


def data_changes(saved: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """Data files added, removed or changed since ``saved``."""
    return sorted(name for name in set(saved) | set(current) if saved.get(name) != current.get(name))


def write_driver_state(folder: Path, state: Any, classes: Mapping[str, type] | None = None) -> None:
    """``state`` as ``driver.json``; dataclasses and enums only of ``classes`` (what a resume may
    build: a type outside them fails here, at the save)."""
    (folder / DRIVER_STATE).write_text(state_codec.dumps(state, dict(classes or {})))


def read_driver_state(folder: Path, classes: Mapping[str, type] | None = None) -> Any:
    """The driver state of a verified checkpoint; dataclasses and enums only of ``classes``."""
    try:
        return state_codec.loads((folder / DRIVER_STATE).read_text(), dict(classes or {}))
    except (ValueError, TypeError, KeyError) as err:  # StateCodecError and JSON errors are ValueErrors
        raise CheckpointError(f"run.resume: {folder / DRIVER_STATE} is unreadable ({err})") from None


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted names of config fields that differ, except those a resume may change (``RESUMABLE``)."""
    flat_saved, flat_current = _flatten(saved), _flatten(current)
    keys = sorted(set(flat_saved) | set(flat_current))
    return [k for k in keys if not may_change_on_resume(k) and flat_saved.get(k) != flat_current.get(k)]


def log_sizes(paths: dict[str, Path]) -> dict[str, int]:
    """Bytes of each append-only log now (a resume cuts them back to this)."""
    return {name: p.stat().st_size if p.is_file() else 0 for name, p in paths.items()}


def truncate_log(path: Path, size: int) -> None:
    """Drop what a killed run appended to ``path`` after its checkpoint (lines of redone steps)."""
    if path.is_file() and path.stat().st_size > size:
        with path.open("r+b") as f:
            f.truncate(size)


def drop_cut_line(path: Path) -> int:
    """A JSONL log whose last line was cut mid-line (no newline at its end: a write that did not
    finish, a disk that lost the file's tail) loses that line, so appending does not glue the next
    record onto it; the bytes dropped (0: the file ends with a whole line, is empty or absent)."""
    if not path.is_file() or path.stat().st_size == 0:
        return 0
    with path.open("r+b") as f:
        size = f.seek(0, os.SEEK_END)
        tail, start = b"", size
        while start > 0 and b"\n" not in tail:  # back to the last newline, a block at a time
            start = max(0, start - 4096)
            f.seek(start)
            tail = f.read(size - start)
        if tail.endswith(b"\n"):
            return 0
        keep = start + tail.rfind(b"\n") + 1  # 0 when the file holds no newline at all
        f.truncate(keep)
    return size - keep


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
