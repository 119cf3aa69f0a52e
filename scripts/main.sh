#!/usr/bin/env bash
# Quick start, part 1: set up, obtain the trained draft, then run the main job on the embedded default
# (SmolLM2 target, CPU). The draft is trained on the first run (configs/smollm2_draft.gin, with
# progress and ETA) and reused from out/smollm2_draft afterwards.
# Extra arguments go to specjax.run, e.g. --gin_bindings='run.DecodeSpec.max_new_tokens = 64'.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m specjax.train_draft --gin_file=configs/smollm2_draft.gin
exec .venv/bin/python -m specjax.run --gin_file=configs/smollm2_default.gin "$@"
