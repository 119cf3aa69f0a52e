"""The checks every job runs on its inputs before any work: one place, so that every path refuses the
same input with the same message (the setting or file it names, and the fix).

  settings      whole numbers and finite floats in range (`whole_number`, `finite_number`), a mesh
                shape (`check_mesh_shape`), an integer from the environment (`env_int`)
  prompts       a prompt set as a run uses it: not empty, every text a non-blank string that is
                valid UTF-8 (`check_prompt_set`), every prompt tokenizing to 1..max_prompt_length
                tokens (`check_token_lists`), and the digest of the prompts actually used
                (`prompt_digest`), which enters a run's spec and so its fingerprint
  vocabulary    lives in `loading.check_same_vocabulary`: it reads the tokenizer a checkpoint ships,
                which this module, imported by the decoding core, must not reach up to
  memory        the KV cache and the verification logits a decode allocates, from the model's shapes
                (the planner's arithmetic, `jax.eval_shape`: nothing allocated), against this
                machine's memory (`check_decode_fits`)

Nothing here imports TensorFlow or gin; the heavier imports (jax, the tokenizers) happen inside the
functions that need them.
"""

from __future__ import annotations

import hashlib
import math
import operator
import os
from typing import Any, Sequence

# Token positions and cache slots are int32 on the device; a length beyond this would wrap.
MAX_POSITIONS = 2 ** 30


# ---- settings ---------------------------------------------------------------------------------------

def whole_number(value: Any, name: str, minimum: int = 1, maximum: int | None = None,
                 fix: str = "") -> int:
  """`value` as an int, or ValueError naming the setting `name`, the range and `fix`: a bool, a
  non-number, a fraction, NaN or infinity, or a value outside [minimum, maximum] is refused."""
  upper = "" if maximum is None else f" and <= {maximum}"
  message = f"{name} must be a whole number >= {minimum}{upper}, got {value!r}"
  if isinstance(value, bool):
    raise ValueError(message + (f"; {fix}" if fix else ""))
  try:
    number = operator.index(value)
  except TypeError:
    try:
      as_float = float(value)
    except (TypeError, ValueError):
      raise ValueError(message + (f"; {fix}" if fix else "")) from None
    if not math.isfinite(as_float) or as_float != int(as_float):
      raise ValueError(message + (f"; {fix}" if fix else "")) from None
    number = int(as_float)
  if number < minimum or (maximum is not None and number > maximum):
    raise ValueError(message + (f"; {fix}" if fix else ""))
  return number


def finite_number(value: Any, name: str, minimum: float | None = None,
                  maximum: float | None = None, fix: str = "") -> float:
  """`value` as a finite float in [minimum, maximum], or ValueError naming the setting."""
  try:
    number = float(value) if not isinstance(value, bool) else math.nan
  except (TypeError, ValueError):
    number = math.nan
  if not (math.isfinite(number) and (minimum is None or number >= minimum)
          and (maximum is None or number <= maximum)):
    bounds = " ".join(part for part in (
        "" if minimum is None else f">= {minimum}", "" if maximum is None else f"<= {maximum}") if part)
    raise ValueError(f"{name} must be a finite number{' ' + bounds if bounds else ''}, got "
                     f"{value!r}" + (f"; {fix}" if fix else ""))
  return number


def check_mesh_shape(mesh_shape: Any, name: str = "mesh_shape") -> tuple[int, int]:
  """(data, model) of a mesh shape: two whole numbers >= 1, or ValueError naming the setting."""
  try:
    parts = tuple(mesh_shape)
  except TypeError:
    parts = ()
  if len(parts) != 2:
    raise ValueError(f"{name} must be (data, model), two whole numbers >= 1 such as (1, 1), got "
                     f"{mesh_shape!r}")
  return tuple(whole_number(part, f"{name}[{i}] ({axis})", 1,
                            fix="a mesh axis counts devices; (1, 1) runs on one device")
               for i, (part, axis) in enumerate(zip(parts, ("data", "model"))))


def env_int(name: str, minimum: int = 0, environ=None) -> int | None:
  """The whole number in environment variable `name` (None when unset or empty), or ValueError
  naming the variable."""
  environ = os.environ if environ is None else environ
  text = environ.get(name)
  if text is None or not text.strip():
    return None
  try:
    value = int(text.strip())
  except ValueError:
    raise ValueError(f"the environment variable {name}={text!r} is not a whole number; set it to "
                     f"one >= {minimum} or unset it") from None
  if value < minimum:
    raise ValueError(f"the environment variable {name}={value} must be >= {minimum}")
  return value


# ---- prompts ----------------------------------------------------------------------------------------

