"""Offline sequence-to-sequence tasks from real text: Django's gettext catalogs as translation pairs.

Django ships its English messages translated into ~100 locales (`django/**/locale/<locale>/LC_MESSAGES/
*.po`, the core catalog and every contrib app). Each non-fuzzy translated message becomes one example:
inputs "translate English to <Language>: <English>" (T5's prefix form, the language named as Django's
own LANG_INFO names it), targets the translation. English -> German is the evaluation pair; the other
locales are multilingual training data. Labelled for what it is: short software strings, not WMT.

Splits are by the ENGLISH message, so they hold in every locale at once: a message held out is held
out in German and in all 98 other languages, and no held-out German reference's source is ever seen in
training. The rule is `hash_percent(english)`: below HELDOUT_PERCENT (20) -> 'heldout' (the
same rule as the `ende` prompt set, whose held-out prompts are therefore held out here too), the next
VALIDATION_PERCENT (3) -> 'validation' (the training's validation loss), the rest -> 'train'.

Tasks (the seqio wrappers in `specjax.data.seqio_tasks` yield exactly these examples; every offline
task, `catalogs_ende` included, is named in `specjax.data.tasks`):
  gettext_translate  every locale but English (train: the multilingual training set)
  gettext_ende       German only (heldout: the evaluation messages)
No TensorFlow here: the training command and the embedded experiment read these directly.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import pathlib

from specjax import assets
from specjax.data.splits import HELDOUT_PERCENT, hash_percent

TASKS = ("gettext_translate", "gettext_ende")
SPLITS = ("train", "validation", "heldout")
VALIDATION_PERCENT = 3
DEFAULT_COMMENT = "#. Default:"
EVALUATION_LOCALE = "de"
PREFIX = "translate English to {language}: "


@dataclasses.dataclass(frozen=True)
class Pair:
  english: str
  locale: str      # the catalog directory's name, e.g. 'de', 'pt_BR', 'zh_Hans'
  language: str    # its English name, e.g. 'German', 'Brazilian Portuguese'
  translation: str
  message: str     # the catalog entry's msgid: what the split is decided by (a plural form's pair
                   # goes where its singular goes)

  @property
  def inputs(self) -> str:
    return PREFIX.format(language=self.language) + self.english


def split_of(english: str) -> str:
  """'heldout' | 'validation' | 'train' for an English message (deterministic, hash-based)."""
  percent = hash_percent(english)
  if percent < HELDOUT_PERCENT:
    return "heldout"
  if percent < HELDOUT_PERCENT + VALIDATION_PERCENT:
    return "validation"
  return "train"


def django_root() -> pathlib.Path:
  return assets.package_dir("django", assets.ASSETS["django_de_po"].requirement)


@functools.lru_cache(maxsize=None)
def language_names() -> dict[str, str]:
  """Django's locale code -> English language name, read from django/conf/locale/__init__.py's
  LANG_INFO literal (importing django needs its runtime dependencies, which are not installed)."""
  source = (django_root() / "conf" / "locale" / "__init__.py").read_text(encoding="utf-8")
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LANG_INFO" for t in node.targets):
      info = ast.literal_eval(node.value)
      return {code: entry["name"] for code, entry in info.items() if "name" in entry}
  raise assets.MissingAssetError(f"no LANG_INFO in {django_root()}/conf/locale/__init__.py; reinstall "
                                 f"`pip install --no-deps {assets.ASSETS['django_de_po'].requirement}`")


@functools.lru_cache(maxsize=None)
def gettext_pairs() -> tuple[Pair, ...]:
  """Every (English, locale, translation) of Django's catalogs, in a fixed order (sorted catalog
  paths, file order within). Kept: translated, non-fuzzy, non-obsolete messages; a plural entry gives
  two pairs, msgid -> msgstr[0] and msgid_plural -> its last plural form (the general plural in
  most languages); placeholders and markup stay, as translators wrote them.
  English locales (en, en_AU, en_GB) are skipped; an identical (English, locale, translation) counts
  once."""
  names = language_names()
  catalogs = sorted(django_root().glob("**/locale/*/LC_MESSAGES/*.po"))
  if not catalogs:
    raise assets.MissingAssetError(f"no gettext catalogs under {django_root()}; reinstall "
                                   f"`pip install --no-deps {assets.ASSETS['django_de_po'].requirement}`")
  pairs, seen = [], set()
  for path in catalogs:
    locale = path.parts[-3]
    language = names.get(locale.lower().replace("_", "-"))
    if language is None or locale.split("_")[0] == "en":
      continue
    for entry in parse_po(path.read_text(encoding="utf-8")):
      message = entry.get("msgid", "")
      if not message.strip() or entry.get("obsolete") or "fuzzy" in entry.get("flags", ()):
        continue
      forms = [(message, entry.get("msgstr", entry.get("msgstr[0]", "")))]
      if "msgid_plural" in entry:
        plurals = sorted((int(k[7:-1]), v) for k, v in entry.items() if k.startswith("msgstr[") and k != "msgstr[0]")
        if plurals:
          forms.append((entry["msgid_plural"], plurals[-1][1]))
      for english, translation in forms:
        key = (english, locale, translation)
        if english.strip() and translation.strip() and key not in seen:
          seen.add(key)
          pairs.append(Pair(english, locale, language, translation, message))
  return tuple(pairs)


def check_task(task: str) -> None:
  if task not in TASKS:
    raise ValueError(f"unknown gettext task {task!r}; its tasks are {list(TASKS)} (every offline "
                     "task: specjax.data.tasks.TASKS)")


@functools.lru_cache(maxsize=None)
def examples(task: str, split: str) -> tuple[dict, ...]:
  """The task's examples {'inputs', 'targets', 'locale'} of one split, in gettext_pairs order."""
  check_task(task)
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r} of {task}; splits: {list(SPLITS)}")
  return tuple({"inputs": pair.inputs, "targets": pair.translation, "locale": pair.locale}
               for pair in gettext_pairs()
               if split_of(pair.message) == split
               and (task == "gettext_translate" or pair.locale == EVALUATION_LOCALE))


