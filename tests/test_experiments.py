"""experiments/: the resumable sweep runner, the paper-form tables and the plots, from JSONL alone.

Oracles: hand-written rows with hand-computed table values; a sweep interrupted (KeyboardInterrupt, or
a subprocess SIGKILLed halfway through writing a row) and rerun must equal an uninterrupted one.
"""

import fcntl
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# experiments/ is a top-level folder (run as `python -m experiments.tables` from the repository root);
# pyproject's pytest `pythonpath` makes the root importable.
from experiments import measure, plots, sweep, tables
from specjax import timing


def thm38(alpha, gamma, c):
  """Leviathan Thm 3.8, written out independently of tables.py and specjax.theory."""
  return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def row(task, drafter, temperature, gamma, alpha, speedup, *, c=0.05, lenience=1.0, top_p=1.0,
        tokens=None, baseline_ms=20.0, **extra):
  """One results row as an engine would write it; the ms fields follow from baseline_ms / speedup."""
  spec_ms = baseline_ms / speedup
  out = {
      "task": task, "target": "smollm2-135m", "drafter": drafter, "temperature": temperature,
      "top_k": 0, "top_p": top_p, "lenience": lenience, "gamma": gamma, "alpha": alpha,
      "acceptance_rate": alpha, "tokens_per_target_call": tokens if tokens is not None else 1 + alpha * gamma,
      "per_position_acceptance": [alpha ** i for i in range(1, gamma + 1)],
      "acceptance_histogram": [1] * (gamma + 1), "baseline_ms_per_token": baseline_ms,
      "speculative_ms_per_token": spec_ms, "speedup": speedup, "target_step_ms": 20.0,
      "draft_step_ms": 20.0 * c, "c": c, "outputs_match_baseline": True if temperature == 0 else None,
      "prompts": 4, "new_tokens": 64, "ms_per_128_tokens": 128 * spec_ms, "seconds": 1.0}
  out.update(extra)
  out["point_id"] = sweep.point_id({k: out[k] for k in ("task", "drafter", "temperature", "top_p",
                                                        "lenience", "gamma")})
  return out


ROWS = [
    # ende, model draft, greedy: best measured gamma is 5.
    *[row("ende", "model:draft-wide", 0.0, g, 0.7, s) for g, s in [(1, 1.5), (3, 2.2), (5, 2.4), (7, 2.1)]],
    # the engine's own prediction is used when present
    row("ende", "bigram", 0.0, 3, 0.20, 1.18, c=0.0, predicted_speedup=1.25),
    row("ende", "bigram", 1.0, 3, 0.18, 1.10, c=0.0),
    row("ende", "unigram", 0.0, 3, 0.06, 1.02, c=0.0),
    # a lenience sweep at temperature 1
    row("ende", "model:draft-wide", 1.0, 3, 0.60, 1.8, lenience=1.0),
    row("ende", "model:draft-wide", 1.0, 3, 0.70, 2.0, lenience=0.5),
    # Chen HumanEval form: T=0.8, top-p 0.95, K = 3 and 4
    row("humaneval", "model:draft-wide", 0.8, 3, 0.8, 2.0, top_p=0.95, tokens=3.2),
    row("humaneval", "model:draft-wide", 0.8, 4, 0.8, 2.5, top_p=0.95, tokens=3.5),
]


@pytest.fixture
def results(tmp_path):
  """The hand-written rows as a results JSONL, read back the way the CLI reads it."""
  path = tmp_path / "results.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  return sweep.read_rows(path)


def body_row(table, **match):
  """The one body row whose named columns equal `match`."""
  hits = [dict(zip(table.names, cells)) for cells in table.body]
  hits = [h for h in hits if all(h[k] == v for k, v in match.items())]
  assert len(hits) == 1, (match, table.body)
  return hits[0]


# ----- tables -----


def test_leviathan_table2_values_and_paper_column(results):
  t = tables.leviathan_table2(results)
  r = body_row(t, task="ende", draft="model:draft-wide", temp="greedy", gamma=7)
  assert r["alpha"] == 0.7 and r["speedup end to end"] == 2.1
  assert r["expected (Thm 3.8)"] == pytest.approx(thm38(0.7, 7, 0.05))
  assert r["v"] is None and r["decode / expected with v"] is None  # rows without them
  assert r["greedy output == baseline"] is True
  assert "EnDe T5-small: alpha 0.75, expected 3.2x, measured 3.4x" in r[tables.PAPER_LABEL]
  # the paper ran gamma 7 on EnDe greedy, never gamma 1
  assert body_row(t, draft="model:draft-wide", temp="greedy", gamma=1)[tables.PAPER_LABEL] is None
  assert body_row(t, draft="bigram", temp="greedy")["expected (Thm 3.8)"] == 1.25  # engine's own
  md = t.markdown()
  assert "Leviathan et al. 2022, Table 2" in md and tables.PAPER_LABEL in md
  assert r["target step ms (floor)"] == "20.0"  # rows from before the floor was recorded
  assert "| ende | smollm2-135m | model:draft-wide | greedy | 7 | 0.70 | 20.0 | 0.050 | — | " in md
  assert "| 2.10x |" in md


