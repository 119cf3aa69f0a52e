"""Output directories and result files: one writer for generations, sweeps and training runs.

A run's directory holds what it was asked (`spec.json`, the resolved dataclasses; `config.gin`; the
`environment.json` it ran in) and what it produced, one JSON row per finished item in a JSONL file.
The rules every writer here keeps:

  * a directory holding another spec's results is refused, never mixed (`prepare_output_dir`);
  * each finished row is appended as ONE line in a single write, then flushed and fsynced, so the file on
    disk is always "complete rows + at most one torn tail";
  * on open a torn last line (not valid JSON, or valid but missing its newline) is cut off and its item
    is done again; an invalid line in the middle is refused (a kill cannot produce it);
  * every row carries the fingerprint of its config; a file with rows of another fingerprint is refused;
  * an exclusive lock on `<file>.lock` refuses a second writer (the OS drops it when the holder dies,
    even by SIGKILL).
Rows are standard JSON: numpy values become plain numbers and lists, NaN and infinities null.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import numbers
import os
import platform
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax

# 16 hex digits = 64 bits: collisions among a few thousand items are out of reach, ids stay readable.
_ID_HEX = 16
SPEC_FILE = "spec.json"


def _normalize(value: Any, hashing: bool) -> Any:
  """A JSON value with numpy values as Python ones. hashing: whole floats become ints (1.0 hashes
  as 1); otherwise NaN and infinities become None (standard JSON)."""
  if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
    value = value.tolist()  # numpy arrays and scalars
  if isinstance(value, bool) or value is None or isinstance(value, str):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    value = float(value)
    if hashing:
      return int(value) if value.is_integer() else value
    return value if math.isfinite(value) else None
  if isinstance(value, Mapping):
    return {str(k): _normalize(v, hashing) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_normalize(v, hashing) for v in value]
  raise TypeError(f"values must be JSON values (str, number, bool, None, list, dict); "
                  f"got {type(value).__name__}: {value!r}")


def canonical(value: Any) -> Any:
  """Normalises a JSON-able value so equal parameters hash equally (temperature 1 == 1.0)."""
  return _normalize(value, hashing=True)


def jsonable(value: Any) -> Any:
  """Measured values -> standard JSON: numpy scalars / arrays to Python, NaN / inf to None (so jq,
  pandas and browsers read the rows too)."""
  return _normalize(value, hashing=False)


def digest(obj: Mapping[str, Any] | None) -> str:
  """Stable hash of a JSON dict: key order and int-vs-float spelling do not change it."""
  text = json.dumps(canonical(dict(obj or {})), sort_keys=True, separators=(",", ":"),
                    allow_nan=False)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:_ID_HEX]


# ---- output directories -----------------------------------------------------------------------------

def environment() -> dict:
  """Where a run ran: jax version and devices, processes, host, Python, command line."""
  return {"jax": jax.__version__, "backend": jax.default_backend(),
          "devices": [str(d) for d in jax.devices()], "process_index": jax.process_index(),
          "process_count": jax.process_count(), "host": platform.node(),
          "python": sys.version.split()[0], "argv": sys.argv}


def without_none(value: Any) -> Any:
  """A spec with None-valued fields left out: a field added later at its None default does not make
  an existing directory's spec "different"."""
  if isinstance(value, dict):
    return {k: without_none(v) for k, v in value.items() if v is not None}
  return value


def check_spec(output_dir: str | os.PathLike, spec: dict) -> dict:
  """Refuse a directory whose spec.json holds another spec; return `spec` as JSON would reread it."""
  spec_path = Path(output_dir) / SPEC_FILE
  spec = json.loads(json.dumps(spec))  # tuples -> lists, as a reread spec.json has them
  if spec_path.exists() and without_none(json.loads(spec_path.read_text())) != without_none(spec):
    raise ValueError(f"{output_dir} holds results of a different config (see its spec.json); choose "
                     "another output_dir or delete that one: results of two configs are never mixed")
  return spec


