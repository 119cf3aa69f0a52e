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


def test_logits_have_the_same_argmax_everywhere(smollm2, peer, real_prompts):
  import torch  # pylint: disable=import-outside-toplevel
  config, params, _ = smollm2
  step = jax.jit(decoder_only.make_step(config))
  for ids in real_prompts:
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids))[None]
    ours, _ = step(params, tokens, positions, decoder_only.init_cache(config, 1, len(ids) + 1))
    with torch.no_grad():
      theirs = peer(torch.tensor([ids])).logits.numpy()
    np.testing.assert_array_equal(np.argmax(ours[0], -1), np.argmax(theirs[0], -1))
    np.testing.assert_allclose(ours[0], theirs[0], atol=2e-3, rtol=1e-3)


def test_greedy_generation_equals_hugging_face(smollm2, peer, real_prompts):
  import torch  # pylint: disable=import-outside-toplevel
  config, params, tok = smollm2
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
