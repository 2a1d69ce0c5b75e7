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


CALLED_FROM_OUTSIDE = {
    "get_seq_length": "engines/kv_batch.py: transformers' Cache API; the model's forward calls it",
    "handle_error": "rollout/agent_endpoint.py: socketserver calls it on a handler's error",
    "save_model": "rl_trainer.py: the Python API's RLTrainer (docs/design.md), called by users' scripts",
}
"""Definitions no module of ``src/sluice`` names, and who calls them instead."""


def _definitions_no_module_names() -> dict[str, list[str]]:
    """Top-level functions and classes, and methods without decorators, whose name appears nowhere
    in ``src/sluice`` but at their own definition: not as a name, an attribute, an imported name
    outside a package's ``__init__`` (a re-export alone calls nothing) or a word of a string
    (registries name functions in strings)."""
    defined: dict[str, list[str]] = {}
    named: set[str] = set()
    for path in (SRC / "sluice").rglob("*.py"):
        tree, where = ast.parse(path.read_text()), str(path.relative_to(SRC / "sluice"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.setdefault(node.name, []).append(where)
            if isinstance(node, ast.ClassDef):
                for method in node.body:
                    if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and not method.decorator_list:
                        defined.setdefault(method.name, []).append(f"{where}: {node.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                named.add(node.id)
            elif isinstance(node, ast.Attribute):
                named.add(node.attr)
            elif isinstance(node, ast.alias) and path.name != "__init__.py":
                named.add(node.asname or node.name.rpartition(".")[2])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                named.update(re.findall(r"\w+", node.value))
    return {name: where for name, where in defined.items() if name not in named and not name.startswith("__")}


def test_every_function_and_class_is_named_by_product_code() -> None:
    """The module walk above proves every module reachable; this finds the functions inside them
    that only a benchmark or a test calls (they belong there). Name-based: it misses dead code
    whose name a live one shares, and a function a library calls by name is listed, with its
    caller, in ``CALLED_FROM_OUTSIDE``."""
    unnamed = _definitions_no_module_names()
    assert set(unnamed) == set(CALLED_FROM_OUTSIDE), (
        f"defined in src/sluice but named by no module of it (move them to benchmarks/ or tests/, or say "
        f"who calls them in CALLED_FROM_OUTSIDE): {dict(sorted(unnamed.items()))}"
    )
