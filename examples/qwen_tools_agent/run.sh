#!/usr/bin/env bash
# The qwen_tools_agent example end to end: gsm8k_style data and model (built when missing, ~12 min
# of SFT), the Qwen-style tool template on a copy of that model, then GRPO on the OpenAI-tools agent.
#   bash examples/qwen_tools_agent/run.sh [key=value ...]     (extra arguments go to `sluice train`)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
BASE=examples/gsm8k_style
HERE=examples/qwen_tools_agent
[ -f "$BASE/data/test.parquet" ] || "$PY" "$BASE/make_data.py" --out "$BASE/data"
[ -f "$BASE/model/config.json" ] || "$PY" "$BASE/make_model.py" --data "$BASE/data" --out "$BASE/model"
[ -f "$HERE/model/config.json" ] || "$PY" "$HERE/make_model.py" --base "$BASE/model" --out "$HERE/model"
exec "$PY" -m sluice.cli train "$HERE/config.yaml" "$@"
