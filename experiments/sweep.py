"""A resumable sweep runner: one JSONL row per finished point, safe to kill at any moment.

Contract: a sweep killed at any moment loses at most the point in flight and never duplicates a row.
The rows go through `specjax.outputs.RowsFile`, the writer every specjax run uses (one line per row,
flushed and fsynced; a torn tail cut and redone; rows of another config refused; one writer at a time).
On top of it, points are keyed by `point_id` (unique in the file), a hash of the point's parameters, and a point whose id is
already in the file is skipped; every row carries `sweep_fingerprint`, a hash of the sweep's config
(target, prompts, seeds, ...).

Multi-host: measure on every process if the engine needs it, but only `jax.process_index() == 0` should
call `run_sweep` with a real output path.

Usage:

  points = grid(task=["humaneval"], temperature=[0.0, 1.0], gamma=validate_gammas([1, 3, 5]))
  rows = run_sweep(points, measure, "out/sweep/results.jsonl", config={"target": "smollm2-135m"})
"""

from __future__ import annotations

import itertools
import operator
import os
import time
from typing import Any, Callable, Iterable, Mapping

import tqdm

from specjax import outputs

_RESERVED = frozenset({"point_id", "sweep_fingerprint"})  # keys the runner writes into every row
read_rows = outputs.read_rows


def point_id(point: Mapping[str, Any]) -> str:
  """Stable hash of a point's parameters: key order and int-vs-float spelling do not change it."""
  return outputs.digest(point)


def sweep_fingerprint(config: Mapping[str, Any] | None) -> str:
  """Stable hash of a sweep's config dict (everything a point's result depends on besides its own
  parameters: models, prompts, seeds, hardware). None means an empty config; fields at None are
  left out (outputs.without_none), so adding an optional field keeps existing results resumable."""
  return outputs.digest(outputs.without_none(dict(config or {})))


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
  with outputs.RowsFile(out_path, sweep_fingerprint(config), "sweep_fingerprint",
                        unique_key="point_id") as results:
    done: dict[str, dict] = {row.get("point_id"): row for row in results.existing}

    todo = [(pid, p) for pid, p in dict(zip(ids, points)).items() if pid not in done]
    bar = tqdm.tqdm(total=len(set(ids)), initial=len(set(ids)) - len(todo), desc=desc, unit="point",
                    disable=not progress, dynamic_ncols=True)
    try:
      for pid, point in todo:
        bar.set_postfix_str(", ".join(f"{k}={v}" for k, v in point.items()), refresh=False)
        start = time.perf_counter()
        measured = dict(measure(dict(point)))
        seconds = time.perf_counter() - start
        clash = {k for k in point
                 if k in measured and outputs.canonical(measured[k]) != outputs.canonical(point[k])}
        clash |= _RESERVED & (set(measured) | set(point))
        if clash:
          raise ValueError(f"measure changed the point's own parameters or the runner's keys "
                           f"{sorted(clash)} for point {point}; return measured quantities under "
                           f"other names")
        done[pid] = results.append({"point_id": pid, **point, **measured,
                                    "seconds": measured.get("seconds", seconds)})
        bar.update(1)
    finally:
      bar.close()
  return [done[pid] for pid in dict.fromkeys(ids)]
