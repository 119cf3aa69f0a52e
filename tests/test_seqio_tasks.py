"""specjax.data.seqio_tasks: the seqio tasks yield what their sources hold, tokenized as specjax would.

Oracles: the TFDS tasks under `tfds.testing.mock_data` (offline random text) are compared with the
raw mock examples read through `tfds.load` and encoded by specjax's own SentencePiece wrapper
(`vocabulary.encode`, EOS appended), and decoded back to the prefixed text; the gettext tasks with
`gettext.examples` encoded the same way. The vocabulary is a 500-piece model trained on the
gettext training texts in a temporary directory. The last tests need no TensorFlow: no specjax
module imports it (the subprocess check), and a missing extra says how to install it.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

from specjax import vocabulary
from specjax.data import gettext, seqio_tasks, tasks

EOS = 1
REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  path = tmp_path_factory.mktemp("seqio_vocabulary") / "spiece.model"
  return vocabulary.train(tasks.texts_for_vocabulary("gettext_ende"), path, vocab_size=500)


@pytest.fixture(scope="module")
def libs(vocab):
  """seqio / tf / tfds, with the specjax tasks registered on the test vocabulary."""
  pytest.importorskip("seqio", reason="the tasks extra is not installed")
  libraries = seqio_tasks.require_tensorflow()
  assert seqio_tasks.register(vocab.source) == seqio_tasks.TASKS
  return libraries


def _ids(example_ids) -> list[int]:
  return [int(i) for i in example_ids]


@pytest.mark.parametrize("task_name", [seqio_tasks.WMT_ENDE, seqio_tasks.CNN_DAILYMAIL,
                                       seqio_tasks.XSUM])
def test_paper_tasks_yield_prefixed_tokenized_mock_examples(libs, vocab, tmp_path, task_name):
  tfds = libs.tfds
  spec = seqio_tasks._TFDS_TASKS[task_name]  # pylint: disable=protected-access
  # xsum is read only once its manual download is in place: an (empty) archive satisfies the check,
  # and mock_data replaces the preparation that would unpack it.
  manual_dir = tmp_path / "downloads" / "manual"
  manual_dir.mkdir(parents=True)
  (manual_dir / seqio_tasks.XSUM_ARCHIVE).touch()
  seqio_tasks.register(vocab.source, data_dir=str(tmp_path))
  with tfds.testing.mock_data(num_examples=4, policy=tfds.testing.MockPolicy.USE_CODE):
    raw = list(tfds.load(spec.tfds_name, split="test").as_numpy_iterator())
    examples = seqio_tasks.tokenized_examples(task_name, "test", vocab.source)
  assert len(examples) == len(raw) == 4
  for example, source in zip(examples, raw):
    assert set(example) == {"inputs", "targets"}
    assert example["inputs"].dtype == example["targets"].dtype == "int32"
    text, target = source[spec.source].decode(), source[spec.target].decode()
    assert _ids(example["inputs"]) == vocab.encode(spec.prefix + text)
    assert _ids(example["targets"]) == vocab.encode(target)
    assert example["targets"][-1] == EOS and EOS not in example["targets"][:-1]
    decoded = vocab.decode(example["inputs"])
    assert decoded.startswith(spec.prefix)
    # SentencePiece collapses runs of spaces (the mock text has some): the text is otherwise intact.
    assert decoded == " ".join((spec.prefix + text).split())


def test_gettext_tasks_yield_seq2seq_data_examples(libs, vocab):
  heldout = gettext.examples("gettext_ende", "heldout")
  examples = seqio_tasks.tokenized_examples("specjax_gettext_ende", "heldout", vocab.source)
  assert len(examples) == len(heldout) > 100
  for example, source in zip(examples, heldout):
    assert _ids(example["inputs"]) == vocab.encode(source["inputs"])
    assert _ids(example["targets"]) == vocab.encode(source["targets"])
  # seqio tokenizes with tensorflow-text's SentencePiece, which breaks exact score ties (a run of
  # one letter, "uuuuuu" = "uuuuu" + "u" or "u" + "uuuuu") otherwise than the Python library specjax
  # encodes with: ~2 % of the multilingual examples (3 of the first 30) get other, equally
  # valid ids, that decode to the same text.
  multilingual = gettext.examples("gettext_translate", "validation")[:30]
  first = seqio_tasks.tokenized_examples("specjax_gettext_translate", "validation", vocab.source,
                                         limit=30)
  assert len(first) == 30
  assert {source["locale"] for source in multilingual} != {"de"}  # not just German
  tensorflow_vocabulary = libs.seqio.SentencePieceVocabulary(vocab.source)
  ties = 0
  for example, source in zip(first, multilingual):
    for name in ("inputs", "targets"):
      expected = tensorflow_vocabulary.encode_tf(libs.tf.constant(source[name])).numpy().tolist()
      assert _ids(example[name]) == expected + [EOS]
      assert vocab.decode(example[name]) == vocab.decode(vocab.encode(source[name]))
      ties += _ids(example[name]) != vocab.encode(source[name])
  assert ties <= 4  # Afrikaans inputs and targets, two Arabic targets


def test_sequence_length_trims_before_eos(libs, vocab):
  del libs
  lengths = {"inputs": 6, "targets": 3}
  trimmed = seqio_tasks.tokenized_examples("specjax_gettext_ende", "validation", vocab.source,
                                           limit=5, sequence_length=lengths)
  for example, source in zip(trimmed, gettext.examples("gettext_ende", "validation")):
    for name, length in lengths.items():
      whole = vocab.encode(source[name], add_eos=False)
      assert _ids(example[name]) == whole[:length - 1] + [EOS]


def test_registering_another_vocabulary_replaces_the_tasks(libs, vocab, tmp_path):
  seqio = libs.seqio
  other = vocabulary.train(tasks.texts_for_vocabulary("gettext_ende"),
                           tmp_path / "spiece.model", vocab_size=200)
  source = gettext.examples("gettext_ende", "validation")[0]
  assert other.encode(source["inputs"]) != vocab.encode(source["inputs"])
  # tokenized_examples re-registers on demand when asked for another vocabulary.
  [example] = seqio_tasks.tokenized_examples("specjax_gettext_ende", "validation", other.source,
                                             limit=1)
  assert _ids(example["inputs"]) == other.encode(source["inputs"])
  for name in seqio_tasks.TASKS:
    feature = seqio.TaskRegistry.get(name).output_features["inputs"]
    assert feature.vocabulary.sentencepiece_model_file == other.source
  seqio_tasks.register(vocab.source)
  seqio_tasks.register(vocab.source)  # again: idempotent
  [example] = seqio_tasks.tokenized_examples("specjax_gettext_ende", "validation", vocab.source,
                                             limit=1)
  assert _ids(example["inputs"]) == vocab.encode(source["inputs"])


def test_xsum_without_its_manual_download_says_what_to_put_where(libs, vocab, tmp_path):
  seqio_tasks.register(vocab.source, data_dir=str(tmp_path))
  manual_dir = tmp_path / "downloads" / "manual"
  with pytest.raises(seqio_tasks.ManualDownloadError) as caught:
    seqio_tasks.tokenized_examples(seqio_tasks.XSUM, "test", vocab.source)
  message = str(caught.value)
  assert isinstance(caught.value, FileNotFoundError)
  for needed in ("xsum", str(manual_dir), seqio_tasks.XSUM_ARCHIVE, seqio_tasks.XSUM_SPLIT_LIST,
                 "DownloadConfig(manual_dir=", "EdinburghNLP/XSum"):
    assert needed in message
  # The same error reaches code that reads the task through seqio itself.
  task = libs.seqio.get_mixture_or_task(seqio_tasks.XSUM)
  with pytest.raises(seqio_tasks.ManualDownloadError):
    task.get_dataset(split="validation", shuffle=False)
  seqio_tasks.register(vocab.source)


def test_unregistered_task_names_the_registered_ones(libs, vocab):
  del libs
  with pytest.raises(ValueError, match="seqio.TaskRegistry") as caught:
    seqio_tasks.tokenized_examples("wmt_t2t_ende_v003", "test", vocab.source)
  assert all(name in str(caught.value) for name in seqio_tasks.TASKS)
  with pytest.raises(ValueError, match="no seqio task 'wmt_t2t_ende_v003'"):
    seqio_tasks.check_registered("wmt_t2t_ende_v003")  # the training command's early check
  for name in seqio_tasks.TASKS:
    seqio_tasks.check_registered(name)
  with pytest.raises(ValueError, match="no split 'test'"):
    seqio_tasks.tokenized_examples("specjax_gettext_ende", "test", vocab.source)


def test_other_seqio_tasks_are_read_with_their_own_vocabulary_only(libs, vocab, tmp_path):
  seqio, tf = libs.seqio, libs.tf
  features = {name: seqio.Feature(seqio.SentencePieceVocabulary(vocab.source), add_eos=True)
              for name in ("inputs", "targets")}

  def dataset_fn(split, shuffle_files):
    del split, shuffle_files
    return tf.data.Dataset.from_tensor_slices({"inputs": ["Save and continue"],
                                               "targets": ["Sichern und weiter"]})

  seqio.TaskRegistry.add("specjax_test_foreign",
                         source=seqio.FunctionDataSource(dataset_fn, ["train"]),
                         output_features=features,
                         preprocessors=[seqio.preprocessors.tokenize,
                                        seqio.preprocessors.append_eos_after_trim])
  try:
    [example] = seqio_tasks.tokenized_examples("specjax_test_foreign", "train", vocab.source)
    assert _ids(example["targets"]) == vocab.encode("Sichern und weiter")
    with pytest.raises(ValueError, match="not with the vocabulary asked for"):
      seqio_tasks.tokenized_examples("specjax_test_foreign", "train", tmp_path / "other.model")
  finally:
    seqio.TaskRegistry.remove("specjax_test_foreign")


def test_translation_tasks_score_bleu(libs):
  for name in (seqio_tasks.WMT_ENDE,) + seqio_tasks.GETTEXT_TASKS:
    assert libs.seqio.TaskRegistry.get(name).metric_fns == [seqio_tasks.bleu]
  references = ["Sichern und weiter bearbeiten", "Das Passwort ist zu kurz."]
  assert seqio_tasks.bleu(references, references) == {"bleu": pytest.approx(100.0)}
  partial = seqio_tasks.bleu(references, ["Sichern und bearbeiten", "Das Passwort ist kurz."])
  assert 0.0 < partial["bleu"] < 100.0


def _run_python(script: str) -> str:
  result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


def test_no_specjax_module_imports_tensorflow():
  out = _run_python("""
      import importlib, pkgutil, sys
      import specjax
      HEAVY = {"tensorflow", "tensorflow_datasets", "tensorflow_text", "seqio"}

      def loaded():
        return sorted(name for name in sys.modules if name.split(".")[0] in HEAVY)

      names = [info.name for info in pkgutil.walk_packages(specjax.__path__, "specjax.")]
      for name in names:
        if name != "specjax.data.seqio_tasks":
          importlib.import_module(name)
          assert not loaded(), (name, loaded())
      import specjax.data.seqio_tasks  # lazy too: TensorFlow only once a task is used
      assert not loaded(), loaded()
      print(len(names))
      """)
  assert int(out.split()[-1]) > 20  # every module was found, not just the package


def test_missing_extra_says_how_to_install_it():
  _run_python("""
      import sys
      sys.modules["seqio"] = None  # as if the tasks extra were not installed
      from specjax.data import seqio_tasks
      assert "specjax_xsum" in seqio_tasks.TASKS
      for needs_tensorflow in (seqio_tasks.require_tensorflow,
                               lambda: seqio_tasks.check_registered("specjax_wmt_t2t_ende")):
        try:
          needs_tensorflow()
        except ImportError as e:
          assert "pip install -e '.[tasks]'" in str(e) and "scripts/setup.sh" in str(e), e
        else:
          raise AssertionError("no ImportError")
      """)
