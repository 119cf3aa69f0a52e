"""The token-tree sweep: `python -m specjax.run` with `run.main.job = @tree_sweep.TreeSweep()`.

Every point (task x tree drafter x tree shape x temperature) times the autoregressive baseline and the
tree loop (specjax/trees.py) side by side in this process on the same held-out prompts (batch 1 each,
EOS on), and writes one JSONL row: tokens per target call, the pass rate at every depth (alpha_d =
passed / reached) and its expectation beta_d, the cost of one iteration's parts in the baseline's
decode time per token (the drafter's candidates, the target verifying the T nodes: v(T), the
acceptance walk with the cache compaction; timed in turn with the point's passes), decode ms per token of both and the speedup, theory.tree_speedup's prediction from
beta_d and those costs, and for greedy points whether the output equals the baseline's token for
token. Then trees.md / trees.csv: the table of drafter kind x tree x temperature.

Drafters are tree drafters by name (tree_drafters.make_tree_drafter): `heads:<dir>` (Medusa heads
on the target's hidden states), `mtp:<dir>` (the shared MTP head applied recursively on them),
`lookup+heads:<dir>`, `lookup+mtp:<dir>`, or any chain drafter (`model:<dir>`, `lookup`,
`lookup+model:<dir>`, ...) as a tree of its top-k per depth. A chain drafter on `chain:D` is the chain
draft of the speculative sweep with deterministic (top-1) drafts.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from experiments import speculative_sweep, tables
from experiments import sweep as resumable
from specjax import (checkpoints, drafters, heads, launch, loading, metrics, outputs, specs, theory,
                     timing, tree_drafters, trees)
from specjax.data import prompts as prompt_sets
from specjax.decoding import sampling


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
    for name in self.drafters:
      tree_drafters.check_tree_drafter_name(name)
    shapes = [trees.Tree.from_name(name).name for name in self.trees]
    for temperature in self.temperatures:
      sampling.validate_sampling(float(temperature), 0, 1.0)
    return resumable.grid(task=list(self.tasks), drafter=list(self.drafters), tree=shapes,
                          temperature=[float(t) for t in self.temperatures])


class Bench:
  """What every point shares: target, drafters, prompts, the baseline programs (the speculative
  sweep's), the compiled tree programs and the measured costs."""

  def __init__(self, target, spec: TreeSweepSpec, decode: specs.DecodeSpec, seed: int, style: str):
    self.target, self.spec, self.decode = target, spec, decode
    names = spec.drafters
    sequences = (prompt_sets.train_sequences(target.tokenizer, target.encoder_decoder, style)
                 if any(map(tree_drafters.tree_drafter_needs_text, names)) else None)
    self.drafters = {name: tree_drafters.make_tree_drafter(name, target.config, target.params,
                                                           sequences)
                     for name in names}
    prompts = {task: speculative_sweep.heldout_prompts(target, task, spec.prompts_per_task, style,
                                                       jax.random.PRNGKey(seed))
               for task in spec.tasks}
    grid = speculative_sweep.SweepSpec(tasks=spec.tasks, drafters=("lookup",), gammas=(1,),
                                       prompts_per_task=spec.prompts_per_task,
                                       repeats=spec.repeats)
    self.setup = speculative_sweep.Setup(target, {}, prompts, grid, decode)
    self.programs = speculative_sweep.Programs(self.setup)
    self.max_size = max(trees.Tree.from_name(t).size for t in spec.trees)
    self._part_timers, self._compiled, self._prefill = {}, {}, {}
    probe = next(iter(prompts.values()))[0]
    self.probe, self.probe_source = probe[:2], probe[2]
    self.target_ms = 1000 * timing.step_seconds(
        timing.target_step(target.model), target.params,
        jax.jit(speculative_sweep.ModelDrafter(target.model).init, static_argnums=3)(
            target.params, *self.probe, self.cache_length(probe), self.probe_source),
        *timing.one_token(self.probe), 15)

  def cache_length(self, prompt) -> int:
    return prompt[0].shape[1] + self.decode.max_new_tokens + self.max_size

  def part_timer(self, name: str, tree: trees.Tree):
    """timing.tree_cost_timer for (drafter, tree), built once: measure_point times the iteration's
    parts with it beside every pass it times."""
    key = (name, tree.name)
    if key not in self._part_timers:
      drafter, params = self.drafters[name]
      self._part_timers[key] = timing.tree_cost_timer(
          self.target.model, self.target.params, drafter, params, tree, self.probe,
          self.cache_length(self.probe), source=self.probe_source)
    return self._part_timers[key]

  def tree_run(self, task: str, name: str, tree: trees.Tree, temperature: float):
    drafter, draft_params = self.drafters[name]
    tok, decode = self.target.tokenizer, self.decode
    program = ("tree", task, name, tree.name)
    fn = self.programs.get(program, lambda: trees.make_tree_decode(
        self.target.model, drafter, trees.TreeConfig(tree, decode.max_new_tokens, decode.top_k,
                                                     tok.eos_id, tok.pad_id)))
    run_one = lambda tokens, lengths, source, key: jax.block_until_ready(fn(
        self.target.params, draft_params, tokens, lengths, key, temperature, decode.top_p, source))
    return self.programs.timed(program, task, run_one)

  def tree_prefill_seconds(self, task: str, name: str) -> float:
    """The target's prefill with hidden states plus the drafter's init, on the task's shape."""
    key = (task, name)
    if key not in self._prefill:
      drafter, draft_params = self.drafters[name]
      tokens, lengths, source, _ = prompt = self.setup.prompts[task][0]
      length = self.cache_length(prompt)
      model = self.target.model

      def prefill(params, dparams, tokens, lengths, source):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return (model.feature_step(params, model.encode(params, source), tokens, positions,
                                   model.init_cache(tokens.shape[0], length)),
                drafter.init(dparams, tokens, lengths, length, source))

      inputs = (self.target.params, draft_params, tokens, lengths, source)
      compiled = jax.jit(prefill).lower(*inputs).compile()
      self._prefill[key] = timing.median_seconds(
          lambda: jax.block_until_ready(compiled(*inputs)), 5)[0]
    return self._prefill[key]


def measure_point(bench: Bench, point: dict) -> dict:
  task, name, temperature = point["task"], point["drafter"], point["temperature"]
  tree = trees.Tree.from_name(point["tree"])
  # Baseline, tree decoding and the iteration's parts in turn (see speculative_sweep.measure_point).
  time_parts = bench.part_timer(name, tree)
  base_runs, tree_runs, part_runs = speculative_sweep.in_turn(
      bench.spec.repeats, lambda: bench.programs.baseline(task, temperature),
      lambda: bench.tree_run(task, name, tree, temperature),
      lambda: time_parts(temperature, 9, rounds=-(-3 // bench.spec.repeats)),
      names=("baseline", "tree", "parts"))
  (base_each, base_tokens, base_out), (tree_each, tree_tokens, tree_out) = map(
      speculative_sweep.median_pass, (base_runs, tree_runs))
  part_ms = {part: float(np.median([p[part] for p in part_runs])) for part in part_runs[0]}
  prompts = len(bench.setup.prompts[task])
  base_s, tree_s = float(np.sum(base_each)), float(np.sum(tree_each))
  (base_decode, base_timing), (tree_decode, tree_timing) = speculative_sweep.paired_decode_seconds(
      (base_each, base_out, base_tokens, lambda: bench.programs.prefill_seconds(task, None)),
      (tree_each, tree_out, tree_tokens, lambda: bench.tree_prefill_seconds(task, name)))
  summary = metrics.summarize_outputs(tree_out)
  num_accepted = np.concatenate([np.asarray(o.stats.num_accepted) for o in tree_out])
  betas = np.concatenate([np.asarray(o.stats.acceptance_probs) for o in tree_out])
  _, alpha_by_depth = metrics.per_position_acceptance(num_accepted, tree.depth)
  reached = (num_accepted[..., None] >= np.arange(tree.depth)) & (num_accepted[..., None] >= 0)
  beta_by_depth = [float(betas[..., d][reached[..., d]].mean()) if reached[..., d].any() else 0.0
                   for d in range(tree.depth)]
  # Costs in autoregressive steps: ms over the baseline's decode ms per token at this temperature,
  # measured beside the tree run (the unit the speedup is relative to; a separately timed target
  # step drifted by 10 % from it over a run on this shared machine).
  costs = {part: ms / (1000 * base_decode) for part, ms in part_ms.items()}
  match = None
  if temperature == 0.0:
    match = all(np.array_equal(np.asarray(b.tokens), np.asarray(t.tokens))
                for b, t in zip(base_out, tree_out))
  return {
      "target": speculative_sweep.size_name(bench.target.config), "drafter_kind": kind(name),
      "tree_size": tree.size, "tree_depth": tree.depth, "tree_width": tree.width,
      "tokens_per_target_call": summary["tokens_per_target_call"],
      "alpha_by_depth": [float(a) for a in alpha_by_depth], "beta_by_depth": beta_by_depth,
      "cost_draft": costs["draft"], "cost_verify": costs["verify"], "cost_accept": costs["accept"],
      "target_step_ms": bench.target_ms,
      "baseline_decode_ms_per_token": 1000 * base_decode,
      "tree_decode_ms_per_token": 1000 * tree_decode, "decode_speedup": base_decode / tree_decode,
      "speedup": (base_s / max(base_tokens, 1)) / (tree_s / max(tree_tokens, 1)),
      "predicted_tokens_per_call": float(theory.tree_expected_tokens(beta_by_depth)),
      "predicted_speedup": float(theory.tree_speedup(beta_by_depth, costs["draft"],
                                                     costs["verify"], costs["accept"])),
      "outputs_match_baseline": match, "prompts": prompts, "new_tokens": summary["tokens"],
      "decode_timing": {"baseline": base_timing, "tree": tree_timing},
  }


def kind(name: str) -> str:
  inner = name.removeprefix("lookup+")
  base = ("Medusa heads" if inner.startswith(tree_drafters.HEADS_PREFIX) else
          "MTP head" if inner.startswith(tree_drafters.MTP_PREFIX) else
          "chain draft (top-k)" if inner.startswith("model:") else inner)
  return f"lookup + {base}" if name.startswith("lookup+") else base


def tree_table(rows: list[dict]) -> tables.Table:
  """Drafter kind x tree x temperature, averaged over tasks (tokens per call weighted by calls)."""
  out = []
  for (drafter, tree, temp), group in sorted(tables.group(
      rows, lambda r: (r["drafter"], r["tree"], r["temperature"])).items(), key=str):
    mean = lambda key: tables.mean(r[key] for r in group)
    with warnings.catch_warnings():  # a depth no point reached stays NaN, quietly
      warnings.simplefilter("ignore", RuntimeWarning)
      depths = np.nanmean(np.asarray([r["alpha_by_depth"] for r in group], np.float64), axis=0)
    measured, predicted = mean("decode_speedup"), mean("predicted_speedup")
    out.append((kind(drafter), drafter, f"{tree} ({group[0]['tree_size']})", temp,
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
           "(each prompt's fixed cost left out: speculative_sweep.paired_decode_seconds); predicted = "
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
    spec = {"target": dataclasses.asdict(self.target), "prompts": dataclasses.asdict(self.prompts),
            "decode": dataclasses.asdict(self.decode), "seed": self.seed,
            "sweep": dataclasses.asdict(grid), "measurement": speculative_sweep.MEASUREMENT,
            "content_keys": {**loading.content_keys(self.target, drafters.checkpoints_of(tuple(
                d for d in grid.drafters if tree_drafters.feature_directory(d) is None))), **{
                    d: checkpoints.content_key(tree_drafters.feature_directory(d))
                    for d in grid.drafters if tree_drafters.feature_directory(d) is not None}}}
    loaded, _ = loading.load_target(self.target, (1, 1))
    if loaded.encoder_decoder:  # refused before the run directory is made, not at the first point
      for name in filter(tree_drafters.feature_directory, grid.drafters):
        heads.check_target({}, loaded.config, loaded.params, where=f"the drafter {name!r}")
    bench = []

    def measure(point):
      if not bench:
        start = time.perf_counter()
        bench.append(Bench(loaded, grid, self.decode, self.seed, self.prompts.style))
        logging.info("tree sweep of %d points; setup %.0fs", len(points),
                     time.perf_counter() - start)
      return measure_point(bench[0], point)

    with outputs.RunDirectory(self.output_dir, spec, "results.jsonl", "sweep_fingerprint",
                              launch.operative_config()) as run_dir:
      rows = resumable.run_sweep(points, measure, run_dir.results, desc="tree sweep", config=spec)
      if jax.process_index() == 0:
        table = tree_table(rows)
        (run_dir.path / "trees.md").write_text(table.markdown() + "\n")
        table.write_csv(run_dir.path / "trees.csv")
    logging.info("tree sweep done: %d rows in %s", len(rows), self.output_dir)
    return rows
