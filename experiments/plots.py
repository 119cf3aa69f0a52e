"""The papers' figures, drawn from a results JSONL alone (matplotlib, Agg backend, PNG).

  speedup_vs_gamma.png      small multiples, a panel per (task, sampling): rows = task, columns =
                            temperature (with its top-k / top-p), one y axis for all. In each panel,
                            per drafter (the same colour in every panel; a marker per target when
                            there are several): the measured speedup per gamma (the decode speedup
                            where the rows have it, else end to end; the y label says which),
                            Leviathan Thm 3.8's curve for the setting's measured alpha and c (dashed),
                            Thm 3.8 with the measured verification cost v (dotted), 1x, and the
                            papers' speedups for the task ours stands in for (grey, hollow: Leviathan
                            Table 2 at T = 0 / 1, Chen Table 1 at K = 4). One legend for the figure;
                            each panel lists its series' alpha and c (Leviathan Figure 3 / Table 2)
  acceptance_by_position.png  the same grid: per-position acceptance at each setting's largest gamma,
                            with alpha^i, its i.i.d. prediction, dotted (vLLM's per-position metric)
  chen_k_sweep.png          ms per 128 tokens and accepted/(K+1) against K (Chen et al. 2023)
  alpha_vs_lenience.png     alpha against lenience l (Leviathan Table 5 / appendix A.5)
  accepted_per_call.png     (the tree sweep's rows) the share of target calls that kept k drafted
                            tokens, k = 0 .. depth, a panel per temperature, bars per drafter x tree

  python -m experiments.plots out/sweep/results.jsonl out/sweep/plots

A plot with no data in the rows is skipped, so `plot_all` returns only the files it wrote.
`speedup_figure` and `acceptance_figure` build the two grids without saving them (the tests read
their artists: gid "measured", "thm38", "thm38_v", "alpha_i", "paper", "1x").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI machines or TPU hosts
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position
from matplotlib import patches  # pylint: disable=wrong-import-position
from matplotlib import ticker  # pylint: disable=wrong-import-position
from matplotlib.figure import Figure  # pylint: disable=wrong-import-position
from matplotlib.lines import Line2D  # pylint: disable=wrong-import-position

from experiments import paper_figures, sweep, tables  # pylint: disable=wrong-import-position

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


# Small multiples: speedup and acceptance per (task, sampling), one colour per drafter.

Panel = tuple  # (task, temperature, sampling label)
_TARGET_MARKERS = ("o", "s", "^", "D", "v", "P")
_PAPER_MARKERS = {"T5-small": "o", "T5-base": "s", "T5-large": "^"}
_PAPER_STYLE = {"color": "grey", "markerfacecolor": "none", "linestyle": "none", "markersize": 7,
                "markeredgewidth": 1.2, "zorder": 4}
_SPEEDUP_NAMES = {"decode_speedup": "decode speedup", "speedup": "end-to-end speedup"}


def _short(name) -> str:
  """Checkpoint and prompt-file paths cut to their last two parts: titles and legends have room for a
  name, not a temporary directory."""
  kind, sep, rest = str(name).partition(":")
  if not sep:
    kind, rest = "", kind
  if "/" in rest:
    rest = "/".join(Path(rest).parts[-2:])
  return f"{kind}{sep}{rest}"


def _nan(value: float | None) -> float:
  return float("nan") if value is None else value


def _panels(rows: list[dict]) -> dict[Panel, dict[tuple, dict[int, list[dict]]]]:
  """Lossless settings by panel (task, temperature, sampling label), each by (drafter, target), then
  by gamma: the panel holds what the papers compare, the series inside it are the drafters."""
  out: dict[Panel, dict[tuple, dict[int, list[dict]]]] = {}
  for (task, target, drafter, temp, label), by_gamma in _settings(rows).items():
    out.setdefault((task, temp, label), {})[(drafter, target)] = by_gamma
  return out


def _task_name(task) -> str:
  key = str(task).lower()
  stand_ins = sorted({paper_figures.LEVIATHAN_TASK.get(key), paper_figures.CHEN_TASK.get(key)} - {None})
  return _short(task) + (f" ({'/'.join(stand_ins)} stand-in)" if stand_ins else "")


def _grid(panels: Sequence[Panel], ylim: tuple | None = None) -> tuple:
  """(figure, {panel: axes}): rows = task, columns = sampling, one y axis for the whole figure so
  panels read against each other; a (task, sampling) the sweep did not run leaves its cell empty."""
  tasks = sorted({p[0] for p in panels}, key=str)
  samplings = sorted({p[1:] for p in panels})
  # A bare Figure, outside pyplot's registry: a caller that only inspects it has nothing to close.
  fig = Figure(figsize=(2.6 + 3.5 * len(samplings), 1.0 + 2.8 * len(tasks)), layout="constrained")
  grid = fig.subplots(len(tasks), len(samplings), squeeze=False, sharex=True, sharey=True)
  # "<task> · <sampling>", or the sampling on a line of its own in every panel where one title would
  # not fit over its panel (the same in every panel, so rows of panels stay aligned).
  sep = "\n" if max(len(_task_name(t)) + len(label) for t, _, label in panels) > 40 else " · "
  axes = {}
  for i, task in enumerate(tasks):
    first = True
    for j, sampling in enumerate(samplings):
      ax = grid[i][j]
      if (task, *sampling) not in panels:
        fig.delaxes(ax)
        continue
      axes[(task, *sampling)] = ax
      ax.set_title(f"{_task_name(task)}{sep}{sampling[1]}", fontsize=9)
      # Shared axes hide inner tick labels; an empty cell would take a row's or column's with it.
      ax.tick_params(labelbottom=True, labelleft=first, labelsize=8)
      ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
      ax.grid(alpha=0.25)
      first = False
      if ylim:
        ax.set_ylim(*ylim)
  return fig, axes


def _styles(panels: dict) -> tuple[dict[str, str], dict[str, str]]:
  """Colour per drafter and marker per target, fixed for the whole figure (sorted, so a figure's
  colours do not depend on which panel a drafter first shows up in)."""
  series = [s for settings in panels.values() for s in settings]
  drafters = sorted({d for d, _ in series}, key=str)
  targets = sorted({t for _, t in series}, key=str)
  return ({d: f"C{i % 10}" for i, d in enumerate(drafters)},
          {t: _TARGET_MARKERS[i % len(_TARGET_MARKERS)] for i, t in enumerate(targets)})


def _figure_legend(fig, axes: dict, colours: dict, markers: dict, keys: list[tuple[str, str]],
                   title: str) -> None:
  """One legend for the figure, headed by its title: drafters by colour, targets by marker (when there
  are several), the line styles, and the paper points drawn in any panel. The title sits here rather
  than above the grid, where a one-panel figure's legend would run into it."""
  handles = [Line2D([], [], color=c, marker=next(iter(markers.values())), label=_short(d))
             for d, c in colours.items()]
  if len(markers) > 1:
    handles += [Line2D([], [], color="black", marker=m, linestyle="none", label=f"target {t}")
                for t, m in markers.items()]
  handles += [Line2D([], [], color="black", linestyle=style, label=label) for style, label in keys]
  papers = {line.get_label(): line for ax in axes.values() for line in ax.lines
            if line.get_gid() == "paper"}
  handles += [Line2D([], [], marker=line.get_marker(), label=label, **_PAPER_STYLE)
              for label, line in papers.items()]  # in the papers' own order
  targets = ", ".join(_short(t) for t in markers)
  fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False, alignment="left",
             title=f"{title}\ntarget{'s' if len(markers) > 1 else ''} {targets}", title_fontsize=9)


