"""T5X checkpoints: the format of the public T5 and T5 1.1 models (gs://t5-data/.../t5x/).

`load(path)` reads a checkpoint directory into (T5Config, float32 numpy params); `save` writes one
the way t5x's own `checkpoints.Checkpointer` does. Neither t5x nor seqio is imported (they do not
install here): the layout below was read from t5x's source (`t5x/checkpoints.py`,
`t5x/checkpoint_utils.py`, `t5x/examples/t5/{layers,network}.py`).

Legacy t5x layout (every public T5X checkpoint):

  checkpoint_<step>/
    checkpoint      flax.serialization msgpack: {"version": 3, "optimizer": {"target": params,
                    "state": {"step": ..., "param_states": optimizer slots}}}
    target.encoder.layers_0.attention.query.kernel/  one zarr array per leaf (gzip chunks of at
    ...                                        most 64 MiB), named by its tree path, "/" -> "."

  t5x writes that file with flax's own `serialization.to_bytes` and reads it with `msgpack_restore`,
  so flax's msgpack format is t5x's. A leaf is either an inline numpy array (flax's ext type; t5x
  writes unpartitioned leaves such as the step this way) or the JSON of the `tensorstore.Spec` the
  array was written with (t5x registers `ts.Spec` with flax to write `to_json()`), its path relative
  to the checkpoint directory:
    {"driver": "zarr", "dtype": "bfloat16", "kvstore": {"driver": "file", "path": "target.x.y/"},
     "metadata": {"shape": [E, V], "chunks": [...], "compressor": {"id": "gzip"}}}
  (tensorstore < 0.1.14 put "path" at the top level beside a "gcs" kvstore with the placeholder
  bucket "t5x-dummy-bucket"). Version 3 stores bfloat16 natively in tensorstore; version 2 kept its
  bits as uint16 zarr arrays, which `load` views as bfloat16 (t5x itself now refuses them).
  t5x tells its own format apart by exactly these two top-level keys or by a spec in the tree.

Orbax layouts (t5x's OrbaxCheckpointManagerInterface writes checkpoint_<step>/state/; plain orbax
writes the item directory itself): older orbax left an aggregate msgpack `checkpoint` whose array
leaves are "PLACEHOLDER://<dotted name>" strings, each a zarr directory of that name (read here like
the legacy layout); newer orbax writes `_METADATA`, `manifest.ocdbt` and `ocdbt.process_*/` (OCDBT),
which `load` reads through orbax-checkpoint's PyTreeCheckpointer.

Parameters: T5X's names under `target` are specjax's T5 names (see `t5_layout.param_shapes`). The
kernels of t5x/examples/t5 (the network of the public T5 / T5 1.1 checkpoints) are 2-D:
DenseGeneral keeps a [in, out] parameter and reshapes it, C order, to [embed, heads, head_dim] only
when applying it, so column h * head_dim + d is head h, dim d, exactly specjax's layout.
t5x/examples/scalable_t5 stores the same matrix 3-D, [embed, heads, head_dim] (out: [heads,
head_dim, embed]); `load` flattens those. `rel_embedding` is [heads, buckets] in both, as in
specjax. Scanned checkpoints (one stacked `layers` tree with a layer axis, e.g. umT5's, which also
has per-layer relative position tables) are a different architecture and are refused.
"""

from __future__ import annotations

import os
import pathlib
import re

import jax
import ml_dtypes  # registers bfloat16 with numpy
import msgpack
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import serialization, traverse_util

from specjax.checkpoints.t5_layout import check_shapes, infer_config
from specjax.models.t5_network import T5Config

VERSION = 3  # t5x's checkpoint version since 2021-06 (native bfloat16 in tensorstore)
CHECKPOINT_FILE = "checkpoint"
_ORBAX_FILES = ("_METADATA", "manifest.ocdbt")
_PLACEHOLDER = "PLACEHOLDER://"  # orbax's aggregate-file reference to a separately stored array
_CHUNK_BYTES = 64 * 1024 * 1024  # t5x's target chunk size
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Where the parameters sit in a checkpoint's tree: t5x's optimizer target, flax / orbax params.
_TARGET_KEYS = (("target",), ("params",), ("params", "params"), ())
_ATTENTION = ("attention", "self_attention", "encoder_decoder_attention")


