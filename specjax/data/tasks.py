"""The offline sequence-to-sequence tasks by name, whatever module reads them: Django's catalogs
(`gettext_translate`, `gettext_ende`: specjax.data.gettext) and every German catalog offline
(`catalogs_ende`: specjax.data.catalogs). Training and the seqio wrappers ask here; no TensorFlow.
"""

from __future__ import annotations

import functools

from specjax.data import catalogs, gettext, placeholders

TASKS = gettext.TASKS + (catalogs.TASK,)
EVALUATION_LOCALE = gettext.EVALUATION_LOCALE


def check_task(task: str) -> None:
  if task not in TASKS:
    raise ValueError(f"unknown offline task {task!r}; specjax's offline tasks are {list(TASKS)} "
                     "(the seqio tasks, with TensorFlow, are listed by specjax.data.seqio_tasks.TASKS)")


def task_splits(task: str) -> tuple[str, ...]:
  """The splits of an offline task: train / validation / heldout, and catalogs_ende's held-out
  packages' split too."""
  check_task(task)
  return catalogs.SPLITS if task == catalogs.TASK else gettext.SPLITS


@functools.lru_cache(maxsize=None)
def examples(task: str, split: str) -> tuple[dict, ...]:
  """The task's examples {'inputs', 'targets', 'locale'} of one split, in its reader's order
  (catalogs_ende's, with 'placeholders' too, and its counts per source and split logged)."""
  check_task(task)
  if task == catalogs.TASK:
    catalogs.log_counts()
    return catalogs.examples(split)
  return gettext.examples(task, split)


def vocabulary_symbols(task: str) -> tuple[str, ...]:
  """Pieces a vocabulary trained for the task must keep whole: catalogs_ende's placeholders'
  symbols."""
  check_task(task)
  return placeholders.SYMBOLS if task == catalogs.TASK else ()


def texts_for_vocabulary(task: str) -> list[str]:
  """The training split's inputs and targets: what a SentencePiece vocabulary is trained on (never
  the held-out messages)."""
  return [text for example in examples(task, "train") for text in (example["inputs"],
                                                                     example["targets"])]