def check_prompt_text(text: Any, where: str) -> str:
  """A prompt's text as a run reads it: a string, not blank, encodable as UTF-8 (no lone surrogate
  such as a JSON "\\ud800"); else ValueError starting with `where` (the file and the prompt's id)."""
  if not isinstance(text, str):
    raise ValueError(f"{where}: \"text\" is {type(text).__name__} {text!r}, not a string; write the "
                     "prompt as a JSON string (in quotes)")
  if not text.strip():
    raise ValueError(f"{where}: the prompt is empty or blank; give it text or drop the line")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as error:
    raise ValueError(f"{where}: the text holds a lone surrogate {text[error.start]!r} at character "
                     f"{error.start} (a \\ud800-\\udfff escape without its pair), which is not "
                     "text; fix the escape or drop the prompt") from None
  return text


def check_prompt_set(prompt_set, what: str) -> None:
  """Refuse a prompt set a run cannot use, before any work: no prompts at all (an empty or blank
  file, a split or limit that keeps none), or a prompt `check_prompt_text` refuses. `what` names the
  setting (e.g. "PromptSpec(name='p.jsonl', split='all', limit=None)")."""
  if len(prompt_set) == 0:
    raise ValueError(f"{what} has no prompts: the file is empty or blank, or its split and limit "
                     "keep none; give it prompts (a .jsonl file of {\"id\": ..., \"text\": ...} "
                     "lines), or another split or limit")
  for key, text in zip(prompt_set.keys, prompt_set.prompts):
    check_prompt_text(text, f"{prompt_set.name}, prompt {key!r}")


def check_token_lists(token_lists: Sequence[Sequence[int]], keys: Sequence[str], source: str,
                      max_prompt_length: int | None = None) -> None:
  """Every prompt tokenizes to 1..max_prompt_length tokens, or ValueError naming the prompt by its
  id (not its row in a batch) and the file or set it came from."""
  for key, ids in zip(keys, token_lists):
    if len(ids) == 0:
      raise ValueError(f"{source}, prompt {key!r}: it tokenizes to no tokens (nothing the model's "
                       "tokenizer keeps); give it text or drop it")
    if max_prompt_length is not None and len(ids) > max_prompt_length:
      raise ValueError(f"{source}, prompt {key!r}: {len(ids)} tokens, more than "
                       f"PromptSpec.max_prompt_length={max_prompt_length}; raise max_prompt_length "
                       f"to at least {len(ids)}, or shorten or drop the prompt")


def prompt_digest(prompt_set) -> str:
  """A digest of the prompts a run uses: every id with its text as formatted (style applied) and its
  reference, in order. It enters a run's spec, so a prompt file edited in place makes "a different
  config" rather than rows of two prompt versions in one file."""
  sha = hashlib.sha256()
  for key, text, reference in zip(prompt_set.keys, prompt_set.prompts, prompt_set.references):
    for part in (key, text, "" if reference is None else reference):
      data = str(part).encode("utf-8", "surrogatepass")
      sha.update(len(data).to_bytes(8, "big") + data)
  return sha.hexdigest()[:16]


# ---- memory -----------------------------------------------------------------------------------------

def memory_bytes() -> int | None:
  """Bytes of memory of this machine's first device: an accelerator's limit (memory_stats), else
  the host's physical memory; None when unknown."""
  import jax  # pylint: disable=import-outside-toplevel
  device = jax.local_devices()[0]
  stats = None
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  # backends without it raise various errors
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def cache_bytes(model, batch: int, max_length: int) -> int:
  """Bytes of the KV cache `model.init_cache(batch, max_length)` allocates (its shapes only)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  shapes = jax.eval_shape(lambda: model.init_cache(batch, max_length))
  return sum(int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree_util.tree_leaves(shapes))


def check_decode_fits(model, vocab_size: int, batch: int, prompt_length: int, max_new_tokens: int,
                      tree_size: int, names: str, available: int | None = None) -> None:
  """Refuse a decode whose cache length or memory is beyond what this machine and int32 positions
  allow, before anything runs. The cache holds prompt + max_new_tokens + the verified nodes per row
  (decoding/core.py: tree_size is the tree's nodes with its root; 1 for the autoregressive loop);
  its bytes (and the verification's logits, batch x tree_size x vocabulary float32) must fit the device's memory. `names` lists the settings to change, e.g.
  "PromptSpec.batch_size=4, DecodeSpec.max_new_tokens=128, gamma=4"."""
  slots = prompt_length + max_new_tokens + tree_size
  if slots > MAX_POSITIONS:
    raise ValueError(f"{names}: a row needs {slots} cache slots (prompt {prompt_length} + "
                     f"max_new_tokens {max_new_tokens} + {tree_size} verified nodes), beyond the "
                     f"{MAX_POSITIONS} positions int32 holds; lower max_new_tokens or gamma")
  available = memory_bytes() if available is None else available
  if available is None:
    return
  needed = cache_bytes(model, batch, slots) + batch * tree_size * vocab_size * 4
  if needed > available:
    gib = lambda n: f"{n / 2 ** 30:.1f} GiB"
    raise ValueError(f"{names}: the decode needs {gib(needed)} for its KV cache ({batch} rows x "
                     f"{slots} slots) and verification logits, more than the {gib(available)} of "
                     "this machine's device; lower max_new_tokens, gamma or batch_size "
                     "(python -m specjax.plan reports what a config needs)")
