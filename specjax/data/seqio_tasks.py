"""seqio tasks for the papers' datasets (TFDS) and specjax's offline gettext data, behind an extra.

The only specjax module that touches seqio, TensorFlow or TensorFlow Datasets, and even it imports
them lazily (`require_tensorflow`), so `import specjax.data.seqio_tasks` is cheap and works without the
extra: callers can test a name against `TASKS` or catch `ManualDownloadError` before paying the
~10 s TensorFlow import. Install the libraries with `pip install -e '.[tasks]'` (`bash scripts/setup.sh
test` does).

Nothing is registered at import time: the vocabulary is the caller's (the public T5 one, or one
trained with `specjax.vocabulary.train`), so `register(vocabulary_path)` adds the tasks to
`seqio.TaskRegistry`, and registering again with another vocabulary replaces them.
`tokenized_examples` registers on demand and is what the training command reads.

Tasks (every one: features 'inputs' and 'targets', SentencePiece ids with EOS 1 appended; T5's task
prefixes, so a public T5 checkpoint sees the inputs it was fine-tuned on):
  specjax_wmt_t2t_ende     TFDS wmt_t2t_translate/de-en: train = Europarl v7 + CommonCrawl + News
                           Commentary v13, validation = newstest2013, test = newstest2014 (the split
                           lists in TFDS's wmt_t2t.py, as Tensor2Tensor built them); inputs
                           "translate English to German: " + en, targets de. BLEU metric.
  specjax_cnn_dailymail    TFDS cnn_dailymail:3.4.0 (non-anonymized); "summarize: " + article ->
                           highlights (joined by newlines).
  specjax_xsum             TFDS xsum:1.1.0; "summarize: " + document -> summary. TFDS cannot
                           download the articles: see `ManualDownloadError`.
  specjax_gettext_translate, specjax_gettext_ende, specjax_catalogs_ende
                           `specjax.data.tasks.examples(...)` exactly, in their order (splits
                           train / validation / heldout, and catalogs_ende's heldout_catalogs).
                           BLEU metric (catalogs_ende's on the texts with placeholder symbols: its
                           examples' restoring tables are not features here; the training run's
                           evaluation scores restored text).
No metric for the summarization tasks: ROUGE's package is not among the dependencies.

Tokenization is seqio's own (tensorflow-text's SentencePiece, in the graph). It breaks exact score
ties, e.g. a run of one letter ("uuuuuu" as "uuuuu" + "u" or "u" + "uuuuu"), otherwise than the
Python library behind `specjax.vocabulary`: a few examples (~2 % of the multilingual gettext ones
with a 500-piece vocabulary) get other, equally valid ids that decode to the same text.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import textwrap
import types

from specjax.data import tasks

PREFIX = "specjax_"
WMT_ENDE = PREFIX + "wmt_t2t_ende"
CNN_DAILYMAIL = PREFIX + "cnn_dailymail"
XSUM = PREFIX + "xsum"
GETTEXT_TASKS = tuple(PREFIX + task for task in tasks.TASKS)
TASKS = (WMT_ENDE, CNN_DAILYMAIL, XSUM) + GETTEXT_TASKS
INSTALL_HINT = ("specjax's seqio tasks need seqio, TensorFlow and TensorFlow Datasets: install the "
                "extra with `pip install -e '.[tasks]'` (or run `bash scripts/setup.sh test`)")

TFDS_SPLITS = ("train", "validation", "test")
XSUM_TFDS_NAME = "xsum:1.1.0"
XSUM_ARCHIVE = "xsum-extracts-from-downloads.tar.gz"
XSUM_SPLIT_LIST = "XSum-TRAINING-DEV-TEST-SPLIT-90-5-5.json"


@dataclasses.dataclass(frozen=True)
class _TfdsTask:
  """A TFDS dataset read as (T5 prefix + source feature) -> target feature."""
  tfds_name: str
  prefix: str
  source: str
  target: str
  translation: bool = False


_TFDS_TASKS = {
    WMT_ENDE: _TfdsTask("wmt_t2t_translate/de-en:1.0.0", "translate English to German: ", "en",
                        "de", translation=True),
    CNN_DAILYMAIL: _TfdsTask("cnn_dailymail:3.4.0", "summarize: ", "article", "highlights"),
    XSUM: _TfdsTask(XSUM_TFDS_NAME, "summarize: ", "document", "summary"),
}


class ManualDownloadError(FileNotFoundError):
  """A TFDS dataset that TFDS cannot fetch by itself is neither prepared nor manually downloaded.

  Raised before TFDS starts preparing, because TFDS would first try the network (xsum downloads its
  split list) and fail there with an error that does not name the missing archive.
  """


@dataclasses.dataclass(frozen=True)
class _Registration:
  vocabulary_path: str
  extra_ids: int
  data_dir: str | None


_registration: _Registration | None = None


@functools.lru_cache(maxsize=None)
def require_tensorflow() -> types.SimpleNamespace:
  """seqio, tensorflow and tensorflow_datasets as `.seqio`, `.tf`, `.tfds`, imported on first use;
  an ImportError that says how to install them when they are missing."""
  try:
    import seqio  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"{INSTALL_HINT} ({e})") from e
  return types.SimpleNamespace(seqio=seqio, tf=tf, tfds=tfds)


def register(vocabulary_path, extra_ids: int = 0, *,
             data_dir: str | None = None) -> tuple[str, ...]:
  """(Re)register every specjax task with the SentencePiece model at `vocabulary_path`.

  Idempotent: the tasks are removed from seqio.TaskRegistry and added again, so a later call with
  another vocabulary (or extra_ids, or data_dir) replaces them. data_dir: TFDS's data directory
  (None: TFDS's default, $TFDS_DATA_DIR or ~/tensorflow_datasets). Returns TASKS.
  """
  global _registration
  libs = require_tensorflow()
  seqio = libs.seqio
  path = os.fspath(vocabulary_path)
  if "://" not in path and not pathlib.Path(path).is_file():
    raise FileNotFoundError(f"no SentencePiece model at {path} (the vocabulary for specjax's seqio "
                            "tasks)")
  vocabulary = seqio.SentencePieceVocabulary(path, extra_ids)
  features = {name: seqio.Feature(vocabulary, add_eos=True) for name in ("inputs", "targets")}

  def tokenize_then_eos():  # t5's order: what the cache would hold, then the length-dependent EOS
    return [seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder(),
            seqio.preprocessors.append_eos_after_trim]

  for name in TASKS:
    seqio.TaskRegistry.remove(name)
  for name, spec in _TFDS_TASKS.items():
    source_class = _xsum_source() if name == XSUM else seqio.TfdsDataSource
    seqio.TaskRegistry.add(
        name, source=source_class(tfds_name=spec.tfds_name, tfds_data_dir=data_dir,
                                  splits=TFDS_SPLITS),
        output_features=features,
        preprocessors=[functools.partial(_prefixed, spec=spec)] + tokenize_then_eos(),
        metric_fns=[bleu] if spec.translation else [])
  for name in GETTEXT_TASKS:
    seqio.TaskRegistry.add(
        name, source=seqio.FunctionDataSource(
            functools.partial(_gettext_dataset, name[len(PREFIX):]),
            splits=tasks.task_splits(name[len(PREFIX):])),
        output_features=features, preprocessors=tokenize_then_eos(), metric_fns=[bleu])
  _registration = _Registration(path, extra_ids, data_dir)
  return TASKS


def check_registered(task_name: str) -> None:
  """Fail early, before a run does any work: ImportError (how to install) without the tasks extra,
  ValueError for a name that is neither a specjax task (registered on demand, with the vocabulary
  `tokenized_examples` is given) nor already in seqio.TaskRegistry."""
  seqio = require_tensorflow().seqio
  if task_name not in TASKS and task_name not in seqio.TaskRegistry.names():
    raise ValueError(
        f"no seqio task {task_name!r} is registered. specjax registers {list(TASKS)} itself (with "
        "the vocabulary given); register any other task with seqio.TaskRegistry.add(...) (or "
        "import the module that does, e.g. t5.data.tasks) before asking for it")


def tokenized_examples(task_name: str, split: str, vocabulary_path, *, limit: int | None = None,
                       sequence_length: dict | None = None, extra_ids: int = 0) -> list[dict]:
  """[{'inputs': int32[n], 'targets': int32[m]}] of a seqio task's split, in the source's order.

  No shuffling, one epoch, nothing cached in memory between calls. A specjax task is (re)registered
  with `vocabulary_path` when it is not registered with it yet (keeping register's data_dir); any
  other task must already be in seqio.TaskRegistry (e.g. t5's, after `import t5.data.tasks`), with
  this vocabulary. sequence_length: {'inputs': n, 'targets': m} trims each feature to fit its EOS
  in that length; None keeps whole sequences. limit: the first `limit` examples only.
  """
  if limit is not None and limit < 0:
    raise ValueError(f"limit must be None or >= 0, not {limit}")
  check_registered(task_name)
  seqio = require_tensorflow().seqio
  path = os.fspath(vocabulary_path)
  if task_name in TASKS:
    current = _registration
    if current is None or (current.vocabulary_path, current.extra_ids) != (path, extra_ids):
      register(path, extra_ids, data_dir=current.data_dir if current else None)
  task = seqio.TaskRegistry.get(task_name)
  _check_vocabulary(task, path)
  if split not in task.splits:
    raise ValueError(f"task {task_name} has no split {split!r}; splits: {list(task.splits)}")
  dataset = task.get_dataset(sequence_length=sequence_length, split=split, shuffle=False,
                             num_epochs=1, use_cached=False, try_in_mem_cache=False)
  if limit is not None:
    dataset = dataset.take(limit)
  return [{name: example[name].astype("int32") for name in ("inputs", "targets")}
          for example in dataset.as_numpy_iterator()]


def bleu(targets: list[str], predictions: list[str]) -> dict[str, float]:
  """Corpus BLEU as T5 reports it for WMT: sacrebleu, international tokenization, exponential
  smoothing, case-sensitive."""
  import sacrebleu  # pylint: disable=import-outside-toplevel
  score = sacrebleu.corpus_bleu(predictions, [targets], smooth_method="exp", tokenize="intl",
                                lowercase=False)
  return {"bleu": score.score}


def check_xsum_download(data_dir: str | None = None, tfds_name: str = XSUM_TFDS_NAME) -> None:
  """ManualDownloadError unless xsum is prepared in `data_dir` (None: TFDS's default) or its
  archive waits in TFDS's default manual directory there, <data_dir>/downloads/manual (the one a
  seqio TfdsDataSource gets: seqio passes no DownloadConfig)."""
  tfds = require_tensorflow().tfds
  root = pathlib.Path(data_dir or tfds.core.constants.get_default_data_dir()).expanduser()
  if tfds.builder(tfds_name, data_dir=os.fspath(root)).is_prepared():
    return
  manual_dir = root / "downloads" / "manual"
  if (manual_dir / XSUM_ARCHIVE).exists():
    return
  builder_class = tfds.builder_cls(tfds_name.split(":")[0])
  instructions = textwrap.dedent(builder_class.MANUAL_DOWNLOAD_INSTRUCTIONS)
  raise ManualDownloadError(
      f"TFDS dataset {tfds_name} (specjax task {XSUM}) needs a manual download: it is not "
      f"prepared under {root}, and {manual_dir} has no {XSUM_ARCHIVE}. TFDS cannot fetch the BBC "
      "articles itself. Run the XSum download and extraction scripts, compress their folder "
      f"'xsum-extracts-from-downloads' as {XSUM_ARCHIVE} and put it in {manual_dir} (TFDS's "
      "default manual directory, <data_dir>/downloads/manual, where TFDS looks when seqio has it "
      "prepare the data). On a machine without network, put the split list TFDS would otherwise "
      f"download, {XSUM_SPLIT_LIST}, there too. Or prepare it yourself with any directory: "
      f"tfds.builder('{tfds_name}', data_dir=D).download_and_prepare(download_config="
      "tfds.download.DownloadConfig(manual_dir=M)), then seqio_tasks.register(..., data_dir=D). "
      f"TFDS's own instructions:\n{instructions.strip()}")


@functools.lru_cache(maxsize=None)
def _xsum_source() -> type:
  """seqio.TfdsDataSource that checks for xsum's manual download before TFDS prepares (a class
  built on first use, because seqio is imported lazily)."""
  seqio = require_tensorflow().seqio

  class ManualDownloadTfdsSource(seqio.TfdsDataSource):
    """TfdsDataSource whose get_dataset first raises ManualDownloadError if the data is missing."""

    def get_dataset(self, split=None, shuffle=True, seed=None, shard_info=None, **kwargs):
      check_xsum_download(self.tfds_dataset.data_dir, self.tfds_dataset.name)
      return super().get_dataset(split, shuffle, seed, shard_info, **kwargs)

  return ManualDownloadTfdsSource


def _prefixed(dataset, spec: _TfdsTask):
  """{'inputs': prefix + source text, 'targets': target text}: T5's task-prefix form."""
  tf = require_tensorflow().tf

  def rekey(example):
    return {"inputs": tf.strings.join([spec.prefix, example[spec.source]]),
            "targets": example[spec.target]}

  return dataset.map(rekey, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _gettext_dataset(task: str, split: str, shuffle_files: bool, seed: int | None = None):
  """seq2seq_data's examples of one split as a tf.data.Dataset of strings, in their order.

  shuffle_files and seed are seqio's FunctionDataSource interface; there is one "file" (the split
  in memory) and its order is kept; a shuffled Task shuffles examples itself.
  """
  del shuffle_files, seed
  tf = require_tensorflow().tf
  examples = tasks.examples(task, split)
  columns = {key: tf.constant([example[key] for example in examples], dtype=tf.string,
                             shape=[len(examples)])
             for key in ("inputs", "targets", "locale")}
  return tf.data.Dataset.from_tensor_slices(columns)


def _check_vocabulary(task, vocabulary_path: str) -> None:
  """ValueError when a task's features are tokenized with another SentencePiece model: ids from it
  would mean other pieces to the model this vocabulary belongs to."""
  for name in ("inputs", "targets"):
    feature = task.output_features.get(name)
    if feature is None:
      raise ValueError(f"task {task.name} has no '{name}' feature (features: "
                       f"{sorted(task.output_features)}); specjax reads inputs -> targets tasks")
    model_file = getattr(feature.vocabulary, "sentencepiece_model_file", None)
    if model_file is not None and os.fspath(model_file) != vocabulary_path:
      raise ValueError(f"task {task.name} tokenizes '{name}' with {model_file}, not with the "
                       f"vocabulary asked for, {vocabulary_path}")
