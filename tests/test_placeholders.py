"""Placeholder protection (specjax.data.placeholders): what counts as a placeholder, the exact round
trip on every catalog pair offline, and a vocabulary that keeps the symbols whole."""

import pytest

from specjax import vocabulary
from specjax.data import catalogs, placeholders, tasks


@pytest.mark.parametrize("text, found", [
    ("Submit to %(workflow_name)s", ("%(workflow_name)s",)),
    ("%(count).1f%% of %1$s, %-10s and %lu", ("%(count).1f", "%1$s", "%-10s", "%lu")),
    ("{0} of {name} ({count:d}), {}", ("{0}", "{name}", "{count:d}", "{}")),
    ("Hello {{ user }} {% trans %}", ("{{ user }}", "{% trans %}")),
    ('See <a href="%(url)s">the guide</a>.<br/>', ('<a href="%(url)s">', "</a>", "<br/>")),
    ("Tom &amp; Jerry&#160;", ("&amp;", "&#160;")),
    ("%s and %s again", ("%s",)),                      # distinct ones, first appearance
    ("100% done, 50 % off, a { b } c, 3 < 4 > 2", ()),  # percent signs, braces, comparisons
])
def test_what_a_placeholder_is(text, found):
  assert placeholders.find(text) == found


def test_protect_numbers_the_englishs_placeholders_in_both_texts():
  english, german, table = placeholders.protect("Move %(page)s to {0}: %s, %s",
                                                "{0}: %(page)s (%s, %s) verschieben %(other)s")
  assert (english, table) == ("Move <ph0> to <ph1>: <ph2>, <ph2>", ("%(page)s", "{0}", "%s"))
  assert german == "<ph1>: <ph0> (<ph2>, <ph2>) verschieben %(other)s"  # not in the English: kept
  assert placeholders.protect("Plain text") == ("Plain text", None, ())
  # A model's output: symbols back, one the source never had dropped.
  assert placeholders.restore("<ph1> nach <ph0> <ph7>", table) == "{0} nach %(page)s "
  with pytest.raises(ValueError, match="<ph0>"):
    placeholders.protect("Already <ph0> here")


def test_more_placeholders_than_symbols_stay_as_written():
  english = " ".join(f"{{p{k}}}" for k in range(placeholders.MAX_SYMBOLS + 2))
  protected, _, table = placeholders.protect(english)
  assert len(table) == placeholders.MAX_SYMBOLS
  assert protected.endswith("<ph9> {p10} {p11}")
  assert placeholders.restore(protected, table) == english


def test_every_catalog_pair_round_trips_and_its_example_is_protected():
  """restore(protect(...)) gives back both texts of every pair offline byte for byte, and the task's
  examples are exactly the protected texts with the table that restores them."""
  pairs = catalogs.catalog_pairs()
  protected = 0
  for pair in pairs:
    english, german, table = placeholders.protect(pair.english, pair.german)
    assert placeholders.restore(english, table) == pair.english
    assert placeholders.restore(german, table) == pair.german
    protected += bool(table)
  assert protected > 10_000  # a fifth of the messages carry placeholders
  pair = next(p for p in pairs if catalogs.split_of(p) == catalogs.HELDOUT_SPLIT
              and "%(" in p.english and "%(" in p.german)
  example = catalogs.example(pair)
  assert "%(" not in example["inputs"] + example["targets"] and "<ph0>" in example["targets"]
  protected_english = placeholders.protect(pair.english)[0]
  assert example["inputs"] == "translate English to German: " + protected_english
  assert placeholders.restore(example["targets"], example["placeholders"]) == pair.german


def test_a_vocabulary_trained_with_the_symbols_keeps_each_whole(tmp_path):
  texts = [f"Move {'<ph0>' if k % 2 else 'the page'} to the folder number {k}" for k in range(300)]
  vocab = vocabulary.train(texts, tmp_path / "spiece.model", 60, hard_vocab_limit=False,
                           user_defined_symbols=list(placeholders.SYMBOLS))
  ids = vocab.encode("Move <ph0> to <ph9>", add_eos=False)
  symbols = [vocab.id_to_piece(i) for i in ids if vocab.id_to_piece(i).startswith("<ph")]
  assert symbols == ["<ph0>", "<ph9>"]
  assert vocab.decode(ids) == "Move <ph0> to <ph9>"


def test_only_the_catalogs_task_trains_its_vocabulary_with_the_symbols():
  assert tasks.vocabulary_symbols("catalogs_ende") == placeholders.SYMBOLS
  assert tasks.vocabulary_symbols("gettext_ende") == ()


def test_the_training_runs_evaluation_scores_restored_outputs(tmp_path, monkeypatch):
  """evaluate_generation restores each output from its own message's table, and compares it with
  the German as shipped: a model that always writes `Erneut in <ph0> einreichen` matches exactly the
  held-out reference that says so, and loses the symbol where the English has no placeholder."""
  from specjax.training import seq2seq  # pylint: disable=import-outside-toplevel
  vocab = vocabulary.train(tasks.texts_for_vocabulary("catalogs_ende")[:4000], tmp_path / "spm",
                           300, user_defined_symbols=list(placeholders.SYMBOLS))
  shape = seq2seq.T5Shape(embed_dim=32, num_encoder_layers=1, num_decoder_layers=1, num_heads=2,
                          head_dim=16, mlp_dim=64)
  config, params = seq2seq.initial_params(shape, vocab, None, seed=0)
  monkeypatch.setattr(vocab, "decode", lambda ids, **_: "Erneut in <ph0> einreichen")
  task = seq2seq.TaskSpec(task=catalogs.TASK, evaluation_task=catalogs.TASK, max_input_length=16,
                          max_target_length=4, evaluation_split=catalogs.HELDOUT_SPLIT,
                          evaluation_limit=4)
  result = seq2seq.evaluate_generation(config, params, vocab, task, batch_size=2)  # two batches
  heldout = [pair for pair in catalogs.catalog_pairs()
             if catalogs.split_of(pair) == task.evaluation_split]
  assert [s["reference"] for s in result["samples"]] == [pair.german for pair in heldout[:4]]
  outputs = [s["output"] for s in result["samples"]]
  assert outputs == ["Erneut in " + (placeholders.find(pair.english) or ("",))[0] + " einreichen"
                     for pair in heldout[:4]]
  assert "Erneut in %(task_name)s einreichen" in outputs  # the wagtail message whose German this is
  assert result["exact_match"] == 0.25


def test_a_run_refuses_its_old_vocabulary_without_the_symbols(tmp_path):
  """A catalogs_ende run directory whose spiece.model predates the symbols is refused, naming the
  file and the fix, before any training; one with them is reused."""
  from specjax.training import seq2seq  # pylint: disable=import-outside-toplevel
  texts = [f"Move the page to the folder number {k}" for k in range(200)]
  vocabulary.train(texts, tmp_path / "old" / "spiece.model", 60, hard_vocab_limit=False)
  task = seq2seq.TaskSpec(task=catalogs.TASK)
  with pytest.raises(ValueError, match=r"old/spiece.model was trained without .* delete it"):
    seq2seq.obtain_vocabulary(task, tmp_path / "old")
  vocabulary.train(texts, tmp_path / "new" / "spiece.model", 60, hard_vocab_limit=False,
                   user_defined_symbols=list(placeholders.SYMBOLS))
  assert seq2seq.obtain_vocabulary(task, tmp_path / "new")[1] == tmp_path / "new" / "spiece.model"
