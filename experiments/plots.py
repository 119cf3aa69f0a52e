"""The papers' figures, drawn from a results JSONL alone (matplotlib, Agg backend, PNG).

  speedup_vs_gamma.png      measured walltime speedup per gamma, with Leviathan Thm 3.8's curve for
                            each setting's measured alpha and c (Leviathan Figure 3 / Table 2 shape)
  acceptance_by_position.png  per-position acceptance at each setting's largest gamma, with alpha^i,
                            its i.i.d. prediction (vLLM's per-position metric)
  chen_k_sweep.png          ms per 128 tokens and accepted/(K+1) against K (Chen et al. 2023)
  alpha_vs_lenience.png     alpha against lenience l (Leviathan Table 5 / appendix A.5)

  python -m experiments.plots out/sweep/results.jsonl out/sweep/plots

A plot with no data in the rows is skipped, so `plot_all` returns only the files it wrote.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI machines or TPU hosts
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

from experiments import sweep, tables  # pylint: disable=wrong-import-position

_DPI = 120


def _label(key: tuple) -> str:
  task, target, drafter, _, sampling = key
  return f"{task} · {target} · {drafter} · {sampling}"


def _legend(ax) -> None:
  """Beside the axes, not over the data: settings labels are long and there can be many."""
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _save(fig, path: Path) -> Path:
  fig.savefig(path, dpi=_DPI, bbox_inches="tight")  # "tight" keeps the outside legend in the PNG
  plt.close(fig)
  return path


def _settings(rows: list[dict]) -> dict[tuple, dict[int, list[dict]]]:
  """Lossless rows by (task, target, draft, temperature, sampling), then by gamma."""
  out: dict[tuple, dict[int, list[dict]]] = {}
  for key, grp in tables.by_setting(rows).items():
    out[key] = {g: rs for (g,), rs in tables.group(grp, lambda r: (tables.gamma_of(r),)).items()}
  return out


def speedup_vs_gamma(rows: list[dict], path: Path, max_gamma: int | None = None) -> Path | None:
  """Measured speedup against gamma, one colour per setting; dashed: Thm 3.8 at its mean alpha, c."""
  settings = _settings(rows)
  if not settings:
    return None
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for i, (key, by_gamma) in enumerate(settings.items()):
    colour = f"C{i % 10}"
    gammas = sorted(by_gamma)
    speedups = [tables.mean(tables.num(r, "speedup") for r in by_gamma[g]) for g in gammas]
    flat = [r for rs in by_gamma.values() for r in rs]
    alpha = tables.mean(tables.num(r, "alpha") for r in flat)
    c = tables.mean(tables.num(r, "c") for r in flat)
    theory = alpha is not None and c is not None
    ax.plot(gammas, speedups, "o-", color=colour,
            label=_label(key) + (f" (alpha {alpha:.2f}, c {c:.3f})" if theory else ""))
    if theory:
      grid = list(range(1, max(max_gamma or 0, max(gammas), 8) + 1))
      ax.plot(grid, [tables.predicted_speedup(alpha, g, c) for g in grid], "--", color=colour, alpha=0.7)
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.set(xlabel="gamma (draft tokens per iteration)", ylabel="walltime speedup vs autoregressive",
         title="Speedup vs gamma: measured (solid) and Leviathan Thm 3.8 (dashed)")
  _legend(ax)
  return _save(fig, path)


def acceptance_by_position(rows: list[dict], path: Path) -> Path | None:
  """per_position_acceptance at each setting's largest gamma, beside alpha^i (i.i.d. prediction)."""
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  drawn = 0
  for i, (key, by_gamma) in enumerate(_settings(rows).items()):
    gamma = max(by_gamma)
    curves = [r["per_position_acceptance"] for r in by_gamma[gamma]
              if isinstance(r.get("per_position_acceptance"), list) and r["per_position_acceptance"]]
    if not curves:
      continue
    positions = list(range(1, len(curves[0]) + 1))
    values = [tables.mean(None if c[j] is None else float(c[j]) for c in curves if j < len(c))
              for j in range(len(positions))]
    colour = f"C{drawn % 10}"
    ax.plot(positions, [float("nan") if v is None else v for v in values], "o-", color=colour,
            label=f"{_label(key)} (gamma {gamma})")
    alpha = tables.mean(tables.num(r, "alpha") for r in by_gamma[gamma])
    if alpha is not None:
      ax.plot(positions, [alpha ** p for p in positions], ":", color=colour, alpha=0.7)
    drawn += 1
  if not drawn:
    plt.close(fig)
    return None
  ax.set(xlabel="draft position i", ylabel="acceptance", ylim=(0, 1.05),
         title="Acceptance by draft position (dotted: alpha^i)")
  _legend(ax)
  return _save(fig, path)


