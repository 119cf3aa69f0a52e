"""The T5 EnDe experiment in a tiny configuration (configs/t5_ende/*.gin at toy sizes): a target trained
on `catalogs_ende` lowers its validation loss and resumes to identical parameters, a draft distils from
it, and greedy speculative decoding equals the target's own output on every held-out-catalog message.
The split itself (deterministic, disjoint, the held-out packages never trained on) is tests/test_catalogs.py."""

import json
import pathlib

import gin
import jax
import numpy as np
import pytest

from specjax import checkpoints, run
from specjax import vocabulary as vocabularies
from specjax.data import catalogs, prompts, tasks
from specjax.training import seq2seq, trainer

CONFIGS = pathlib.Path(__file__).parent.parent / "configs" / "t5_ende"
TARGET = seq2seq.T5Shape(embed_dim=48, num_encoder_layers=1, num_decoder_layers=2, num_heads=2,
                         head_dim=24, mlp_dim=96)
DRAFT = seq2seq.T5Shape(embed_dim=16, num_encoder_layers=1, num_decoder_layers=1, num_heads=1,
                        head_dim=16, mlp_dim=32)
SPEC = trainer.TrainSpec(steps=30, tokens_per_batch=512, learning_rate=1e-2, warmup_steps=5,
                         checkpoint_every=10, bucket=16)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(directory, vocabulary path, target summary): a tiny target and a draft distilled from it."""
  root = tmp_path_factory.mktemp("t5_ende")
  vocabulary_path = root / "spiece.model"
  vocabularies.train(tasks.texts_for_vocabulary(catalogs.TASK), vocabulary_path, 400,
                     user_defined_symbols=list(tasks.vocabulary_symbols(catalogs.TASK)))
  task = seq2seq.TaskSpec(task=catalogs.TASK, vocabulary=str(vocabulary_path), max_input_length=32,
                          max_target_length=32, validation_limit=256)
  summary = seq2seq.train(output_dir=str(root / "target"), task=task, model=TARGET, training=SPEC)
  seq2seq.train(output_dir=str(root / "draft"), task=task, model=DRAFT, training=SPEC,
                teacher=str(root / "target" / "hf"))
  return root, vocabulary_path, task, summary


def test_the_experiments_configs_parse_and_train_on_the_task():
  for name in ("target", "draft_small", "draft_base", "draft_large", "sweep", "lenience"):
    gin.clear_config()
    run.parse_gin([str(CONFIGS / f"{name}.gin")], [])
    if name.startswith("draft"):
      # A draft includes target.gin: it must not inherit the target's Adafactor at its own rate.
      assert gin.get_configurable(trainer.TrainSpec)().optimizer is None, name
  gin.clear_config()
  run.parse_gin([str(CONFIGS / "target.gin")], [])
  assert gin.get_configurable(trainer.TrainSpec)().optimizer == "adafactor"
  gin.clear_config()
  run.parse_gin([str(CONFIGS / "target.gin")], [])
  task = gin.get_configurable(seq2seq.TaskSpec)()
  assert (task.task, task.evaluation_split) == (catalogs.TASK, catalogs.HELDOUT_SPLIT)
  gin.clear_config()


def test_tiny_target_learns_and_resumes_exactly(trained, tmp_path):
  root, _, task, whole = trained
  assert whole["validation_after"]["loss"] < whole["validation_before"]["loss"] - 1.0, whole
  cut = str(tmp_path / "cut")
  assert seq2seq.train(output_dir=cut, task=task, model=TARGET, training=SPEC,
                       stop_after_step=20) == {"stopped_after_step": 20}
  resumed = seq2seq.train(output_dir=cut, task=task, model=TARGET, training=SPEC)
  _, a = checkpoints.load(root / "target" / "hf")
  _, b = checkpoints.load(tmp_path / "cut" / "hf")
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)  # bit-identical
  assert whole["loss_curve"] == resumed["loss_curve"]
  assert whole["validation_curve"] == resumed["validation_curve"]


def _generate(root, name: str, drafter: str | None) -> dict:
  gin.clear_config()
  run.parse_gin([str(CONFIGS.parent / "smollm2_generate.gin")], [
      f"generation.Generate.output_dir = '{root / name}'",
      f"specs.ModelSpec.checkpoint = '{root / 'target' / 'hf'}'",
      "specs.PromptSpec.name = 'heldout_catalogs'", "specs.PromptSpec.split = 'all'",
      "specs.PromptSpec.limit = None", "specs.PromptSpec.style = 't5'",
      "specs.PromptSpec.batch_size = 64", f"specs.DecodeSpec.max_new_tokens = {NEW_TOKENS}",
      f"generation.Generate.drafter = {drafter!r}", "generation.Generate.gamma = 3"])
  gin.get_configurable(run.main)()
  gin.clear_config()
  rows = [json.loads(line) for line in (root / name / "generations.jsonl").read_text().splitlines()]
  return {row["key"]: row["new_tokens"] for row in rows}


def test_greedy_speculative_equals_the_target_on_every_heldout_catalog_message(trained):
  root = trained[0]
  target = _generate(root, "generate_target", None)
  speculative = _generate(root, "generate_speculative", f"model:{root / 'draft' / 'hf'}")
  messages = prompts.load_prompt_set("heldout_catalogs", "all")
  assert len(target) == len(messages) > 2000  # every held-out message, each English once
  assert speculative == target
  # Not vacuous: the target writes more than EOS for most messages.
  assert np.mean([len(tokens) > 1 for tokens in target.values()]) > 0.5
