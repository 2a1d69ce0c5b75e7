"""``WeightTensors``: weight updates staged in memory, for an engine that loads them from tensors.

The in-memory counterpart of ``WeightFolders`` (``weight_folder.py``), with the same methods, so
``SegmentedEngine`` drives either: ``write`` turns a version's weights into the list of
``(name, tensor)`` pairs the engine loads (snapshots on the CPU, tied aliases once, a tied
model's ``lm_head.weight`` added as a copy of the embedding when the engine serves it untied)
and keeps it until a newer version is loaded. No file is written for an update; the only
folder is the untied copy of a tied model that the engine starts from (``serving_folder``).

It does not move the tensors to the engine: the engine's backend does (vLLM: a
``reload_weights(weights_iterator=...)`` RPC, ``vllm_engine.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from sluice.engines.weight_folder import DEFAULT_ROOT, WeightFolders, serving_tensors

WeightItems = list[tuple[str, torch.Tensor]]
"""One version's weights as an engine's weight iterator yields them."""


class WeightTensors:
    """Stages versions as ``WeightItems`` in this process; drops superseded ones."""

    def __init__(self, model_dir: str | Path, root: str | Path = DEFAULT_ROOT, *, untie: bool = False) -> None:
        self._folders = WeightFolders(model_dir, root, untie=untie)  # the serving folder and checksum rules
        self.model_dir = self._folders.model_dir
        self.staged: dict[int, WeightItems] = {}

    def serving_folder(self) -> Path:
        """The folder the engine starts from (``WeightFolders.serving_folder``)."""
        return self._folders.serving_folder()

    def write(self, weights: Mapping[str, torch.Tensor], version: int) -> WeightItems:
        """Snapshot ``weights`` (names as in the HF ``state_dict``) as version ``version``."""
        items = list(serving_tensors(weights, self._folders.untie, copy=True).items())
        self.staged[version] = items
        return items

    def checksum(self, weights: Mapping[str, torch.Tensor]) -> float:
        return self._folders.checksum(weights)

    def release_older(self, version: int) -> None:
        """Forget the versions below ``version`` (loaded or superseded)."""
        for old in [v for v in self.staged if v < version]:
            del self.staged[old]

    def close(self) -> None:
        self.staged.clear()
        self._folders.close()