def _paper_points(ax, task, temp: float, truncated: bool) -> None:
  """The papers' measured speedups for the task ours stands in for, at this sampling: other models
  and hardware (T5-XXL, Chinchilla 70B on TPUs), so grey and hollow, a shape to compare with."""
  leviathan = paper_figures.LEVIATHAN_TASK.get(str(task).lower())
  if leviathan and not truncated and temp in (0.0, 1.0):  # Table 2 is plain sampling at T = 0 and 1
    for ptask, draft, ptemp, gamma, _, _, measured in paper_figures.PAPER["leviathan_table2"]["rows"]:
      if ptask == leviathan and ptemp == temp:
        ax.plot([gamma], [measured], marker=_PAPER_MARKERS.get(draft, "o"), label=f"paper: {draft}",
                gid="paper", **_PAPER_STYLE)
  chen = paper_figures.CHEN_TASK.get(str(task).lower())
  if chen and (temp == 0 or truncated):  # Chen sampled with nucleus (top-p) only; K = 4 throughout
    for method, ptask, greedy, _, _, speedup in paper_figures.PAPER["chen_table1"]["rows"]:
      if ptask == chen and greedy == (temp == 0):
        ax.plot([4], [speedup], marker="D", label=f"paper: Chen {ptask} {method}", gid="paper",
                **_PAPER_STYLE)