def test_leviathan_table2_decode_speedup_against_thm38_with_verify_cost():
  r = row("humaneval", "model:d", 0.0, 4, 0.7, 1.6, c=0.04, decode_speedup=1.9, verify_cost=1.4,
          predicted_speedup_with_verify_cost=2.0)
  got = body_row(tables.leviathan_table2([r]), gamma=4)
  assert got["v"] == 1.4 and got["expected with v"] == 2.0 and got["decode speedup"] == 1.9
  assert got["decode / expected with v"] == pytest.approx(0.95)
  assert got["expected from costs"] is None  # rows from before the iteration's parts were timed
  got = body_row(tables.leviathan_table2([{**r, "predicted_speedup_from_costs": 1.6}]), gamma=4)
  assert got["expected from costs"] == 1.6
  assert got["decode / expected from costs"] == pytest.approx(1.9 / 1.6)
  # The target's step beside its floor (weights' bytes over the run's read bandwidth)
  got = body_row(tables.leviathan_table2([{**r, "target_step_ms": 27.34}]), gamma=4)
  assert got["target step ms (floor)"] == "27.3"  # rows from before the floor was recorded
  got = body_row(tables.leviathan_table2([{**r, "target_step_ms": 27.34,
                                           "target_step_floor_ms": 18.46}]), gamma=4)
  assert got["target step ms (floor)"] == "27.3 (18.5)"


def test_best_gamma(results):
  t = tables.best_gamma_table(results)
  r = body_row(t, task="ende", draft="model:draft-wide", temp="greedy")
  assert r["best gamma"] == 5 and r["speedup end to end"] == 2.4 and r["gammas tried"] == "1 3 5 7"
  assert r["decode speedup"] is None and r["gamma picked with v"] is None  # rows without them
  # Thm 3.8 for alpha 0.7, c 0.05: gammas 5 and 6 tie at 2.353x, the smaller is reported
  assert thm38(0.7, 5, 0.05) == pytest.approx(thm38(0.7, 6, 0.05), rel=1e-4)
  assert r["Thm 3.8 gamma"] == 5 and r["Thm 3.8 speedup"] == pytest.approx(thm38(0.7, 5, 0.05))
  # at c = 0 the curve creeps up to gamma 16 (1.25x); gamma 3 (1.248x) is within 0.5% of it, as in
  # Leviathan's own bigram example (alpha 0.2, gamma 3, 1.25x)
  bigram = body_row(t, draft="bigram", temp="greedy")
  assert bigram["Thm 3.8 gamma"] == 3 and bigram[tables.PAPER_LABEL] is None
  assert "EnDe T5-small: gamma 7, 3.4x" in r[tables.PAPER_LABEL]
  assert "| 5 | — | 2.40x |" in t.markdown()


def test_best_gamma_by_decode_speedup_and_the_gamma_picked_with_verify_costs():
  """Best gamma follows the decode speedup when rows have it; the picked gamma maximises
  expected_tokens / (gamma c + v_gamma) over the measured v (written out here independently)."""
  # gamma 3 was not tried: its (cheap) v must not make it the pick
  costs = {"1": 1.3, "2": 1.35, "3": 1.0, "4": 1.4, "6": 1.7}
  rows = [row("humaneval", "model:d", 0.0, g, 0.7, e2e, c=0.04, decode_speedup=dec, verify_costs=costs)
          for g, e2e, dec in [(1, 1.2, 1.3), (2, 1.5, 1.6), (4, 1.6, 1.9), (6, 1.7, 1.8)]]
  r = body_row(tables.best_gamma_table(rows), task="humaneval")
  assert r["best gamma"] == 4 and r["decode speedup"] == 1.9 and r["speedup end to end"] == 1.6
  gains = {int(g): (1 - 0.7 ** (int(g) + 1)) / (0.3 * (int(g) * 0.04 + v)) for g, v in costs.items()
           if g != "3"}
  assert max(gains, key=gains.get) == 4 == r["gamma picked with v"]
  assert r["predicted with v"] == pytest.approx(gains[4]) and r["measured at picked gamma"] == 1.9


