#!/usr/bin/env bash
# The T5 EnDe experiment (docs/t5.md): set up, train the 39.7 M-parameter T5 target on English -> German
# pairs of every gettext catalog offline and its three distilled drafts, then run Leviathan et al.'s
# Tables 2 / 3 (configs/t5_ende/sweep.gin) and 5 (lenience.gin) on the held-out wagtail, django-allauth
# and sphinx messages, and the greedy check of every held-out message (BLEU / chrF, outputs equal to the
# target's). About 3 hours on a 2-core CPU (an estimate: the target's 83 minutes measured on an
# AMD EPYC on 2026-12-08, plus the rest's 85 minutes measured there on
# 2026-12-06 / 07); not part of scripts/main.sh. Every step shows progress
# with an ETA; a killed run resumes where it stopped, and a finished model or sweep row is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
for model in target draft_small draft_base draft_large; do
  .venv/bin/python -m specjax.train --gin_file="configs/t5_ende/$model.gin"
done
.venv/bin/python -m specjax.run --gin_file=configs/t5_ende/sweep.gin
.venv/bin/python -m specjax.run --gin_file=configs/t5_ende/lenience.gin
exec .venv/bin/python benchmarks/t5_greedy.py --experiment t5_ende --kernels cpu --limit 320 --batch_size 32
