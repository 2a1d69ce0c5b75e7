"""Makes the top-level packages named in ``SLUICE_ABSENT_MODULES`` (comma-separated) absent from
every Python process that starts with this folder on ``PYTHONPATH``, child processes included
(they inherit the variable).

Each finder on ``sys.meta_path`` is wrapped so that it finds nothing under those names: ``import
ray`` raises ``ModuleNotFoundError``, ``importlib.util.find_spec("ray")`` returns ``None`` and
``"ray" not in sys.modules``, exactly as when the package is not installed. Used by
``tests/integration/test_without_ray.py`` to run sluice as on a machine without Ray; with the
variable unset it does nothing. It deliberately does not hide installed metadata
(``importlib.metadata``).
"""

import os
import sys

_HIDDEN = frozenset(filter(None, (n.strip() for n in os.environ.get("SLUICE_ABSENT_MODULES", "").split(","))))


class _Hiding:
    """A meta-path finder that finds what ``finder`` finds, except the hidden packages."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, attr):  # invalidate_caches, find_distributions, ...
        return getattr(self._finder, attr)


if _HIDDEN:
    sys.meta_path[:] = [_Hiding(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
