"""Shared fixtures and table models. Multi-device tests set XLA_FLAGS themselves in a subprocess.

Table models (DESIGN.md: the decoding core never imports models/, so the loop can be tested on logits
looked up from fixed arrays): `bigram_step` / `bigram_cache` as a target, `BigramDrafter` over a dense
[V, V] log-prob table, and `bigram_table` / `bigram_from_step` to build such tables.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

# The suite compiles hundreds of small programs and runs each for milliseconds: XLA's compile is most
# of its time. These flags make that compile about 3x cheaper without changing a program: LLVM at -O0
# and XLA's older loop emitters instead of its fusion emitters (same HLO, same passes, same library
# calls for the matrix products; elementwise code is just less optimised). Set before jax starts its
# backend, and inherited by every subprocess a test starts (the 8-device checks append to them).
# Benchmarks and real runs never see them. SPECJAX_TEST_XLA_FLAGS="" compiles as a user's run does.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if "SPECJAX_TEST_XLA_FLAGS_SET" not in os.environ:
  os.environ["SPECJAX_TEST_XLA_FLAGS_SET"] = "1"
  os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), os.environ.get(
      "SPECJAX_TEST_XLA_FLAGS", TEST_XLA_FLAGS)]))

import flax.struct  # noqa: E402  pylint: disable=wrong-import-position
import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import contracts
from specjax.models import decoder_only, t5


def pytest_configure(config):
  """One persistent compilation cache for the whole run: the controller picks a fresh directory and
  the environment hands it to every pytest-xdist worker and to every subprocess a test starts (the
  8-device checks, the two-process run, the notebook's kernel). Tests rebuild the same programs
  again and again (a resumed run compiles what the first run did, two sweeps share their baseline),
  and XLA's compile is most of a small test's time on this CPU. Keyed by the program, the compiler
  and the devices, a hit is the very executable a compile would give. A size limit turns on JAX's
  file lock, so the two workers never read an entry the other is still writing."""
  if hasattr(config, "workerinput") or "SPECJAX_TEST_XLA_CACHE" in os.environ:
    directory = os.environ.get("SPECJAX_TEST_XLA_CACHE")
  else:
    directory = tempfile.mkdtemp(prefix="specjax-test-xla-")
    os.environ["SPECJAX_TEST_XLA_CACHE"] = directory
    config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))
  if directory:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(16 << 30)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_compilation_cache_max_size", 16 << 30)


def random_decoder_params(config, seed=0, scale=0.2):
  """Random weights large enough that greedy outputs vary from token to token (std 0.02 collapses)."""
  params = decoder_only.init_params(config, jax.random.PRNGKey(seed))
  rng = np.random.RandomState(seed)

  def scaled(leaf):
    leaf = np.asarray(leaf)
    if np.all(leaf == 1.0):  # norm scales: perturb around 1 so a bug in their use shows
      return (1.0 + 0.1 * rng.randn(*leaf.shape)).astype(np.float32)
    return (scale * rng.randn(*leaf.shape)).astype(np.float32)

  return jax.tree_util.tree_map(scaled, params)


def run_check_on_8_devices(script: str) -> str:
  """Run tests/<script> in a subprocess (it sets XLA_FLAGS for 8 host devices before importing jax,
  which is fixed per process); assert it succeeded and return its stdout."""
  here = pathlib.Path(__file__).parent
  env = dict(os.environ, PYTHONPATH=str(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run([sys.executable, str(here / script)], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


@flax.struct.dataclass
class LengthsCache:
  """The cache of a table model: nothing but each row's length."""
  lengths: jax.Array


def bigram_step(table, tokens, positions, cache):
  """A table model (DESIGN.md: the decoding core never imports models/): next-token logits =
  table[token]; the cache only tracks lengths."""
  return table[tokens], cache.replace(lengths=positions[:, -1] + 1)


def bigram_cache(batch, max_length):
  del max_length  # a table model stores nothing per position
  return LengthsCache(jnp.zeros((batch,), jnp.int32))


def bigram_model():
  """The bigram table model as a contracts.Model: its params are the [V, V] logits table."""
  return contracts.StepModel(bigram_step, bigram_cache)


class BigramDrafter:
  """Proposes row params[previous token] of a dense [V, V] log-prob table (Leviathan's bigram draft
  for small vocabularies); no state, the previous token arrives in `tokens`."""

  def init(self, params, prompt_tokens, prompt_lengths, max_length, source=None):
    return None

  def propose(self, params, state, tokens, positions, transform):
    return transform(params[tokens[:, -1]]), state

  def rollback(self, state, lengths):
    return state


def bigram_marginals(target, temperature, top_k, top_p, steps, prompt_token=2):
  """Exact law of the tokens target-only sampling from a [V, V] bigram logits table emits at output
  positions 0..steps-1 after a one-token prompt."""
  from specjax.decoding import sampling  # pylint: disable=import-outside-toplevel
  chain = np.asarray(sampling.probs_from_logits(jnp.asarray(target), temperature, top_k, top_p),
                     np.float64)
  law, laws = chain[prompt_token], []
  for _ in range(steps):
    laws.append(law)
    law = law @ chain
  return laws


def assert_follows_laws(tokens, laws, label=""):
  """Each output position's token counts (rows of tokens[N, steps]) vs its exact law: no token off
  the support; chi-square p < 1e-6 fails; total variation < 0.06 (its sd at N = 4000 and V = 6 is
  ~0.005, so > 7 sd)."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  tokens = np.asarray(tokens)
  rows = len(tokens)
  for position, law in enumerate(laws):
    counts = np.bincount(tokens[:, position], minlength=len(law))
    support = law > 1e-9
    assert counts[~support].sum() == 0, (label, position)
    if support.sum() > 1:
      assert stats.chisquare(counts[support], law[support] / law[support].sum() * rows).pvalue > 1e-6
    assert 0.5 * np.abs(counts / rows - law).sum() < 0.06, (label, position)


def bigram_table(sequences, vocab_size, smoothing=1.0):
  """Token-id sequences -> log-probs [V, V], row a = log P(next | previous = a), add-`smoothing`."""
  if smoothing <= 0:
    raise ValueError(f"smoothing must be > 0 so every token keeps some probability, got {smoothing}")
  counts = np.full((vocab_size, vocab_size), float(smoothing))
  for seq in sequences:
    seq = np.asarray(seq, np.int64)
    np.add.at(counts, (seq[:-1], seq[1:]), 1.0)
  return (np.log(counts) - np.log(counts.sum(-1, keepdims=True))).astype(np.float32)


def bigram_from_step(model, params, vocab_size, chunk=1024):
  """A model's own bigram: log-softmax of its logits after each single token at position 0, `chunk`
  token ids at a time. Returns [V, V] float32."""
  def logits(p, tokens):
    session = contracts.open_session(model, p)
    return session.step(tokens, jnp.zeros_like(tokens), session.init_cache(tokens.shape[0], 1))[0][:, 0]
  run = jax.jit(logits)
  chunk = min(chunk, vocab_size)
  rows = []
  for start in range(0, vocab_size, chunk):
    ids = np.arange(start, min(start + chunk, vocab_size), dtype=np.int32)
    padded = np.pad(ids, (0, chunk - len(ids)))  # one compiled shape for every chunk
    rows.append(np.asarray(jax.nn.log_softmax(run(params, padded[:, None])))[:len(ids)])
  return np.concatenate(rows).astype(np.float32)


def random_t5_params(cfg, seed=0, scale=0.2):
  """Weights large enough that outputs vary (std 0.02 collapses): kernels `scale`, embedding and
  relative position tables std 1 (T5's own init), norm scales around 1."""
  rng = np.random.RandomState(seed)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return (1.0 + 0.1 * rng.randn(*leaf.shape)).astype(np.float32)
    std = 1.0 if ("embedding" in name or "rel_embedding" in name) else scale
    return (std * rng.randn(*leaf.shape)).astype(np.float32)

  return jax.tree_util.tree_map_with_path(draw, t5.param_shapes(cfg))


def ragged_source(cfg, lengths=(20, 9, 14), seed=0):
  """Right-padded (with pad 0) random sources ending in EOS: tokens[B, max(lengths)], lengths[B]."""
  rng = np.random.RandomState(seed)
  tokens = np.zeros((len(lengths), max(lengths)), np.int32)
  for row, length in enumerate(lengths):
    tokens[row, :length] = rng.randint(2, cfg.vocab_size, length)
    tokens[row, length - 1] = cfg.eos_id
  return tokens, np.asarray(lengths, np.int32)


def llama_cpp_permute(w, n_head):
  """What llama.cpp's converter does to q/k rows (written from its documented layout)."""
  d_out, d_in = w.shape
  return w.reshape(n_head, 2, d_out // n_head // 2, d_in).swapaxes(1, 2).reshape(d_out, d_in)


def write_llama_gguf(path, cfg, params):
  """A float32 GGUF of a Llama-family model laid out as llama.cpp writes one (q / k rows permuted)."""
  import gguf  # pylint: disable=import-outside-toplevel
  from specjax.checkpoints import llama_layout  # pylint: disable=import-outside-toplevel
  tensors = llama_layout.hf_tensors_from_params(params, cfg)
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(cfg.num_layers)
  writer.add_embedding_length(cfg.embed_dim)
  writer.add_feed_forward_length(cfg.mlp_dim)
  writer.add_head_count(cfg.num_heads)
  writer.add_head_count_kv(cfg.num_kv_heads)
  writer.add_rope_freq_base(cfg.rope_theta)
  writer.add_layer_norm_rms_eps(cfg.norm_eps)
  writer.add_vocab_size(cfg.vocab_size)
  names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
  per_layer = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight"}
  for name, value in tensors.items():
    if name.startswith("model.layers."):
      _, _, layer, rest = name.split(".", 3)
      if rest == "self_attn.q_proj.weight":
        value = llama_cpp_permute(value, cfg.num_heads)
      elif rest == "self_attn.k_proj.weight":
        value = llama_cpp_permute(value, cfg.num_kv_heads)
      out_name = f"blk.{layer}.{per_layer[rest]}"
    else:
      out_name = names[name]
    writer.add_tensor(out_name, np.ascontiguousarray(value, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


@pytest.fixture(scope="session")
def smollm2():
  """(config, params, tokenizer) of the embedded SmolLM2-135M-Instruct; loads in well under a second
  once the dequantized cache exists."""
  from specjax import assets, checkpoints, tokenizer  # pylint: disable=import-outside-toplevel
  path = assets.smollm2_gguf_path()
  config, params = checkpoints.load(path)
  return config, params, tokenizer.Tokenizer.from_gguf(path)


@pytest.fixture(scope="session")
def smollm2_two_blocks(tmp_path_factory, smollm2):
  """SmolLM2-135M-Instruct cut to its first 2 of 30 blocks (decoder_only.truncate_layers), as a Hugging
  Face directory with SmolLM2's own tokenizer: the real vocabulary, embeddings and head at 1/10 of the
  compile and step time, for tests of the machinery around a model (sweeps, resuming, tables)."""
  import json  # pylint: disable=import-outside-toplevel
  from specjax.checkpoints import hf  # pylint: disable=import-outside-toplevel
  config, params, tok = smollm2
  directory = hf.save(tmp_path_factory.mktemp("smollm2-2-blocks"),
                      *decoder_only.truncate_layers(config, params, 2))
  (directory / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
  token = lambda i: None if i is None else tok.backend.id_to_token(i)
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": token(tok.bos_id), "eos_token": token(tok.eos_id), "pad_token": token(tok.pad_id),
      "chat_template": tok.chat_template}), encoding="utf-8")
  return directory


def tiny_t5_files(root: pathlib.Path, config=None, seed: int = 21):
  """A tiny random T5 with a SentencePiece model trained on the English / German prompt texts:
  -> (HF directory with spiece.model, the same weights as a T5X checkpoint, the vocabulary file,
  a prompts JSONL of five "translate English to German: ..." sources, those texts)."""
  import json  # pylint: disable=import-outside-toplevel
  from specjax import vocabulary  # pylint: disable=import-outside-toplevel
  from specjax.data import prompts  # pylint: disable=import-outside-toplevel
  from specjax.checkpoints import hf_t5, t5x  # pylint: disable=import-outside-toplevel
  config = config or t5.SIZES["tiny"]
  pairs = prompts.django_de_pairs()
  vocab_path = root / "spm" / "spiece.model"
  vocab = vocabulary.train([text for pair in pairs for text in pair], vocab_path, vocab_size=100)
  assert vocab.vocab_size == 100
  params = random_t5_params(config, seed=seed)
  hf_dir = hf_t5.save(root / "hf", config, params, vocabulary=vocab_path)
  t5x_dir = t5x.save(root / "t5x" / "checkpoint_0", config, params)
  texts = ["translate English to German: " + english for english, _ in pairs[:5]]
  prompts = root / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n"
                             for i, t in enumerate(texts)))
  return hf_dir, pathlib.Path(t5x_dir), vocab_path, prompts, texts


def generation_gin(path, output_dir, checkpoint, vocabulary_path, prompts, max_new_tokens=10):
  """A `generation.Generate` config for `checkpoint` over a prompts file (all of it, batches of 2)."""
  path.write_text(f"""from __gin__ import dynamic_registration
from specjax import generation
from specjax import run
from specjax import specs

run.main.job = @generation.Generate()
generation.Generate:
  output_dir = "{output_dir}"
  target = @specs.ModelSpec()
  prompts = @specs.PromptSpec()
  decode = @specs.DecodeSpec()
specs.ModelSpec.checkpoint = "{checkpoint}"
specs.ModelSpec.vocabulary = {'None' if vocabulary_path is None else repr(str(vocabulary_path))}
specs.PromptSpec:
  name = "{prompts}"
  split = "all"
  limit = None
  batch_size = 2
  bucket = 8
specs.DecodeSpec.max_new_tokens = {max_new_tokens}
""")
  return path
