"""The offline translation task from Django's gettext catalogs: size, determinism, disjoint splits."""

import collections

from specjax.data import prompts, gettext, tasks


def test_corpus_is_large_and_multilingual():
  pairs = gettext.gettext_pairs()
  train = gettext.examples("gettext_translate", "train")
  assert len(train) >= 50_000  # the issue's floor for training pairs (django==5.2.19: 51,755)
  locales = collections.Counter(e["locale"] for e in train)
  assert len(locales) >= 90 and "de" in locales and not any(l.startswith("en") for l in locales)
  german = [p for p in pairs if p.locale == "de"]
  assert all(p.inputs == "translate English to German: " + p.english for p in german)
  assert {p.language for p in pairs if p.locale == "fr"} == {"French"}


def test_splits_are_deterministic_and_disjoint_in_every_locale():
  pairs = gettext.gettext_pairs()
  by_split = collections.defaultdict(set)
  for pair in pairs:
    by_split[gettext.split_of(pair.message)].add(pair.english)
    by_split["message:" + gettext.split_of(pair.message)].add(pair.message)
  # No English text (a message or a plural form) is in two splits, in any locale.
  assert not by_split["train"] & by_split["heldout"]
  assert not by_split["train"] & by_split["validation"]
  assert not by_split["validation"] & by_split["heldout"]
  # The rule is a hash of the text alone: the same text always lands in the same split, and about
  # 20 % / 3 % of the messages are held out / validation.
  messages = len({p.message for p in pairs})
  assert 0.15 < len(by_split["message:heldout"]) / messages < 0.25
  assert 0.01 < len(by_split["message:validation"]) / messages < 0.06
  assert gettext.split_of("Save and continue editing") == gettext.split_of(
      "Save and continue editing")
  heldout_inputs = {e["inputs"].split(": ", 1)[1] for e in gettext.examples("gettext_ende",
                                                                                "heldout")}
  train_inputs = {e["inputs"].split(": ", 1)[1]
                  for e in gettext.examples("gettext_translate", "train")}
  assert heldout_inputs and not heldout_inputs & train_inputs
  # The evaluation prompt set splits exactly like the task: its held-out prompts are held out here.
  prompt_set = prompts.load_prompt_set("gettext_ende", "heldout", style="t5")
  assert len(prompt_set) > 100
  assert all(gettext.split_of(p.split(": ", 1)[1]) == "heldout" for p in prompt_set.prompts)
  # The older `ende` set (the core catalog alone) agrees too.
  ende = prompts.load_prompt_set("ende", "heldout", style="t5")
  assert not {p.split(": ", 1)[1] for p in ende.prompts} & train_inputs


def test_unknown_task_and_split_are_named():
  import pytest
  with pytest.raises(ValueError, match="offline tasks are"):
    tasks.examples("gettext_klingon", "train")
  with pytest.raises(ValueError, match="splits"):
    tasks.examples("gettext_ende", "test")
