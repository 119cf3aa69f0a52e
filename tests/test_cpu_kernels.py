"""specjax's CPU kernels (specs.ModelSpec.kernels = "cpu", models/cpu_kernels.py, csrc/).

Oracles: XLA's products and a float64 numpy attention (values to float32 rounding); and the property
the kernels exist for, exactness: a row of a product and a query of the attention come out bit for bit
the same whatever else shares the call, so the target's verification of T tokens (a chain, or a
token tree whose nodes sit in scattered slots) scores each token exactly as its one-token step does,
and greedy speculative output equals greedy autoregressive output by construction. Needs
scripts/build_cpu_kernels.sh, which scripts/setup.sh runs: without the library these fail, naming it.
"""

import ctypes
import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_decoder_params, random_t5_params
from specjax import contracts, loading, models, specs
from specjax.decoding import autoregressive
from specjax.decoding import tree as trees
from specjax.decoding.tree import Tree
from specjax.drafters import registry
from specjax.models import cpu_kernels, decoder_only, kv_cache, layers, t5

BF16 = jnp.bfloat16
DTYPES = [jnp.float32, BF16]


def _name(dtype) -> str:
  return jnp.dtype(dtype).name


# ---- products ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape,rows", [((64, 128), (1,)), ((100, 37), (2, 3)), ((576, 1536), (5,)),
                                        ((7, 70), (11,)), ((33, 1), (9,)), ((70, 45), (25,))])
def test_products_equal_xlas_to_float32_rounding(shape, rows, dtype):
  """x[..., k] x kernel[k, n] on the CPU kernels against XLA's product summed in float32, odd shapes
  included (the last panel of 32 columns is zero-padded; 25 rows run as three blocks), and the
  packed kernel unpacks to itself."""
  rng = np.random.RandomState(0)
  kernel = jnp.asarray(rng.standard_normal(shape), dtype)
  x = jnp.asarray(rng.standard_normal((*rows, shape[0])), dtype)
  packed = cpu_kernels.pack(kernel, dtype)
  ours = jax.jit(cpu_kernels.matmul)(x, packed)
  xla = jnp.matmul(x, kernel, preferred_element_type=jnp.float32)
  assert ours.shape == xla.shape and ours.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(ours), np.asarray(xla), rtol=1e-5,
                             atol=1e-5 * float(np.abs(np.asarray(xla)).max()))
  np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack(packed)), np.asarray(kernel))
  with pytest.raises(ValueError, match=r"x\[\.\.\., 3\] against a packed"):
    cpu_kernels.matmul(jnp.ones((1, 3), dtype), packed)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", [(576, 960), (576, 3072), (1536, 576), (576, 49152), (32, 128)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_row_of_a_product_is_computed_alike_whatever_the_row_count(shape, dtype):
  """SmolLM2's product shapes (fused q / k / v, fused gate / up, down, the tied head) and a tiny one:
  rows computed 1, 2, ... 20, 33 or 64 at a time, from any offset, equal the same rows of one
  256-row product bit for bit (a row's sums run in one order whatever its block of up to 12 rows,
  its place in it, or which core owns its columns)."""
  rng = np.random.RandomState(1)
  packed = cpu_kernels.pack(jnp.asarray(rng.standard_normal(shape) * 0.05, dtype), dtype)
  x = jnp.asarray(rng.standard_normal((256, shape[0])), dtype)
  product = jax.jit(cpu_kernels.matmul)
  whole = np.asarray(product(x, packed))
  for rows in (*range(1, 21), 33, 64):
    for start in (0, 7, 150):
      np.testing.assert_array_equal(np.asarray(product(x[start:start + rows], packed)),
                                    whole[start:start + rows], err_msg=f"{rows} rows from {start}")


def _build(directory, march: str) -> str:
  """csrc/matmul.cc built for another CPU (`-march`), as a library of its own: x86-64-v4 takes its
  AVX-512 path (no tile unit), x86-64-v3 its AVX2 path, x86-64-v2 its portable std::fma one."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  library = os.path.join(directory, f"lib{march}.so")
  subprocess.run(["g++", "-O2", f"-march={march}", "-ffp-contract=off", "-std=c++17", "-fPIC",
                  "-shared", "-pthread", "-w", os.path.join(root, "csrc", "matmul.cc"), "-o", library,
                  f"-I{jax.ffi.include_dir()}"], check=True)
  return library


def _run(lib, x, k, n, data, f32) -> np.ndarray:
  x = np.ascontiguousarray(x, np.float32)
  y = np.empty((x.shape[0], n), np.float32)
  lib.specjax_cpu_matmul_run.restype = None
  lib.specjax_cpu_matmul_run(x.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.shape[0]),
                             ctypes.c_int64(k), ctypes.c_int64(n), ctypes.c_int(int(f32)),
                             data.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p))
  return y


# Runs in a process of its own, so that its team of threads is sized by SPECJAX_CPU_THREADS (one
# team per process, shared by every build of the kernels loaded into it).
_OTHER_BUILD_RUN = """
import ctypes, sys
import numpy as np
sys.path.insert(0, sys.argv[3])
import test_cpu_kernels as tests
lib = ctypes.CDLL(sys.argv[1])
lib.specjax_cpu_matmul_implementation.restype = ctypes.c_char_p
cases = np.load(sys.argv[2])
out = {"threads": np.array(lib.specjax_cpu_threads()),
       "implementation": np.array(lib.specjax_cpu_matmul_implementation().decode())}
