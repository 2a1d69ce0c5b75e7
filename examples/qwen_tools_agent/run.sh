#!/usr/bin/env bash
# The qwen_tools_agent example end to end: gsm8k_style data and model (built when missing: `sluice sft`,
# minutes), the Qwen-style tool template on a copy of that model, then GRPO on the OpenAI-tools agent.
#   bash examples/qwen_tools_agent/run.sh [key=value ...]     (extra arguments go to `sluice train`)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
BASE=examples/gsm8k_style
HERE=examples/qwen_tools_agent
[ -f "$BASE/data/test.parquet" ] || "$PY" "$BASE/make_data.py" --out "$BASE/data"
[ -f "$BASE/init/config.json" ] || "$PY" "$BASE/make_model.py" --data "$BASE/data" --out "$BASE/init"
[ -f "$BASE/runs/sft/final_model/config.json" ] || "$PY" -m sluice.cli sft "$BASE/sft.yaml"
[ -f "$HERE/model/config.json" ] || "$PY" "$HERE/make_model.py" --base "$BASE/runs/sft/final_model" --out "$HERE/model"
exec "$PY" -m sluice.cli train "$HERE/config.yaml" "$@"
