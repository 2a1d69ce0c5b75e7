"""What a test asks of this host or of a run's files, that no ``sluice`` command needs: whether
the sandbox's cgroups can be created here, and who holds a run directory's lock."""

from __future__ import annotations

import json
from pathlib import Path

from sluice.rewards.jail import Cgroup
from sluice.runtime.run_lock import LOCK_FILE


def cgroups_available() -> bool:
    """Whether this process can create the sandbox's cgroups."""
    probe = Cgroup(8, 64 << 20)
    probe.remove()
    return bool(probe.dirs)


def read_holder(run_dir: Path) -> dict[str, object]:
    """The holder recorded in ``run_dir``'s lock file (``{}``: none, or released in order)."""
    path = run_dir / LOCK_FILE
    text = path.read_text(errors="replace").strip() if path.is_file() else ""
    return json.loads(text) if text else {}
