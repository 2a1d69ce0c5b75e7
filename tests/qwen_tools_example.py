"""The ``examples/qwen_tools_agent`` scripts as modules, for tests of its template, agent and model step."""

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).parents[1] / "examples" / "qwen_tools_agent"


def load(name: str) -> ModuleType:
    """``examples/qwen_tools_agent/<name>.py`` imported under a unique module name."""
    spec = importlib.util.spec_from_file_location(f"qwen_tools_agent_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