def prepare_output_dir(output_dir: str | os.PathLike, spec: dict, config_text: str | None = None
                       ) -> Path:
  """Create `output_dir` for `spec` (the run's resolved dataclasses as a dict) and write spec.json,
  environment.json and, when given, config.gin (`config_text`). A directory whose spec.json holds
  another spec is refused before anything is written."""
  output_dir = Path(output_dir)
  spec = check_spec(output_dir, spec)
  output_dir.mkdir(parents=True, exist_ok=True)
  spec_path = output_dir / SPEC_FILE
  if jax.process_index() == 0:
    spec_path.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    (output_dir / "environment.json").write_text(json.dumps(environment(), indent=2) + "\n")
    if config_text is not None:
      (output_dir / "config.gin").write_text(config_text)
  return output_dir


# ---- result rows ------------------------------------------------------------------------------------

def read_rows(path: str | os.PathLike) -> list[dict]:
  """The complete rows of a results JSONL (read-only; a torn last line is ignored, not repaired).

  Raises ValueError for a bad line that is not the last one: a kill only ever tears the tail, so that
  is corruption from something else, and silently dropping it could lose results.
  """
  rows, _ = _scan(Path(path))
  return rows


def _scan(path: Path) -> tuple[list[dict], int | None]:
  """(complete rows, byte length to truncate the file to when its last line is torn, else None)."""
  if not path.exists():
    return [], None
  data = path.read_bytes()
  rows, start, torn_at = [], 0, None
  while start < len(data):
    end = data.find(b"\n", start)
    line = data[start:] if end < 0 else data[start:end]
    last = end < 0 or end == len(data) - 1
    try:
      row = json.loads(line)
      if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    except ValueError as error:
      if not last:
        raise ValueError(f"{path}: invalid JSON row at byte {start}, line {len(rows) + 1}, in the "
                         f"middle of the file ({error}); a killed run only tears the last line, so "
                         f"something else changed this file. Fix or move it.") from None
      torn_at = start  # the row in flight when the writer died
      break
    if end < 0:  # it parses, but its newline never landed: redo it rather than trust a half write
      torn_at = start
      break
    rows.append(row)
    start = end + 1
  return rows, torn_at


class RowsFile:
  """An exclusive, append-only JSONL of result rows, each stamped with the writer's fingerprint.

      with RowsFile(path, fingerprint) as rows:   # locks, repairs a torn tail, checks fingerprints
        done = {row["key"] for row in rows.existing}
        rows.append({"key": ..., ...})            # one line, flushed and fsynced
  """

  def __init__(self, path: str | os.PathLike, fingerprint: str, fingerprint_key: str):
    self.path = Path(path)
    self.fingerprint = fingerprint
    self.fingerprint_key = fingerprint_key
    self.existing: list[dict] = []
    self._stack = contextlib.ExitStack()
    self._file = None

  def __enter__(self) -> "RowsFile":
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._stack.enter_context(_exclusive(self.path))
    try:
      rows, torn_at = _scan(self.path)
      others = sorted({r.get(self.fingerprint_key) for r in rows} - {self.fingerprint}, key=str)
      if others:
        raise ValueError(f"{self.path} holds rows of a different config ({self.fingerprint_key} "
                         f"{', '.join(map(str, others))}; this run's is {self.fingerprint}). Refusing "
                         "to mix results: write to another output path, or move the old file away.")
      if torn_at is not None:
        _truncate(self.path, torn_at)
      self.existing = rows
      self._file = self._stack.enter_context(open(self.path, "a", encoding="utf-8"))
    except BaseException:
      self._stack.close()
      raise
    return self

  def __exit__(self, *exc_info) -> None:
    self._stack.close()

  def append(self, row: Mapping[str, Any]) -> dict:
    """Stamp, normalise and write one row as one line; flush and fsync before returning it."""
    row = jsonable({**row, self.fingerprint_key: self.fingerprint})
    self._file.write(json.dumps(row, allow_nan=False) + "\n")
    self._file.flush()
    os.fsync(self._file.fileno())
    return row


def _truncate(path: Path, length: int) -> None:
  """Cuts a torn tail off in place: the complete rows before it keep their bytes."""
  with open(path, "r+b") as f:
    f.truncate(length)
    f.flush()
    os.fsync(f.fileno())


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
  """Holds an exclusive advisory lock on `<path>.lock`; two writers on one file would interleave."""
  lock_path = path.with_name(path.name + ".lock")
  with open(lock_path, "a", encoding="utf-8") as lock:
    try:
      fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise RuntimeError(f"another run is writing {path} (lock {lock_path} is held); wait for it "
                         f"or give this run another output path") from None
    try:
      yield
    finally:
      fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
