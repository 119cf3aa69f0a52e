#!/usr/bin/env bash
# Quick start, part 2: set up, then run the whole test suite (slow-marked cases included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q tests "$@"
