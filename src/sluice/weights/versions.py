"""Version bookkeeping every weight sync shares: the "nothing published" version, the error for a
version that is not held, and the checks on ``keep`` and on publishing order.

Torch-free on purpose: the object store's registry actor (``registry.py``) uses these checks, and
an actor that imports torch pays about 2 CPU-seconds at every start. Not here: storing or moving
tensors (``local.py``, ``object_store.py``, ``broadcast.py``).
"""

from __future__ import annotations

NO_VERSION = -1  # ``latest_version()`` before the first ``publish``


class WeightVersionError(LookupError):
    """``fetch`` of a version that was never published or was already dropped."""


def check_keep(keep: int) -> int:
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    return keep


def check_publish(version: int, latest: int) -> None:
    """Versions never decrease; publishing the latest version again replaces it."""
    if version < latest:
        raise ValueError(f"publish of version {version} after version {latest}: versions must not decrease")


def missing_version(version: int, kept: list[int], keep: int) -> WeightVersionError:
    """The error for a ``fetch`` of a version that is not held."""
    if kept and version < min(kept):
        why = f"was dropped (only the latest keep={keep} versions are held: {sorted(kept)})"
    else:
        why = f"was never published (held: {sorted(kept)})"
    return WeightVersionError(f"weights version {version} {why}")