# ---------------------------------------------------------------------------------------------
# Reading.


def load(path) -> tuple[T5Config, dict]:
  """A T5X checkpoint -> (T5Config inferred from the shapes, params as float32 numpy arrays).

  `path`: a checkpoint directory (checkpoint_<step>/, legacy or orbax), its `checkpoint` file, a
  directory holding checkpoint_<step>/ subdirectories (the highest step is read), or a URL that
  tensorstore opens (gs://bucket/.../checkpoint_1000000; URLs must name the checkpoint directory).
  Only `target` (the parameters) is read; optimizer state is ignored. bfloat16 arrays are cast to
  float32 exactly. `t5_layout.size_name(config)` names the matching `SIZES` entry.
  """
  where, params = read_params(path)
  config = infer_config(params, where)
  return config, params


def is_checkpoint(path) -> bool:
  """Whether `load` finds a T5X checkpoint at `path` (looks at file names only)."""
  try:
    _resolve(path)
  except (ValueError, OSError):
    return False
  return True


def read_params(path) -> tuple[str, dict]:
  """(the resolved checkpoint location, its parameter tree as float32 numpy) without any
  architecture check; 3-D attention kernels (scalable_t5) are flattened to specjax's 2-D."""
  kind, directory = _resolve(path)
  if kind == "legacy":
    tree = _read_msgpack_checkpoint(directory)
  else:
    try:
      tree = _read_orbax(directory)
    except ValueError:
      if not directory.has(CHECKPOINT_FILE):
        raise
      # Older orbax wrote an aggregate msgpack file with zarr arrays beside its _METADATA.
      tree = _read_msgpack_checkpoint(directory)
  return directory.text, _flatten_attention(tree)


def read_file(path: str) -> bytes:
  """The bytes of one file, local or at any URL tensorstore's kvstore opens (a vocabulary on gs://,
  say); FileNotFoundError names it when it is not there."""
  text = os.fspath(path)
  directory, _, name = text.rstrip("/").rpartition("/")
  data = _Dir(directory or ".").read(name)
  if data is None:
    raise FileNotFoundError(f"no file at {text}")
  return data


class _Dir:
  """A directory: local, or any URL tensorstore's kvstore opens (gs://, s3://, file://, ...)."""

  def __init__(self, path):
    text = os.fspath(path)
    self.url = bool(_URL.match(text))
    self.text = text.rstrip("/") if self.url else str(pathlib.Path(text).absolute())

  def child(self, name: str) -> "_Dir":
    return _Dir(f"{self.text}/{name}")

  def kvstore(self):
    """The tensorstore kvstore spec of this directory."""
    if self.url:
      return self.text + "/"
    return {"driver": "file", "path": self.text + "/"}

  def read(self, name: str) -> bytes | None:
    """The bytes of file `name` in this directory, None when it does not exist."""
    if not self.url:
      file = pathlib.Path(self.text, name)
      return file.read_bytes() if file.is_file() else None
    result = ts.KvStore.open(self.kvstore()).result().read(name).result()
    return bytes(result.value) if result.state == "value" else None

  def has(self, name: str) -> bool:
    if not self.url:
      return pathlib.Path(self.text, name).is_file()
    return self.read(name) is not None