def test_leviathan_table3_alpha_per_draft(results):
  t = tables.leviathan_table3(results)
  bigram = body_row(t, draft="bigram")
  assert bigram["alpha T=0"] == 0.20 and bigram["alpha T=1"] == 0.18
  assert "T5-XXL EnDe bigram: 0.20 / 0.19" in bigram[tables.PAPER_LABEL + ": alpha T=0 / T=1"]
  unigram = body_row(t, draft="unigram")
  assert unigram["alpha T=0"] == 0.06 and unigram["alpha T=1"] is None
  model = body_row(t, task="ende", draft="model:draft-wide")
  assert model["alpha T=0"] == pytest.approx(0.7) and model["alpha T=1"] == 0.6  # lenience 0.5 left out
  assert "| ende | smollm2-135m | unigram | 0.06 | — |" in t.markdown()
  # top-p rows are not plain temperature-1 sampling: no humaneval row
  assert all(cells[0] != "humaneval" for cells in t.body)


def test_leviathan_table5_lenience(results):
  t = tables.leviathan_table5(results)
  assert [(c[5], c[6]) for c in t.body] == [(1.0, 0.6), (0.5, 0.7)]  # lenience 1 first, as the paper
  half = body_row(t, lenience=0.5)
  assert half["speedup"] == 2.0
  assert half[tables.PAPER_LABEL] == "EnDe T5-small: alpha 0.71; EnDe T5-base: alpha 0.80"


def test_chen_table1_and_k_sweep(results):
  t = tables.chen_table1(results)
  r = body_row(t, task="humaneval")
  assert r["method"] == "T=0.8, top-p 0.95" and r["K"] == 4 and r["speedup"] == 2.5
  assert r["autoregressive ms/token"] == 20.0 and r["speculative ms/token"] == 8.0
  assert r[tables.PAPER_LABEL] == "HumanEval p=0.95, temp 0.8: 14.1 -> 5.73 ms/token, 2.46x (K = 4)"
  greedy = body_row(t, task="ende", draft="model:draft-wide", method="greedy")
  assert greedy["K"] == 5 and greedy[tables.PAPER_LABEL] is None  # Chen has no translation task

  k = tables.chen_k_sweep(results)
  k3, k4 = body_row(k, task="humaneval", K=3), body_row(k, task="humaneval", K=4)
  assert k3["ms / 128 tokens"] == pytest.approx(128 * 10.0)
  assert k4["ms / 128 tokens"] == pytest.approx(128 * 8.0)
  assert k3["accepted/(K+1)"] == pytest.approx(3.2 / 4) and k4["accepted/(K+1)"] == pytest.approx(3.5 / 5)
  assert (k3["fastest"], k4["fastest"]) == ("", "*")
  assert "HumanEval: keeps improving to K = 6-7" in k3[tables.PAPER_LABEL]
  assert "| 1024.0 | 0.70 | 2.50x | * |" in k.markdown()


def test_write_all_and_cli(results, tmp_path):
  paths = tables.write_all(results, tmp_path / "a")
  names = sorted(p.name for p in paths)
  assert names == sorted(["tables.md"] + [f"{n}.csv" for n in tables.BUILDERS])
  md = (tmp_path / "a" / "tables.md").read_text()
  for mirrored in ("Table 2", "Table 3", "Table 4", "Table 5", "Chen et al. 2023, Table 1", "K sweep"):
    assert mirrored in md
  assert md.count(tables.PAPER_LABEL) >= 6
  csv_lines = (tmp_path / "a" / "best_gamma.csv").read_text().splitlines()
  assert csv_lines[0].startswith("task,target,draft,temp,best gamma,decode speedup,speedup end to end")
  assert any(line.startswith("ende,smollm2-135m,model:draft-wide,greedy,5,,2.4,") for line in csv_lines)

  src = tmp_path / "results.jsonl"
  src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  assert tables.main([str(src), str(tmp_path / "b")]) == 0
  assert (tmp_path / "b" / "tables.md").read_text() == md


def test_empty_rows_give_empty_tables():
  md = tables.markdown([])
  assert md.count("_No rows in these results._") == len(tables.BUILDERS)


# ----- plots -----


def test_plots_are_png(results, tmp_path):
  paths = plots.plot_all(results, tmp_path)
  assert sorted(p.name for p in paths) == ["acceptance_by_position.png", "alpha_vs_lenience.png",
                                           "chen_k_sweep.png", "speedup_vs_gamma.png"]
  for p in paths:
    data = p.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, p
  assert plots.plot_all([], tmp_path / "none") == []


GRID_TASKS, GRID_TEMPS, GRID_GAMMAS = ("gettext_ende", "code"), (0.0, 1.0), (1, 3, 5)
GRID_DRAFTERS = {"model:ckpt/draft-wide": (0.7, 0.05), "bigram": (0.2, 0.0), "lookup": (0.4, 0.01)}