for name in sorted({key.split("/")[0] for key in cases.files}):
  k, n, f32 = (int(v) for v in cases[name + "/knf"])
  out[name] = tests._run(lib, cases[name + "/x"], k, n, cases[name + "/data"], f32)
np.savez(sys.argv[1] + ".out.npz", **out)
"""


def test_every_build_and_another_thread_count_compute_the_same_bits(tmp_path):
  """The vector code (this machine's build, in this process: a thread per core) against the same
  file built for AVX2 and built without vector code, each run on 3 threads in a process of its own
  (another split of the panels): every float32 and bfloat16 product, odd shapes, subnormal inputs
  (flushed alike) and 1-40 rows included, equal bit for bit. All sum each row over k in one order
  from zero with one rounding per step, and a panel's owner changes nothing. Where this build runs
  bfloat16 products on AMX's tile unit (which rounds its own way), those products are compared
  across an AVX-512 build without it and the others instead; the rest still against this build."""
  vector = cpu_kernels.require()
  on_tiles = cpu_kernels.implementation() == "amx"
  rng = np.random.RandomState(3)
  cases, expected, tiled = {}, {}, set()
  for dtype in DTYPES:
    for (k, n), rows in [((576, 960), 17), ((1536, 576), 5), ((33, 70), 40), ((7, 1), 1),
                         ((64, 4096), 3)]:
      name = f"{jnp.dtype(dtype).name}-{rows}x{k}x{n}"
      packed = cpu_kernels.pack(jnp.asarray(rng.standard_normal((k, n)) * 0.1, dtype), dtype)
      x = rng.standard_normal((rows, k)).astype(np.float32)
      x[0, :3] = [1e-39, -3e-40, 0.0]
      data, f32 = np.ascontiguousarray(np.asarray(packed.data)), packed.dtype == "float32"
      cases.update({name + "/x": x, name + "/data": data, name + "/knf": np.array([k, n, f32])})
      expected[name] = _run(vector, x, k, n, data, f32)
      if on_tiles and not f32 and k % 32 == 0:
        tiled.add(name)
  np.savez(tmp_path / "cases.npz", **cases)
  builds = [("x86-64-v3", "avx2"), ("x86-64-v2", "portable")]
  if on_tiles:
    builds.insert(0, ("x86-64-v4", "avx512"))
  assert len(tiled) == (3 if on_tiles else 0)
  for march, implementation in builds:
    library = _build(str(tmp_path), march)
    subprocess.run([sys.executable, "-c", _OTHER_BUILD_RUN, library, str(tmp_path / "cases.npz"),
                    os.path.dirname(os.path.abspath(__file__))],
                   check=True, env={**os.environ, "SPECJAX_CPU_THREADS": "3"})
    got = np.load(library + ".out.npz")
    assert (int(got["threads"]), str(got["implementation"])) == (3, implementation)
    if march == builds[0][0]:  # the first build without tiles sets the tiled cases' reference
      expected.update({name: got[name] for name in tiled})
    for name, ours in expected.items():
      np.testing.assert_array_equal(got[name], ours, err_msg=f"{march}: {name}")


def test_products_run_alone_when_xla_runs_them_concurrently():
  """16 independent products in one program, each large enough to be split between the team's
  threads (XLA may run them at once, from several threads, and they share one team): every one
  equals the same product run alone, bit for bit, in each of 50 runs. The calls take turns on the
  team, so the results are deterministic and this test cannot fail by chance."""
  rng = np.random.RandomState(1)
  kernels = [jnp.asarray(rng.standard_normal((576, 96)), BF16) for _ in range(16)]
  packed = [cpu_kernels.pack(kernel) for kernel in kernels]
  rows = [jnp.asarray(rng.standard_normal((3, 576)), BF16) for _ in range(16)]
  alone = jax.jit(cpu_kernels.matmul)
  expected = [np.asarray(alone(x, k)) for x, k in zip(rows, packed)]
  products = jax.jit(lambda xs, ks: [cpu_kernels.matmul(x, k) for x, k in zip(xs, ks)])
  for _ in range(50):
    for ours, theirs in zip(products(rows, packed), expected):
      np.testing.assert_array_equal(np.asarray(ours), theirs)


# ---- attention and the cache write ------------------------------------------------------------------


def _reference_attention(q, keys, values, visible, bias=None, scale=1.0):
  """float64 numpy: q[B, T, H, D], keys / values[B, S, KV, D], visible[B, T or 1, S]."""
  group = q.shape[2] // keys.shape[2]
  k = np.repeat(keys.astype(np.float64), group, axis=2)
  v = np.repeat(values.astype(np.float64), group, axis=2)
  scores = np.einsum("bthd,bshd->bhts", q.astype(np.float64), k) * scale
  if bias is not None:
    scores = scores + bias
  scores = np.where(visible[:, None], scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  return np.einsum("bhts,bshd->bthd", weights / weights.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16), (6, 6, 8), (2, 1, 12)])
def test_attention_equals_a_float64_reference(heads, kv_heads, dim):
  """Grouped-query attention with a causal mask, then with a bias and a mask shared by a row's
  queries (T5's relative positions, a source's padding), then a query that sees no slot (zeros).
  9 queries: 9 to 54 rows per KV head, so blocks of 8 rows and of 16 both run."""
  rng = np.random.RandomState(2)
  batch, steps, slots = 2, 9, 40
  q = rng.standard_normal((batch, steps, heads, dim)).astype(np.float32)
  keys = rng.standard_normal((batch, slots, kv_heads, dim)).astype(np.float32)
  values = rng.standard_normal((batch, slots, kv_heads, dim)).astype(np.float32)
  positions = np.asarray([[20], [31]]) + np.arange(steps)
  causal = np.arange(slots)[None, None] <= positions[:, :, None]
  ours = jax.jit(functools.partial(cpu_kernels.attention, scale=dim ** -0.5))(q, keys, values, causal)
  np.testing.assert_allclose(np.asarray(ours), _reference_attention(q, keys, values, causal,
                                                                    scale=dim ** -0.5),
                             rtol=2e-5, atol=2e-5)
  bias = rng.standard_normal((1, heads, steps, slots)).astype(np.float32)
  shared = np.arange(slots)[None, None] < np.asarray([17, 40])[:, None, None]  # [B, 1, S]
  ours = jax.jit(cpu_kernels.attention)(q, keys, values, shared, bias)
  np.testing.assert_allclose(np.asarray(ours), _reference_attention(q, keys, values, shared, bias),
                             rtol=2e-5, atol=2e-5)
  nothing = np.zeros((batch, 1, slots), bool)
  assert not np.asarray(jax.jit(cpu_kernels.attention)(q, keys, values, nothing)).any()


def test_a_querys_attention_does_not_depend_on_what_else_the_call_holds():
  """One query's output, bit for bit, alone and among 17 queries, over a buffer of 64 slots and of
  128, and with the keys and values it sees moved to other slots (a token tree's nodes sit in slots
  after the prefix in node order, their ancestors not next to each other) while the slots between
  hold other keys and NaN garbage it does not see."""
  rng = np.random.RandomState(3)
  heads, kv_heads, dim, slots, prefix = 9, 3, 64, 64, 30
  q = rng.standard_normal((1, 17, heads, dim)).astype(np.float32)
  keys = rng.standard_normal((1, slots, kv_heads, dim)).astype(np.float32)
  values = rng.standard_normal((1, slots, kv_heads, dim)).astype(np.float32)
  positions = prefix + np.arange(17)
  causal = np.arange(slots)[None, None] <= positions[None, :, None]
  attend = jax.jit(functools.partial(cpu_kernels.attention, scale=0.125))
  together = np.asarray(attend(q, keys, values, causal))
  for t in (0, 3, 16):
    alone = np.asarray(attend(q[:, t:t + 1], keys, values, causal[:, t:t + 1]))
    np.testing.assert_array_equal(alone[0, 0], together[0, t])
    pad = lambda a, fill, axis=1: np.concatenate([a, np.full_like(a, fill)], axis=axis)
    longer = np.asarray(attend(q[:, t:t + 1], pad(keys, 1.0), pad(values, 1.0),
                               pad(causal[:, t:t + 1], False, axis=2)))
    np.testing.assert_array_equal(longer[0, 0], together[0, t])
  # Query 3 (position prefix + 3) in a tree: its ancestors at depths 1..3 sit in slots prefix + 2,
  # prefix + 5 and prefix + 9, the root at prefix; the slots between hold garbage it does not see.
  moved_keys = np.full((1, 128, kv_heads, dim), np.nan, np.float32)
  moved_values = np.full((1, 128, kv_heads, dim), np.nan, np.float32)
  moved_keys[:, :prefix + 1], moved_values[:, :prefix + 1] = keys[:, :prefix + 1], values[:, :prefix + 1]
  tree_slots = [prefix, prefix + 2, prefix + 5, prefix + 9]
  for depth, slot in enumerate(tree_slots):
    moved_keys[:, slot], moved_values[:, slot] = keys[:, prefix + depth], values[:, prefix + depth]
  seen = np.zeros((1, 1, 128), bool)
  seen[:, :, :prefix] = True
  seen[:, :, tree_slots] = True
  in_tree = np.asarray(attend(q[:, 3:4], moved_keys, moved_values, seen))
  np.testing.assert_array_equal(in_tree[0, 0], together[0, 3])


def test_argmax_is_the_first_maximum_or_the_first_nan_and_runs_in_the_library():
  """The library's argmax, and sampling.argmax over a large vocabulary (the library's on one CPU
  device, XLA's form where this process has several), give jnp.argmax's ids (numpy's): the first of
  tied maxima, the first NaN, index 0 for a row of -inf."""
  from specjax.decoding import sampling  # pylint: disable=import-outside-toplevel
  rng = np.random.RandomState(6)
  x = rng.standard_normal((3, 7, 49152)).astype(np.float32)
  x[0, 1, [7, 9000]] = 50.0
  x[0, 2, [40000, 12]] = 60.0
  x[1, 2, [123, 5000]] = np.nan
  x[1, 3, 49151] = np.nan
  x[2, 3] = -np.inf
  x[2, 4, 49151] = 100.0
  x[2, 5, 49140:] = 70.0  # a tie in the tail past the whole vectors' part of a row
  routed = jax.jit(sampling.argmax)
  uses_library = "specjax_cpu_argmax" in routed.lower(jnp.asarray(x)).as_text()
  assert uses_library == (jax.device_count() == 1)
  for find in (routed, jax.jit(cpu_kernels.argmax)):
    np.testing.assert_array_equal(np.asarray(find(jnp.asarray(x))), np.argmax(x, axis=-1))
    np.testing.assert_array_equal(np.asarray(find(jnp.asarray(x[:, :, :4099]))),
                                  np.argmax(x[:, :, :4099], axis=-1))


def test_rms_norm_equals_a_float64_reference_and_each_row_is_computed_alike():
  """The norm's rows against float64 (to float32 rounding), and rows 1..20 at a time, from any
  offset, equal the same rows normed 64 at a time bit for bit (XLA's own row sums at this width
  change order from 8 rows on)."""
  cpu_kernels.require()
  rng = np.random.RandomState(4)
  x = rng.standard_normal((64, 576)).astype(np.float32) * 3
  scale = rng.standard_normal(576).astype(np.float32)
  norm = jax.jit(lambda rows: cpu_kernels.rms_norm(rows, scale, 1e-5))
  whole = np.asarray(norm(x))
  x64 = x.astype(np.float64)
  reference = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * scale
  np.testing.assert_allclose(whole, reference, rtol=2e-6, atol=2e-6 * np.abs(reference).max())
  for rows in range(1, 21):
    for start in (0, 7, 40):
      np.testing.assert_array_equal(np.asarray(norm(x[start:start + rows])),
                                    whole[start:start + rows], err_msg=f"{rows} rows from {start}")
  bfloat16 = jnp.asarray(x[:3], BF16)  # read as float32, returned in float32
  np.testing.assert_array_equal(np.asarray(norm(bfloat16)),
                                np.asarray(norm(np.asarray(bfloat16.astype(jnp.float32)))))


def test_the_cache_write_puts_each_token_in_its_slot_and_drops_slots_outside_the_buffer():
  rng = np.random.RandomState(4)
  keys, values = (rng.standard_normal((2, 10, 3, 4)).astype(np.float32) for _ in range(2))
  new_keys, new_values = (rng.standard_normal((2, 3, 3, 4)).astype(np.float32) for _ in range(2))
  slots = np.asarray([[4, 5, 6], [0, 9, 10]], np.int32)  # 10 is past the end
  ours = jax.jit(cpu_kernels.cache_write)(keys, values, new_keys, new_values, slots)
  expected_keys, expected_values = keys.copy(), values.copy()
  for b, t in np.ndindex(slots.shape):
    if slots[b, t] < 10:
      expected_keys[b, slots[b, t]], expected_values[b, slots[b, t]] = new_keys[b, t], new_values[b, t]
  np.testing.assert_array_equal(np.asarray(ours[0]), expected_keys)
  np.testing.assert_array_equal(np.asarray(ours[1]), expected_values)
  # XLA's write agrees where every slot is inside (row 0).
  xla = kv_cache.write(jnp.asarray(keys[:1]), jnp.asarray(new_keys[:1]), jnp.asarray(slots[:1]))
  np.testing.assert_array_equal(np.asarray(ours[0])[:1], np.asarray(xla))


@pytest.mark.parametrize("tied", [False, True], ids=["T5 1.1", "T5 1.0"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_a_t5_steps_bytes_are_its_decoders_per_step_weights(tied, packed):
  """The floor of a T5 step reads the decoder's weights only, counted here from the config: each
  layer's self-attention (q, k, v, o), the cross-attention's query and output (its key / value
  kernels project the source once per request), the MLP and three norms; the relative position table,
  the final norm, and the head (1.1's own kernel, or 1.0's embedding read transposed). Not the
  encoder, and not an untied model's embedding table (the lookup gathers a row). All tiny widths are
  multiples of 32, so packing pads nothing."""
  config = t5.SIZES["tiny-1.0" if tied else "tiny"]
  e, inner, v = config.embed_dim, config.num_heads * config.head_dim, config.vocab_size
  mlp = (3 if config.gated else 2) * e * config.mlp_dim
  layer = 4 * e * inner + 2 * e * inner + mlp + 3 * e
  expected = 4 * (config.num_decoder_layers * layer + config.num_heads * config.relative_buckets
                  + e + e * v)
  params = random_t5_params(config, seed=3)
  if packed:
    params = cpu_kernels.pack_params_for(config, params)
  assert cpu_kernels.step_bytes(params, config) == expected
  whole = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
  assert cpu_kernels.step_bytes(params, config) < whole  # the encoder and the rest were left out


# ---- whole models -----------------------------------------------------------------------------------


# Two-layer models as wide as SmolLM2 / T5-small: XLA's row sums change order with the row count at
# these widths (from 8 rows of 576) and not at the tiny ones.
WIDE = {"decoder-only": dict(embed_dim=576, num_heads=9, num_kv_heads=3, head_dim=64, mlp_dim=1536),
        "T5": dict(embed_dim=512, num_heads=8, head_dim=64, mlp_dim=1024)}


def _family(family: str, dtype, wide: bool = False):
  """(model, packed params, prompt, lengths, source) of a tiny random target in `dtype`, or with
  `wide` one of the real models' widths."""
  if family == "decoder-only":
    config = decoder_only.SIZES["tiny"]
    config = dataclasses.replace(config, **WIDE[family]) if wide else config
    params = random_decoder_params(config, seed=5)
    prompt = jnp.asarray([[5, 9, 11, 20, 3, 0, 0, 0], [7, 1, 4, 0, 0, 0, 0, 0]], jnp.int32)
    lengths, source = jnp.asarray([5, 3], jnp.int32), None
  else:
    config = t5.SIZES["tiny" if family == "T5" else "tiny-1.0"]
    config = dataclasses.replace(config, **WIDE["T5"]) if wide else config
    params = random_t5_params(config, seed=6)
    prompt, lengths = t5.decoder_prompt(config, 2)
    source = contracts.Source(jnp.asarray([[5, 9, 11, 20, 3, 0], [8, 2, 0, 0, 0, 0]], jnp.int32),
                              jnp.asarray([5, 2], jnp.int32))
  params = cpu_kernels.pack_params_for(config, models.cast(params, dtype))
  return models.model_for(config, None, cpu_kernels.CACHE_DTYPE), params, prompt, lengths, source


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("family", ["decoder-only", "T5", "T5 1.0"])
def test_a_prompt_is_scored_as_xlas_kernels_score_it(family, dtype):
  """A ragged prefill's logits on the CPU kernels against those on XLA's: in float32 equal to
  float32 rounding (the sums run in other orders); in bfloat16 at least as close to the float32
  logits of the same weights as XLA's bfloat16 ones are (the attention here keeps its weights in
  float32 where XLA's rounds them to bfloat16, so the two bfloat16 paths round differently)."""
  target, params, prompt, lengths, source = _family(family, dtype)
  config = target_config(params, family)

  def scored(model, weights):
    session = contracts.open_session(model, weights, source)
    return np.asarray(jax.jit(functools.partial(autoregressive.prefill, session, max_length=16))(
        prompt, lengths)[0])
  ours = scored(target, params)
  xla = scored(models.model_for(config, None, dtype), models.cast(cpu_kernels.plain(params), dtype))
  if dtype == jnp.float32:
    np.testing.assert_allclose(ours, xla, rtol=1e-5, atol=1e-5 * np.abs(xla).max())
    return
  exact = scored(models.model_for(config), models.cast(cpu_kernels.plain(params), jnp.float32))
  ours_error, xla_error = np.abs(ours - exact).max(), np.abs(xla - exact).max()
  assert 0 < ours_error <= 1.25 * xla_error < 0.1 * np.abs(exact).max(), (ours_error, xla_error)


def target_config(params, family: str):
  del params
  return decoder_only.SIZES["tiny"] if family == "decoder-only" else \
      t5.SIZES["tiny" if family == "T5" else "tiny-1.0"]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("family", ["decoder-only", "T5", "T5 1.0"])
def test_verification_scores_every_token_bit_for_bit_as_its_single_step(family, dtype):
  """In a model of the real ones' widths, after a prefill into a 24-slot cache, 17 tokens scored in
  one call (a chain), and 5 of them scored as a token tree whose path 0 -> 2 -> 3 leaves slot 1 to a
  sibling, give logits equal bit for bit to those of one-token steps over a 40-slot cache: what
  greedy speculative output equalling greedy autoregressive output rests on. (XLA's kernels agree
  only to float32 rounding: tests/test_bfloat16.py; its RMSNorm alone differed from 8 rows on.)"""
  target, params, prompt, lengths, source = _family(family, dtype, wide=True)
  session = contracts.open_session(target, params, source)

  def prefill(length):
    return jax.jit(functools.partial(autoregressive.prefill, session, max_length=length))(
        prompt, lengths)

  step = jax.jit(lambda tokens, positions, cache: contracts.open_session(
      target, params, source).step(tokens, positions, cache))
  tokens = jnp.asarray(np.random.RandomState(3).randint(1, 100, (2, 17)), jnp.int32)
  positions = jnp.arange(17, dtype=jnp.int32)[None] + lengths[:, None]
  _, cache = prefill(40)
  one_by_one = []
  for t in range(17):
    logits, cache = step(tokens[:, t:t + 1], positions[:, t:t + 1], cache)
    one_by_one.append(np.asarray(logits))
  one_by_one = np.concatenate(one_by_one, axis=1)
  together, _ = step(tokens, positions, prefill(24)[1])
  np.testing.assert_array_equal(np.asarray(together), one_by_one)
  # The tree: root 0, nodes 1 and 2 its children, 3 the child of 2, 4 the child of 3. Node i is
  # written to slot length + i, at position length + its depth; path 0, 2, 3, 4 carries tokens 0, 1,
  # 2, 3 of the chain (node 1 holds another token).
  parents = np.asarray([-1, 0, 0, 2, 3])
  tree_tokens = jnp.stack([tokens[:, 0], tokens[:, 4], tokens[:, 1], tokens[:, 2], tokens[:, 3]], 1)
  tree_positions, slots, visible = trees.attention_inputs(parents, lengths, 24)
  logits, _, _ = jax.jit(lambda t, p, c, s, v: target.forward(
      params, target.encode(params, source), t, p, c, s, v))(
          tree_tokens, tree_positions, prefill(24)[1], slots, visible)
  np.testing.assert_array_equal(np.asarray(logits)[:, [0, 2, 3, 4]], one_by_one[:, :4])


def test_the_setting_is_checked_and_reaches_the_target_and_its_drafts(smollm2_two_blocks,
                                                                      monkeypatch):
  with pytest.raises(ValueError, match=r"ModelSpec.kernels = 'onednn': use 'cpu'"):
    specs.ModelSpec(str(smollm2_two_blocks), kernels="onednn")
  for dtype in ("float32", "bfloat16"):
    spec = specs.ModelSpec(str(smollm2_two_blocks), dtype=dtype, kernels="cpu")
    loaded, _ = loading.load_target(spec)
    assert cpu_kernels.is_packed(loaded.params) and cpu_kernels.HEAD in loaded.params  # tied head
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(loaded.model.init_cache(1, 8))
            if jnp.issubdtype(leaf.dtype, jnp.floating)} == {jnp.dtype(cpu_kernels.CACHE_DTYPE)}
    assert {value.dtype for value in jax.tree_util.tree_leaves(
        loaded.params, is_leaf=lambda x: isinstance(x, cpu_kernels.PackedKernel))
            if isinstance(value, cpu_kernels.PackedKernel)} == {dtype}
    # each block runs 4 products, not 7
    assert set(loaded.params["layers_0"]["attn"]) == {"wq+wk+wv", "wo"}
    assert set(loaded.params["layers_0"]["mlp"]) == {"w_gate+w_up", "w_down"}
    target = registry.Target(loaded.config, loaded.params)
    for name in ("layers1", f"model:{smollm2_two_blocks}"):
      _, draft_params = registry.build(name, target, Tree.chain(2))
      assert cpu_kernels.is_packed(draft_params), name
    # Heads trained for these weights recognise them packed.
    from specjax.drafters import heads  # pylint: disable=import-outside-toplevel
    plain = loading.load_target(dataclasses.replace(spec, kernels=None))[0].params
    assert heads.target_fingerprint(loaded.config, loaded.params) == heads.target_fingerprint(
        loaded.config, plain)
    # The packed params unpack to the params they were packed from, bit for bit.
    jax.tree_util.tree_map(np.testing.assert_array_equal, cpu_kernels.plain(loaded.params), plain)
    # A bfloat16 table is kept as its bit patterns, and its rows gather as the table's; the heads'
    # output rows run on the CPU kernels as well, scoring as the plain rows do.
    table, tokens = loaded.params["embedding"], jnp.asarray([[3, 0, 7]], jnp.int32)
    assert table.dtype == (jnp.uint16 if dtype == "bfloat16" else jnp.float32)
    np.testing.assert_array_equal(np.asarray(layers.embed(table, tokens)),
                                  np.asarray(plain["embedding"][tokens]))
    rows, _ = heads.drafting_rows(loaded.config, loaded.params, [3, 5, 7])
    assert isinstance(rows, cpu_kernels.PackedKernel)
    states = jnp.asarray(np.random.RandomState(0).standard_normal((2, loaded.config.embed_dim)))
    expected = np.asarray(heads.scored(states, heads.head_rows(loaded.config, plain, [3, 5, 7])[0]))
    np.testing.assert_allclose(np.asarray(heads.scored(states, rows)), expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())
    # So do the MTP head's two kernels: its next state as from the plain weights.
    from specjax.drafters import mtp  # pylint: disable=import-outside-toplevel
    rng = np.random.RandomState(1)
    weights = {name: (rng.standard_normal(value.shape) * 0.05).astype(np.float32)
               for name, value in mtp.init_mtp(loaded.config.embed_dim).items()}
    packed_mtp = mtp.drafter_params(weights, [3, 5, 7], loaded.config, loaded.params)["mtp"]
    plain_mtp = mtp.drafter_params(weights, [3, 5, 7], loaded.config, plain)["mtp"]
    # Packed in the target's dtype: a bfloat16 decode reads no float32 drafter.
    assert all(isinstance(packed_mtp[name], cpu_kernels.PackedKernel)
               and packed_mtp[name].dtype == dtype for name in ("in_kernel", "kernel"))
    embedded = jnp.asarray(rng.standard_normal((2, loaded.config.embed_dim)), jnp.float32)
    expected = np.asarray(mtp.next_state(plain_mtp, states, embedded))
    tolerance = 1e-5 if dtype == "float32" else 2e-2  # bfloat16 kernels and rows: 8 bits of mantissa
    np.testing.assert_allclose(np.asarray(mtp.next_state(packed_mtp, states, embedded)), expected,
                               rtol=tolerance, atol=tolerance * np.abs(expected).max())
    _assert_feature_drafters_run_packed(loaded.config, loaded.params, plain, dtype, tolerance)
  # Without the library the setting names the script that builds it, before any work.
  monkeypatch.setattr(cpu_kernels, "LIBRARY", "/nonexistent/libspecjax_cpu.so")
  cpu_kernels._library.cache_clear()  # pylint: disable=protected-access
  try:
    with pytest.raises(RuntimeError, match=r"kernels = 'cpu' needs /nonexistent/libspecjax_cpu.so, "
                                           r"which is not built: bash scripts/build_cpu_kernels.sh"):
      loading.load_target(spec)
  finally:
    cpu_kernels._library.cache_clear()  # pylint: disable=protected-access


def _assert_feature_drafters_run_packed(config, packed, plain, dtype, tolerance):
  """The EAGLE-3 layer and the DFlash drafter beside a packed target: every kernel packed in the
  target's dtype, and each of their products gives what the plain float32 weights give."""
  from specjax.drafters import dflash, eagle3  # pylint: disable=import-outside-toplevel
  rng = np.random.RandomState(2)
  close = lambda got, want: np.testing.assert_allclose(
      np.asarray(got), np.asarray(want), rtol=tolerance, atol=tolerance * np.abs(want).max())
  positions = jnp.arange(3)[None]
  eagle_config = eagle3.Eagle3Config.for_target(config)
  weights = eagle3.init_params(eagle_config, jax.random.PRNGKey(0))
  packed_eagle = eagle3.drafter_params(weights, [3, 5], config, packed)["eagle3"]
  plain_eagle = eagle3.drafter_params(weights, [3, 5], config, plain)["eagle3"]
  assert all(isinstance(packed_eagle[name], cpu_kernels.PackedKernel)
             and packed_eagle[name].dtype == dtype for name in eagle3.KERNELS)
  features = jnp.asarray(rng.standard_normal((1, 3, 2 * config.embed_dim)), jnp.float32)
  hidden = jnp.asarray(rng.standard_normal((1, 3, config.embed_dim)), jnp.float32)
  close(eagle3.fuse(packed_eagle, features), eagle3.fuse(plain_eagle, features))
  for got, want in zip(eagle3.entry(eagle_config, packed_eagle, hidden, hidden, positions),
                       eagle3.entry(eagle_config, plain_eagle, hidden, hidden, positions)):
    close(got, want)
  attended = jnp.asarray(rng.standard_normal((1, 3, config.num_heads * config.head_dim)), jnp.float32)
  close(eagle3.finish(eagle_config, packed_eagle, hidden, attended),
        eagle3.finish(eagle_config, plain_eagle, hidden, attended))
  flash_config = dflash.DFlashConfig.for_target(config, block_size=3, num_layers=1, num_features=2)
  weights = dflash.init_params(flash_config, jax.random.PRNGKey(1))
  packed_flash = dflash.drafter_params(weights, [3, 5], config, packed)["dflash"]
  plain_flash = dflash.drafter_params(weights, [3, 5], config, plain)["dflash"]
  kernels = [packed_flash["fc"]] + [packed_flash["layers_0"][name] for name in dflash.KERNELS[1:]]
  assert all(isinstance(k, cpu_kernels.PackedKernel) and k.dtype == dtype for k in kernels)
  visible = jnp.ones((1, 3, 3), bool)
  outputs = []
  for params in (packed_flash, plain_flash):
    context = dflash.project_context(flash_config, params, features)
    cached = dflash.context_kv(flash_config, params, context, positions)
    outputs.append(dflash.block_hidden(flash_config, params, hidden, positions + 3, cached,
                                       visible, visible))
  close(*outputs)


@pytest.mark.parametrize("family,tree", [("decoder-only", "chain:3"), ("decoder-only", "spine:3x2"),
                                         ("T5", "chain:3"), ("T5 1.0", "spine:3x2")])
def test_greedy_tokens_on_both_kernels_agree_in_float32(family, tree):
  """XLA's kernels are the fallback of the CPU kernels: in float32 the two give the same greedy
  tokens, alone and speculatively (a chain or a tree of the target's first layer as its draft), on a
  ragged batch of 2 rows x 16 tokens; and on the CPU kernels the speculative tokens equal the target's
  own (bit-for-bit scoring makes that hold on any prompt)."""
  from specjax.drafters import expansion  # pylint: disable=import-outside-toplevel
  from specjax.drafters.model import ModelDrafter  # pylint: disable=import-outside-toplevel
  from specjax.decoding import core  # pylint: disable=import-outside-toplevel
  target, params, prompt, lengths, source = _family(family, jnp.float32)
  config = target_config(params, family)
  plain = cpu_kernels.plain(params)
  if family == "decoder-only":
    draft_config, draft_plain = decoder_only.truncate_layers(config, plain, 1)
  else:
    draft_config = dataclasses.replace(config, num_decoder_layers=1)
    draft_plain = {**plain, "decoder": {k: v for k, v in plain["decoder"].items() if k != "layers_1"}}
  shape = autoregressive.DecodeShape(16)
  outputs = {}
  for kernels in ("xla", "cpu"):
    on_cpu = kernels == "cpu"
    model = target if on_cpu else models.model_for(config)
    weights = params if on_cpu else plain
    draft_weights = cpu_kernels.pack_params_for(draft_config, draft_plain) if on_cpu else draft_plain
    draft = models.model_for(draft_config, None, cpu_kernels.CACHE_DTYPE)
    drafter = expansion.expand(ModelDrafter(draft), Tree.from_name(tree), sample=True)
    key = jax.random.PRNGKey(0)
    alone = autoregressive.make_generate(model, shape)(weights, prompt, lengths, key, 0.0, 1.0,
                                                       source)
    speculative = core.make_decode(model, drafter, core.DecodeConfig(16))(
        weights, draft_weights, prompt, lengths, key, 0.0, 1.0, 1.0, source)
    outputs[kernels] = np.asarray(alone.tokens), np.asarray(speculative.tokens)
  np.testing.assert_array_equal(outputs["cpu"][0], outputs["xla"][0])
  np.testing.assert_array_equal(outputs["cpu"][1], outputs["cpu"][0])
  np.testing.assert_array_equal(outputs["xla"][1], outputs["xla"][0])


def test_the_attention_and_the_norm_run_first_in_a_fresh_process():
  """Each custom call registers the library's FFI targets itself: a process whose first call is the
  attention, the cache write or the norm (no product packed before) runs them."""
  script = """
import jax.numpy as jnp
from specjax.models import cpu_kernels
ones = jnp.ones((1, 2, 2, 8))
out = cpu_kernels.attention(ones, ones, ones, jnp.ones((1, 2, 2), bool))
keys, _ = cpu_kernels.cache_write(jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)), ones, ones,
                                  jnp.asarray([[0, 1]], jnp.int32))
norm = cpu_kernels.rms_norm(jnp.ones((2, 8)), jnp.ones((8,)), 0.0)
print(float(out.sum()), float(keys.sum()), float(norm.sum()))
"""
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
  assert done.stdout.split() == ["32.0", "32.0", "16.0"]
