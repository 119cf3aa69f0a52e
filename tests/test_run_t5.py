"""`python -m specjax.run` on T5 checkpoints: a Hugging Face T5 directory (random weights, a small
SentencePiece model trained here) decodes prompts from a JSONL file into exactly the token ids
transformers' greedy `generate` gives; the same weights as a T5X checkpoint (plus the vocabulary
path) give the same ids; HF -> specjax -> T5X -> specjax keeps the logits; bad vocabularies and
sources that do not fit are refused with the fix."""

import functools
import json
import pathlib
import subprocess
import sys

import gin
import jax
import numpy as np
import pytest

from conftest import random_t5_params, generation_gin, tiny_t5_files
from specjax import contracts, loading, run, vocabulary
from specjax.data import prompts
from specjax.checkpoints import hf_t5, t5x
from specjax.models import t5

CONFIG = t5.SIZES["tiny"]  # 128 logits; the vocabulary below has 100 pieces
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def t5_dirs(tmp_path_factory):
  """(HF directory with spiece.model, T5X checkpoint, the vocabulary file, prompts JSONL, texts)."""
  return tiny_t5_files(tmp_path_factory.mktemp("t5"))


_gin_file = functools.partial(generation_gin, max_new_tokens=NEW_TOKENS)


def _generated(output_dir):
  rows = [json.loads(line) for line in (output_dir / "generations.jsonl").read_text().splitlines()]
  return {row["key"]: row["new_tokens"] for row in rows}


def _transformers_greedy(hf_dir, vocab, texts):
  import torch
  import transformers
  peer = transformers.T5ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
  out = {}
  for i, text in enumerate(texts):
    ids = torch.tensor([vocab.encode(text)])
    with torch.no_grad():
      tokens = peer.generate(input_ids=ids, do_sample=False, max_new_tokens=NEW_TOKENS,
                             decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)[0, 1:]
    tokens = tokens.tolist()
    out[f"p{i}"] = tokens[:tokens.index(1) + 1] if 1 in tokens else tokens
  return out


def test_hf_t5_directory_through_python_m_specjax_run(t5_dirs, tmp_path):
  hf_dir, _, vocab_path, prompts, texts = t5_dirs
  config = _gin_file(tmp_path / "t5.gin", tmp_path / "out", hf_dir, None, prompts)
  subprocess.run([sys.executable, "-m", "specjax.run", f"--gin_file={config}"], check=True,
                 cwd=pathlib.Path(__file__).parent.parent, capture_output=True, timeout=600)
  ours = _generated(tmp_path / "out")
  vocab = vocabulary.SentencePieceVocabulary.from_file(vocab_path)
  assert ours == _transformers_greedy(hf_dir, vocab, texts)
  assert len({tuple(v) for v in ours.values()}) > 1  # the prompts really give different outputs


def test_t5x_checkpoint_with_vocabulary_path_gives_the_same_ids(t5_dirs, tmp_path):
  hf_dir, t5x_dir, vocab_path, prompts, _ = t5_dirs
  results = {}
  # The T5X checkpoint and its vocabulary by URL (what gs:// paths go through), the HF one by path.
  for name, checkpoint, vocab in [("hf", hf_dir, None),
                                  ("t5x", f"file://{t5x_dir}", f"file://{vocab_path}")]:
    gin.clear_config()
    run.parse_gin([str(_gin_file(tmp_path / f"{name}.gin", tmp_path / name, checkpoint, vocab,
                                 prompts))], [])
    summary = gin.get_configurable(run.main)()
    assert summary["prompts"] == 5
    results[name] = _generated(tmp_path / name)
  gin.clear_config()
  assert results["hf"] == results["t5x"]


def test_hf_to_t5x_and_back_keeps_the_logits(t5_dirs, tmp_path):
  hf_dir, *_ = t5_dirs
  config, from_hf = hf_t5.load(hf_dir)
  t5x.save(tmp_path / "checkpoint_7", config, from_hf)
  back_config, from_t5x = t5x.load(tmp_path / "checkpoint_7")
  assert back_config == config
  source = contracts.Source(np.array([[5, 9, 33, 1, 0], [7, 1, 0, 0, 0]], np.int32),
                            np.array([4, 2], np.int32))
  prompt = t5.decoder_prompt(config, 2)

  def logits(params):
    session = contracts.open_session(t5.model(config), params, source)
    return np.asarray(session.step(prompt[0], np.zeros((2, 1), np.int32),
                                   session.init_cache(2, 4))[0])

  np.testing.assert_array_equal(logits(from_t5x), logits(from_hf))


def test_bad_vocabulary_and_long_sources_are_refused(t5_dirs, tmp_path):
  hf_dir, t5x_dir, vocab_path, _, texts = t5_dirs
  with pytest.raises(ValueError, match="holds no vocabulary; pass its SentencePiece model"):
    loading.load_model(str(t5x_dir))
  big = vocabulary.train([t for pair in prompts.django_de_pairs() for t in pair],
                         tmp_path / "big.model", vocab_size=300)
  with pytest.raises(ValueError, match="300 tokens but the model only 128 logits"):
    loading.load_model(str(t5x_dir), str(tmp_path / "big.model"))
  del big
  loaded = loading.load_model(str(hf_dir))
  with pytest.raises(ValueError, match="more than max_prompt_length=4; raise max_prompt_length"):
    loaded.batch(texts[:1], bucket=8, max_length=4)
  assert jax.tree_util.tree_structure(loaded.params) == jax.tree_util.tree_structure(
      t5.param_shapes(CONFIG))


