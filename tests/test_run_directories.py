"""Output directories under abuse: weights changed behind a path, kills mid-write, two runs at once,
typos, a deleted spec.json, corrupt and truncated files. Each case asserts what the run did (refused
with a message naming the file or model and the fix, or ran) and what it left on disk.

Generations run `python -m specjax.run`'s job in-process on a tiny random T5 (HF directory with a
SentencePiece model trained here) over a 5-prompt JSONL file: a few seconds each.
"""

import fcntl
import json
import shutil

import gin
import pytest

from conftest import random_decoder_params, random_t5_params, generation_gin, tiny_t5_files
from experiments import speculative_sweep
from specjax import checkpoints, loading, outputs, run, specs
from specjax.checkpoints import hf, hf_t5
from specjax.drafters import registry
from specjax.models import decoder_only, t5

CONFIG = t5.SIZES["tiny"]


@pytest.fixture(scope="module")
def t5_files(tmp_path_factory):
  return tiny_t5_files(tmp_path_factory.mktemp("t5"))


@pytest.fixture
def model_dir(t5_files, tmp_path):
  """A private copy of the tiny T5's HF directory (tests change its weights)."""
  return shutil.copytree(t5_files[0], tmp_path / "model")


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _generate(tmp_path, output_dir, checkpoint, prompts, max_new_tokens=6, name="gen.gin"):
  gin.clear_config()
  run.parse_gin([str(generation_gin(tmp_path / name, output_dir, checkpoint, None, prompts,
                                    max_new_tokens))], [])
  return gin.get_configurable(run.main)()


def _keys(output_dir):
  return [json.loads(line)["key"]
          for line in (output_dir / "generations.jsonl").read_text().splitlines()]


def test_weights_changed_behind_the_path_are_refused_naming_the_model(t5_files, model_dir, tmp_path):
  prompts = t5_files[3]
  out = tmp_path / "out"
  assert _generate(tmp_path, out, model_dir, prompts)["prompts"] == 5
  hf_t5.save(model_dir, CONFIG, random_t5_params(CONFIG, seed=99))  # retrained in place
  before = (out / "generations.jsonl").read_bytes()
  with pytest.raises(ValueError, match=r"(?s)5 rows of another config.*the weights of 'target' "
                                       r"changed \(content key [0-9a-f]+ -> [0-9a-f]+\)"):
    _generate(tmp_path, out, model_dir, prompts)
  assert (out / "generations.jsonl").read_bytes() == before


def test_a_changed_draft_is_refused_by_name(t5_files, model_dir, tmp_path):
  """The sweep's spec carries a content key per model drafter; RunDirectory names the one that
  changed (the sweep itself is exercised end to end in test_run*.py)."""
  target = specs.ModelSpec(checkpoint=str(t5_files[0]))
  drafter_names = ("lookup", f"lookup+model:{model_dir}")
  spec = {"sweep": "grid", "content_keys": loading.content_keys(
      target, registry.checkpoints_of(drafter_names))}
  assert set(spec["content_keys"]) == {"target", f"lookup+model:{model_dir}"}
  out = tmp_path / "sweep"
  with outputs.RunDirectory(out, spec, "results.jsonl", "sweep_fingerprint") as run_dir, \
       outputs.RowsFile(run_dir.results, run_dir.fingerprint, "sweep_fingerprint") as rows:
    rows.append({"point_id": "a", "alpha": 0.5})
  hf_t5.save(model_dir, CONFIG, random_t5_params(CONFIG, seed=5))
  spec = {"sweep": "grid", "content_keys": loading.content_keys(
      target, registry.checkpoints_of(drafter_names))}
  with pytest.raises(ValueError, match=f"the weights of 'lookup\\+model:{model_dir}' changed"):
    with outputs.RunDirectory(out, spec, "results.jsonl", "sweep_fingerprint"):
      pass


