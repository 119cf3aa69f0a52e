"""The catalogs_ende task: every German gettext catalog offline, three packages held out for evaluation.

The held-out packages' catalogs are read again here straight from their directories, as the oracle
for "never trained on"; the .mo reader is checked against a file written here byte by byte and
against the standard library's reader."""

import collections
import gettext as stdlib_gettext
import pathlib
import struct

import pytest

from specjax import assets
from specjax.data import catalogs, gettext, placeholders, prompts, tasks
from specjax.training import seq2seq

TRAINED = ("train", "validation", "heldout")


def _by_split():
  by_split = collections.defaultdict(list)
  for pair in catalogs.catalog_pairs():
    by_split[catalogs.split_of(pair)].append(pair)
  return by_split


def _heldout_package_messages() -> dict[str, set[str]]:
  """source -> every English text (msgid, msgid_plural) of the package's German .po catalogs."""
  messages = {}
  for source, asset_name in catalogs.HELDOUT_PACKAGES.items():
    asset = assets.ASSETS[asset_name]
    root = assets.package_dir(asset.package, asset.requirement)
    paths = sorted(root.glob("**/locale/de*/LC_MESSAGES/*.po"))
    assert paths, f"{source}: no German .po catalogs under {root}"
    messages[source] = {entry[key].strip() for path in paths
                        for entry in gettext.parse_po(path.read_text(encoding="utf-8"))
                        for key in ("msgid", "msgid_plural") if entry.get(key, "").strip()}
  return messages


def test_reads_are_deterministic():
  first = catalogs.catalog_pairs()
  catalogs.catalog_pairs.cache_clear()
  second = catalogs.catalog_pairs()
  assert first == second and first is not second  # identical pairs in identical order, read twice


def test_splits_are_disjoint_by_english_message():
  english = {split: {pair.english for pair in pairs} for split, pairs in _by_split().items()}
  assert sorted(english) == sorted(catalogs.SPLITS)
  for i, a in enumerate(catalogs.SPLITS):
    for b in catalogs.SPLITS[i + 1:]:
      assert not english[a] & english[b], (a, b)
  # The other sources split exactly as the gettext_ende task does, by the English message.
  assert all(gettext.split_of(pair.english) == split for split in TRAINED
             for pair in _by_split()[split])
  pairs = [(pair.english, pair.german) for pair in catalogs.catalog_pairs()]
  assert len(pairs) == len(set(pairs))


def test_heldout_packages_are_never_trained_on():
  oracle = _heldout_package_messages()
  heldout_english = set().union(*oracle.values())
  by_split = _by_split()
  for split in TRAINED:
    assert not {pair.english for pair in by_split[split]} & heldout_english, split
  heldout = by_split[catalogs.HELDOUT_SPLIT]
  assert {pair.source for pair in heldout} == set(catalogs.HELDOUT_PACKAGES)
  assert all(pair.english in oracle[pair.source] for pair in heldout)
  assert all(pair.source not in catalogs.HELDOUT_PACKAGES for split in TRAINED
             for pair in by_split[split])
  # Nor one that reads as a held-out message once placeholders are protected (`Add %s` and wagtail's
  # `Add %(model_name)s` are both `Add <ph0>`); Django, for one, has such messages: the rule works.
  heldout_protected = {placeholders.protect(text)[0] for text in heldout_english}
  for split in TRAINED:
    protected = {placeholders.protect(pair.english)[0] for pair in by_split[split]}
    assert not protected & heldout_protected, split
  django = {english for source, path in catalogs.catalog_files() if source == "django"
            for english, _ in catalogs.singular_pairs(catalogs.read_catalog(path))}
  assert {english for english in django - heldout_english
          if placeholders.protect(english)[0] in heldout_protected}
  # What training and its vocabulary read: none of it is a held-out message.
  vocabulary_texts = set(tasks.texts_for_vocabulary("catalogs_ende"))
  assert not {gettext.PREFIX.format(language="German") + placeholders.protect(text)[0]
              for text in heldout_english} & vocabulary_texts


