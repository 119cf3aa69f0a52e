"""The training entry point: `python -m specjax.train --gin_file=configs/X.gin [--gin_bindings='...']`.

A training config names its job the way a decoding config does (specjax/run.py):

    from __gin__ import dynamic_registration
    from specjax import train
    from specjax.training import draft_model
    train.main.job = @draft_model.train

Jobs: `training.draft_model.train` (distil a chain draft from a decoder-only target),
`training.heads.train` (Medusa heads or an MTP head on the target's hidden states),
`training.seq2seq.train` (train or fine-tune a T5 on a sequence-to-sequence task). Each finds its
finished output and returns in seconds, and resumes where a killed run stopped.
"""

from __future__ import annotations

import functools

import gin

from specjax import launch

parse_gin = functools.partial(launch.parse_configs, functools.partial(
    gin.parse_config_files_and_bindings, finalize_config=False))


@gin.configurable
def main(job=None):
  """What `python -m specjax.train` runs: the training job the config binds."""
  if job is None:
    raise ValueError("the config names no training job: bind one, e.g. "
                     "`train.main.job = @draft_model.train` (see configs/smollm2_draft.gin)")
  return job()


def cli():
  launch.cli(lambda: gin.get_configurable(main)(), parse_gin, gin.config_str,
             "configs/<training config>.gin (e.g. configs/smollm2_draft.gin)")


if __name__ == "__main__":
  from specjax import train as _module  # pylint: disable=import-self
  _module.cli()
