#!/usr/bin/env bash
# Quick start, part 1: set up, then run the main job on the embedded default (SmolLM2 target, CPU).
# Extra arguments go to specjax.run, e.g. --gin_bindings='run.DecodeSpec.temperature = 1.0'.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m specjax.run --gin_file=configs/smollm2_default.gin "$@"
