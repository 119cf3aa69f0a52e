#!/usr/bin/env bash
# Quick start, part 2: set up, then run the whole test suite (slow-marked cases included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Two pytest-xdist workers (one per core here; SPECJAX_TEST_WORKERS for another machine), tests
# handed out one at a time and stolen back when one worker runs out, so a long test at the end does
# not leave the other core idle.
exec .venv/bin/python -m pytest -q -n "${SPECJAX_TEST_WORKERS:-2}" --dist worksteal tests "$@"
