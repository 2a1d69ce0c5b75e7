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

from sluice.weights.versions import NO_VERSION, WeightVersionError, check_keep, check_publish, missing_version

__all__ = ["NO_VERSION", "InProcessWeightSync", "WeightVersionError"]


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
