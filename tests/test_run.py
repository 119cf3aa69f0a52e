"""The gin entry point: every config parses and binds; a tiny real run end to end; resume and refusal."""

import json
import pathlib

import gin
import pytest

from specjax import run

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("**/*.gin"))


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_parses_and_binds(config):
  run.parse_gin([str(config)], [])
  bound = gin.get_bindings(run.run)
  assert {"output_dir", "target", "prompts", "decode"} <= set(bound)


def _tiny(tmp_path, *extra):
  run.parse_gin([str(CONFIGS[0])], [f"run.run.output_dir = '{tmp_path}'", "run.PromptSpec.limit = 2",
                                    "run.PromptSpec.batch_size = 2", "run.DecodeSpec.max_new_tokens = 6",
                                    *extra])
  return gin.get_configurable(run.run)()


def test_smoke_real_run_writes_everything_and_resumes(tmp_path):
  summary = _tiny(tmp_path)
  assert summary["prompts"] == 2 and 2 <= summary["tokens"] <= 12
  for name in ("config.gin", "spec.json", "environment.json", "generations.jsonl", "summary.json"):
    assert (tmp_path / name).is_file(), name
  rows = [json.loads(l) for l in (tmp_path / "generations.jsonl").read_text().splitlines()]
  assert [r["key"] for r in rows] == ["HumanEval/7", "HumanEval/14"]
  assert all(1 <= r["num_generated"] <= 6 and r["text"] for r in rows)
  assert json.loads((tmp_path / "spec.json").read_text())["decode"]["max_new_tokens"] == 6
  gin.clear_config()
  _tiny(tmp_path)  # same spec again: nothing left to do, no duplicate rows
  assert len((tmp_path / "generations.jsonl").read_text().splitlines()) == 2


def test_output_dir_of_another_config_is_refused(tmp_path):
  (tmp_path / "spec.json").write_text('{"something": "else"}')
  with pytest.raises(ValueError, match="holds results of a different config"):
    _tiny(tmp_path)


def test_unknown_binding_and_missing_checkpoint_are_clear(tmp_path):
  with pytest.raises(ValueError, match="no_such_parameter"):
    _tiny(tmp_path, "run.DecodeSpec.no_such_parameter = 3")
  gin.clear_config()
  with pytest.raises(FileNotFoundError, match="does not exist"):
    _tiny(tmp_path / "x", "run.ModelSpec.checkpoint = '/nonexistent/model.gguf'")
  gin.clear_config()
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    _tiny(tmp_path / "y", "run.DecodeSpec.temperature = -1.0")
