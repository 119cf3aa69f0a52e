"""A sampled run killed after any row and resumed writes what an uninterrupted run writes (issue 33):
a prompt's random stream depends on (seed, prompt id) alone, not on its batch or what ran before.

For generation (the target alone and speculatively, temperature 1, batch 4), the chain sweep and the
tree sweep (temperature 1), on a tiny random T5 over a prompts file: one uninterrupted run, then for
every row boundary a copy of its directory with the rows file cut after that row (what a kill
between two rows leaves) is resumed, and its rows compared with the uninterrupted run's. Before,
generation folded one key per batch from the batch's first prompt index, so a resumed run, whose
batches start elsewhere, drew other tokens for half the prompts.

The sweeps' timers (step costs, an iteration's parts, the work before the first token) are stubbed
to constants here: they time, they draw nothing, and the rows' sampled columns come from the
baseline and speculative decodes, which run for real.
"""

import json
import shutil

import pytest

from conftest import tiny_t5_files
from experiments import speculative_sweep, tree_sweep
from specjax import generation, specs
from specjax.data import prompts

TEXTS = [english for english, _ in prompts.django_de_pairs()[5:10]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("t5")
  hf_dir, *_ = tiny_t5_files(root)
  file = root / "five.jsonl"
  file.write_text("".join(json.dumps({"id": f"q{i}", "text": "translate English to German: " + t})
                          + "\n" for i, t in enumerate(TEXTS)))
  return str(hf_dir), str(file)


def _rows(directory, name):
  return [json.loads(line) for line in (directory / name).read_text().splitlines()]


def _resumed_at_every_row(run, done, name, same):
  """Cut a copy of the finished run `done` after each row in turn, resume it with `run(copy)`, and
  compare every row with `same(row)` (the fields a row is made of, timing left out)."""
  whole = _rows(done, name)
  assert len(whole) >= 2
  for kept in range(1, len(whole)):
    copy = done.parent / f"{done.name}-cut{kept}"
    shutil.copytree(done, copy)
    lines = (copy / name).read_text().splitlines(keepends=True)
    (copy / name).write_text("".join(lines[:kept]))
    run(copy)
    resumed = _rows(copy, name)
    assert [same(r) for r in resumed] == [same(r) for r in whole], f"cut after row {kept}"
  return whole


@pytest.mark.slow  # 6 generations on a tiny T5 (compiles dominate): about a minute on 2 cores
@pytest.mark.parametrize("drafter", [None, "lookup"])
def test_generation_resumed_after_any_row_equals_the_uninterrupted_run(files, tmp_path, drafter):
  checkpoint, prompts_file = files

  def run(output_dir, temperature=1.0):
    return generation.Generate(
        output_dir=str(output_dir), target=specs.ModelSpec(checkpoint=checkpoint),
        prompts=specs.PromptSpec(name=prompts_file, split="all", limit=None, batch_size=4,
                                 bucket=8),
        decode=specs.DecodeSpec(max_new_tokens=6, temperature=temperature), seed=3,
        drafter=drafter, gamma=2)()

  assert run(tmp_path / "whole")["prompts"] == 5
  whole = _resumed_at_every_row(run, tmp_path / "whole", "generations.jsonl",
                                lambda r: (r["key"], r["new_tokens"]))
  if drafter is not None:
    return
  # The rows were sampled: the greedy run writes other tokens for some prompt.
  run(tmp_path / "greedy", temperature=0.0)
  greedy = {r["key"]: r["new_tokens"] for r in _rows(tmp_path / "greedy", "generations.jsonl")}
  assert any(r["new_tokens"] != greedy[r["key"]] for r in whole)


_MEASURED = ("point_id", "alpha", "acceptance_rate", "tokens_per_target_call",
             "per_position_acceptance", "acceptance_histogram", "alpha_by_depth", "beta_by_depth",
             "new_tokens", "prompts")


def _measured(row):
  return {key: row.get(key) for key in _MEASURED}


@pytest.fixture
def quick_timers(monkeypatch):
  """Constant timings in place of the sweeps' timers (see the module docstring)."""
  from specjax import timing
  monkeypatch.setattr(speculative_sweep.StepCosts, "_timed", lambda self, *args: 1.0)
  monkeypatch.setattr(timing, "iteration_timer", lambda *args, **kwargs: (
      lambda temperature, repeats, rounds=1: {"draft": 0.1, "verify": 1.0, "accept": 0.1}))
  monkeypatch.setattr(timing, "start_seconds", lambda *args, **kwargs: 1e-3)


@pytest.mark.slow
def test_chain_sweep_resumed_after_any_row_equals_the_uninterrupted_run(files, tmp_path,
                                                                         quick_timers):
  checkpoint, prompts_file = files
  sweep = lambda output_dir: speculative_sweep.Sweep(
      output_dir=str(output_dir), target=specs.ModelSpec(checkpoint=checkpoint),
      decode=specs.DecodeSpec(max_new_tokens=6), seed=1,
      grid=speculative_sweep.SweepSpec(tasks=(prompts_file,), drafters=("lookup",),
                                       gammas=(1, 2), temperatures=(1.0,), leniences=(1.0,),
                                       prompts_per_task=3))()
  sweep(tmp_path / "whole")
  whole = _resumed_at_every_row(sweep, tmp_path / "whole", "results.jsonl", _measured)
  assert len(whole) == 2 and all(r["new_tokens"] > 0 for r in whole)


@pytest.mark.slow
def test_tree_sweep_resumed_after_any_row_equals_the_uninterrupted_run(files, tmp_path,
                                                                        quick_timers):
  checkpoint, prompts_file = files
  sweep = lambda output_dir: tree_sweep.TreeSweep(
      output_dir=str(output_dir), target=specs.ModelSpec(checkpoint=checkpoint),
      decode=specs.DecodeSpec(max_new_tokens=6), seed=1,
      grid=tree_sweep.TreeSweepSpec(tasks=(prompts_file,), drafters=("lookup",),
                                    trees=("chain:2", "spine:2x2"),
                                    temperatures=(1.0,), prompts_per_task=3))()
  sweep(tmp_path / "whole")
  whole = _resumed_at_every_row(sweep, tmp_path / "whole", "results.jsonl", _measured)
  assert len(whole) == 2