def grid_rows():
  """2 tasks x 2 temperatures x 3 drafters x 3 gammas, as the engine writes them: decode speedup and
  Thm 3.8 with v on every row; speedups that differ per (task, temperature, drafter, gamma)."""
  out = []
  for t, task in enumerate(GRID_TASKS):
    for temp in GRID_TEMPS:
      for d, (drafter, (alpha, c)) in enumerate(GRID_DRAFTERS.items()):
        for g in GRID_GAMMAS:
          out.append(row(task, drafter, temp, g, alpha - 0.1 * temp, 1.0 + 0.1 * g, c=c,
                         decode_speedup=1.1 + 0.1 * g + 0.01 * d + 0.001 * t - 0.02 * temp,
                         verify_cost=1.3, predicted_speedup_with_verify_cost=0.9 + 0.05 * g))
  return out


def lines(ax, gid):
  return [line for line in ax.get_lines() if line.get_gid() == gid]


def test_speedup_small_multiples_structure():
  """One panel per (task, temperature), a colour per drafter kept across panels, the Thm 3.8 curves
  beside each measured line, and Leviathan's EnDe points on the gettext_ende panels only."""
  rows = grid_rows()
  fig = plots.speedup_figure(rows)
  axes = {ax.get_title(): ax for ax in fig.axes}
  assert sorted(axes) == ["code · T=1", "code · greedy", "gettext_ende (EnDe stand-in) · T=1",
                          "gettext_ende (EnDe stand-in) · greedy"]
  assert all(fig.axes[0].get_shared_y_axes().joined(fig.axes[0], ax) for ax in fig.axes)  # one y axis
  colours = {}
  for title, ax in axes.items():
    measured = lines(ax, "measured")
    assert sorted(l.get_label() for l in measured) == sorted(GRID_DRAFTERS)
    for line in measured:
      assert colours.setdefault(line.get_label(), line.get_color()) == line.get_color(), title
      assert list(line.get_xdata()) == list(GRID_GAMMAS)
    for gid, style in (("thm38", "--"), ("thm38_v", ":")):
      predicted = lines(ax, gid)
      assert {l.get_linestyle() for l in predicted} == {style}
      assert {l.get_label(): l.get_color() for l in predicted} == {
          l.get_label(): l.get_color() for l in measured}
    assert [list(l.get_ydata()) for l in lines(ax, "1x")] == [[1.0, 1.0]]
  assert len(set(colours.values())) == len(GRID_DRAFTERS)
  # measured = the decode speedup (the rows have it); dashed = Thm 3.8 at the setting's alpha, c
  ende_greedy = axes["gettext_ende (EnDe stand-in) · greedy"]
  wide = next(l for l in lines(ende_greedy, "measured") if l.get_label() == "model:ckpt/draft-wide")
  assert list(wide.get_ydata()) == pytest.approx([1.1 + 0.1 * g for g in GRID_GAMMAS])
  curve = next(l for l in lines(ende_greedy, "thm38") if l.get_label() == "model:ckpt/draft-wide")
  assert dict(zip(curve.get_xdata(), curve.get_ydata()))[3] == pytest.approx(thm38(0.7, 3, 0.05))
  dotted = next(l for l in lines(ende_greedy, "thm38_v") if l.get_label() == "bigram")
  assert list(dotted.get_ydata()) == pytest.approx([0.9 + 0.05 * g for g in GRID_GAMMAS])
  assert "decode speedup" in fig.get_supylabel()
  # Leviathan Table 2's EnDe rows at each temperature, on the EnDe stand-in only
  paper = {t: sorted((l.get_label(), l.get_xdata()[0], l.get_ydata()[0]) for l in lines(ax, "paper"))
           for t, ax in axes.items()}
  assert paper["gettext_ende (EnDe stand-in) · greedy"] == [
      ("paper: T5-base", 7, 2.8), ("paper: T5-large", 7, 1.7), ("paper: T5-small", 7, 3.4)]
  assert paper["gettext_ende (EnDe stand-in) · T=1"] == [
      ("paper: T5-base", 5, 2.4), ("paper: T5-large", 3, 1.4), ("paper: T5-small", 7, 2.6)]
  assert paper["code · greedy"] == paper["code · T=1"] == []
  assert all(l.get_markerfacecolor() == "none" for ax in axes.values() for l in lines(ax, "paper"))
  # one legend for the figure, naming every drafter once and the paper's drafts
  assert len(fig.legends) == 1
  legend = [t.get_text() for t in fig.legends[0].get_texts()]
  assert sorted(set(GRID_DRAFTERS) & set(legend)) == sorted(GRID_DRAFTERS)
  assert {"paper: T5-small", "paper: T5-base", "paper: T5-large"} <= set(legend)