def _random_draft(directory, vocab_path):
  """A smaller random T5 (its own encoder) saved as a Hugging Face directory: a sweep's draft."""
  config = t5.T5Config(vocab_size=128, embed_dim=16, num_encoder_layers=1, num_decoder_layers=1,
                       num_heads=2, head_dim=8, mlp_dim=32)
  return hf_t5.save(directory, config, random_t5_params(config, seed=3), vocabulary=vocab_path)


def test_t5_sweep_end_to_end(t5_dirs, tmp_path):
  """The measured speculative sweep on a T5 target: a smaller T5 draft (its own encoder) and prompt
  lookup over the source, on a prompts file; greedy points equal the baseline token for token."""
  hf_dir, _, vocab_path, prompts, _ = t5_dirs
  draft_dir = _random_draft(tmp_path / "draft", vocab_path)
  gin.clear_config()
  run.parse_gin([str(pathlib.Path(__file__).parent.parent / "configs" / "smollm2_default.gin")], [
      f"speculative_sweep.Sweep.output_dir = '{tmp_path / 'sweep'}'",
      f"specs.ModelSpec.checkpoint = '{hf_dir}'", "specs.PromptSpec.style = 't5'",
      "specs.DecodeSpec.max_new_tokens = 8",
      f"speculative_sweep.SweepSpec.tasks = ('{prompts}',)",
      f"speculative_sweep.SweepSpec.drafters = ('model:{draft_dir}', 'lookup')",
      "speculative_sweep.SweepSpec.gammas = (2,)", "speculative_sweep.SweepSpec.temperatures = (0.0,)",
      "speculative_sweep.SweepSpec.prompts_per_task = 2"])
  try:
    rows = gin.get_configurable(run.main)()
  finally:
    gin.clear_config()
  assert len(rows) == 2
  for row in rows:
    assert row["outputs_match_baseline"] is True and row["prompts"] == 2
    # measure.size_name names sizes by models.SIZES, where T5's test shapes are "t5-tiny"
    assert 0.0 <= row["alpha"] <= 1.0 and row["c"] > 0 and row["target"] == "t5-tiny"
    assert min(row["iteration_ms"].values()) > 0 and row["predicted_speedup_from_costs"] > 0
  assert (tmp_path / "sweep" / "tables.md").is_file()


def test_t5_tree_sweep_end_to_end(t5_dirs, tmp_path):
  """The token-tree sweep on a T5 target: trees from a smaller T5 draft's top-k and from prompt lookup
  over the source, on a prompts file; greedy points equal the baseline token for token."""
  hf_dir, _, vocab_path, prompts, _ = t5_dirs
  draft_dir = _random_draft(tmp_path / "draft", vocab_path)
  gin.clear_config()
  run.parse_gin([str(pathlib.Path(__file__).parent.parent / "configs" / "t5_gettext" / "trees.gin")], [
      f"tree_sweep.TreeSweep.output_dir = '{tmp_path / 'trees'}'",
      f"specs.ModelSpec.checkpoint = '{hf_dir}'", "specs.DecodeSpec.max_new_tokens = 8",
      f"tree_sweep.TreeSweepSpec.tasks = ('{prompts}',)",
      f"tree_sweep.TreeSweepSpec.drafters = ('model:{draft_dir}', 'lookup')",
      "tree_sweep.TreeSweepSpec.trees = ('spine:2x2',)",
      "tree_sweep.TreeSweepSpec.temperatures = (0.0, 1.0)",
      "tree_sweep.TreeSweepSpec.prompts_per_task = 2"])
  try:
    rows = gin.get_configurable(run.main)()
  finally:
    gin.clear_config()
  assert len(rows) == 4
  for row in rows:
    assert row["outputs_match_baseline"] is (True if row["temperature"] == 0.0 else None)
    assert row["prompts"] == 2 and row["target"] == "t5-tiny" and row["tree_size"] == 5
    assert 1.0 <= row["tokens_per_target_call"] <= 3.0 and row["predicted_speedup"] > 0
    assert min(row["cost_draft"], row["cost_verify"], row["cost_accept"]) > 0
  # the kind column is registry.label(name): "draft model" for `model:<dir>`
  assert "draft model" in (tmp_path / "trees" / "trees.md").read_text()


def test_t5_tree_sweep_refuses_heads_before_writing(t5_dirs, tmp_path):
  """Heads and the MTP head read a decoder-only target's hidden states: a T5 tree sweep naming them is
  refused with the fix (a chain drafter's top-k) before its run directory exists."""
  hf_dir, _, _, prompts, _ = t5_dirs
  heads_dir = tmp_path / "heads"
  heads_dir.mkdir()
  (heads_dir / "heads.json").write_text("{}")
  gin.clear_config()
  run.parse_gin([str(pathlib.Path(__file__).parent.parent / "configs" / "t5_gettext" / "trees.gin")], [
      f"tree_sweep.TreeSweep.output_dir = '{tmp_path / 'trees'}'",
      f"specs.ModelSpec.checkpoint = '{hf_dir}'", f"tree_sweep.TreeSweepSpec.tasks = ('{prompts}',)",
      f"tree_sweep.TreeSweepSpec.drafters = ('lookup', 'lookup+mtp:{heads_dir}')"])
  try:
    with pytest.raises(ValueError, match="decoder-only targets only.*model draft's top-k"):
      gin.get_configurable(run.main)()
  finally:
    gin.clear_config()
  assert not (tmp_path / "trees").exists()
