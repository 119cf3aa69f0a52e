"""The embedded SmolLM2-135M-Instruct against Hugging Face transformers on the same GGUF weights."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import assets
from specjax.decoding import autoregressive
from specjax.data import prompts
from specjax.models import decoder_only

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def peer():
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(assets.smollm2_gguf_path())
  torch.set_num_threads(2)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, torch_dtype=torch.float32)
  return model.eval()


@pytest.fixture(scope="module")
def real_prompts(smollm2):
  """Token ids of a few real prompts of each kind (the peer gets the same ids, not text)."""
  _, _, tok = smollm2
  texts = (list(prompts.load_prompt_set("humaneval", limit=2).prompts)
           + list(prompts.load_prompt_set("news", limit=1).prompts)
           + list(prompts.load_prompt_set("ende", limit=1).prompts))
  # News articles are long; a 200-token prefix keeps the peer's forward pass quick.
  return [tok.encode(t)[:200] for t in texts]


def test_logits_and_greedy_generation_equal_hugging_face(smollm2, peer, real_prompts):
  """One test for both checks: the peer takes seconds to load, and the suite's workers would each load
  it for a test of its own."""
  import torch  # pylint: disable=import-outside-toplevel
  config, params, tok = smollm2
  step = jax.jit(decoder_only.make_step(config))
  # Every prompt right-padded to one length: one compiled program, and causal attention keeps the
  # padding out of the logits of the prompt's own positions.
  length = max(len(ids) for ids in real_prompts)
  for ids in real_prompts:
    tokens = jnp.asarray([ids + [tok.pad_id] * (length - len(ids))], jnp.int32)
    positions = jnp.arange(length)[None]
    ours, _ = step(params, tokens, positions, decoder_only.init_cache(config, 1, length + 1))
    ours = ours[:, :len(ids)]
    with torch.no_grad():
      theirs = peer(torch.tensor([ids])).logits.numpy()
    np.testing.assert_array_equal(np.argmax(ours[0], -1), np.argmax(theirs[0], -1))
    np.testing.assert_allclose(ours[0], theirs[0], atol=2e-3, rtol=1e-3)

  # Greedy generation, batched and right-padded, token for token against the peer's generate.
  new_tokens = 24
  shape = autoregressive.DecodeShape(new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id)
  generate = autoregressive.make_generate(
      decoder_only.model(config), shape)
  tokens, lengths = prompts.make_batch(real_prompts, tok.pad_id, bucket=32)
  batched = generate(params, tokens, lengths, jax.random.PRNGKey(0), 0.0, 1.0)
  for row, ids in enumerate(real_prompts):
    with torch.no_grad():
      theirs = peer.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)[0, len(ids):].tolist()
    n = int(batched.num_generated[row])
    assert np.asarray(batched.tokens[row, :n]).tolist() == theirs
