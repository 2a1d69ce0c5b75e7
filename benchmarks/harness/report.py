"""Where benchmark results go: one JSON file per run, beside the printed table.

Deliberately not here: measuring, or formatting tables (each benchmark prints its own columns).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def write_results(path: str | Path, args: argparse.Namespace, rows: list[dict[str, Any]], **extra: Any) -> Path:
    """Write ``{"args", "rows", **extra}`` as JSON to ``path`` (parents created) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, **extra}, indent=2))
    print(f"wrote {out}")
    return out
