"""The token-tree sweep: `python -m specjax.run` with `run.main.job = @tree_sweep.TreeSweep()`.

Every point (task x drafter x tree shape x temperature) times the autoregressive baseline and the
speculative loop verifying the drafter's tree side by side (experiments/measure.py) on the same
held-out prompts (batch 1 each, EOS on), and writes one JSONL row: tokens per target call, the pass
rate at every depth (alpha_d = passed / reached) and its expectation beta_d, the cost of one
iteration's parts in the baseline's decode time per token (the drafter's candidates, the target
verifying the T nodes: v(T), the acceptance walk with the cache compaction; timed three times in
each of the point's passes), decode ms per token of both and the speedup, theory.tree_speedup's
prediction from beta_d and those costs, and for greedy points whether the output equals the
baseline's token for token. Then trees.md / trees.csv: the table of drafter kind x tree x
temperature.

Drafters are any registered drafter names (specjax.drafters.registry): `heads:<dir>` (Medusa heads on
the target's hidden states), `mtp:<dir>` (the shared MTP head applied recursively on them),
`lookup+heads:<dir>`, `lookup+mtp:<dir>`, or a one-token drafter (`model:<dir>`, `lookup`,
`lookup+model:<dir>`, ...) as a tree of its top-k per depth. A one-token drafter on `chain:D` is the
chain draft of the speculative sweep with deterministic (top-1) drafts, verified by exact match.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import jax
import numpy as np
from absl import logging

from experiments import measure, plots, tables
from experiments import sweep as resumable
from specjax import launch, loading, metrics, outputs, specs, theory, validation
from specjax.data import prompts as prompt_sets
from specjax.decoding import sampling
from specjax.decoding.tree import Tree
from specjax.drafters import registry


@dataclasses.dataclass(frozen=True)
class TreeSweepSpec:
  """The grid: trees are static (one compile per drafter and tree); temperatures are traced."""
  tasks: tuple = ("humaneval",)
  drafters: tuple = ("lookup",)
  trees: tuple = ("chain:3", "spine:3x3")
  temperatures: tuple = (0.0, 1.0)
  prompts_per_task: int = 4
  repeats: int = 1

  def points(self) -> list[dict]:
    """Every point, validated before anything is loaded or written."""
    for name, value in (("prompts_per_task", self.prompts_per_task), ("repeats", self.repeats)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TreeSweepSpec.{name} = {value!r} must be an integer >= 1")
    if not self.tasks or not self.drafters or not self.trees:
      raise ValueError("TreeSweepSpec.tasks, drafters and trees need at least one entry each")
    for task in self.tasks:
      prompt_sets.check_prompt_set_name(task)
    shapes = [Tree.from_name(name).name for name in self.trees]
    for name in self.drafters:  # every pair of the grid: a drafter that cannot draft a tree, now
      for shape in shapes:
        registry.check_tree(name, Tree.from_name(shape))
    for temperature in self.temperatures:
      sampling.validate_sampling(float(temperature), 0, 1.0)
    return resumable.grid(task=list(self.tasks), drafter=list(self.drafters), tree=shapes,
                          temperature=[float(t) for t in self.temperatures])


def measure_point(bench: measure.Bench, repeats: int, point: dict) -> dict:
  task, name, temperature = point["task"], point["drafter"], point["temperature"]
  tree = Tree.from_name(point["tree"])
  # point["sampled"]: a chain drawn from the drafter's own distribution and verified by chain
  # rejection (drafters that have one: DFlash); by default candidates are point masses (the walk).
  sampled = bool(point.get("sampled", False))
  measured = measure.measure(bench, task, (name, tree, sampled), temperature, 1.0, repeats)
  outs, summary = measured["outputs"], measured["summary"]
  num_accepted = np.concatenate([np.asarray(o.stats.num_accepted) for o in outs])
  betas = np.concatenate([np.asarray(o.stats.acceptance_probs) for o in outs])
  _, alpha_by_depth = metrics.per_position_acceptance(num_accepted, tree.depth)
  reached = (num_accepted[..., None] >= np.arange(tree.depth)) & (num_accepted[..., None] >= 0)
  beta_by_depth = [float(betas[..., d][reached[..., d]].mean()) if reached[..., d].any() else 0.0
                   for d in range(tree.depth)]
  # Costs in autoregressive steps: ms over the baseline's decode ms per token at this temperature,
  # measured beside the tree run (the unit the speedup is relative to; a separately timed target
  # step drifted by 10 % from it over a run on this shared machine).
  base_decode = measured["baseline_decode_ms_per_token"]
  costs = {part: ms / base_decode for part, ms in measured["parts_ms"].items()}
  return {
      "target": measure.size_name(bench.target.config), "drafter_kind": registry.label(name),
      "tree_size": tree.size, "tree_depth": tree.depth, "tree_width": tree.width,
      "tokens_per_target_call": summary["tokens_per_target_call"],
      "alpha_by_depth": [float(a) for a in alpha_by_depth], "beta_by_depth": beta_by_depth,
      # Calls that kept k of the candidates, k = 0 .. depth (the bonus token not counted).
      "accepted_histogram": metrics.acceptance_histogram(num_accepted, tree.depth).tolist(),
      "cost_draft": costs["draft"], "cost_verify": costs["verify"], "cost_accept": costs["accept"],
      "baseline_decode_ms_per_token": base_decode,
      "tree_decode_ms_per_token": measured["speculative_decode_ms_per_token"],
      "decode_speedup": measured["decode_speedup"], "speedup": measured["speedup"],
      "predicted_tokens_per_call": float(theory.tree_expected_tokens(beta_by_depth)),
      "predicted_speedup": float(theory.tree_speedup(beta_by_depth, costs["draft"],
                                                     costs["verify"], costs["accept"])),
      "outputs_match_baseline": measured["outputs_match_baseline"],
      "prompts": measured["prompts"], "new_tokens": summary["tokens"],
      "decode_timing": {"baseline": measured["decode_timing"]["baseline"],
                        "tree": measured["decode_timing"]["speculative"]},
  }


def tree_table(rows: list[dict]) -> tables.Table:
  """Drafter kind x tree x temperature, averaged over tasks (tokens per call weighted by calls)."""
  out = []
  for (drafter, tree, temp, sampled), group in sorted(tables.group(
      rows, lambda r: (r["drafter"], r["tree"], r["temperature"], r.get("sampled", False))).items(),
      key=str):
    mean = lambda key: tables.mean(r[key] for r in group)
    with warnings.catch_warnings():  # a depth no point reached stays NaN, quietly
      warnings.simplefilter("ignore", RuntimeWarning)
      depths = np.nanmean(np.asarray([r["alpha_by_depth"] for r in group], np.float64), axis=0)
    measured, predicted = mean("decode_speedup"), mean("predicted_speedup")
    kind = registry.label(drafter) + (" (own q, rejection)" if sampled else "")
    out.append((kind, drafter, f"{tree} ({group[0]['tree_size']})", temp,
                 mean("tokens_per_target_call"), " ".join(f"{a:.2f}" for a in depths),
                 mean("cost_draft"), mean("cost_verify"), mean("cost_accept"), measured, predicted,
                 measured / predicted if measured and predicted else None,
                 tables._match_outputs(group)))  # pylint: disable=protected-access
  columns = [("kind", None), ("drafter", None), ("tree (T)", None), ("temp", "{:g}"),
             ("tokens / call", "{:.2f}"), ("alpha by depth", None), ("draft", "{:.3f}"),
             ("verify(T)", "{:.2f}"), ("accept", "{:.3f}"), ("speedup", "{:.2f}x"),
             ("predicted", "{:.2f}x"), ("measured / predicted", "{:.2f}"), ("= greedy target", None)]
  return tables.Table(
      "trees", "Token trees: drafter x tree x temperature",
      "no table of the two papers (they verify one chain); SpecInfer / Medusa report tokens per call "
      "and speedup in this form", columns, out,
      note="Held-out prompts, batch 1, EOS on. Costs are one iteration's parts in autoregressive "
           "steps (the baseline's decode ms per token at that temperature): the drafter's "
           "candidates, the target verifying the T nodes (v(T)), the transform at every node with "
           "the walk and the cache compaction. speedup = baseline decode ms/token over the tree loop's "
           "(each prompt's fixed cost left out: measure.paired_decode_seconds); predicted = "
           "theory.tree_speedup(beta by depth, costs).")


@dataclasses.dataclass(frozen=True)
class TreeSweep:
  """Measure every point of `grid` into output_dir/results.jsonl (resumable), then trees.md / .csv.
  Calling it runs the sweep and returns the rows."""
  output_dir: str = "out/smollm2_trees"
  target: specs.ModelSpec = specs.ModelSpec()
  prompts: specs.PromptSpec = specs.PromptSpec()
  decode: specs.DecodeSpec = specs.DecodeSpec()
  grid: TreeSweepSpec = TreeSweepSpec()
  seed: int = 0

  def __call__(self) -> list[dict]:
    grid = self.grid
    points = grid.points()
    validation.whole_number(self.seed, "TreeSweep.seed", 0)
    task_prompts = measure.task_prompt_sets(grid.tasks, grid.prompts_per_task, self.prompts.style)
    spec = {"target": dataclasses.asdict(self.target), "prompts": dataclasses.asdict(self.prompts),
            "decode": dataclasses.asdict(self.decode), "seed": self.seed,
            "sweep": dataclasses.asdict(grid), "measurement": measure.MEASUREMENT,
            "prompt_digests": {task: validation.prompt_digest(prompt_set)
                               for task, prompt_set in task_prompts.items()},
            "content_keys": loading.content_keys(self.target,
                                                 registry.checkpoints_of(grid.drafters))}
    loaded, _ = loading.load_target(self.target, (1, 1))
    for name in grid.drafters:  # refused before the run directory is made, not at the first point
      registry.check(name, loaded.config)
    registry.check_vocabulary(grid.drafters, loaded.tokenizer, self.target.checkpoint)
    measure.check_tasks(loaded, task_prompts, self.decode,
                        max(Tree.from_name(t).size for t in grid.trees),
                        f"DecodeSpec.max_new_tokens={self.decode.max_new_tokens}, "
                        f"TreeSweepSpec.trees={tuple(grid.trees)}")
    bench = []

    def measure_one(point):
      if not bench:
        start = time.perf_counter()
        bench.append(measure.Bench(loaded, task_prompts, self.decode, self.seed,
                                   self.prompts.style, grid.drafters,
                                   largest_tree=max(Tree.from_name(t).size for t in grid.trees)))
        logging.info("tree sweep of %d points; setup %.0fs", len(points),
                     time.perf_counter() - start)
      return measure_point(bench[0], grid.repeats, point)

    with outputs.RunDirectory(self.output_dir, spec, "results.jsonl", "sweep_fingerprint",
                              launch.operative_config()) as run_dir:
      rows = resumable.run_sweep(points, measure_one, run_dir.results, desc="tree sweep",
                                 config=spec)
      if jax.process_index() == 0:
        table = tree_table(rows)
        (run_dir.path / "trees.md").write_text(table.markdown() + "\n")
        table.write_csv(run_dir.path / "trees.csv")
        plots.accepted_per_call(rows, run_dir.path / "accepted_per_call.png")
    logging.info("tree sweep done: %d rows in %s", len(rows), self.output_dir)
    return rows
