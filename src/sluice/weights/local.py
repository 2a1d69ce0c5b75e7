"""In-process weight sync: versioned, detached CPU copies of the trainer's tensors in a dict.

``InProcessWeightSync`` implements ``WeightSync`` for ``backend: local`` (trainer and engines in
one process) and for unit tests: ``publish`` copies every tensor to CPU (so later optimizer steps
cannot change a published version), ``fetch`` returns those copies, and only the newest ``keep``
versions are held. It does not cross processes (``object_store.py`` does) and does not apply
weights to an engine (``InferenceEngine.update_weights`` does).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

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


class InProcessWeightSync:
    """``WeightSync`` within one process (see the module docstring)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = check_keep(keep)
        self._versions: dict[int, dict[str, torch.Tensor]] = {}

    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Store detached CPU copies of ``named_tensors`` as ``version``; drop the oldest beyond ``keep``."""
        check_publish(version, self.latest_version())
        self._versions[version] = {name: t.detach().to("cpu", copy=True) for name, t in named_tensors.items()}
        for old in sorted(self._versions)[: -self.keep]:
            del self._versions[old]

    def fetch(self, version: int) -> Mapping[str, torch.Tensor]:
        """The tensors published as ``version`` (shared, not copied: treat them as read-only)."""
        if version not in self._versions:
            raise missing_version(version, list(self._versions), self.keep)
        return dict(self._versions[version])

    def latest_version(self) -> int:
        return max(self._versions, default=NO_VERSION)
