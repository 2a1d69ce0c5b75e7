"""A local Hugging Face model folder's checks (``model.path``), without torch or transformers.

The CLI asks them before it imports either, so a wrong path is said in a second, not after the
seconds those imports take; ``engines/hf_model.py`` asks them again before it loads. A
``*.safetensors`` file must hold what its header says: a truncated or corrupt one (a download cut
short, a disk that lost its tail) is said naming the file, instead of a loader's traceback. This
module does not load anything; it reads the headers only, so a bit flipped inside a tensor's
bytes is not found.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER = 100 << 20
"""safetensors' own limit on a header's bytes."""


class ModelPathError(ValueError):
    """``model.path`` does not point at a usable local model folder."""


def check_model_dir(path: str | Path, field: str = "model.path") -> Path:
    """``path`` as a checked model folder; ``ModelPathError`` naming ``field`` otherwise."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelPathError(f"{field}: {p} does not exist (expected a local Hugging Face model folder)")
    if not p.is_dir():
        raise ModelPathError(f"{field}: {p} is a file, expected a folder with config.json")
    if not (p / "config.json").is_file():
        raise ModelPathError(f"{field}: {p} has no config.json (not a Hugging Face model folder)")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ModelPathError(f"{field}: {p} has no weights (*.safetensors or *.bin)")
    for weights in sorted(p.glob("*.safetensors")):
        check_safetensors(weights, field)
    return p


def check_safetensors(file: Path, field: str = "model.path") -> None:
    """``file``'s header parses and its tensors end where the file does; ``ModelPathError``
    naming the file otherwise."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or n > MAX_HEADER or 8 + n > size:
            raise ModelPathError(f"{field}: {file} is truncated or corrupt ({size} bytes, no readable header)")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
            raise ModelPathError(f"{field}: {file} is corrupt (its header does not parse: {err})") from None
    if 8 + n + end != size:
        raise ModelPathError(
            f"{field}: {file} is truncated or corrupt: its header lists {8 + n + end} bytes, the file holds {size}"
        )


def check_reward_model_dir(path: str | Path, field: str = "reward.model") -> Path:
    """``path`` as a scalar reward model folder (a ``...ForSequenceClassification`` with one
    label, as ``sluice rm`` writes), from its files and ``config.json`` alone; ``ModelPathError``
    naming ``field`` otherwise."""
    p = check_model_dir(path, field)
    config = json.loads((p / "config.json").read_text())
    architectures = list(config.get("architectures") or [])
    labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures) or labels != 1:
        raise ModelPathError(
            f"{field}: {p} is not a scalar reward model (architectures {architectures}, {labels} labels; expected "
            "a ...ForSequenceClassification with one label: train one with sluice rm)"
        )
    return p
