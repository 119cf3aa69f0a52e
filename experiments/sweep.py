"""A resumable sweep runner: one JSONL row per finished point, safe to kill at any moment.

Contract: a sweep killed at any moment loses at most the point in flight and never duplicates
a row. It holds because

  * each finished point is appended as ONE line in a single write, then flushed and fsynced before the
    next point starts, so the file on disk is always "complete rows + at most one torn tail";
  * on start the file is scanned: a torn last line (not valid JSON, or valid but missing its newline) is
    cut off (the file is truncated to the complete rows before it, then fsynced) and its point is
    measured again;
  * points are keyed by `point_id`, a hash of the point's parameters, and a point whose id is already in
    the file is skipped;
  * every row carries `sweep_fingerprint`, a hash of the sweep's config (target, prompts, seeds, ...);
    a file whose rows carry another fingerprint is refused, so results of two configs never mix;
  * an exclusive lock on `<out>.lock` refuses a second runner on the same file (the OS drops it when the
    holder dies, even by SIGKILL).

Multi-host: measure on every process if the engine needs it, but only `jax.process_index() == 0` should
call `run_sweep` with a real output path (this module stays free of jax).

Usage:

  points = grid(task=["humaneval"], temperature=[0.0, 1.0], gamma=validate_gammas([1, 3, 5]))
  rows = run_sweep(points, measure, "out/sweep/results.jsonl", config={"target": "smollm2-135m"})
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import math
import numbers
import operator
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import tqdm

# 16 hex digits = 64 bits: collisions among a few thousand points are out of reach, ids stay readable.
_ID_HEX = 16
_RESERVED = frozenset({"point_id", "sweep_fingerprint"})  # keys the runner writes into every row


def _canonical(value: Any) -> Any:
  """Normalises a JSON-able value so equal parameters hash equally (temperature 1 == 1.0)."""
  if isinstance(value, bool) or value is None or isinstance(value, str):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    value = float(value)
    return int(value) if value.is_integer() else value
  if isinstance(value, Mapping):
    return {str(k): _canonical(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_canonical(v) for v in value]
  raise TypeError(f"sweep parameters must be JSON values (str, number, bool, None, list, dict); "
                  f"got {type(value).__name__}: {value!r}")


def _jsonable(value: Any) -> Any:
  """Measured values -> standard JSON: numpy scalars / arrays to Python, NaN / inf to None (so jq,
  pandas and browsers read the rows too)."""
  if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
    value = value.tolist()  # numpy arrays and scalars, without importing numpy here
  if isinstance(value, bool) or value is None or isinstance(value, str):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    value = float(value)
    return value if math.isfinite(value) else None
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  raise TypeError(f"measured value {value!r} ({type(value).__name__}) is not JSON-able")


def _digest(obj: Mapping[str, Any]) -> str:
  text = json.dumps(_canonical(obj), sort_keys=True, separators=(",", ":"), allow_nan=False)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:_ID_HEX]


def point_id(point: Mapping[str, Any]) -> str:
  """Stable hash of a point's parameters: key order and int-vs-float spelling do not change it."""
  return _digest(point)


def sweep_fingerprint(config: Mapping[str, Any] | None) -> str:
  """Stable hash of a sweep's config dict (everything a point's result depends on besides its own
  parameters: models, prompts, seeds, hardware). None means an empty config."""
  return _digest(dict(config or {}))


def validate_gammas(gammas: Iterable[Any]) -> list[int]:
  """Returns the gamma grid as ints, or raises ValueError naming the bad value and the fix.

  gamma is the number of draft tokens per iteration, so it must be an integer >= 1; gamma = 0 would be
  plain autoregressive decoding, which every point already measures as its baseline.
  """
  gammas = list(gammas)
  if not gammas:
    raise ValueError("the gamma grid is empty: give at least one gamma >= 1, e.g. [1, 3, 5, 7]")
  out = []
  for gamma in gammas:
    try:
      if isinstance(gamma, bool):
        raise TypeError
      value = operator.index(gamma)
    except TypeError:
      raise ValueError(f"gamma={gamma!r} in the grid {gammas} is not an integer: gamma counts draft "
                       f"tokens per iteration; use integers >= 1, e.g. [1, 3, 5, 7]") from None
    if value < 1:
      raise ValueError(f"gamma={value} in the grid {gammas} is < 1: gamma counts draft tokens per "
                       f"iteration and must be >= 1; drop it from the grid (gamma=0 is the "
                       f"autoregressive baseline, which every point already measures)")
    out.append(value)
  return out


def grid(**axes: Iterable[Any]) -> list[dict]:
  """Cartesian product of the axes as a list of dicts.

  Order is stable: axes vary in the order given, the last one fastest, values in the order given
  (itertools.product), so reruns and progress bars visit points identically.
  Example: grid(temperature=[0, 1], gamma=[1, 3]) ->
    [{temperature: 0, gamma: 1}, {temperature: 0, gamma: 3}, {temperature: 1, gamma: 1}, ...]
  """
  names = list(axes)
  values = [list(v) for v in axes.values()]
  for name, vals in zip(names, values):
    if not vals:
      raise ValueError(f"sweep axis {name!r} has no values")
  return [dict(zip(names, combo)) for combo in itertools.product(*values)]


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
                         f"middle of the file ({error}); a killed sweep only tears the last line, so "
                         f"something else changed this file. Fix or move it.") from None
      torn_at = start  # the row in flight when the writer died
      break
    if end < 0:  # it parses, but its newline never landed: redo it rather than trust a half write
      torn_at = start
      break
    rows.append(row)
    start = end + 1
  return rows, torn_at


