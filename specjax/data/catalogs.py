"""English -> German pairs from every German gettext catalog offline: the `catalogs_ende` task.

Django's catalogs alone give the German pair a few thousand messages; the machine's own compiled
catalogs and fourteen Python packages add tens of thousands more. Sources, in the fixed order that
decides which copy of a repeated pair is kept:
  django            Django's German `.po` catalogs (the `django` asset package; the gettext tasks'
                    source);
  system:<domain>   the system's compiled catalogs, /usr/share/locale/{de,de_DE,de_AT,de_CH}/
                    LC_MESSAGES/<domain>.mo (coreutils, libc, iso_639-3, postgres, ...);
  pretix, weblate, django-oscar, ...
                    the German catalogs of web applications on PyPI (TRAINING_PACKAGES, installed
                    with --no-deps, data only): the held-out packages' domain, which the system's
                    command-line tools and ISO names do not cover;
  wagtail, django-allauth, sphinx
                    the German catalogs shipped inside these PyPI packages (installed with
                    --no-deps, data only). They are HELD OUT: each of their pairs goes to the
                    'heldout_catalogs' split, and any English message of theirs (translated or
                    not, singular or plural) is dropped from every other source, as is any
                    English that protected reads as one of them, so no held-out reference's source
                    is trained on and the splits stay disjoint by English.
One pair per catalog entry, the singular: msgid -> msgstr (a plural entry's msgid -> its first
form), without context. Where a `#. Default: "..."` comment gives the English (Zope / Plone catalogs,
whose msgids are often identifiers such as `label_title`), that text is an id's English; an id
without one is dropped. Cleaning: surrounding whitespace stripped; pairs whose English or German is
empty or longer than MAX_CHARS (400) characters dropped; placeholders (`%s`, `%(name)s`, `{0}`,
`%1$s`, ...) and markup left exactly as translators wrote them; an exact (English, German) pair
counts once. The task's examples hide each English placeholder behind a symbol `<phk>` in both
texts (specjax.data.placeholders) and carry the table that restores them.

The other sources split by `gettext.split_of(english)`, the rule of the `gettext_ende` task, so a
message held out there is held out here: 'train' / 'validation' / 'heldout'.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
import struct

from absl import logging

from specjax import assets
from specjax.data import gettext, placeholders

TASK = "catalogs_ende"
HELDOUT_SPLIT = "heldout_catalogs"
SPLITS = gettext.SPLITS + (HELDOUT_SPLIT,)
MAX_CHARS = 400
_ID = re.compile(r"[A-Za-z0-9.-]*_[A-Za-z0-9_.-]*")  # a msgid that names a message: label_title
SYSTEM_LOCALE_DIR = pathlib.Path("/usr/share/locale")
GERMAN_LOCALES = ("de", "de_DE", "de_AT", "de_CH")
# source name -> the asset (specjax.assets.ASSETS) of the package whose catalogs are held out.
HELDOUT_PACKAGES = {"wagtail": "wagtail_de_po", "django-allauth": "allauth_de_po",
                    "sphinx": "sphinx_de_po"}
# source name -> the asset of a package whose catalogs are trained on (split by English message).
TRAINING_PACKAGES = {"pretix": "pretix_de_catalogs", "weblate": "weblate_de_catalogs",
                     "django-oscar": "oscar_de_catalogs", "django-cms": "cms_de_catalogs",
                     "plone.app.locales": "plone_de_catalogs",
                     "jupyterlab": "jupyterlab_language_pack_de_DE_de_catalogs",
                     "djangorestframework": "rest_framework_de_catalogs",
                     "django-filer": "filer_de_catalogs",
                     "django-debug-toolbar": "debug_toolbar_de_catalogs",
                     "django-two-factor-auth": "two_factor_de_catalogs",
                     "django-celery-beat": "django_celery_beat_de_catalogs"}


@dataclasses.dataclass(frozen=True)
class CatalogPair:
  source: str     # 'django', 'system:<domain>', or a trained-on or held-out package's name
  catalog: str    # the file the pair was read from
  locale: str     # the catalog's locale directory, e.g. 'de', 'de_CH'
  english: str
  german: str


def split_of(pair: CatalogPair) -> str:
  """Held-out packages' pairs -> 'heldout_catalogs'; any other pair by its English message."""
  return HELDOUT_SPLIT if pair.source in HELDOUT_PACKAGES else gettext.split_of(pair.english)


# ---- reading the catalogs ------------------------------------------------------------------------

def _german_catalogs(root: pathlib.Path, pattern: str) -> list[pathlib.Path]:
  """Sorted `locale[s]/<locale>/LC_MESSAGES/<pattern>` files under root's German locale
  directories, at any depth (a package keeps one locale directory per app)."""
  return sorted(path for locale in GERMAN_LOCALES for directory in ("locale", "locales")
                for path in root.glob(f"**/{directory}/{locale}/LC_MESSAGES/{pattern}"))


