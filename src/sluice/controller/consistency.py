"""A checkpoint is believed only if its parts agree: its folder name, its manifest, the driver's
state, the trainer's state and the queue's snapshot.

``check_consistent(path, version, cut)`` runs after ``verify_checkpoint`` (every file is what was written)
and before a checkpoint is resumed from, or an older one is pruned because of it. It checks that
the step in the folder name (``step_NNNNNN``) is the manifest's ``version``, the driver state's
``version`` and the trainer state's ``version``; that the books agree with themselves (no group
trained after that step, no group id at or past the next id to admit, no group both waiting in the
queue and trained or restarted); and that the queue snapshot holds the rows of exactly the groups
whose reports wait untrained. A disagreement is a ``CheckpointError`` naming the checkpoint and
the two parts that disagree: ``resume=auto`` sets it aside (``*.rejected``) and uses the previous
one, a checkpoint just written is set aside and nothing older is pruned (``resume.py``).

It reads and compares; it repairs nothing and knows no file layout beyond the checkpoint's names.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sluice.controller.checkpoint import TRAINER_DIR, CheckpointError, read_manifest
from sluice.schedule.ledger import GroupState
from sluice.trainer.worker import TRAINER_STATE

if TYPE_CHECKING:
    from sluice.controller.cut import AsyncCut

_NAME = re.compile(r"step_(\d{6})")


def check_consistent(path: Path, version: int, cut: AsyncCut) -> None:
    """Raise ``CheckpointError`` naming what disagrees in the checkpoint at ``path``, whose driver
    state holds ``version`` and ``cut``; return if every part agrees."""
    problem = _disagreement(path, version, cut)
    if problem is not None:
        raise CheckpointError(f"run.resume: {path} is inconsistent: {problem}")


def _disagreement(path: Path, version: int, cut: AsyncCut) -> str | None:
    manifest = read_manifest(path).get("version")
    named = _NAME.fullmatch(path.name)  # resume=PATH may name a copy: then the manifest's step is the step
    step = int(named[1]) if named else manifest
    if manifest != step:
        return f"its folder name says step {step}, its manifest version {manifest}"
    if version != step:
        return f"its folder name says step {step}, its driver state (driver.json) version {version}"
    trainer = _trainer_version(path)
    if trainer != step:
        return f"its driver state says version {step}, its trainer state ({TRAINER_DIR}/{TRAINER_STATE}) {trainer}"
    return _books(version, cut) or _queue(cut)


def _trainer_version(path: Path) -> int | str:
    file = path / TRAINER_DIR / TRAINER_STATE
    if not file.is_file():
        return "missing"
    return int(torch.load(file, weights_only=True)["version"])


def _books(version: int, cut: AsyncCut) -> str | None:
    """The driver's books at the cut agree with themselves and with the step."""
    groups = cut.ledger.groups
    late = sorted(g.group_id for g in groups.values() if g.trained_at is not None and g.trained_at > version)
    if late:
        at = groups[late[0]].trained_at
        return f"the ledger has group {late[0]} trained at step {at}, after step {version}"
    ids = set(groups) | set(cut.reports) | {gid for _, gid in cut.regenerate}
    if ids and max(ids) >= cut.next_group:
        return f"group {max(ids)} is at or past the next group id to admit ({cut.next_group})"
    trained = sorted(gid for gid in cut.reports if gid in groups and groups[gid].state is GroupState.TRAINED)
    if trained:
        return f"group {trained[0]} waits in the queue (its report is in the cut) but the ledger has it trained"
    both = sorted(set(cut.reports) & {gid for _, gid in cut.regenerate})
    if both:
        return f"group {both[0]} both waits in the queue and is to be generated again"
    return None


def _queue(cut: AsyncCut) -> str | None:
    """The queue snapshot holds the rows of exactly the groups whose reports wait untrained."""
    snapshot: dict[str, Any] = cut.queue
    if "storage" not in snapshot:  # a pipeline without a queue snapshot (none written)
        return None
    rows = {int(row[1]) for row in snapshot["storage"]["meta"]}
    extra, missing = sorted(rows - set(cut.reports)), sorted(set(cut.reports) - rows)
    if extra:
        return f"the queue snapshot holds rows of group {extra[0]}, which has no report in the driver state"
    if missing:
        return f"the driver state has group {missing[0]} waiting in the queue, the queue snapshot has no row of it"
    return None
