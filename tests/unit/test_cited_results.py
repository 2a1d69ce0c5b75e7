"""Every figure has its data: each ``benchmarks/results/*.json`` the README or ``docs/`` cites is
committed (``benchmarks/results/`` is gitignored, so a result must be added with ``git add -f``;
a file only on the author's disk is no evidence). A path named as a command's default output
(``default `benchmarks/results/x.json```) is not a citation."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r"(?<!default )(?<!default `)(benchmarks/results/[\w./*{},-]+\.json)")
BRACES = re.compile(r"\{([^{}]*)\}")


def _expanded(path: str) -> list[str]:
    """``x{0,4}.json`` -> ``x0.json``, ``x4.json`` (the shell's brace expansion, as the docs write it)."""
    match = BRACES.search(path)
    if match is None:
        return [path]
    parts = match.group(1).split(",")
    return [p for part in parts for p in _expanded(path[: match.start()] + part + path[match.end() :])]


def _cited() -> dict[str, list[str]]:
    """Cited path -> the documents citing it."""
    cited: dict[str, list[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for cited_path in CITED.findall(doc.read_text()):
            for path in _expanded(cited_path):
                cited.setdefault(path, []).append(doc.relative_to(ROOT).as_posix())
    return cited


def _committed() -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: what is committed cannot be asked")
    return set(out.split())


def test_brace_citations_expand_as_the_shell_does():
    assert _expanded("results/a_{0,4}_{x,y}.json") == [
        "results/a_0_x.json",
        "results/a_0_y.json",
        "results/a_4_x.json",
        "results/a_4_y.json",
    ]


def test_every_cited_result_file_is_committed():
    cited = _cited()
    assert len(cited) > 10  # the pattern still finds the citations
    committed = _committed()
    missing = {path: docs for path, docs in cited.items() if path not in committed}
    assert not missing, f"cited but not committed (git add -f, or cite a committed file): {missing}"
