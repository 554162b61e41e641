#!/usr/bin/env bash
# The GPU check from the repository root, without installing the package: bash tools/gpu_check.sh [--smoke]
# Results go to $OUT (the device machine's return folder) or build/gpu_check.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHONUNBUFFERED=1 exec "${PYTHON:-python3}" -m tools.gpu_check --out "${OUT:-build/gpu_check}" "$@"