def _package_catalogs(root: pathlib.Path) -> list[pathlib.Path]:
  """A package's German `.po` catalogs, and its `.mo` ones that have no `.po` beside them (the `.mo`
  is compiled from the `.po`, which also keeps fuzzy flags)."""
  po = _german_catalogs(root, "*.po")
  compiled = [mo for mo in _german_catalogs(root, "*.mo") if mo.with_suffix(".po") not in po]
  return sorted(po + compiled)


def read_catalog(path: pathlib.Path) -> list[dict]:
  """A `.po` or `.mo` file -> gettext.parse_po's entries; a ValueError naming the file if broken."""
  try:
    if path.suffix == ".mo":
      return parse_mo(path.read_bytes())
    return gettext.parse_po(path.read_text(encoding="utf-8"))
  except (ValueError, struct.error) as error:
    raise ValueError(f"cannot read the gettext catalog {path}: {error}. Reinstall the package that "
                     "ships it, or remove it") from error


def _english(entry: dict, zope: bool) -> str:
  """An entry's English: its msgid, or in a Zope catalog, where an id such as `label_title` stands
  for the text, its Default ("" when it has none: the entry is dropped)."""
  msgid = entry.get("msgid", "").strip()
  if zope and _ID.fullmatch(msgid):
    return entry.get("default", "").strip()
  return msgid


def singular_pairs(entries: list[dict]) -> list[tuple[str, str]]:
  """(English, German) of each translated entry, cleaned: the singular form, whitespace stripped;
  the header (empty msgid), fuzzy and obsolete entries, empty and over-long texts dropped. A catalog
  with `#. Default:` comments is a Zope one: its id msgids take their Default as the English."""
  zope = any("default" in entry for entry in entries)
  pairs = []
  for entry in entries:
    if entry.get("obsolete") or "fuzzy" in entry.get("flags", ()):
      continue
    english = _english(entry, zope)
    german = entry.get("msgstr", entry.get("msgstr[0]", "")).strip()
    if english and german and len(english) <= MAX_CHARS and len(german) <= MAX_CHARS:
      pairs.append((english, german))
  return pairs


def english_messages(entries: list[dict]) -> set[str]:
  """Every English text of a catalog, translated or not: msgids, plural msgids and `#. Default:`
  texts, stripped."""
  return {entry[key].strip() for entry in entries for key in ("msgid", "msgid_plural", "default")
          if entry.get(key, "").strip()}


def heldout_package_root(source: str) -> pathlib.Path:
  """A held-out package's installed directory; MissingAssetError with its pip command if absent."""
  return package_root(HELDOUT_PACKAGES[source])


def package_root(asset_name: str) -> pathlib.Path:
  """The installed directory of a package whose German catalogs are read; MissingAssetError with
  its pip command if it is absent or has none."""
  asset = assets.ASSETS[asset_name]
  root = assets.package_dir(asset.package, asset.requirement)
  if not _package_catalogs(root):
    raise assets.MissingAssetError(f"no German gettext catalogs under {root}; reinstall "
                                   f"`{asset.install_command}`")
  return root


def catalog_files() -> list[tuple[str, pathlib.Path]]:
  """(source, file) of every catalog read, in source order: django, system:<domain>, the trained-on
  packages, the held-out packages."""
  django = _german_catalogs(gettext.django_root(), "*.po")
  if not django:
    raise assets.MissingAssetError(f"no German catalogs under {gettext.django_root()}; reinstall "
                                   f"`{assets.ASSETS['django_de_po'].install_command}`")
  files = [("django", path) for path in django]
  files += sorted((f"system:{path.stem}", path) for locale in GERMAN_LOCALES
                  for path in (SYSTEM_LOCALE_DIR / locale / "LC_MESSAGES").glob("*.mo"))
  for source, asset_name in TRAINING_PACKAGES.items():
    files += [(source, path) for path in _package_catalogs(package_root(asset_name))]
  for source in HELDOUT_PACKAGES:
    files += [(source, path) for path in _package_catalogs(heldout_package_root(source))]
  return files


