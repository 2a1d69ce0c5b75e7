"""A local Hugging Face model folder's checks (``model.path``), without torch or transformers.

The CLI asks them before it imports either, so a wrong path is said in a second, not after the
seconds those imports take; ``engines/hf_model.py`` asks them again before it loads. This module
does not load anything.
"""

from __future__ import annotations

from pathlib import Path


class ModelPathError(ValueError):
    """``model.path`` does not point at a usable local model folder."""


def check_model_dir(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelPathError(f"model.path: {p} does not exist (expected a local Hugging Face model folder)")
    if not p.is_dir():
        raise ModelPathError(f"model.path: {p} is a file, expected a folder with config.json")
    if not (p / "config.json").is_file():
        raise ModelPathError(f"model.path: {p} has no config.json (not a Hugging Face model folder)")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ModelPathError(f"model.path: {p} has no weights (*.safetensors or *.bin)")
    return p
