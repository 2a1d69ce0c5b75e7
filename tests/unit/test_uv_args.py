"""``scripts/uv_args.py``: pip's configured package sources become uv's options (the venvs are
built with uv, which does not read pip.conf)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "uv_args.py"


def _uv_args():
    spec = importlib.util.spec_from_file_location("uv_args", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.uv_args


def test_pip_sources_become_uv_options_once_each():
    listed = (
        ":env:.cert='/etc/ssl/certs/ca.crt'\n"
        ":env:.find-links='/opt/wheels'\n"
        ":env:.default-timeout='180'\n"
        "global.constraint='/etc/xdg/pip/constraints.txt'\n"
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'\n"
        "global.find-links='/opt/wheels'\n"
    )
    assert _uv_args()(listed) == [
        "--index-strategy", "unsafe-best-match", "--native-tls", "--find-links", "/opt/wheels",
        "--constraint", "/etc/xdg/pip/constraints.txt",
        "--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple",
    ]  # fmt: skip


def test_no_pip_settings_leave_uv_on_its_defaults_but_picking_like_pip():
    assert _uv_args()("") == ["--index-strategy", "unsafe-best-match"]