@functools.lru_cache(maxsize=None)
def catalog_pairs() -> tuple[CatalogPair, ...]:
  """Every kept pair, in source order then file order. A non-held-out pair whose English is any
  message of a held-out package, or reads as one once placeholders are protected (`Add %s` where a
  held-out package has `Add %(name)s`: the model would see the same text), is dropped; an exact
  (English, German) pair is kept once, first."""
  files = catalog_files()
  entries = {path: read_catalog(path) for _, path in files}
  heldout_english = set().union(*(english_messages(entries[path]) for source, path in files
                                  if source in HELDOUT_PACKAGES))
  heldout_protected = {placeholders.protect(english)[0] for english in heldout_english}
  pairs, seen = [], set()
  for source, path in files:
    heldout = source in HELDOUT_PACKAGES
    for english, german in singular_pairs(entries[path]):
      if (english, german) in seen or (not heldout and (
          english in heldout_english or placeholders.protect(english)[0] in heldout_protected)):
        continue
      seen.add((english, german))
      pairs.append(CatalogPair(source, str(path), path.parts[-3], english, german))
  return tuple(pairs)


def example(pair: CatalogPair) -> dict:
  """A pair as the task's example: {'inputs', 'targets'} with the English's placeholders swapped for
  symbols (specjax.data.placeholders), 'placeholders' the table that restores them, 'locale'."""
  english, german, table = placeholders.protect(pair.english, pair.german)
  return {"inputs": gettext.PREFIX.format(language="German") + english, "targets": german,
          "locale": pair.locale, "placeholders": table}


def examples(split: str) -> tuple[dict, ...]:
  """The task's examples (`example`) of one split, in catalog_pairs order (what
  tasks.examples('catalogs_ende', split) returns)."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r} of {TASK}; splits: {list(SPLITS)}")
  return tuple(example(pair) for pair in catalog_pairs() if split_of(pair) == split)


def counts() -> dict[str, dict[str, int]]:
  """{source: {split: pairs}} with a 'total' row and column: what each source contributes where."""
  table: dict[str, dict[str, int]] = {}
  for pair in catalog_pairs():
    for source in (pair.source, "total"):
      row = table.setdefault(source, dict.fromkeys(SPLITS + ("total",), 0))
      row[split_of(pair)] += 1
      row["total"] += 1
  return dict(sorted(table.items(), key=lambda item: (item[0] == "total", item[0])))


def format_counts(table: dict[str, dict[str, int]]) -> str:
  columns = SPLITS + ("total",)
  lines = [f"{'source':<40}" + "".join(f"{c:>18}" for c in columns)]
  lines += [f"{source:<40}" + "".join(f"{row[c]:>18,}" for c in columns)
            for source, row in table.items()]
  return "\n".join(lines)


def log_counts() -> dict[str, dict[str, int]]:
  table = counts()
  logging.info("%s pairs per source and split:\n%s", TASK, format_counts(table))
  return table


# ---- the .mo format ------------------------------------------------------------------------------

_MO_MAGIC = 0x950412DE


def parse_mo(data: bytes) -> list[dict]:
  """A compiled gettext catalog -> entries shaped like gettext.parse_po's: {'msgid', 'msgstr'}
  or, for a plural entry, {'msgid', 'msgid_plural', 'msgstr[n]'...}; a context ('ctxt\\x04msgid')
  goes to 'msgctxt'. Strings are decoded with the header's charset (UTF-8 when it names none)."""
  if len(data) < 20:
    raise ValueError(f"{len(data)} bytes is too short for a .mo file")
  for order in "<>":
    magic, revision, count, ids_at, strs_at = struct.unpack_from(order + "5I", data)
    if magic == _MO_MAGIC:
      break
  else:
    raise ValueError(f"not a .mo file (magic number {data[:4].hex()})")
  if revision >> 16 > 1:
    raise ValueError(f"unsupported .mo revision {revision >> 16}")

  def string(table_at: int, index: int) -> bytes:
    length, offset = struct.unpack_from(order + "2I", data, table_at + 8 * index)
    if offset + length > len(data):
      raise ValueError(f"string {index} runs past the end of the file")
    return data[offset:offset + length]

  raw = [(string(ids_at, i), string(strs_at, i)) for i in range(count)]
  charset = "utf-8"
  for msgid, msgstr in raw:
    if msgid == b"":
      for line in msgstr.decode("ascii", "replace").splitlines():
        if line.lower().startswith("content-type:") and "charset=" in line:
          charset = line.split("charset=", 1)[1].strip() or "utf-8"
  charset = "utf-8" if charset.upper() == "CHARSET" else charset  # an unfilled template
  entries = []
  for msgid, msgstr in raw:
    ids, strs = msgid.decode(charset).split("\x00"), msgstr.decode(charset).split("\x00")
    entry = {}
    context, separator, ids[0] = ids[0].rpartition("\x04")
    if separator:
      entry["msgctxt"] = context
    entry["msgid"] = ids[0]
    if len(ids) > 1:
      entry["msgid_plural"] = ids[1]
      entry.update((f"msgstr[{n}]", form) for n, form in enumerate(strs))
    else:
      entry["msgstr"] = strs[0]
    entries.append(entry)
  return entries


if __name__ == "__main__":
  print(format_counts(counts()))
