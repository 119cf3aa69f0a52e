"""Output directories and result files: one writer for generations, sweeps and training runs.

A run's directory holds what it was asked (`spec.json`, the resolved dataclasses; `config.gin`; the
`environment.json` it ran in) and what it produced, one JSON row per finished item in a JSONL file.
The rules every writer here keeps:

  * one run at a time per directory (`RunDirectory` holds an exclusive lock for the whole run:
    generation, sweep or training);
  * a directory is judged by its results, not by metadata: rows of another config are refused before
    anything is written, naming what differs (a model whose weights changed shows as its content
    key) and how to recover; a directory without results takes the new spec (a failed start leaves
    nothing that blocks the corrected rerun);
  * each finished row is appended as ONE line in a single write, then flushed and fsynced, so the file on
    disk is always "complete rows + at most one torn tail";
  * on open a torn last line (not valid JSON, or valid but missing its newline) is cut off, saved to
    `<file>.torn` and logged, and its item is done again; an invalid line in the middle is refused
    (a kill cannot produce it), and so is a key that appears twice;
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
from absl import logging

# 16 hex digits = 64 bits: collisions among a few thousand items are out of reach, ids stay readable.
_ID_HEX = 16
SPEC_FILE = "spec.json"
# Written into a results directory (training checkpoints) with the fingerprint of the config writing it.
FINGERPRINT_FILE = ".spec_fingerprint"


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


def _read_spec(spec_path: Path) -> dict | None:
  if not spec_path.exists():
    return None
  try:
    return json.loads(spec_path.read_text())
  except ValueError as error:
    raise ValueError(f"{spec_path} is not valid JSON ({error}); the config that wrote this directory "
                     f"is in {spec_path.with_name('config.gin')}. Delete {spec_path.name} to have it "
                     "rewritten: the results are checked by their own fingerprints") from None


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
  """Where two specs differ, as 'field: old -> new' lines (nested fields dotted); a changed content
  key reads as a model whose weights changed."""
  if isinstance(old, dict) and isinstance(new, dict):
    out = []
    for key in sorted(set(old) | set(new)):
      out += differences(old.get(key), new.get(key), f"{prefix}{key}.")
    return out
  if canonical(old) == canonical(new):
    return []
  field = prefix[:-1]
  if field.startswith("content_keys."):
    return [f"the weights of {field[len('content_keys.'):]!r} changed (content key {old} -> {new})"]
  if field == "measurement":  # a sweep's method of drawing and timing rows (speculative_sweep)
    earlier = "an earlier method" if old is None else json.dumps(old)
    return [f"measurement: the rows were drawn or timed by {earlier}, this code measures by "
            f"{json.dumps(new)}; their rows and new ones would not compare, so rerun the sweep into "
            "another output_dir"]
  return [f"{field}: {json.dumps(old)} -> {json.dumps(new)}"]


def from_process_0(value: Any) -> Any:
  """A JSON value as process 0 has it, on every process (itself on a single process)."""
  if jax.process_count() == 1:
    return value
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  payload = np.frombuffer(json.dumps(value).encode() if jax.process_index() == 0 else b"", np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.int32(payload.size)))
  buffer = payload if jax.process_index() == 0 else np.zeros(size, np.uint8)
  return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes())


class _Held:
  """A context manager whose `_open` (each subclass's) acquires resources on `self._stack`; if `_open` fails, whatever
  it acquired (a lock, a file) is released before the error propagates.

  Across processes `_open` runs on process 0 alone (it checks and writes; other hosts may not even
  share its file system); `_shared()` is what every process learns from it, and a refusal on process
  0 is raised on every process, so no host waits for a partner that gave up."""

  def __init__(self):
    self._stack = contextlib.ExitStack()

  def __enter__(self):
    error = None
    if jax.process_index() == 0:
      try:
        self._open()
      except BaseException as caught:
        self._stack.close()
        if jax.process_count() == 1:
          raise
        error = caught
    shared = from_process_0({"error": None if error is None else f"{type(error).__name__}: {error}",
                             "shared": None if error is not None else self._shared()})
    if error is not None:
      raise error
    if shared["error"] is not None:
      raise RuntimeError(f"process 0 refused the run: {shared['error']}")
    self._receive(shared["shared"])
    return self

  def _shared(self) -> Any:
    """What process 0's `_open` found that every process needs (JSON)."""
    return None

  def _receive(self, shared: Any) -> None:
    del shared

  def __exit__(self, *exc_info) -> None:
    self._stack.close()


class RunDirectory(_Held):
  """A run's output directory, held exclusively while the run lasts.

      with RunDirectory(output_dir, spec, results="results.jsonl", fingerprint_key=...) as run_dir:
        with RowsFile(run_dir.results, run_dir.fingerprint, ...) as rows: ...

  On entry, before anything is written: an output path that is a file is refused; a second run on the
  directory is refused (lock); rows of another config in `results` are refused with what differs
  (from spec.json when it belongs to those rows) and the two ways out. Then spec.json,
  environment.json and config.gin are (re)written: a directory whose results are all this spec's, or
  that has none, takes this spec, whatever metadata a failed start or a deleted spec.json left.
  `other_results`: more paths that count as results (training checkpoints): when they exist and no
  rows decide, spec.json must equal this spec. `fingerprinted`: directories among them that carry
  the fingerprint of the config that writes them (FINGERPRINT_FILE, created here): one holding
  results of another fingerprint is refused even when spec.json and the rows are gone, so another
  config never resumes from a training run's checkpoints.
  """

  def __init__(self, output_dir: str | os.PathLike, spec: dict, results: str, fingerprint_key: str,
               config_text: str | None = None, other_results: tuple = (),
               fingerprinted: tuple = ()):
    self.path = Path(output_dir)
    self.spec = json.loads(json.dumps(spec))  # tuples -> lists, as a reread spec.json has them
    self.fingerprint = digest(without_none(self.spec))
    self.results = self.path / results
    self.fingerprint_key = fingerprint_key
    self.config_text = config_text
    self.other_results = [self.path / name for name in other_results]
    self.fingerprinted = [self.path / name for name in fingerprinted]
    super().__init__()

  def _open(self) -> None:
    if self.path.exists() and not self.path.is_dir():
      raise NotADirectoryError(f"output_dir {self.path} is a file, not a directory; give the run a "
                               "directory path (it is created if missing)")
    self.path.mkdir(parents=True, exist_ok=True)
    self._stack.enter_context(_exclusive(self.path / ".run", what=f"the output directory {self.path}"))
    self._check()
    for directory in self.fingerprinted:
      directory.mkdir(parents=True, exist_ok=True)
      (directory / FINGERPRINT_FILE).write_text(self.fingerprint + "\n")
    (self.path / SPEC_FILE).write_text(json.dumps(self.spec, indent=2, sort_keys=True) + "\n")
    (self.path / "environment.json").write_text(json.dumps(environment(), indent=2) + "\n")
    if self.config_text is not None:
      (self.path / "config.gin").write_text(self.config_text)

  def _check(self) -> None:
    for directory in self.fingerprinted:
      stamp = directory / FINGERPRINT_FILE
      theirs = stamp.read_text().strip() if stamp.is_file() else None
      if theirs not in (None, self.fingerprint) and _holds_results(directory):
        raise ValueError(f"{directory} holds results of another config (its {FINGERPRINT_FILE} "
                         f"says {theirs}; this run's fingerprint is {self.fingerprint}), so this "
                         "run would resume from them. Nothing was written. Rerun with the config "
                         f"that wrote them (config.gin may still say), or give this run another "
                         f"output_dir, or move {directory} away.")
    spec_path = self.path / SPEC_FILE
    stored = _read_spec(spec_path)
    rows = read_rows(self.results)
    others = sorted({str(r.get(self.fingerprint_key)) for r in rows} - {self.fingerprint})
    if others:
      if stored is not None and digest(without_none(stored)) in others:
        what = "its spec.json says they differ from this run in:\n  " + "\n  ".join(
            differences(without_none(stored), without_none(self.spec)))
      else:
        what = (f"{spec_path.name} is {'missing' if stored is None else 'not theirs either'}, so "
                f"which config wrote them is known only by their fingerprint {', '.join(others)} "
                f"(config.gin may still say)")
      raise ValueError(f"{self.results} holds {len(rows)} rows of another config "
                       f"({self.fingerprint_key} {', '.join(others)}; this run's is "
                       f"{self.fingerprint}); {what}.\nNothing was written. To resume them, rerun "
                       f"with the config (and the specjax version) that wrote them; to run this "
                       f"config, give it another output_dir or move {self.results} away.")
    if rows or stored is None or without_none(stored) == without_none(self.spec):
      return
    if any(_holds_results(p) for p in self.other_results if p.is_dir()):
      raise ValueError(f"{self.path} holds results ({', '.join(str(p) for p in self.other_results)}) "
                       "of a config that differs from this run in:\n  " + "\n  ".join(
                           differences(without_none(stored), without_none(self.spec))) +
                       "\nNothing was written. Rerun with the config that wrote them (its "
                       "config.gin is there), or give this run another output_dir.")
    logging.info("%s: replacing the spec.json of a run that left no results", self.path)


def _holds_results(directory: Path) -> bool:
  """Whether a results directory holds anything but its fingerprint file."""
  return directory.is_dir() and any(p.name != FINGERPRINT_FILE for p in directory.iterdir())


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


class RowsFile(_Held):
  """An exclusive, append-only JSONL of result rows, each stamped with the writer's fingerprint.

      with RowsFile(path, fingerprint) as rows:   # locks, repairs a torn tail, checks fingerprints
        done = {row["key"] for row in rows.existing}
        rows.append({"key": ..., ...})            # one line, flushed and fsynced
  """

  def __init__(self, path: str | os.PathLike, fingerprint: str, fingerprint_key: str,
               unique_key: str | None = None):
    self.path = Path(path)
    self.fingerprint = fingerprint
    self.fingerprint_key = fingerprint_key
    self.unique_key = unique_key  # a field no two rows share (a prompt's key, a point's id)
    self.existing: list[dict] = []
    self._file = None
    super().__init__()

  def _open(self) -> None:
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._stack.enter_context(_exclusive(self.path))
    rows, torn_at = _scan(self.path)
    others = sorted({r.get(self.fingerprint_key) for r in rows} - {self.fingerprint}, key=str)
    if others:
      raise ValueError(f"{self.path} holds rows of a different config ({self.fingerprint_key} "
                       f"{', '.join(map(str, others))}; this run's is {self.fingerprint}). Refusing "
                       "to mix results: write to another output path, or move the old file away.")
    if self.unique_key is not None:
      seen, twice = set(), set()
      for row in rows:
        value = json.dumps(row.get(self.unique_key))
        (twice if value in seen else seen).add(value)
      if twice:
        raise ValueError(f"{self.path}: {self.unique_key} {', '.join(sorted(twice))} appears "
                         "more than once; one run at a time writes a file, so something else "
                         "wrote these rows. Deduplicate the file or move it away.")
    if torn_at is not None:
      _cut_torn_tail(self.path, torn_at)
    self.existing = rows
    self._file = self._stack.enter_context(open(self.path, "a", encoding="utf-8"))

  def _shared(self) -> list[dict]:
    return self.existing

  def _receive(self, shared: list[dict]) -> None:
    self.existing = shared  # every process resumes from process 0's rows

  def append(self, row: Mapping[str, Any]) -> dict:
    """Stamp, normalise and write one row as one line (process 0; flushed and fsynced before it
    returns); every process gets the stamped row back."""
    row = jsonable({**row, self.fingerprint_key: self.fingerprint})
    if self._file is not None:
      self._file.write(json.dumps(row, allow_nan=False) + "\n")
      self._file.flush()
      os.fsync(self._file.fileno())
    return row


def _cut_torn_tail(path: Path, length: int) -> None:
  """Cuts a torn tail off in place (the complete rows before it keep their bytes), appending it to
  `<path>.torn` first so that nothing is deleted unseen."""
  with open(path, "rb") as f:
    f.seek(length)
    tail = f.read()
  aside = path.with_name(path.name + ".torn")
  with open(aside, "ab") as f:
    f.write(tail + b"\n")
    f.flush()
    os.fsync(f.fileno())
  logging.warning("%s: cut a torn last line (%d bytes, the row in flight when a run died; its item "
                  "is redone) and saved it in %s", path, len(tail), aside)
  with open(path, "r+b") as f:
    f.truncate(length)
    f.flush()
    os.fsync(f.fileno())


@contextlib.contextmanager
def _exclusive(path: Path, what: str | None = None) -> Iterator[None]:
  """Holds an exclusive advisory lock on `<path>.lock`; two writers on one file would interleave."""
  lock_path = path.with_name(path.name + ".lock")
  with open(lock_path, "a", encoding="utf-8") as lock:
    try:
      fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise RuntimeError(f"another run is using {what or path} (lock {lock_path} is held); wait for "
                         f"it or give this run another output path") from None
    try:
      yield
    finally:
      fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