def test_acceptance_small_multiples_share_the_colours():
  rows = grid_rows()
  speed = {l.get_label(): l.get_color() for l in lines(plots.speedup_figure(rows).axes[0], "measured")}
  fig = plots.acceptance_figure(rows)
  assert len(fig.axes) == len(GRID_TASKS) * len(GRID_TEMPS)
  for ax in fig.axes:
    measured = lines(ax, "measured")
    assert {l.get_label(): l.get_color() for l in measured} == {
        f"{d} (gamma 5)": c for d, c in speed.items()}
    assert len(lines(ax, "alpha_i")) == len(GRID_DRAFTERS)


def test_speedup_panels_end_to_end_and_chen(results):
  """Rows without a decode figure plot the end-to-end speedup and say so; a missing (task, sampling)
  leaves no panel; Chen's HumanEval point appears at its own sampling (top-p 0.95) at K = 4."""
  fig = plots.speedup_figure(results)
  assert "end-to-end" in fig.get_supylabel()
  axes = {ax.get_title(): ax for ax in fig.axes}
  # one title too long for its panel puts the sampling on a second line in every panel
  assert sorted(axes) == ["ende (EnDe stand-in)\nT=1", "ende (EnDe stand-in)\ngreedy",
                          "humaneval (HumanEval stand-in)\nT=0.8, top-p 0.95"]
  chen = lines(axes["humaneval (HumanEval stand-in)\nT=0.8, top-p 0.95"], "paper")
  assert [(l.get_label(), l.get_xdata()[0], l.get_ydata()[0]) for l in chen] == [
      ("paper: Chen HumanEval p=0.95, temp 0.8", 4, 2.46)]
  assert plots.speedup_figure([]) is None and plots.acceptance_figure([]) is None


# ----- sweep runner -----

POINTS = sweep.grid(task=["ende"], temperature=[0.0, 1.0], gamma=[1, 3, 5])


def fake_measure(point):
  """Deterministic stand-in for the engine: a row of the documented schema from the point alone."""
  alpha = 0.7 - 0.1 * point["temperature"]
  speedup = thm38(alpha, point["gamma"], 0.05) * 0.9
  return {"target": "tiny", "drafter": "bigram", "alpha": alpha, "speedup": speedup, "c": 0.05,
          "baseline_ms_per_token": 10.0, "speculative_ms_per_token": 10.0 / speedup,
          "tokens_per_target_call": 1 + point["gamma"] * alpha, "per_position_acceptance": [float("nan")]}


def test_grid_order_and_point_id():
  assert [(p["temperature"], p["gamma"]) for p in POINTS] == [(0.0, 1), (0.0, 3), (0.0, 5),
                                                               (1.0, 1), (1.0, 3), (1.0, 5)]
  assert list(POINTS[0]) == ["task", "temperature", "gamma"]
  assert sweep.point_id({"a": 1, "b": 0.0}) == sweep.point_id({"b": 0, "a": 1.0})
  assert sweep.point_id({"a": 1, "b": 0.0}) != sweep.point_id({"a": 1, "b": 0.5})
  assert len({sweep.point_id(p) for p in POINTS}) == len(POINTS)


def test_run_and_rerun_skips(tmp_path):
  out = tmp_path / "r.jsonl"
  rows = sweep.run_sweep(POINTS, fake_measure, out, config={"seed": 0}, progress=False)
  assert [r["gamma"] for r in rows] == [1, 3, 5, 1, 3, 5]
  assert rows[0]["per_position_acceptance"] == [None]  # NaN written as standard JSON null
  assert all(r["sweep_fingerprint"] == sweep.sweep_fingerprint({"seed": 0}) for r in rows)
  assert all(isinstance(r["seconds"], float) for r in rows)
  calls = []
  again = sweep.run_sweep(POINTS + POINTS[:2], lambda p: calls.append(p) or fake_measure(p), out,
                          config={"seed": 0}, progress=False)
  assert calls == [] and again == rows
  assert len(out.read_text().splitlines()) == len(POINTS)


def test_keyboard_interrupt_then_resume_equals_clean_run(tmp_path):
  clean = sweep.run_sweep(POINTS, fake_measure, tmp_path / "clean.jsonl", progress=False)

  def flaky(point, calls=[]):  # pylint: disable=dangerous-default-value
    calls.append(point)
    if len(calls) == 4:
      raise KeyboardInterrupt
    return fake_measure(point)

  out = tmp_path / "r.jsonl"
  with pytest.raises(KeyboardInterrupt):
    sweep.run_sweep(POINTS, flaky, out, progress=False)
  assert len(sweep.read_rows(out)) == 3
  resumed = sweep.run_sweep(POINTS, fake_measure, out, progress=False)
  on_disk = sweep.read_rows(out)
  assert sorted(r["point_id"] for r in on_disk) == sorted(sweep.point_id(p) for p in POINTS)
  assert tables.markdown(on_disk) == tables.markdown(clean) == tables.markdown(resumed)


