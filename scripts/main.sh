#!/usr/bin/env bash
# Quick start, part 1: set up, obtain the trained models, then run the main job on the embedded
# defaults (CPU): the SmolLM2 sweep, the SmolLM2 token-tree sweep, then the T5 sweep.
#  - the SmolLM2 draft is distilled on the first run (configs/smollm2_draft.gin) and reused from
#    out/smollm2_draft afterwards;
#  - the shared MTP head for SmolLM2 is trained on the first run from the same teacher data
#    (configs/smollm2_mtp.gin) and reused from out/smollm2_mtp afterwards; the token-tree sweep
#    (configs/smollm2_trees.gin) shows it beside the chain draft;
#  - the T5 experiment's target and three drafts are trained on the first run (configs/t5_gettext/*.gin,
#    Django's gettext catalogs) and reused from out/t5_gettext afterwards.
# Every step shows progress with an ETA; a killed run resumes where it stopped.
# Extra arguments go to the SmolLM2 sweep, e.g. --gin_bindings='specs.DecodeSpec.max_new_tokens = 64'.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m specjax.train --gin_file=configs/smollm2_draft.gin
.venv/bin/python -m specjax.train --gin_file=configs/smollm2_mtp.gin
for model in target draft_small draft_base draft_large; do
  .venv/bin/python -m specjax.train --gin_file="configs/t5_gettext/$model.gin"
done
.venv/bin/python -m specjax.run --gin_file=configs/smollm2_default.gin "$@"
.venv/bin/python -m specjax.run --gin_file=configs/smollm2_trees.gin
exec .venv/bin/python -m specjax.run --gin_file=configs/t5_gettext/sweep.gin