def _panel_legend(ax, entries: list[tuple[str, str, str]]) -> None:
  """Each series' measured alpha (and c, or gamma) in its own panel, where the figure legend cannot
  say them: the dashed and dotted curves are functions of exactly these."""
  if entries:
    ax.legend(handles=[Line2D([], [], color=c, marker=m, label=text) for c, m, text in entries],
              loc="best", fontsize=6, frameon=False, handlelength=1.2)


def speedup_figure(rows: list[dict], max_gamma: int | None = None) -> Figure | None:
  """The speedup-vs-gamma grid as a matplotlib Figure (None without lossless rows)."""
  panels = _panels(rows)
  if not panels:
    return None
  colours, markers = _styles(panels)
  fig, axes = _grid(list(panels))
  gammas_run = [g for settings in panels.values() for by_gamma in settings.values() for g in by_gamma]
  curve = list(range(1, max([max_gamma or 0, 8] + gammas_run) + 1))
  measured_as, drawn = set(), set()
  for panel, settings in panels.items():
    ax = axes[panel]
    ax.axhline(1.0, color="black", lw=0.8, alpha=0.6, gid="1x", zorder=0)
    entries = []
    for (drafter, target), by_gamma in settings.items():
      colour, marker = colours[drafter], markers[target]
      gammas, flat = sorted(by_gamma), [r for rs in by_gamma.values() for r in rs]
      # Thm 3.8 leaves the prefill out, so the decode speedup is the figure to hold against it.
      decoded = any(tables.num(r, "decode_speedup") is not None for r in flat)
      key = "decode_speedup" if decoded else "speedup"
      measured_as.add(key)
      ax.plot(gammas, [_nan(tables.mean(tables.num(r, key) for r in by_gamma[g])) for g in gammas],
              marker=marker, color=colour, lw=1.6, label=str(drafter), gid="measured", zorder=3)
      alpha = tables.mean(tables.num(r, "alpha") for r in flat)
      c = tables.mean(tables.num(r, "c") for r in flat)
      if alpha is not None and c is not None:
        ax.plot(curve, [tables.predicted_speedup(alpha, g, c) for g in curve], "--", color=colour,
                lw=1.0, alpha=0.8, label=str(drafter), gid="thm38", zorder=2)
        entries.append((colour, marker, f"α {alpha:.2f}, c {c:.3f}"))
        drawn.add("thm38")
      # The engine's own figure (tables' "expected with v"): each point's alpha, c and measured v.
      with_v = {g: tables.mean(tables.num(r, "predicted_speedup_with_verify_cost") for r in by_gamma[g])
                for g in gammas}
      with_v = [(g, v) for g, v in with_v.items() if v is not None]
      if with_v:
        ax.plot([g for g, _ in with_v], [v for _, v in with_v], ":", marker=".", color=colour, lw=1.4,
                label=str(drafter), gid="thm38_v", zorder=2)
        drawn.add("thm38_v")
    first = next(iter(next(iter(settings.values())).values()))[0]
    _paper_points(ax, panel[0], panel[1], tables.truncated(first))
    _panel_legend(ax, entries)
  measured = " / ".join(_SPEEDUP_NAMES[k] for k in ("decode_speedup", "speedup") if k in measured_as)
  keys = [("-", f"measured ({measured})"), ("--", "Thm 3.8, measured α and c"),
          (":", "Thm 3.8 with measured v")]
  drawn.add("measured")
  _figure_legend(fig, axes, colours, markers,
                 [k for k, gid in zip(keys, ("measured", "thm38", "thm38_v")) if gid in drawn],
                 "Speedup vs gamma")
  ylabel = {("decode_speedup",): "decode speedup vs autoregressive (prefill left out)",
            ("speedup",): "end-to-end speedup vs autoregressive (prefill included)"}
  mixed = "decode speedup vs autoregressive (end to end where rows lack it)"
  fig.supylabel(ylabel.get(tuple(measured_as), mixed), fontsize=9)
  fig.supxlabel("gamma (draft tokens per iteration)", fontsize=9)
  return fig


