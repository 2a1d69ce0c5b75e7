#!/usr/bin/env bash
# Checks sluice on a GPU machine in one go (docs/hardware.md, "Checking a GPU machine").
#
# The machine needs torch (CUDA), transformers and pyarrow, and no network: the few wheels sluice
# needs beyond such an image come from .gpu-wheels/ (`make gpu-wheels` on a machine with network;
# the folder travels with the working tree). They are installed from that folder only
# (--no-index), never from an index, into a folder of their own on PYTHONPATH (--target: the
# image's environment is left untouched, and a root-owned or externally managed one is no
# obstacle); sluice itself runs from the tree (PYTHONPATH=src), never `pip install -e .` (that
# would try to resolve Ray). Then benchmarks/gpu_check.py prints one
# table and writes its JSON to $OUT/gpu_check.json ($OUT set) or --out PATH.
#
#   bash scripts/gpu_check.sh                      # on the GPU machine: cuda, the ~0.5B model
#   bash scripts/gpu_check.sh --device cpu --small # anywhere: tiny model, one step (a test)
#
# Environment: PYTHON (default python3), GPU_WHEELS (default .gpu-wheels),
# GPU_CHECK_SITE (default $TMPDIR/sluice-gpu-check-site: where the wheels are installed),
# GPU_CHECK_SKIP_INSTALL=1 to skip the wheel install (the packages are already there).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
SITE=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/sluice-gpu-check-site}
# The top-level requirements; pip takes their dependencies from the same folder.
PACKAGES=(pydantic rich)

if [[ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]]; then
    missing=()
    for pkg in "${PACKAGES[@]}"; do
        PYTHONPATH="$SITE" "$PYTHON" -c "import $pkg" 2>/dev/null || missing+=("$pkg")
    done
    if ((${#missing[@]})); then
        if [[ ! -d "$WHEELS" ]]; then
            echo "gpu_check: ${missing[*]} not installed and no $WHEELS/ (run 'make gpu-wheels' where there is network, and carry the folder)" >&2
            exit 2
        fi
        echo "gpu_check: installing ${missing[*]} from $WHEELS/"
        "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$WHEELS" \
            --upgrade --target "$SITE" "${missing[@]}"
    fi
fi

export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
exec "$PYTHON" benchmarks/gpu_check.py "$@"