def evaluation_items() -> list[tuple[str, str, str]]:
  """(key, English, German) of every German message (singular forms, each English once): the
  `gettext_ende` prompt set. A message's key is its English text, so `splits.is_heldout` splits the set
  exactly as `split_of` splits the task."""
  items, seen = [], set()
  for pair in gettext_pairs():
    if pair.locale == EVALUATION_LOCALE and pair.english == pair.message and pair.english not in seen:
      seen.add(pair.english)
      items.append((pair.english, pair.english, pair.translation))
  return items


# ---- the .po format ---------------------------------------------------------------------------------

def parse_po(text: str) -> list[dict]:
  """A gettext .po catalog -> entries {'msgid', 'msgstr' | 'msgstr[n]', 'msgctxt', 'msgid_plural',
  'flags': set, 'obsolete': bool, 'default'} with strings unescaped and continuation lines joined;
  'default' is the English of a `#. Default: "..."` comment (Zope catalogs, whose msgids are ids)."""
  entries, entry, keyword = [], {}, None
  default_continues = False  # the last line was a Default comment's (or its continuation's)

  def flush():
    nonlocal entry
    if "msgid" in entry:
      entries.append(entry)
    entry = {}

  for raw in text.splitlines():
    line = raw.strip()
    has_translation = any(k.startswith("msgstr") for k in entry)
    if not line.startswith("#"):
      default_continues = False
    if not line:
      flush()
      keyword = None
    elif line.startswith("#~"):  # obsolete entry, kept in the file for translators' memory
      entry["obsolete"] = True
    elif line.startswith("#"):
      if has_translation:
        flush()
      if line.startswith("#,"):
        entry.setdefault("flags", set()).update(f.strip() for f in line[2:].split(","))
      elif line.startswith(DEFAULT_COMMENT):
        with contextlib.suppress(ValueError):  # a comment in another form is only a comment
          entry["default"] = _po_unquote(line[len(DEFAULT_COMMENT):].strip())
          default_continues = True
          continue
      elif default_continues and line.startswith('#. "'):  # a long Default, wrapped
        with contextlib.suppress(ValueError):
          entry["default"] += _po_unquote(line[2:].strip())
          continue
      default_continues = False
    elif line.startswith('"'):
      if keyword is None:
        raise ValueError(f"malformed .po line (string without keyword): {raw!r}")
      entry[keyword] += _po_unquote(line)
    else:
      keyword, _, rest = line.partition(" ")
      if keyword in ("msgctxt", "msgid") and has_translation:
        flush()
      entry[keyword] = _po_unquote(rest.strip())
  flush()
  return entries


_PO_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\"}


def _po_unquote(quoted: str) -> str:
  """'"a \\"b\\"\\n"' -> 'a "b"' + newline (the C escapes gettext uses)."""
  if len(quoted) < 2 or quoted[0] != '"' or quoted[-1] != '"':
    raise ValueError(f"malformed .po string: {quoted!r}")
  body, out, i = quoted[1:-1], [], 0
  while i < len(body):
    if body[i] == "\\" and i + 1 < len(body):
      out.append(_PO_ESCAPES.get(body[i + 1], body[i + 1]))
      i += 2
    else:
      out.append(body[i])
      i += 1
  return "".join(out)