def _resolve(path) -> tuple[str, _Dir]:
  """("legacy" | "orbax", the checkpoint directory) for what `load` accepts."""
  directory = _Dir(path)
  if not directory.url:
    local = pathlib.Path(directory.text)
    if not local.exists():
      raise FileNotFoundError(f"no T5X checkpoint at {path}: the path does not exist")
    if local.is_file():
      if local.name != CHECKPOINT_FILE:
        raise ValueError(f"not a T5X checkpoint: {path} is a file; expected a checkpoint_<step>/ "
                         f"directory or the `{CHECKPOINT_FILE}` msgpack file inside one")
      directory = _Dir(local.parent)
  for candidate in (directory, directory.child("state")):
    if any(candidate.has(name) for name in _ORBAX_FILES):
      return "orbax", candidate
    if candidate.has(CHECKPOINT_FILE):
      return "legacy", candidate
  if not directory.url:
    steps = sorted((int(m.group(1)), p) for p in pathlib.Path(directory.text).iterdir()
                   if (m := re.fullmatch(r"checkpoint_(\d+)", p.name)) and p.is_dir())
    for _, step_dir in reversed(steps):  # the newest step that holds a checkpoint
      try:
        return _resolve(step_dir)
      except ValueError:
        continue
  steps = ("checkpoint_<step>/ subdirectories" if not directory.url else
           "(a URL must name the checkpoint directory itself, not the directory of its steps)")
  raise ValueError(
      f"no T5X checkpoint at {path}: looked for a `{CHECKPOINT_FILE}` msgpack file (legacy t5x), "
      f"orbax files ({', '.join(_ORBAX_FILES)}), the same under state/ (t5x's orbax manager) and "
      f"{steps}")


def _is_spec(leaf) -> bool:
  return isinstance(leaf, dict) and {"driver", "kvstore"} <= leaf.keys()


def _read_msgpack_checkpoint(directory: _Dir) -> dict:
  """The `target` tree of a legacy t5x (or aggregate-file orbax) checkpoint, float32 numpy."""
  where = f"{directory.text}/{CHECKPOINT_FILE}"
  raw = directory.read(CHECKPOINT_FILE)
  if raw.startswith(b"model_checkpoint_path"):
    raise ValueError(f"{where} is a TensorFlow (Mesh TF) checkpoint index, not a T5X checkpoint: "
                     "convert it with t5x's checkpoint conversion first")
  try:
    contents = serialization.msgpack_restore(raw)
  except (ValueError, msgpack.UnpackException) as e:
    raise ValueError(f"{where} is not a msgpack T5X checkpoint: {e}") from e
  if not isinstance(contents, dict):
    raise ValueError(f"{where} is not a T5X checkpoint: its msgpack holds a {type(contents)}")
  # version >= 1: {"version", "optimizer": state}; version 0 (and orbax's aggregate file): state.
  state = contents.get("optimizer", contents)
  target_keys = _target_keys(state)
  if target_keys is None:
    raise ValueError(f"{where} has no parameters: expected optimizer/target (or target) holding "
                     f"token_embedder/encoder/decoder; top-level keys {sorted(state)}")
  return _read_leaves(directory, _flatten_specs(_get(state, target_keys, None)), where)


def _target_keys(tree) -> tuple | None:
  """The keys of the parameter tree (the dict holding token_embedder) in `tree`, or None."""
  return next((keys for keys in _TARGET_KEYS if isinstance(node := _get(tree, keys, None), dict)
               and "token_embedder" in node), None)