def test_sigkill_mid_write_then_resume(tmp_path):
  """A real kill: the child writes half a row of point 3 to the file, then SIGKILLs itself."""
  out = tmp_path / "r.jsonl"
  script = textwrap.dedent(f"""
      import os, signal, sys
      sys.path.insert(0, {str(REPO)!r})
      from experiments import sweep
      points = sweep.grid(task=["ende"], temperature=[0.0, 1.0], gamma=[1, 3, 5])
      def measure(point, n=[0]):
        n[0] += 1
        if n[0] == 4:
          with open({str(out)!r}, "a") as f:
            f.write('{{"point_id": "' + sweep.point_id(point) + '", "task": "en')
          os.kill(os.getpid(), signal.SIGKILL)
        return {{"alpha": 0.5}}
      sweep.run_sweep(points, measure, {str(out)!r}, progress=False)
  """)
  child = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60, check=False)
  assert child.returncode == -signal.SIGKILL, child.stderr.decode()
  assert not out.read_text().endswith("\n")  # the torn row is really there
  assert len(sweep.read_rows(out)) == 3

  redone = []
  sweep.run_sweep(POINTS, lambda p: redone.append(p) or {"alpha": 0.5}, out, progress=False)
  assert redone == POINTS[3:]
  lines = out.read_text().splitlines()
  assert len(lines) == len(POINTS) and len({json.loads(l)["point_id"] for l in lines}) == len(POINTS)


def test_torn_tail_that_parses_is_redone(tmp_path):
  out = tmp_path / "r.jsonl"
  sweep.run_sweep(POINTS[:2], fake_measure, out, progress=False)
  out.write_text(out.read_text()[:-1])  # the last row lost its newline: its write did not finish
  redone = []
  sweep.run_sweep(POINTS, lambda p: redone.append(p) or fake_measure(p), out, progress=False)
  assert redone == POINTS[1:]
  assert len(out.read_text().splitlines()) == len(POINTS)


def test_corrupt_middle_line_refused(tmp_path):
  out = tmp_path / "r.jsonl"
  sweep.run_sweep(POINTS[:2], fake_measure, out, progress=False)
  lines = out.read_text().splitlines()
  out.write_text(lines[0][:10] + "\n" + lines[1] + "\n")
  with pytest.raises(ValueError, match=r"r.jsonl: invalid JSON row at byte 0, line 1, in the middle"):
    sweep.run_sweep(POINTS, fake_measure, out, progress=False)


def test_gamma_below_one_refused(tmp_path):
  assert sweep.validate_gammas([1, 3]) == [1, 3]
  with pytest.raises(ValueError, match=r"gamma=0 in the grid \[1, 0, 3\] is < 1.*drop it"):
    sweep.validate_gammas([1, 0, 3])
  with pytest.raises(ValueError, match=r"gamma=2.5 .* not an integer"):
    sweep.validate_gammas([2.5])
  with pytest.raises(ValueError, match="empty"):
    sweep.validate_gammas([])
  out = tmp_path / "r.jsonl"
  calls = []
  with pytest.raises(ValueError, match="gamma=-1"):
    sweep.run_sweep(sweep.grid(gamma=[2, -1]), calls.append, out, progress=False)
  assert calls == [] and not out.exists()


def test_other_sweep_config_refused(tmp_path):
  out = tmp_path / "r.jsonl"
  sweep.run_sweep(POINTS[:2], fake_measure, out, config={"target": "a", "seed": 0}, progress=False)
  before = out.read_text()
  with pytest.raises(ValueError, match="different config.*Refusing to mix"):
    sweep.run_sweep(POINTS, fake_measure, out, config={"target": "b", "seed": 0}, progress=False)
  assert out.read_text() == before
  # key order of the config does not matter
  sweep.run_sweep(POINTS, fake_measure, out, config={"seed": 0, "target": "a"}, progress=False)
  assert len(sweep.read_rows(out)) == len(POINTS)


def test_second_writer_and_bad_measure_refused(tmp_path):
  out = tmp_path / "r.jsonl"
  with open(str(out) + ".lock", "a") as lock:
    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    with pytest.raises(RuntimeError, match="another run is using"):
      sweep.run_sweep(POINTS, fake_measure, out, progress=False)
  with pytest.raises(ValueError, match=r"changed the point's own parameters .*\['gamma'\]"):
    sweep.run_sweep(POINTS, lambda p: {"gamma": 99}, out, progress=False)
  with pytest.raises(ValueError, match=r"\['point_id'\]"):
    sweep.run_sweep(POINTS, lambda p: {"point_id": "x"}, out, progress=False)
  assert not out.exists() or out.read_text() == ""


