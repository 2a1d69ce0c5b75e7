#!/usr/bin/env bash
# The gsm8k_style example end to end: synthetic data -> tiny Qwen2 -> `sluice sft` -> `sluice train` (GRPO).
#   bash examples/gsm8k_style/run.sh [key=value ...]     (extra arguments go to `sluice train`)
# Run from anywhere; it works in the repository root. Data, models and the warm start are built only when missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
HERE=examples/gsm8k_style
[ -f "$HERE/data/test.parquet" ] || "$PY" "$HERE/make_data.py" --out "$HERE/data"
[ -f "$HERE/init/config.json" ] || "$PY" "$HERE/make_model.py" --data "$HERE/data" --out "$HERE/init"
[ -f "$HERE/runs/sft/final_model/config.json" ] || "$PY" -m sluice.cli sft "$HERE/sft.yaml"
exec "$PY" -m sluice.cli train "$HERE/config.yaml" "$@"