def _read_leaves(directory: _Dir, flat: dict, where: str) -> dict:
  """Inline arrays as they are, tensorstore specs / orbax placeholders read (concurrently)."""
  context = ts.Context({"file_io_concurrency": {"limit": 64}})
  out, pending = {}, []
  for name, leaf in flat.items():
    if isinstance(leaf, np.ndarray):  # a copy: the decoded array is a read-only buffer view
      out[name] = np.array(_to_float32(leaf))
      continue
    if _is_spec(leaf):
      array = (leaf["kvstore"].get("path") if isinstance(leaf["kvstore"], dict) else None)
      array = (array or leaf.get("path") or "").rstrip("/")
      driver = leaf["driver"]
      shape = tuple(leaf.get("metadata", {}).get("shape", ())) or None
    elif isinstance(leaf, str) and leaf.startswith(_PLACEHOLDER):
      array, driver, shape = leaf[len(_PLACEHOLDER):], "zarr", None
    else:
      raise ValueError(f"{where}: parameter {name} is a {type(leaf).__name__}, neither an inline "
                       "array nor a reference to a TensorStore array")
    if not array:
      raise ValueError(f"{where}: parameter {name} references a TensorStore array without a path")
    expect = f"expected shape {shape}" if shape else "shape unknown"
    if not directory.url and not pathlib.Path(directory.text, array).is_dir():
      raise ValueError(f"{where}: the array directory {array}/ of parameter {name} ({expect}) is "
                       f"missing from {directory.text}")
    spec = {"driver": driver, "kvstore": directory.child(array).kvstore()}
    pending.append((name, array, shape, expect, ts.open(spec, open=True, read=True,
                                                         context=context)))
  reads = []
  for name, array, shape, expect, future in pending:
    try:
      store = future.result()
    except ValueError as e:
      raise ValueError(f"{where}: cannot open the array {array}/ of parameter {name} ({expect}): "
                       f"{e}") from e
    if shape is not None and tuple(store.shape) != shape:
      raise ValueError(f"{where}: the array {array}/ of parameter {name} has shape "
                       f"{tuple(store.shape)}, but the checkpoint file says {shape}")
    reads.append((name, store.read()))
  for name, future in reads:
    out[name] = _to_float32(future.result())
  return traverse_util.unflatten_dict(out, sep="/")


def _to_float32(array) -> np.ndarray:
  array = np.asarray(array)
  if array.dtype == np.uint16:  # t5x checkpoint version 2 kept bfloat16 bits as uint16
    array = array.view(ml_dtypes.bfloat16)
  return np.ascontiguousarray(array, dtype=np.float32)