def test_paired_decode_seconds_uses_one_method_for_both_sides():
  """Both sides of a ratio by the loop fit only where both fit (enough prompts, iteration counts that
  spread, fixed cost >= 0); else both by the prefill subtracted: never a fit over a subtraction."""
  def side(iterations, fixed, per_iteration, tokens_per_iteration, prefill=0.5):
    outs = [SimpleNamespace(target_calls=n) for n in iterations]
    seconds = [fixed + per_iteration * n for n in iterations]
    return seconds, outs, int(sum(iterations) * tokens_per_iteration) + len(outs), lambda: prefill

  spread = list(range(10, 30, 2))  # 10 prompts
  # Both fit: each side's per-token cost is its line's slope over its tokens per iteration.
  (base, base_how), (spec, spec_how) = measure.paired_decode_seconds(
      side(spread, 0.3, 0.04, 1), side(spread, 0.6, 0.1, 2.5))
  assert base_how["method"] == spec_how["method"] == "fit over prompts"
  assert base == pytest.approx(0.04) and spec == pytest.approx(0.1 / 2.5)
  assert spec_how["fixed_ms_per_prompt"] == pytest.approx(600)
  # One side with 4 prompts: both subtract their prefill, though the other could be fitted.
  few = side(spread[:4], 0.6, 0.1, 2.5)
  results = measure.paired_decode_seconds(side(spread, 0.3, 0.04, 1), few)
  assert [how["method"] for _, how in results] == ["prefill subtracted"] * 2
  decoded = few[2] - 4
  assert results[1][0] == pytest.approx((sum(few[0]) - 4 * 0.5) / decoded)
  # A fit whose fixed cost comes out negative is refused for both.
  results = measure.paired_decode_seconds(side(spread, 0.3, 0.04, 1),
                                                    side(spread, -0.2, 0.1, 2.5))
  assert [how["method"] for _, how in results] == ["prefill subtracted"] * 2
  # A fit whose per-iteration cost is lost in noise (timing.loop_seconds) is refused for both: here
  # its slope comes out positive and its fixed cost >= 0, but its standard error is over a quarter.
  # So is one whose standard error is a tenth of it (noise of 0.16 s against 0.1 s per iteration
  # over iteration counts 10-28), as SmolLM2's fits read; a twentieth of that noise is fitted.
  seconds, outs, tokens, prefill = side(spread, 0.6, 0.1, 2.5)
  noisy = (np.asarray(seconds) + np.random.RandomState(0).normal(0, 0.5, len(seconds)), outs, tokens,
           prefill)
  results = measure.paired_decode_seconds(side(spread, 0.3, 0.04, 1), noisy)
  assert [how["method"] for _, how in results] == ["prefill subtracted"] * 2
  noise = np.random.RandomState(1).normal(0, 1, len(seconds))
  fitted = np.polyfit(spread, noise, 1)
  noise -= np.polyval(fitted, spread)  # the noise alone moves neither the slope nor the intercept
  noise *= 0.16 / noise.std()
  tenth = (np.asarray(seconds) + noise, outs, tokens, prefill)
  # The old limit (a quarter) took this fit, at the true slope; a twentieth refuses it.
  assert timing.loop_seconds(tenth[0], spread)[0] == pytest.approx(0.1)
  assert timing.loop_seconds(tenth[0], spread, max_relative_error=0.05) is None
  results = measure.paired_decode_seconds(side(spread, 0.3, 0.04, 1), tenth)
  assert [how["method"] for _, how in results] == ["prefill subtracted"] * 2
  quiet = (np.asarray(seconds) + noise / 20, outs, tokens, prefill)
  results = measure.paired_decode_seconds(side(spread, 0.3, 0.04, 1), quiet)
  assert [how["method"] for _, how in results] == ["fit over prompts"] * 2
  assert results[1][0] == pytest.approx(0.1 / 2.5)
  # A start timed apart that outlasts one side's whole decode (a tiny model on a busy machine):
  # both sides count their whole decode, never a negative time.
  slow_start = side(spread[:4], 0.001, 0.001, 1, prefill=0.5)
  results = measure.paired_decode_seconds(side(spread[:4], 0.3, 0.04, 1), slow_start)
  assert [how["method"] for _, how in results] == [
      "whole decode (the start timed apart outlasted a decode)"] * 2
  assert results[1][0] == pytest.approx(sum(slow_start[0]) / slow_start[2]) and results[1][0] > 0