def test_content_key_follows_the_bytes_not_the_path(t5_files, tmp_path):
  first = checkpoints.content_key(t5_files[0])
  copy = shutil.copytree(t5_files[0], tmp_path / "copy")
  assert checkpoints.content_key(copy) == first  # same weights elsewhere: same key
  (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
  assert checkpoints.content_key(copy) != first


def test_generation_killed_mid_write_resumes_without_duplicates(t5_files, model_dir, tmp_path):
  prompts = t5_files[3]
  out = tmp_path / "out"
  _generate(tmp_path, out, model_dir, prompts)
  lines = (out / "generations.jsonl").read_text().splitlines(keepends=True)
  complete = "".join(lines[:3])
  # A kill while the fourth row was being written: three rows and half a line on disk.
  (out / "generations.jsonl").write_text(complete + lines[3][:len(lines[3]) // 2])
  for _ in range(2):  # the first rerun repairs and finishes, the second finds nothing to do
    summary = _generate(tmp_path, out, model_dir, prompts)
    assert sorted(_keys(out)) == [f"p{i}" for i in range(5)]  # no duplicate, none lost
    assert summary["prompts"] == 5
    assert json.loads((out / "summary.json").read_text())["prompts"] == 5
  assert (out / "generations.jsonl").read_text().startswith(complete)  # finished rows kept as is
  assert (out / "generations.jsonl.torn").read_text() == lines[3][:len(lines[3]) // 2] + "\n"


def test_a_second_run_on_the_same_directory_is_refused(t5_files, model_dir, tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  with open(out / ".run.lock", "a") as lock:  # what a running generation or sweep holds
    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    with pytest.raises(RuntimeError, match=f"another run is using the output directory {out}"):
      _generate(tmp_path, out, model_dir, t5_files[3])
  assert sorted(p.name for p in out.iterdir()) == [".run.lock"]  # it wrote nothing
  assert _generate(tmp_path, out, model_dir, t5_files[3])["prompts"] == 5  # once the first ends


def test_a_typo_leaves_nothing_that_blocks_the_corrected_run(t5_files, model_dir, tmp_path):
  out = tmp_path / "out"
  with pytest.raises(FileNotFoundError, match="no prompts file"):
    _generate(tmp_path, out, model_dir, tmp_path / "promts.jsonl")
  assert not out.exists()
  # A failed start of an older version left metadata but no results: the directory is free.
  out.mkdir()
  (out / "spec.json").write_text('{"target": "something else"}')
  assert _generate(tmp_path, out, model_dir, t5_files[3])["prompts"] == 5
  assert json.loads((out / "spec.json").read_text())["decode"]["max_new_tokens"] == 6


def test_sweep_grid_typos_are_refused_before_anything_is_loaded():
  for fields, match in [({"tasks": ("humaneval_x",)}, "unknown prompt set 'humaneval_x'"),
                        ({"drafters": ("lokup",)}, "unknown drafter 'lokup'"),
                        ({"drafters": ("model:/no/such/draft",)}, "no draft model checkpoint at"),
                        ({"temperatures": (0.0, -1.0)}, "temperature must be >= 0"),
                        ({"repeats": 0}, r"SweepSpec.repeats = 0: .* >= 1"),
                        ({"prompts_per_task": 0}, r"SweepSpec.prompts_per_task = 0: .* >= 1")]:
    with pytest.raises((ValueError, FileNotFoundError), match=match):
      speculative_sweep.SweepSpec(**fields).points()


def test_spec_json_removed_then_another_config_is_refused_and_the_original_resumes(
    t5_files, model_dir, tmp_path):
  prompts, out = t5_files[3], tmp_path / "out"
  _generate(tmp_path, out, model_dir, prompts, max_new_tokens=6)
  rows = (out / "generations.jsonl").read_bytes()
  (out / "spec.json").unlink()
  with pytest.raises(ValueError, match=r"(?s)5 rows of another config.*spec.json is missing.*"
                                       r"rerun with the config \(and the specjax version\) that "
                                       r"wrote them.*move .* away"):
    _generate(tmp_path, out, model_dir, prompts, max_new_tokens=4, name="other.gin")
  assert not (out / "spec.json").exists() and (out / "generations.jsonl").read_bytes() == rows
  assert _generate(tmp_path, out, model_dir, prompts, max_new_tokens=6)["prompts"] == 5
  assert json.loads((out / "spec.json").read_text())["decode"]["max_new_tokens"] == 6
  # With its spec.json in place, the refusal says what differs.
  with pytest.raises(ValueError, match=r"decode.max_new_tokens: 6 -> 4"):
    _generate(tmp_path, out, model_dir, prompts, max_new_tokens=4, name="other.gin")
  assert json.loads((out / "spec.json").read_text())["decode"]["max_new_tokens"] == 6


def test_bad_files_are_named(t5_files, model_dir, tmp_path):
  prompts, out = t5_files[3], tmp_path / "out"
  _generate(tmp_path, out, model_dir, prompts)
  spec = (out / "spec.json").read_text()
  (out / "spec.json").write_text(spec[:40])
  with pytest.raises(ValueError, match=f"{out / 'spec.json'} is not valid JSON.*config.gin"):
    _generate(tmp_path, out, model_dir, prompts)
  (out / "spec.json").write_text(spec)
  lines = (out / "generations.jsonl").read_text().splitlines(keepends=True)
  (out / "generations.jsonl").write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
  with pytest.raises(ValueError, match=f"{out / 'generations.jsonl'}: invalid JSON row .* line 2"):
    _generate(tmp_path, out, model_dir, prompts)

  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  with pytest.raises(NotADirectoryError, match=f"output_dir {a_file} is a file"):
    _generate(tmp_path, a_file, model_dir, prompts)

  gguf_path = loading.checkpoint_path(loading.EMBEDDED_SMOLLM2)
  truncated = tmp_path / "truncated.gguf"
  truncated.write_bytes(gguf_path.read_bytes()[:1 << 20])
  with pytest.raises(ValueError, match=f"{truncated} .* is truncated or corrupt"):
    checkpoints.load(truncated)
  not_gguf = tmp_path / "model.gguf"
  not_gguf.write_bytes(b"<html>not found</html>")
  with pytest.raises(ValueError, match=f"{not_gguf} is not a GGUF file"):
    checkpoints.load(not_gguf)

  llama_dir = hf.save(tmp_path / "llama", decoder_only.SIZES["tiny"],
                      random_decoder_params(decoder_only.SIZES["tiny"]))
  with pytest.raises(FileNotFoundError, match="has no tokenizer.json; a target needs its tokenizer"):
    loading.load_model(str(llama_dir))

  with pytest.raises(FileNotFoundError, match=r"no gin config configs/x.gin; configs here: .*"
                                              r"configs/smollm2_default.gin"):
    run.parse_gin(["configs/x.gin"], [])
