"""Loading an agent by its path: ``package.module:function`` or ``path/to/file.py:function``.

Kept apart (standard library only) so the agents' own process (``agent_process.py``) loads an
agent without importing the rest of sluice. Running agents is ``agent_runner.py``'s.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

AgentFn = Callable[[Any, dict[str, Any]], Any]


def load_agent(path: str) -> AgentFn:
    """The function ``package.module:attr`` (or ``path/to/file.py:attr``) names; a ``ValueError``
    naming ``agentic.agent`` otherwise."""
    module, _, attr = path.rpartition(":")
    if not module or not attr:
        raise ValueError(f"agentic.agent: {path!r} is not 'package.module:function' or 'file.py:function'")
    try:
        fn = getattr(_module_from_file(module) if module.endswith(".py") else importlib.import_module(module), attr)
    except (ImportError, AttributeError, OSError) as err:
        raise ValueError(f"agentic.agent: cannot load {path!r} ({err})") from err
    if not callable(fn):
        raise ValueError(f"agentic.agent: {path!r} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def _module_from_file(file: str) -> Any:
    name = f"sluice_agent_{Path(file).stem}_{zlib.crc32(file.encode())}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None or not Path(file).is_file():
        raise ImportError(f"no Python file {file}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
