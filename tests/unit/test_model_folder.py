"""``model.path`` with a truncated or corrupt ``model.safetensors``: one line naming the file,
before torch is imported (``engines/model_folder.py``), exit 2 from the CLI."""

import json
import struct

import pytest

from sluice.cli import main
from sluice.engines.model_folder import ModelPathError, check_model_dir


def _model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    return folder


def test_a_whole_safetensors_file_passes(tmp_path):
    assert check_model_dir(_model(tmp_path)) == tmp_path / "model"


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda b: b[:-5], "the file holds"),  # a download cut short
        (lambda b: b[:6], "no readable header"),
        (lambda b: b[:8] + b"#" + b[9:], "its header does not parse"),
        (lambda b: b + b"tail", "the file holds"),
    ],
)
def test_a_damaged_safetensors_file_is_one_line_naming_it(tmp_path, capsys, damage, says):
    weights = _model(tmp_path) / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(ModelPathError, match=says):
        check_model_dir(weights.parent)
    assert main(["train", f"model.path={weights.parent}", "run.backend=local"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.path: {weights} is" in err[0] and "corrupt" in err[0]
