"""The ``examples/gsm8k_style`` scripts as modules, for tests that build its data and model."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).parents[1] / "examples" / "gsm8k_style"


def load(name: str) -> ModuleType:
    """``examples/gsm8k_style/<name>.py`` imported under a unique module name."""
    spec = importlib.util.spec_from_file_location(f"gsm8k_style_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module