def _read_orbax(directory: _Dir) -> dict:
  """The parameter subtree of an orbax PyTree checkpoint (OCDBT or not), as float32 numpy."""
  checkpointer = ocp.PyTreeCheckpointer()
  try:
    metadata = checkpointer.metadata(directory.text)
    tree = getattr(metadata, "item_metadata", metadata)  # orbax >= 0.11 wraps it in StepMetadata
    tree = getattr(tree, "tree", tree)
    target_keys = _target_keys(tree)
    if target_keys is None:
      raise ValueError(f"no token_embedder/encoder/decoder tree (top-level keys {sorted(tree)})")
    item = _get(tree, target_keys, None)
    for key in reversed(target_keys):
      item = {key: item}
    restore_args = jax.tree_util.tree_map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    restored = checkpointer.restore(directory.text, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except  # any orbax failure: say what to do
    raise ValueError(
        f"{directory.text}: orbax checkpoint (_METADATA / manifest.ocdbt / ocdbt.process_*) that "
        f"orbax-checkpoint could not restore: {e}. Restore it with the orbax version that wrote it "
        "and save the parameters again with specjax.checkpoints.t5x.save") from e
  target = _get(restored, target_keys, None)
  return traverse_util.unflatten_dict(
      {name: _to_float32(leaf) for name, leaf in _flatten_specs(target).items()}, sep="/")


def _get(tree, keys, default):
  for key in keys:
    if not isinstance(tree, dict) or key not in tree:
      return default
    tree = tree[key]
  return tree


def _flatten_attention(tree: dict) -> dict:
  """scalable_t5 stores attention kernels 3-D: [E, H, D] (out: [H, D, E]) -> 2-D, C order, which
  is how t5x/examples/t5's DenseGeneral reshapes its 2-D parameter."""
  flat = _flatten_specs(tree)
  for name, array in flat.items():
    parts = name.split("/")
    if len(parts) >= 3 and parts[-3] in _ATTENTION and array.ndim == 3:
      if parts[-2] == "out":
        flat[name] = array.reshape(-1, array.shape[-1])
      else:
        flat[name] = array.reshape(array.shape[0], -1)
  return traverse_util.unflatten_dict(flat, sep="/")


# ---------------------------------------------------------------------------------------------
# Writing.


def save(path, config: T5Config, params, dtype=np.float32, step: int = 0) -> str:
  """Write `params` as a legacy t5x checkpoint directory `path` (e.g. .../checkpoint_<step>/).

  Laid out as t5x's Checkpointer writes it: one gzip zarr array per parameter, named
  "target.<path with / -> .>", in float32 or bfloat16 (t5x's `save_dtype` casts only `target`), and
  the msgpack `checkpoint` file {"version": 3, "optimizer": {"target": <tensorstore spec JSON per
  parameter, relative path>, "state": {"step": int32}}}, written last so a partial save is not a
  checkpoint. No optimizer slots are written: t5x's `load_t5x_checkpoint` reads the result as it is,
  a t5x training run restores it with a fallback for the optimizer state (e.g. as its initial
  checkpoint). `path` may be a URL tensorstore writes (gs://...). Returns the path.
  """
  dtype = np.dtype(dtype)
  if dtype.name not in ("float32", "bfloat16"):
    raise ValueError(f"T5X checkpoints are float32 or bfloat16, not {dtype.name}")
  flat = {name: np.asarray(leaf) for name, leaf in _flatten_specs(params).items()}
  check_shapes(flat, config, where=f"params to save at {path}")
  directory = _Dir(path)
  if not directory.url:
    pathlib.Path(directory.text).mkdir(parents=True, exist_ok=True)
  context = ts.Context({"file_io_concurrency": {"limit": 64}})
  on_gcs = directory.text.startswith("gs://")
  specs, writes = {}, []
  for name, array in flat.items():
    array = np.ascontiguousarray(array.astype(dtype))
    array_name = "target." + name.replace("/", ".")
    metadata = {"compressor": {"id": "gzip"}, "shape": list(array.shape),
                "chunks": _chunk_shape(array.shape, dtype.itemsize)}
    store = ts.open({"driver": "zarr", "dtype": dtype.name, "metadata": metadata,
                     "kvstore": directory.child(array_name).kvstore()},
                    create=True, delete_existing=True, context=context).result()
    writes.append(store.write(array))
    # What t5x records: the spec with the path relative to the checkpoint directory, so the
    # directory can move; on GCS a placeholder bucket that readers replace.
    kvstore = ({"driver": "gcs", "bucket": "t5x-dummy-bucket", "path": array_name} if on_gcs
               else {"driver": "file", "path": array_name})
    specs[name] = ts.Spec({"driver": "zarr", "dtype": dtype.name, "kvstore": kvstore,
                           "metadata": metadata}).to_json()
  for write in writes:
    write.result()
  contents = {"version": VERSION, "optimizer": {
      "target": traverse_util.unflatten_dict(specs, sep="/"),
      "state": {"step": np.asarray(step, np.int32)}}}
  # Not `to_bytes`, as t5x: its to_state_dict would turn the specs' JSON lists into {"0": ...}
  # dicts (t5x registers ts.Spec with flax instead, a global left alone here). in_place: flax's
  # copy otherwise goes through jax.tree_util, which sorts dict keys; `to_bytes` packs in place.
  data = serialization.msgpack_serialize(contents, in_place=True)
  if directory.url:
    ts.KvStore.open(directory.kvstore()).result().write(CHECKPOINT_FILE, data).result()
  else:
    pathlib.Path(directory.text, CHECKPOINT_FILE).write_bytes(data)
  return str(path)


def _chunk_shape(shape, itemsize: int) -> list[int]:
  """The largest chunk that tiles `shape` exactly within t5x's 64 MiB: repeatedly shrink the
  largest dimension to its next smaller divisor (t5x's `_choose_chunk_shape`; orbax's copy of it
  is private)."""
  chunk = list(shape)
  while chunk and np.prod(chunk, dtype=np.int64) * itemsize > _CHUNK_BYTES:
    axis = int(np.argmax(chunk))
    size = shape[axis]
    chunk[axis] = max(d for d in range(1, chunk[axis]) if size % d == 0)
  return chunk


def _flatten_specs(tree) -> dict:
  """{"a/b/c": leaf}, a tensorstore spec dict counting as a leaf."""
  return traverse_util.flatten_dict(tree, sep="/", is_leaf=lambda _, value: _is_spec(value))
