"""T5X checkpoints (specjax/checkpoints/t5x.py).

Oracles: a checkpoint written here directly with tensorstore + flax.serialization (the two libraries
t5x itself writes with), in t5x's layout, reads back to the arrays that went in; save -> load is
exact in float32 and equals the bfloat16 rounding of the input in bfloat16; flax reads the written
`checkpoint` file; orbax-checkpoint's own OCDBT writer produces a directory `load` reads exactly.
"""

import json
import pathlib
import shutil

import flax.serialization
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from flax import traverse_util

from specjax.checkpoints import t5_layout, t5x
from specjax.models import t5


def _flat(tree, prefix=""):
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}/"))
    else:
      out[f"{prefix}{key}"] = value
  return out


def random_params(config, seed=0):
  """float32 numpy params shaped like specjax's T5 (structure from t5.param_shapes: no compile)."""
  rng = np.random.default_rng(seed)
  return traverse_util.unflatten_dict(
      {name: rng.standard_normal(tuple(leaf.shape)).astype(np.float32)
       for name, leaf in _flat(t5.param_shapes(config)).items()}, sep="/")


def _assert_same(got, want):
  got, want = _flat(got), _flat(want)
  assert sorted(got) == sorted(want)
  for name in want:
    assert got[name].dtype == np.float32, name
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def write_by_hand(directory, params, *, bfloat16=(), inline=(), old_spec=(), kernels_3d=False,
                  config=None, orbax_aggregate=False):
  """A t5x checkpoint, laid out as t5x's Checkpointer writes it, without specjax's writer: one zarr
  array per parameter (`target.<dotted path>`) and the msgpack file via flax.serialization, whose
  leaves are tensorstore spec JSON (or inline arrays). `old_spec`: the tensorstore < 0.1.14 form
  (top-level path, gcs kvstore, dummy bucket). `kernels_3d`: scalable_t5's [E, H, D] attention.
  `orbax_aggregate`: older orbax's form instead: {"target", "state"} at the top, array leaves as
  "PLACEHOLDER://<dotted name>" strings."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True)
  target = {}
  for name, array in _flat(params).items():
    parts = name.split("/")
    attention = len(parts) > 2 and parts[-3] in ("attention", "self_attention",
                                                 "encoder_decoder_attention")
    if kernels_3d and attention:
      heads, head_dim = config.num_heads, config.head_dim
      array = (array.reshape(heads, head_dim, -1) if parts[-2] == "out"
               else array.reshape(array.shape[0], heads, head_dim))
    if name in inline:
      target[name] = array
      continue
    dtype = "bfloat16" if name in bfloat16 else "float32"
    dotted = "target." + name.replace("/", ".")
    metadata = {"compressor": {"id": "gzip"}, "shape": list(array.shape),
                "chunks": list(array.shape)}
    store = ts.open({"driver": "zarr", "dtype": dtype, "metadata": metadata,
                     "kvstore": {"driver": "file", "path": str(directory / dotted)}},
                    create=True).result()
    store.write(array.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)).result()
    if orbax_aggregate:
      target[name] = "PLACEHOLDER://" + dotted
    elif name in old_spec:
      target[name] = {"driver": "zarr", "dtype": dtype, "path": dotted, "metadata": metadata,
                      "kvstore": {"driver": "gcs", "bucket": "t5x-dummy-bucket"}}
    else:
      target[name] = {"driver": "zarr", "dtype": dtype, "metadata": metadata,
                      "kvstore": {"driver": "file", "path": dotted + "/"}}
  # Optimizer state: a reference to an array that was never written (must not be read) + the step.
  state = {"step": np.asarray(1000, np.int32), "param_states": {"encoder": {"encoder_norm": {
      "scale": {"v": {"driver": "zarr", "dtype": "float32", "metadata": {"shape": [32]},
                      "kvstore": {"driver": "file",
                                  "path": "state.param_states.encoder.encoder_norm.scale.v/"}}}}}}}
  contents = {"version": 3, "optimizer": {"target": traverse_util.unflatten_dict(target, sep="/"),
                                          "state": state}}
  if orbax_aggregate:
    contents = {"target": traverse_util.unflatten_dict(target, sep="/"),
                "state": {"step": state["step"]}}
  (directory / "checkpoint").write_bytes(flax.serialization.msgpack_serialize(contents))
  return directory


@pytest.mark.parametrize("layout", ["examples_t5", "scalable_t5", "orbax_aggregate"])
def test_handwritten_t5x_checkpoint_reads_back(tmp_path, layout):
  config = t5.SIZES["tiny"]
  params = random_params(config)
  bf16 = {"token_embedder/embedding", "decoder/layers_1/mlp/wi_1/kernel"}
  path = write_by_hand(tmp_path / "checkpoint_1000", params, bfloat16=bf16,
                       inline={"encoder/encoder_norm/scale"},
                       old_spec={"decoder/logits_dense/kernel"},
                       kernels_3d=layout == "scalable_t5", config=config,
                       orbax_aggregate=layout == "orbax_aggregate")
  got_config, got = t5x.load(path)
  assert got_config == config and t5_layout.size_name(got_config) == "tiny"
  want = dict(_flat(params))
  for name in bf16:  # stored as bfloat16: the read is exact, of the rounded values
    want[name] = want[name].astype(ml_dtypes.bfloat16).astype(np.float32)
    assert not np.array_equal(want[name], _flat(params)[name])
  _assert_same(got, traverse_util.unflatten_dict(want, sep="/"))


@pytest.mark.parametrize("size", ["tiny", "tiny-1.0"])
def test_save_load_round_trip_float32(tmp_path, size):
  config = t5.SIZES[size]
  params = random_params(config, seed=1)
  path = t5x.save(tmp_path / "checkpoint_7", config, params, step=7)
  got_config, got = t5x.load(path)
  assert got_config == config
  _assert_same(got, params)
  assert t5x.load(tmp_path)[0] == config  # a model directory: its newest checkpoint_<step>
  # The file is what t5x reads with flax.serialization: version 3, spec JSON with relative paths.
  contents = flax.serialization.msgpack_restore((pathlib.Path(path) / "checkpoint").read_bytes())
  assert contents["version"] == 3 and int(contents["optimizer"]["state"]["step"]) == 7
  spec = contents["optimizer"]["target"]["encoder"]["layers_0"]["attention"]["query"]["kernel"]
  assert spec["driver"] == "zarr" and spec["dtype"] == "float32"
  assert spec["kvstore"] == {"driver": "file",
                             "path": "target.encoder.layers_0.attention.query.kernel/"}
  assert spec["metadata"]["shape"] == [32, 32] and spec["metadata"]["compressor"]["id"] == "gzip"
  zarray = json.loads((pathlib.Path(path) / "target.decoder.decoder_norm.scale" / ".zarray")
                      .read_text())
  assert zarray["dtype"] == "<f4" and zarray["shape"] == [32]
  assert ("logits_dense" in contents["optimizer"]["target"]["decoder"]) == (size == "tiny")


def test_save_load_bfloat16(tmp_path):
  config = t5.SIZES["tiny"]
  params = random_params(config, seed=2)
  path = t5x.save(tmp_path / "ckpt", config, params, dtype="bfloat16")
  got_config, got = t5x.load(path)
  assert got_config == config
  rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in _flat(params).items()}
  _assert_same(got, traverse_util.unflatten_dict(rounded, sep="/"))
  for name, value in _flat(got).items():  # within bfloat16's half-ulp: 2**-9 relative
    np.testing.assert_allclose(value, _flat(params)[name], rtol=2.0**-8, atol=0)
  zarray = pathlib.Path(path) / "target.token_embedder.embedding" / ".zarray"
  zarray = json.loads(zarray.read_text())
  assert zarray["dtype"] == "bfloat16"


def test_orbax_ocdbt_checkpoint(tmp_path):
  """orbax's default PyTree layout (OCDBT), as t5x's orbax manager nests it: checkpoint_3/state/."""
  ocp = pytest.importorskip("orbax.checkpoint")
  config = t5.SIZES["tiny-1.0"]
  params = random_params(config, seed=3)
  item = tmp_path / "checkpoint_3" / "state"
  ocp.PyTreeCheckpointer().save(item, {"target": params, "state": {"step": np.int32(3)}})
  assert (item / "manifest.ocdbt").is_file() and (item / "_METADATA").is_file()
  assert not (item / "target.encoder.encoder_norm.scale").exists()  # arrays live in OCDBT
  got_config, got = t5x.load(tmp_path / "checkpoint_3")
  assert got_config == config
  _assert_same(got, params)
  assert t5x.load(tmp_path)[0] == config


def test_url_paths(tmp_path):
  """Any URL tensorstore opens (gs://... in practice) goes through its kvstore; file:// here."""
  config = t5.SIZES["tiny-1.0"]
  params = random_params(config, seed=4)
  url = f"file://{tmp_path}/checkpoint_2"
  t5x.save(url, config, params)
  assert (tmp_path / "checkpoint_2" / "checkpoint").is_file()
  got_config, got = t5x.load(url)
  assert got_config == config
  _assert_same(got, params)
  shutil.rmtree(tmp_path / "checkpoint_2" / "target.encoder.layers_0.mlp.wi.kernel")
  with pytest.raises(ValueError, match=r"cannot open the array target\.encoder\.layers_0\.mlp\.wi"
                     r"\.kernel/ of parameter encoder/layers_0/mlp/wi/kernel \(expected shape "
                     r"\(32, 64\)\)"):
    t5x.load(url)
  with pytest.raises(ValueError, match="a URL must name the checkpoint directory itself"):
    t5x.load(f"file://{tmp_path}")


def test_unreadable_orbax_checkpoint(tmp_path):
  (tmp_path / "checkpoint_5").mkdir()
  (tmp_path / "checkpoint_5" / "_METADATA").write_text("{not json")
  with pytest.raises(ValueError, match=r"checkpoint_5: orbax checkpoint \(_METADATA / "
                     r"manifest\.ocdbt / ocdbt\.process_\*\) that orbax-checkpoint could not "
                     r"restore"):
    t5x.load(tmp_path / "checkpoint_5")


def test_missing_array_directory(tmp_path):
  config = t5.SIZES["tiny"]
  path = pathlib.Path(t5x.save(tmp_path / "ckpt", config, random_params(config)))
  shutil.rmtree(path / "target.decoder.layers_1.mlp.wo.kernel")
  with pytest.raises(ValueError, match=r"ckpt.*target\.decoder\.layers_1\.mlp\.wo\.kernel/ of "
                     r"parameter decoder/layers_1/mlp/wo/kernel \(expected shape \(64, 32\)\) is "
                     r"missing"):
    t5x.load(path)


def test_parameter_missing_from_tree(tmp_path):
  config = t5.SIZES["tiny"]
  params = _flat(random_params(config))
  del params["encoder/layers_1/pre_mlp_layer_norm/scale"]
  path = write_by_hand(tmp_path / "ckpt", traverse_util.unflatten_dict(params, sep="/"))
  with pytest.raises(ValueError, match=r"ckpt.*encoder/layers_1/pre_mlp_layer_norm/scale is "
                     r"missing \(expected shape \(32,\)"):
    t5x.load(path)


def test_shape_matching_no_architecture(tmp_path):
  config = t5.SIZES["tiny"]
  params = _flat(random_params(config))
  params["encoder/layers_1/mlp/wo/kernel"] = np.zeros((65, 32), np.float32)
  path = write_by_hand(tmp_path / "wo", traverse_util.unflatten_dict(params, sep="/"))
  with pytest.raises(ValueError, match=r"wo.*encoder/layers_1/mlp/wo/kernel has shape \(65, 32\), "
                     r"expected \(64, 32\)"):
    t5x.load(path)
  params = _flat(random_params(config))
  params["encoder/layers_0/attention/query/kernel"] = np.zeros((32, 30), np.float32)  # 30 % 4 heads
  path = write_by_hand(tmp_path / "query", traverse_util.unflatten_dict(params, sep="/"))
  with pytest.raises(ValueError, match=r"query.*encoder/layers_0/attention/query/kernel has shape "
                     r"\(32, 30\), expected \(32, 4 \* head_dim\)"):
    t5x.load(path)


def test_no_checkpoint(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match=r"no T5X checkpoint at .*empty: looked for a `checkpoint`"):
    t5x.load(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    t5x.load(tmp_path / "nowhere")
  assert not t5x.is_checkpoint(tmp_path / "empty")
  config = t5.SIZES["tiny"]
  assert t5x.is_checkpoint(t5x.save(tmp_path / "ckpt", config, random_params(config)))


@pytest.mark.parametrize("name", sorted(t5.SIZES))
def test_shapes_alone_give_the_config(name):
  """Config inference needs shapes only: every SIZES entry (XXL included) from shape tuples."""
  config = t5.SIZES[name]
  assert t5_layout.infer_config(t5_layout.param_shapes(config)) == config
  assert t5_layout.size_name(config) == name


@pytest.mark.parametrize("name", ["tiny", "tiny-1.0", "t5.1.1-small", "t5-small"])
def test_layout_is_the_specjax_model_tree(name):
  config = t5.SIZES[name]
  model = {k: tuple(v.shape) for k, v in _flat(t5.param_shapes(config)).items()}
  assert model == _flat(t5_layout.param_shapes(config))
