"""Versioned weight folders on tmpfs: how the trainer's tensors reach an engine in another process.

vLLM (``reload_weights(weights_path=...)``) and SGLang (``/update_weights_from_disk``) both load
weights from a folder by path, which works whatever process (or machine, with a shared
filesystem) the engine runs in; passing tensors themselves through vLLM's RPC breaks a
multiprocess engine (they arrive as lists). ``WeightFolders`` writes one ``model.safetensors``
plus the model's ``config.json`` per version under a private folder (``/dev/shm`` by default:
RAM, no disk I/O) and deletes a version's folder once a newer one is loaded.

``untie=True`` serves a tied-embedding model as an untied one (``lm_head.weight`` written as a
copy of the input embedding, ``tie_word_embeddings: false``): vLLM 0.32's in-place reload on CPU
refreshes the embedding but leaves the output projection's repacked copy stale, so a tied model
would keep its old output layer. It does not load anything; the engines do.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DEFAULT_ROOT = "/dev/shm"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def weights_checksum(weights: Mapping[str, torch.Tensor]) -> float:
    """The float64 sum of every element, tied aliases once: ``HFInferenceEngine``'s fingerprint."""
    with torch.no_grad():
        return float(sum(w.double().sum() for w in _unaliased(weights).values()))


def folder_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder's ``*.safetensors`` files."""
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


class WeightFolders:
    """Writes ``<root>/sluice-weights-<pid>-XXXX/v<version>/`` folders; removes superseded ones."""

    def __init__(self, model_dir: str | Path, root: str | Path = DEFAULT_ROOT, *, untie: bool = False) -> None:
        self.model_dir = Path(model_dir)
        self.config = json.loads((self.model_dir / "config.json").read_text())
        self.tied = bool(self.config.get("tie_word_embeddings"))
        self.untie = untie and self.tied
        if self.untie:
            self.config["tie_word_embeddings"] = False
        root = Path(root) if Path(root).is_dir() else Path(tempfile.gettempdir())
        self.base = Path(tempfile.mkdtemp(prefix=f"sluice-weights-{os.getpid()}-", dir=root))
        self.written: dict[int, Path] = {}
        # tmpfs is RAM: remove the folders even when nobody calls close() (a worker's end, exit)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.base, ignore_errors=True)

    def serving_folder(self) -> Path:
        """The folder an engine should start from: the model folder itself, or (``untie``) an
        untied copy with the tokenizer files next to it."""
        if not self.untie:
            return self.model_dir
        folder = self.base / "initial"
        folder.mkdir()
        for path in self.model_dir.iterdir():
            if path.is_file() and path.suffix not in (".safetensors", ".bin") and path.name != "config.json":
                shutil.copyfile(path, folder / path.name)
        self._save(folder_weights(self.model_dir), folder)
        return folder

    def write(self, weights: Mapping[str, torch.Tensor], version: int) -> Path:
        """Save ``weights`` (names as in the HF ``state_dict``) as version ``version``'s folder."""
        folder = self.base / f"v{version}"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir()
        self._save(weights, folder)
        self.written[version] = folder
        return folder

    def checksum(self, weights: Mapping[str, torch.Tensor]) -> float:
        """``weights_checksum`` with a tied model's ``lm_head`` counted once even when it arrives as
        a separate copy (weight syncs copy tensor by tensor)."""
        return weights_checksum({n: w for n, w in weights.items() if not (self.tied and n == HEAD)})

    def staged_checksum(self, version: int) -> float:
        """``checksum`` of version ``version``'s folder (read back: it is in RAM)."""
        return self.checksum(folder_weights(self.written[version]))

    def release_older(self, version: int) -> None:
        """Delete the folders of versions below ``version`` (loaded or superseded)."""
        for old in [v for v in self.written if v < version]:
            shutil.rmtree(self.written.pop(old), ignore_errors=True)

    def close(self) -> None:
        self._cleanup()
        self.written.clear()

    def _save(self, weights: Mapping[str, torch.Tensor], folder: Path) -> None:
        save_file(serving_tensors(weights, self.untie), str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(self.config, indent=2))


def serving_tensors(weights: Mapping[str, torch.Tensor], untie: bool) -> dict[str, torch.Tensor]:
    """``weights`` as the engine serves them: contiguous CPU tensors (views where they already
    are), tied aliases once, and with ``untie`` ``lm_head.weight`` added as a copy of the input
    embedding."""
    tensors = {name: w.detach().contiguous().cpu() for name, w in _unaliased(weights).items()}
    if untie:
        if EMBED not in tensors:
            raise ValueError(f"update_weights: tied model without {EMBED!r}; cannot untie its output layer")
        tensors[HEAD] = tensors[EMBED].clone()
    return tensors


def _unaliased(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop names whose tensor is another name's (a tied ``lm_head``): checkpoints store it once."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            out[name] = w
    return out
