"""Every module of ``src/sluice`` is reached from the ``sluice`` command: an AST walk from
``sluice/cli.py`` over imports (lazy ones inside functions too), module paths named in strings
(registries such as ``"sluice.dag.model_nodes:rollout"``) and files named in strings (scripts
copied into the code sandbox). Code that only a benchmark or a test calls lives in
``benchmarks/`` or ``tests/``, not here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MODULE_NAME = re.compile(r"^(sluice(?:\.\w+)+)(?::\w+)?$")


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "sluice").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _reached_from(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if match := MODULE_NAME.match(node.value):
                names.add(match.group(1))
            elif node.value.endswith(".py"):  # a file of this package shipped somewhere by name
                names.add(f"{package}.{Path(node.value).stem}")
    reached = set()
    for found in names:
        while found:  # a name reaches its module and every package above it
            if found in modules:
                reached.add(found)
            found = found.rpartition(".")[0]
    return reached


def test_every_module_is_reached_from_the_cli() -> None:
    modules = _modules()
    seen, todo = set(), ["sluice.cli"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_reached_from(name, modules[name], modules) - seen)
    unreached = sorted(set(modules) - seen)
    assert not unreached, f"modules no sluice command reaches (move them to benchmarks/ or tests/): {unreached}"
    assert len(seen) > 150  # the walk really followed the imports