def speedup_vs_gamma(rows: list[dict], path: Path, max_gamma: int | None = None) -> Path | None:
  fig = speedup_figure(rows, max_gamma)
  return None if fig is None else _save(fig, path)


def acceptance_figure(rows: list[dict]) -> Figure | None:
  """per_position_acceptance at each setting's largest gamma beside alpha^i (the i.i.d. prediction),
  in speedup_figure's grid and colours; None when no row has the curve."""
  panels = _panels(rows)
  colours, markers = _styles(panels)
  curves: dict[Panel, list] = {}
  for panel, settings in panels.items():
    for (drafter, target), by_gamma in settings.items():
      gamma = max(by_gamma)
      found = [r["per_position_acceptance"] for r in by_gamma[gamma]
               if isinstance(r.get("per_position_acceptance"), list) and r["per_position_acceptance"]]
      if found:
        alpha = tables.mean(tables.num(r, "alpha") for r in by_gamma[gamma])
        curves.setdefault(panel, []).append((drafter, target, gamma, found, alpha))
  if not curves:
    return None
  fig, axes = _grid(list(curves), ylim=(0, 1.05))
  for panel, series in curves.items():
    ax, entries = axes[panel], []
    for drafter, target, gamma, found, alpha in series:
      positions = list(range(1, len(found[0]) + 1))
      values = [tables.mean(None if c[j] is None else float(c[j]) for c in found if j < len(c))
                for j in range(len(positions))]
      ax.plot(positions, [_nan(v) for v in values], marker=markers[target], color=colours[drafter],
              label=f"{drafter} (gamma {gamma})", gid="measured")
      if alpha is not None:
        ax.plot(positions, [alpha ** p for p in positions], ":", color=colours[drafter], alpha=0.8,
                label=str(drafter), gid="alpha_i")
      entries.append((colours[drafter], markers[target],
                      f"γ {gamma}" + ("" if alpha is None else f", α {alpha:.2f}")))
    _panel_legend(ax, entries)
  _figure_legend(fig, axes, {d: c for d, c in colours.items()
                             if any(s[0] == d for series in curves.values() for s in series)},
                 markers, [("-", "measured, largest γ run"), (":", "α^i (i.i.d. prediction)")],
                 "Acceptance by draft position")
  fig.supylabel("acceptance", fontsize=9)
  fig.supxlabel("draft position i", fontsize=9)
  return fig


def acceptance_by_position(rows: list[dict], path: Path) -> Path | None:
  fig = acceptance_figure(rows)
  return None if fig is None else _save(fig, path)


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


def accepted_per_call(rows: list[dict], path: Path) -> Path | None:
  """The tree sweep's histograms of kept candidates per call (rows with `accepted_histogram`),
  summed over tasks: a panel per temperature, a bar group per k, a bar per (drafter, tree, rule)."""
  series: dict[float, dict[str, list[float]]] = {}
  for row in rows:
    if "accepted_histogram" not in row:
      continue
    label = f"{_short(row['drafter'])} {row['tree']}" + (" (own q)" if row.get("sampled") else "")
    counts = series.setdefault(float(row["temperature"]), {}).setdefault(label, [])
    for k, count in enumerate(row["accepted_histogram"]):
      counts.extend([0.0] * (k + 1 - len(counts)))
      counts[k] += count
  if not series:
    return None
  fig, axes = plt.subplots(1, len(series), figsize=(5.5 * len(series), 3.6), squeeze=False,
                           sharey=True)
  # One colour per series in every panel (a sampled chain exists at temperature > 0 only).
  labels = sorted({label for by_label in series.values() for label in by_label})
  colour = {label: f"C{i % 10}" for i, label in enumerate(labels)}
  for ax, (temperature, by_label) in zip(axes[0], sorted(series.items())):
    width = 0.8 / len(by_label)
    for i, (label, counts) in enumerate(sorted(by_label.items())):
      total = max(sum(counts), 1.0)
      ax.bar([k + i * width for k in range(len(counts))], [c / total for c in counts], width,
             color=colour[label])
    ax.set_title(f"temperature {temperature:g}", fontsize=9)
    ax.set_xlabel("drafted tokens kept per target call", fontsize=9)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  axes[0][0].set_ylabel("share of calls", fontsize=9)
  # The legend names every series, whichever panels hold it.
  axes[0][-1].legend(handles=[patches.Patch(color=colour[label], label=label) for label in labels],
                     fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
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
