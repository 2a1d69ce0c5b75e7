"""Every committed mutation (``benchmarks/mutations.json``, docs/testing.md "Run no more than the
assertion needs") still applies to the code it breaks and still names a test that exists: a
refactor that rewrites a mutated line leaves the mutation inert, and ``benchmarks/mutations.py``
would only say so when someone runs it (two entries had drifted that way before this check)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPECS = json.loads((ROOT / "benchmarks" / "mutations.json").read_text())


def test_each_mutation_replaces_one_exact_text_of_its_file() -> None:
    inert = []
    for spec in SPECS:
        path = ROOT / spec["file"]
        found = path.read_text().count(spec["old"]) if path.is_file() else -1
        if found != 1 or spec["new"] == spec["old"]:
            inert.append(f"{spec['test']}: {spec['file']} holds its text {found} times (want 1)")
    assert not inert, "\n".join(inert)


def test_each_mutation_names_a_test_that_exists() -> None:
    missing = []
    for spec in SPECS:
        file, name = spec["test"].split("::")
        function = re.sub(r"\[.*\]$", "", name)
        path = ROOT / file
        if not path.is_file() or not re.search(rf"^(def {function}\(|{function} = )", path.read_text(), re.M):
            missing.append(spec["test"])
    assert not missing, missing