def test_the_heldout_catalogs_prompt_set_is_the_heldout_packages_messages():
  """The T5 EnDe sweep's prompts: each held-out English message once (read from the packages' own
  catalogs), with a German translation of it from them; never split, nothing trained on any of it."""
  oracle = set().union(*_heldout_package_messages().values())
  german_of = collections.defaultdict(set)
  for pair in _by_split()[catalogs.HELDOUT_SPLIT]:
    german_of[pair.english].add(pair.german)
  whole = prompts.load_prompt_set("heldout_catalogs", "all", style="t5")
  assert sorted(whole.keys) == sorted(german_of) and set(whole.keys) <= oracle
  assert all(ref in german_of[key] for key, ref in zip(whole.keys, whole.references))
  assert all(text == "translate English to German: " + placeholders.protect(key)[0]
             for key, text in zip(whole.keys, whole.prompts))
  # Ordered by hash: any first 40 mix the three packages (the catalogs come one after the other).
  source_of = {pair.english: pair.source for pair in _by_split()[catalogs.HELDOUT_SPLIT]}
  assert {source_of[key] for key in whole.keys[:40]} == set(catalogs.HELDOUT_PACKAGES)
  assert prompts.load_prompt_set("heldout_catalogs", "heldout", style="t5").prompts == whole.prompts
  with pytest.raises(ValueError, match="not split"):
    prompts.load_prompt_set("heldout_catalogs", "train")
  trained = {example["inputs"] for split in TRAINED for example in tasks.examples(catalogs.TASK, split)}
  assert not set(whole.prompts) & trained


def test_placeholders_survive_byte_for_byte():
  pairs = catalogs.catalog_pairs()
  named = next(p for p in pairs if p.source == "django" and "%(" in p.english and "%(" in p.german)
  entries = gettext.parse_po(pathlib.Path(named.catalog).read_text(encoding="utf-8"))
  assert any(e["msgid"] == named.english and e.get("msgstr") == named.german for e in entries)
  braced = [p for p in pairs if p.source.startswith("system:") and "{" in p.english
            and "{" in p.german]
  exact = 0
  for catalog in sorted({p.catalog for p in braced})[:5]:
    with open(catalog, "rb") as file:  # the standard library's reader, as the oracle
      oracle = stdlib_gettext.GNUTranslations(file)._catalog  # pylint: disable=protected-access
    stripped = {(k.strip(), v.strip()) for k, v in oracle.items() if isinstance(k, str)}
    for pair in (p for p in braced if p.catalog == catalog):
      assert (pair.english, pair.german) in stripped  # only surrounding whitespace ever goes
      exact += oracle.get(pair.english) == pair.german
  assert exact > 0


def _write_mo(path: pathlib.Path, messages: dict[str, str]) -> None:
  """A little-endian .mo file, laid out as msgfmt writes it: header, the two string tables, then
  the strings (msgids sorted)."""
  keys = sorted(messages)
  ids, strs = [k.encode() for k in keys], [messages[k].encode() for k in keys]
  count, table_at = len(keys), 28
  data_at = table_at + 16 * count
  blob, id_table, str_table = b"", [], []
  for table, strings in ((id_table, ids), (str_table, strs)):
    for string in strings:
      table.append((len(string), data_at + len(blob)))
      blob += string + b"\x00"
  header = struct.pack("<7I", 0x950412DE, 0, count, table_at, table_at + 8 * count, 0, 0)
  tables = b"".join(struct.pack("<2I", *e) for e in id_table + str_table)
  path.write_bytes(header + tables + blob)