def chen_k_sweep(rows: list[dict], path: Path) -> Path | None:
  """Chen et al.'s K sweep: ms per 128 tokens (left) and accepted/(K+1) (right) against K."""
  settings = _settings(rows)
  if not settings:
    return None
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
  for i, (key, by_k) in enumerate(settings.items()):
    ks = sorted(by_k)
    ms = [tables.mean(map(tables.ms_per_128, by_k[k])) for k in ks]
    tokens = [tables.mean(tables.num(r, "tokens_per_target_call") for r in by_k[k]) for k in ks]
    left.plot(ks, [float("nan") if v is None else v for v in ms], "o-", color=f"C{i % 10}",
              label=_label(key))
    right.plot(ks, [float("nan") if t is None else t / (k + 1) for t, k in zip(tokens, ks)], "o-",
               color=f"C{i % 10}", label=_label(key))
  left.set(xlabel="K (= gamma)", ylabel="ms per 128 tokens", title="Latency against K")
  right.set(xlabel="K (= gamma)", ylabel="accepted / (K + 1)", ylim=(0, 1.05),
            title="Tokens per target call / (K + 1)")
  _legend(right)
  return _save(fig, path)


def alpha_vs_lenience(rows: list[dict], path: Path) -> Path | None:
  """alpha against lenience for every (task, target, draft, sampling) swept over lenience."""
  grouped = tables.group(rows, tables.setting_key)
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  drawn = 0
  for key, grp in grouped.items():
    by_l = tables.group(grp, lambda r: (tables.lenience(r),))
    if len(by_l) < 2:
      continue
    ls = [l for (l,) in by_l]
    alphas = [tables.mean(tables.num(r, "alpha") for r in by_l[(l,)]) for l in ls]
    ax.plot(ls, [float("nan") if a is None else a for a in alphas], "o-", color=f"C{drawn % 10}",
            label=_label(key))
    drawn += 1
  if not drawn:
    plt.close(fig)
    return None
  ax.invert_xaxis()  # the paper reads from l = 1 (lossless) towards more lenient
  ax.set(xlabel="lenience l (1 = lossless)", ylabel="alpha", ylim=(0, 1.05),
         title="alpha vs lenience (Leviathan Table 5)")
  _legend(ax)
  return _save(fig, path)


def plot_all(rows: list[dict], out_dir: str | Path) -> list[Path]:
  """Writes every plot the rows have data for into out_dir; returns the PNG paths written."""
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  written = [speedup_vs_gamma(rows, out_dir / "speedup_vs_gamma.png"),
             acceptance_by_position(rows, out_dir / "acceptance_by_position.png"),
             chen_k_sweep(rows, out_dir / "chen_k_sweep.png"),
             alpha_vs_lenience(rows, out_dir / "alpha_vs_lenience.png")]
  return [p for p in written if p is not None]


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.plots", description=__doc__.split("\n")[0])
  parser.add_argument("results", help="results JSONL written by experiments.sweep.run_sweep")
  parser.add_argument("out_dir", help="directory for the PNGs")
  args = parser.parse_args(argv)
  print("\n".join(str(p) for p in plot_all(sweep.read_rows(args.results), args.out_dir)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