def _truncate(path: Path, length: int) -> None:
  """Cuts a torn tail off in place: the complete rows before it keep their bytes."""
  with open(path, "r+b") as f:
    f.truncate(length)
    f.flush()
    os.fsync(f.fileno())


@contextlib.contextmanager
def _exclusive(path: Path):
  """Holds an exclusive advisory lock on `<path>.lock`; two runners on one file would interleave."""
  lock_path = path.with_name(path.name + ".lock")
  with open(lock_path, "a", encoding="utf-8") as lock:
    try:
      fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise RuntimeError(f"another sweep is writing {path} (lock {lock_path} is held); wait for it "
                         f"or give this sweep another output path") from None
    try:
      yield
    finally:
      fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _check_fingerprints(path: Path, rows: list[dict], fingerprint: str) -> None:
  others = sorted({r.get("sweep_fingerprint") for r in rows} - {fingerprint}, key=str)
  if others:
    raise ValueError(f"{path} holds rows of a different sweep config (sweep_fingerprint "
                     f"{', '.join(map(str, others))}; this sweep's is {fingerprint}). Refusing to mix "
                     f"results: write to another output path, or move the old file away.")


def run_sweep(points: Iterable[Mapping[str, Any]],
              measure: Callable[[dict], Mapping[str, Any]],
              out_path: str | os.PathLike,
              desc: str = "sweep",
              config: Mapping[str, Any] | None = None,
              progress: bool = True) -> list[dict]:
  """Measures every point not yet in `out_path`, appending one JSONL row per point as it finishes.

  Args:
    points: parameter dicts (JSON values), e.g. from `grid`. Repeated points are measured once. A
      `gamma` key is checked with `validate_gammas` before anything runs.
    measure: point -> dict of measured quantities. It must not change the point's own parameters. It
      may raise (KeyboardInterrupt included): finished rows are already on disk, and a rerun resumes.
    out_path: the results JSONL; its parent directory is created.
    desc: progress bar label.
    config: the sweep's fixed settings; its hash goes into every row as `sweep_fingerprint` and a file
      with rows of another fingerprint is refused.
    progress: show a tqdm bar (with ETA over the points still to run).
  Returns:
    the rows of `points`, in the order of `points` (rows already in the file are reused as they are).
    Each row is {point_id, **point, **measured, seconds, sweep_fingerprint}; `seconds` is the point's
    wall time unless `measure` reports its own.
  """
  points = [dict(p) for p in points]
  gammas = [p["gamma"] for p in points if "gamma" in p]
  if gammas:
    validate_gammas(gammas)
  ids = [point_id(p) for p in points]
  fingerprint = sweep_fingerprint(config)
  path = Path(out_path)
  path.parent.mkdir(parents=True, exist_ok=True)

  with _exclusive(path):
    existing, torn_at = _scan(path)
    _check_fingerprints(path, existing, fingerprint)
    if torn_at is not None:
      _truncate(path, torn_at)
    done: dict[str, dict] = {}
    for row in existing:
      if row.get("point_id") in done:
        raise ValueError(f"{path}: point_id {row['point_id']} appears twice; the file was not written "
                         f"by a single run_sweep. Deduplicate or move it.")
      done[row.get("point_id")] = row

    todo = [(pid, p) for pid, p in dict(zip(ids, points)).items() if pid not in done]
    bar = tqdm.tqdm(total=len(set(ids)), initial=len(set(ids)) - len(todo), desc=desc, unit="point",
                    disable=not progress, dynamic_ncols=True)
    try:
      with open(path, "a", encoding="utf-8") as out:
        for pid, point in todo:
          bar.set_postfix_str(", ".join(f"{k}={v}" for k, v in point.items()), refresh=False)
          start = time.perf_counter()
          measured = dict(measure(dict(point)))
          seconds = time.perf_counter() - start
          clash = {k for k in point if k in measured and _canonical(measured[k]) != _canonical(point[k])}
          clash |= _RESERVED & (set(measured) | set(point))
          if clash:
            raise ValueError(f"measure changed the point's own parameters or the runner's keys "
                             f"{sorted(clash)} for point {point}; return measured quantities under "
                             f"other names")
          row = {"point_id": pid, **point, **measured}
          row.setdefault("seconds", seconds)
          row["sweep_fingerprint"] = fingerprint
          row = _jsonable(row)
          # One write per row, then flush + fsync: a kill leaves whole rows plus at most a torn tail.
          out.write(json.dumps(row, allow_nan=False) + "\n")
          out.flush()
          os.fsync(out.fileno())
          done[pid] = row
          bar.update(1)
    finally:
      bar.close()
  return [done[pid] for pid in dict.fromkeys(ids)]
