#!/usr/bin/env bash
# The RLHF example end to end: pairs -> `sluice rm` -> `sluice train` with that reward model alone -> report.
#   bash examples/rlhf/run.sh [key=value ...]     (extra arguments go to `sluice train`)
# Run from anywhere; it works in the repository root. The pairs and the reward model are built only when missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
HERE=examples/rlhf
[ -f "$HERE/data/pairs_val.jsonl" ] && [ -e "$HERE/base" ] || "$PY" "$HERE/make_pairs.py"
[ -f "$HERE/runs/rm/final_model/config.json" ] || "$PY" -m sluice.cli rm "$HERE/rm.yaml"
"$PY" -m sluice.cli train "$HERE/config.yaml" "$@"
"$PY" "$HERE/report.py"