def test_mo_reader_matches_a_hand_written_file(tmp_path):
  path = tmp_path / "demo.mo"
  _write_mo(path, {
      "": "Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2; plural=(n != 1);\n",
      "Hello": "Hallo",
      "%d file\x00%d files": "%d Datei\x00%d Dateien",
      "menu\x04Open %(name)s": "  %(name)s öffnen\n",
      "Untranslated": "",
      "Long": "x" * (catalogs.MAX_CHARS + 1),
  })
  with open(path, "rb") as file:  # a well-formed file: the standard library reads it
    assert stdlib_gettext.GNUTranslations(file).ngettext("%d file", "%d files", 2) == "%d Dateien"
  entries = catalogs.read_catalog(path)
  assert {"msgid": "%d file", "msgid_plural": "%d files", "msgstr[0]": "%d Datei",
          "msgstr[1]": "%d Dateien"} in entries
  assert {"msgctxt": "menu", "msgid": "Open %(name)s", "msgstr": "  %(name)s öffnen\n"} in entries
  assert catalogs.singular_pairs(entries) == [("%d file", "%d Datei"), ("Hello", "Hallo"),
                                              ("Open %(name)s", "%(name)s öffnen")]
  assert catalogs.english_messages(entries) == {"%d file", "%d files", "Hello", "Open %(name)s",
                                                "Untranslated", "Long"}


def test_mo_reader_agrees_with_the_standard_library_on_a_system_catalog():
  path = catalogs.SYSTEM_LOCALE_DIR / "de" / "LC_MESSAGES" / "coreutils.mo"
  if not path.is_file():
    pytest.skip(f"no {path} on this machine")
  with open(path, "rb") as file:
    expected = stdlib_gettext.GNUTranslations(file)._catalog  # pylint: disable=protected-access
  singular = {e["msgid"]: e["msgstr"] for e in catalogs.read_catalog(path)
              if "msgstr" in e and "msgctxt" not in e}
  assert singular and all(expected[msgid] == msgstr for msgid, msgstr in singular.items())


def test_broken_input_is_named(tmp_path, monkeypatch):
  broken = tmp_path / "broken.mo"
  broken.write_bytes(b"not a catalog at all")
  with pytest.raises(ValueError, match="broken.mo"):
    catalogs.read_catalog(broken)
  missing = assets.Asset("specjax_no_such_package", "x.po", "wagtail==8.0.1", "test")
  monkeypatch.setitem(assets.ASSETS, "wagtail_de_po", missing)
  with pytest.raises(assets.MissingAssetError, match="pip install --no-deps wagtail==8.0.1"):
    catalogs.heldout_package_root("wagtail")


def test_counts_and_task_wiring():
  table = catalogs.counts()
  total = table["total"]
  # Floors well under what this machine's catalogs give (54,761 / 2,053 / 14,137 / 2,329), so a
  # reader that loses a source fails.
  assert total["train"] > 40_000 and total["validation"] > 1_400 and total["heldout"] > 10_000
  assert total[catalogs.HELDOUT_SPLIT] > 500
  assert all(table[source][catalogs.HELDOUT_SPLIT] > 100 for source in catalogs.HELDOUT_PACKAGES)
  # Every web application is read (pretix 4,841 training pairs ... django-two-factor-auth 59), and
  # Plone's through its Default comments: its English is text, not ids such as `label_title`.
  assert all(table[source]["train"] > 40 for source in catalogs.TRAINING_PACKAGES)
  assert table["pretix"]["train"] > 3_000 and table["plone.app.locales"]["train"] > 1_500
  plone = [p.english for p in catalogs.catalog_pairs() if p.source == "plone.app.locales"]
  assert sum(" " in english for english in plone) > 0.8 * len(plone)
  assert table["django"]["train"] > 400 and sum(s.startswith("system:") for s in table) > 50
  assert sum(row["total"] for source, row in table.items() if source != "total") == total["total"]
  assert tasks.task_splits("catalogs_ende") == catalogs.SPLITS
  assert tasks.task_splits("gettext_ende") == gettext.SPLITS  # the existing tasks are unchanged
  seq2seq.check_task("catalogs_ende")
  for split in catalogs.SPLITS:
    examples = tasks.examples("catalogs_ende", split)
    assert len(examples) == total[split]
    assert all(e["inputs"].startswith("translate English to German: ") for e in examples)
  with pytest.raises(ValueError, match="heldout_catalogs"):
    tasks.examples("catalogs_ende", "test")