def test_side_by_side_lets_a_drifting_machine_slow_both_sides_alike():
  """Two runs doing the same work on a machine that slows down steadily (each run takes 1 ms more
  than the one before, on a fake clock): prompt by prompt in alternating order, their totals come
  out equal; whole passes in turn (the method before) would charge the second run every pass's
  later, slower half. The parts' timer runs three times a pass at evenly spaced prompts, and the
  outputs are the last pass's, by run."""
  now, calls = [0.0], []

  def clock():
    return now[0]

  def run(name):
    def run_one(prompt):
      calls.append((name, prompt))
      now[0] += 1.0 + 0.001 * len(calls)
      return f"{name}{prompt}"
    return run_one

  prompts = [(i,) for i in range(12)]
  seconds, outputs, between = measure.side_by_side(prompts, (run("a"), run("b")), 4,
                                                   lambda: len(calls), clock=clock)
  assert seconds.shape == (2, 4, 12)
  assert seconds[0].sum() == pytest.approx(seconds[1].sum(), rel=1e-9)
  assert calls[:4] == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
  assert calls[24:26] == [("b", 0), ("a", 0)]  # the next pass starts the other way round
  assert between == [8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96]  # after prompts 3, 7, 11
  assert outputs == [[f"a{i}" for i in range(12)], [f"b{i}" for i in range(12)]]
  # The same work in whole passes in turn: the second run reads slower, the drift's artefact.
  now[0], calls[:] = 0.0, []
  in_turn = [[], []]
  for _ in range(4):
    for j, name in enumerate("ab"):
      start = clock()
      for prompt in prompts:
        run(name)(*prompt)
      in_turn[j].append(clock() - start)
  assert sum(in_turn[1]) > sum(in_turn[0]) * 1.005


def test_every_prompt_of_a_sweep_gets_its_own_key():
  """Sampled points draw each prompt's randomness from its own key (one key for all moved every
  prompt's acceptances together), the same on every call (a rerun resumes on the same draws)."""
  import jax
  rng = jax.random.PRNGKey(0)
  keys = [tuple(np.asarray(k).tolist()) for task in ("humaneval", "news")
          for k in measure.prompt_keys(rng, task, [f"p{i}" for i in range(8)])]
  assert len(set(keys)) == 16
  again = [tuple(np.asarray(k).tolist()) for k in measure.prompt_keys(rng, "news", [f"p{i}" for i in range(8)])]
  assert again == keys[8:]


def test_sampled_runs_of_both_sweeps_draw_from_each_prompt_s_key(monkeypatch):
  """The baseline, chain and tree runs of a prompt draw from that prompt's key: three copies of one
  prompt with keys (k0, k1, k0) sample the first and third alike and the second differently, on every
  side. A run that ignored the key would give three equal outputs. A tiny random decoder over 128
  tokens sampled at T = 1 for 12 tokens: the outputs are fixed by the seeds (no false failures).
  Both sweeps measure through experiments.measure.Bench: the chain sweep's points run the drafter's
  sampled chain, the tree sweep's its top-k tree (sample=False)."""
  import jax
  from specjax import loading, models, specs
  from specjax.decoding.tree import Tree
  from specjax.models import decoder_only
  config = decoder_only.SIZES["tiny"]
  params = decoder_only.init_params(config, jax.random.PRNGKey(3))
  target = loading.LoadedModel("tiny", config, params, SimpleNamespace(eos_id=1, pad_id=0),
                               models.model_for(config))
  k0, k1 = measure.prompt_keys(jax.random.PRNGKey(0), "humaneval", ["HumanEval/0", "HumanEval/1"])
  tokens = np.array([[5, 9, 17, 33, 65, 9, 17, 0]], np.int32)
  lengths = np.array([7], np.int32)
  prompts = [measure.Prompt(tokens, lengths, None, key) for key in (k0, k1, k0)]
  decode = specs.DecodeSpec(max_new_tokens=12)

  def pattern(outs):
    out = [np.asarray(o.tokens).tolist() for o in outs]
    return out[0] == out[2], out[0] != out[1]

  monkeypatch.setattr(measure, "heldout_prompts", lambda *args: prompts)
  spine = Tree.from_name("spine:2x2")
  bench = measure.Bench(target, {"humaneval": None}, decode, 0, "chat", ("layers1",),
                        largest_tree=spine.size)
  assert len(bench.prompts["humaneval"]) == 3
  runs = lambda run_one: [run_one(*prompt) for prompt in bench.prompts["humaneval"]]
  assert pattern(runs(bench.baseline("humaneval", 1.0))) == (True, True)
  assert pattern(runs(bench.speculative("humaneval", ("layers1", Tree.chain(2), True), 1.0,
                                        1.0))) == (True, True)
  assert pattern(runs(bench.speculative("humaneval", ("layers1", spine, False), 1.0,
                                        1.0))) == (True, True)
