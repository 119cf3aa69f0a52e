"""Every input checked before any work (issue 33): each case is refused with a clear error type, a
message naming the file or setting and the fix, and nothing written (or what was written untouched);
or, where it is an edit, kept apart from results of the old input.

Generations run `python -m specjax.run`'s job in-process on a tiny random T5 (HF directory with a
SentencePiece model trained here) over small prompt files; the SmolLM2 cases load the embedded GGUF.
The property-based tests (hypothesis) run validation only, no model.
"""

import json
import os
import pathlib
import re
import shutil

import gin
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import generation_gin, random_decoder_params, tiny_t5_files, write_llama_gguf
from specjax import checkpoints, launch, loading, outputs, run, specs, tokenizer, validation
from specjax import vocabulary as vocabularies
from specjax.checkpoints import gguf
from specjax.data import prompts
from specjax.decoding.tree import Tree
from specjax.models import decoder_only


@pytest.fixture(scope="module")
def t5_files(tmp_path_factory):
  return tiny_t5_files(tmp_path_factory.mktemp("t5"))


@pytest.fixture(scope="module")
def other_vocabulary(tmp_path_factory, t5_files):
  """A SentencePiece model of the tiny T5's size (100 pieces) trained on other text: the same ids,
  other pieces."""
  path = tmp_path_factory.mktemp("other") / "spiece.model"
  texts = [german[::-1] + " " + english.upper() for english, german in prompts.django_de_pairs()]
  vocab = vocabularies.train(texts, path, vocab_size=100)
  assert vocab.vocab_size == vocabularies.SentencePieceVocabulary.from_file(t5_files[2]).vocab_size
  return path


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def _generate(tmp_path, output_dir, checkpoint, prompts_file, *bindings, vocabulary=None,
              max_new_tokens=4):
  gin.clear_config()
  config = generation_gin(tmp_path / "gen.gin", output_dir, checkpoint, vocabulary, prompts_file,
                          max_new_tokens)
  run.parse_gin([str(config)], list(bindings))
  return gin.get_configurable(run.main)()


def _write_prompts(path, rows) -> pathlib.Path:
  path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n"
                          for row in rows))
  return path


def _snapshot(directory: pathlib.Path) -> dict:
  """{relative path: bytes} of every file under a directory (nothing if it does not exist)."""
  if not directory.exists():
    return {}
  return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
          if p.is_file()}


# ---- 1. prompt content is part of the spec --------------------------------------------------------

def test_a_prompt_file_edited_in_place_is_another_config(t5_files, tmp_path):
  prompts_file = shutil.copy(t5_files[3], tmp_path / "prompts.jsonl")
  out = tmp_path / "out"
  assert _generate(tmp_path, out, t5_files[0], prompts_file)["prompts"] == 5
  before = _snapshot(out)
  lines = pathlib.Path(prompts_file).read_text().splitlines()
  lines[2] = json.dumps({"id": "p2", "text": "translate English to German: Edited in place."})
  pathlib.Path(prompts_file).write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=r"(?s)5 rows of another config.*prompt_digest: "
                                       r"\"[0-9a-f]+\" -> \"[0-9a-f]+\".*another output_dir"):
    _generate(tmp_path, out, t5_files[0], prompts_file)
  assert _snapshot(out) == before


def test_sweeps_and_teacher_data_key_the_prompts_they_use(monkeypatch, tmp_path):
  """The sweeps' specs carry a digest per task of the prompts measured (measure.task_prompts), the
  trainers' specs and the teacher data's cache keys the digests of the train prompts they
  continue (teacher.prompt_digests)."""
  from experiments import measure
  from specjax.training import draft_model, teacher
  first = _write_prompts(tmp_path / "a.jsonl", [{"id": "a", "text": "one"}, {"id": "b", "text": "x"}])
  digest = validation.prompt_digest(measure.task_prompts(str(first), 2, "chat"))
  _write_prompts(first, [{"id": "a", "text": "one"}, {"id": "b", "text": "y"}])
  assert validation.prompt_digest(measure.task_prompts(str(first), 2, "chat")) != digest
  assert validation.prompt_digest(measure.task_prompts(str(first), 1, "chat")) != digest

  seen = {}

  class Refuse(Exception):
    pass

  def capture(output_dir, spec, *args, **kwargs):
    seen.update(spec)
    raise Refuse
  monkeypatch.setattr(outputs, "RunDirectory", capture)
  spec = teacher.TeacherSpec(tasks=("ende",), max_new_tokens=(4,), samples=(0,),
                             prompts_per_task=(3,))
  with pytest.raises(Refuse):
    draft_model.train(str(tmp_path / "draft"), teacher=spec)
  assert seen["prompt_digests"] == teacher.prompt_digests(spec)
  more = teacher.TeacherSpec(tasks=("ende",), max_new_tokens=(4,), samples=(0,),
                             prompts_per_task=(4,))
  assert teacher.prompt_digests(more) != teacher.prompt_digests(spec)


# ---- 2. a vocabulary that is not the model's ------------------------------------------------------

def test_a_vocabulary_that_is_not_the_model_s_is_refused(t5_files, other_vocabulary, tmp_path):
  with pytest.raises(ValueError, match=r"the model .*hf was trained with another vocabulary "
                                       r"\(.*spiece.model: 100 pieces\) than ModelSpec.vocabulary "
                                       r".*Leave ModelSpec.vocabulary None"):
    loading.load_model(str(t5_files[0]), str(other_vocabulary))
  out = tmp_path / "out"
  with pytest.raises(ValueError, match="another vocabulary"):
    _generate(tmp_path, out, t5_files[0], t5_files[3], vocabulary=other_vocabulary)
  assert not out.exists()
  # Its own vocabulary, named explicitly, is fine.
  assert loading.load_model(str(t5_files[0]), str(t5_files[2])).config.vocab_size == 128


def test_a_draft_of_the_same_size_but_another_vocabulary_is_refused(t5_files, other_vocabulary,
                                                                     tmp_path):
  draft = shutil.copytree(t5_files[0], tmp_path / "draft")
  shutil.copyfile(other_vocabulary, draft / "spiece.model")
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=rf"the draft 'model:{re.escape(str(draft))}' .* was trained with "
                                       r"another vocabulary .*pick or train a draft with the "
                                       r"target's tokenizer"):
    _generate(tmp_path, out, t5_files[0], t5_files[3], f"generation.Generate.drafter = "
              f"'model:{draft}'", "generation.Generate.gamma = 2")
  assert not out.exists()


def test_fine_tuning_or_distilling_with_another_task_vocabulary_is_refused(t5_files,
                                                                          other_vocabulary,
                                                                          tmp_path):
  from specjax.training import seq2seq
  task = seq2seq.TaskSpec(task="gettext_ende", vocabulary=str(other_vocabulary))
  for kwargs, role in (({"init_checkpoint": str(t5_files[0])}, "init_checkpoint"),
                       ({"teacher": str(t5_files[0])}, "the teacher")):
    out = tmp_path / role.replace(" ", "_")
    with pytest.raises(ValueError, match=rf"{role} .*hf was trained with another vocabulary.*"
                                         r"set TaskSpec.vocabulary to .*spiece.model"):
      seq2seq.train(output_dir=str(out), task=task, **kwargs)
    assert not out.exists()
  # A vocabulary trained here (TaskSpec.vocabulary None) cannot be the checkpoint's either.
  with pytest.raises(ValueError, match=r"ships its vocabulary .*TaskSpec.vocabulary is None"):
    seq2seq.train(output_dir=str(tmp_path / "none"), task=seq2seq.TaskSpec(task="gettext_ende"),
                  init_checkpoint=str(t5_files[0]))
  assert not (tmp_path / "none").exists()


# ---- 3. empty prompt sets, and the split of a user's file ------------------------------------------

@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_an_empty_or_blank_prompt_file_is_an_error(t5_files, tmp_path, content):
  empty = tmp_path / "empty.jsonl"
  empty.write_text(content)
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=rf"PromptSpec.name '{re.escape(str(empty))}' .* has no "
                                       r"prompts: the file "
                                       r"is empty or blank.*give it prompts"):
    _generate(tmp_path, out, t5_files[0], empty)
  assert not out.exists()


def test_a_user_s_prompt_file_is_used_whole_whatever_the_split(t5_files, tmp_path):
  two = _write_prompts(tmp_path / "two.jsonl", [{"id": "a", "text": "Hello."},
                                                {"id": "b", "text": "Good bye."}])
  assert not any(prompts.is_heldout(text) for text in ("Hello.", "Good bye."))
  summary = _generate(tmp_path, tmp_path / "out", t5_files[0], two, "specs.PromptSpec.split = "
                      "'heldout'")
  assert summary["prompts"] == 2
  with pytest.raises(ValueError, match="a prompts file is not split.*use split 'all' or 'heldout'"):
    prompts.load_prompt_set(str(two), "train")


# ---- 4. bad prompts, named by file and id, before any row ----------------------------------------

@pytest.mark.parametrize("line, match", [
    ('{"id": "p1", "text": 12}', r"line 2, prompt 'p1': \"text\" is int 12, not a string"),
    ('{"id": "p1", "text": "\\ud800 x"}', r"line 2, prompt 'p1': the text holds a lone surrogate"),
    ('{"id": "p1", "text": "   "}', r"line 2, prompt 'p1': the prompt is empty or blank"),
    ('{"id": "p1"}', r"line 2: expected a JSON object with \"id\" and \"text\""),
    ('{"id": "p0", "text": "again"}', r"line 2: id 'p0' appears twice"),
    ('{"id": [1], "text": "x"}', r"line 2: \"id\" \[1\] is not a non-empty string"),
])
def test_bad_prompts_are_named_by_file_line_and_id(t5_files, tmp_path, line, match):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"id": "p0", "text": "Fine."}\n' + line + "\n")
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}, {match}"):
    _generate(tmp_path, out, t5_files[0], bad)
  assert not out.exists()


def test_a_file_that_is_not_utf8_is_named(t5_files, tmp_path):
  bad = tmp_path / "latin1.jsonl"
  bad.write_bytes(b'{"id": "p0", "text": "ok"}\n{"id": "p1", "text": "caf\xe9"}\n')
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}, line 2: byte \d+ \(0xe9\) is not "
                                       r"UTF-8; save the file as UTF-8"):
    _generate(tmp_path, out, t5_files[0], bad)
  assert not out.exists()


def test_a_prompt_smollm2_tokenizes_to_nothing_is_refused_by_id_before_any_row(tmp_path):
  """\\x04 has no token in SmolLM2's vocabulary (tokenizer.py): the prompt tokenizes to nothing.
  Before, the rows of the batches before it were written and the error named "prompt 0"."""
  file = _write_prompts(tmp_path / "p.jsonl", [{"id": "first", "text": "def f():"},
                                               {"id": "second", "text": "x = 1"},
                                               {"id": "no-tokens", "text": "\x04"}])
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=rf"{re.escape(str(file))}, prompt 'no-tokens': it tokenizes "
                                       r"to no tokens"):
    _generate(tmp_path, out, specs.EMBEDDED_SMOLLM2, file, "specs.PromptSpec.batch_size = 1")
  assert not out.exists()


# ---- 5. settings beyond what the machine and the model allow --------------------------------------

@pytest.mark.parametrize("bindings, match", [
    (("generation.Generate.drafter = 'lookup'", "generation.Generate.gamma = 1000000000"),
     r"gamma \(draft tokens per iteration\) must be a whole number >= 1 and <= 1024"),
    (("generation.Generate.drafter = 'lookup'", "generation.Generate.gamma = 0"),
     r"gamma \(draft tokens per iteration\) must be a whole number >= 1"),
    (("specs.DecodeSpec.max_new_tokens = 1000000000",),
     r"DecodeSpec.max_new_tokens=1000000000: the decode needs [\d.]+ GiB .* lower max_new_tokens"),
    (("specs.DecodeSpec.max_new_tokens = 3000000000",),
     r"DecodeSpec.max_new_tokens must be a whole number >= 1 and <= 1073741824"),
    (("specs.PromptSpec.batch_size = 0",),
     r"PromptSpec.batch_size must be a whole number >= 1, got 0; it counts the prompts"),
    (("generation.Generate.mesh_shape = (0, 1)",),
     r"Generate.mesh_shape\[0\] \(data\) must be a whole number >= 1"),
    (("generation.Generate.seed = -1",), r"Generate.seed must be a whole number >= 0"),
])
def test_settings_are_refused_by_name_before_any_work(t5_files, tmp_path, bindings, match):
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=match):
    _generate(tmp_path, out, t5_files[0], t5_files[3], *bindings)
  assert not out.exists()


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_temperature_that_is_not_finite_is_refused_by_name(value):
  with pytest.raises(ValueError, match=r"DecodeSpec.temperature must be a finite number"):
    specs.DecodeSpec(temperature=value)
  with pytest.raises(ValueError, match=r"temperature must be >= 0 and finite"):
    from specjax.decoding import sampling
    sampling.validate_sampling(value, 0, 1.0)  # the sweeps' grids check through this one


def test_a_decode_too_large_for_the_machine_names_the_settings(t5_files):
  loaded = loading.load_model(str(t5_files[0]))
  with pytest.raises(ValueError, match=r"PromptSpec.batch_size=64, gamma=4: the decode needs "
                                       r"[\d.]+ GiB .* more than the 0.0 GiB"):
    validation.check_decode_fits(loaded.model, 128, 64, 32, 1000, 5,
                                 "PromptSpec.batch_size=64, gamma=4", available=1000)
  validation.check_decode_fits(loaded.model, 128, 4, 32, 100, 5, "x", available=1 << 30)


# ---- 6. corrupt files ------------------------------------------------------------------------------

def test_corrupt_checkpoint_files_are_named_with_the_fix(t5_files, tmp_path):
  truncated = shutil.copytree(t5_files[0], tmp_path / "truncated")
  weights = truncated / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
  with pytest.raises(ValueError, match=rf"{re.escape(str(weights))} is truncated or corrupt .*copy or download the "
                                       r"checkpoint again"):
    checkpoints.load(truncated)
  broken = shutil.copytree(t5_files[0], tmp_path / "broken")
  (broken / "config.json").write_text((broken / "config.json").read_text()[:30])
  for read in (checkpoints.load, checkpoints.read_config):
    with pytest.raises(ValueError, match=rf"{re.escape(str(broken / 'config.json'))} is not valid JSON .*restore "
                                         r"it from the checkpoint's source"):
      read(broken)


def test_a_corrupt_dequantized_gguf_cache_entry_is_dequantized_again(monkeypatch, tmp_path):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  config = decoder_only.SIZES["tiny"]
  path = write_llama_gguf(tmp_path / "tiny.gguf", config, random_decoder_params(config, seed=5))
  loaded, params = gguf.load(path)
  (entry,) = (tmp_path / "cache" / "gguf").glob("*.npz")
  entry.write_bytes(entry.read_bytes()[:4096])  # a copy cut short
  again, params_again = gguf.load(path)
  assert again == loaded == config
  np.testing.assert_array_equal(params_again["embedding"], params["embedding"])
  with np.load(entry) as data:  # rewritten whole
    assert len(data.files) > 10


def test_a_corrupt_gguf_tokenizer_cache_entry_is_read_again(monkeypatch, tmp_path):
  """The tokenizer's metadata is cached as JSON (parsing it takes seconds): a cached read builds the
  same tokenizer as the file's, and an entry cut short is removed and the file read again."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  path = loading.checkpoint_path(specs.EMBEDDED_SMOLLM2)
  text = "def f(x):\n  return 2024 <|im_start|>é"
  first = tokenizer.Tokenizer.from_gguf(path)
  (entry,) = (tmp_path / "cache" / "gguf").glob("*.tokenizer.json")
  cached = tokenizer.Tokenizer.from_gguf(path)
  entry.write_bytes(entry.read_bytes()[:4096])  # a copy cut short
  again = tokenizer.Tokenizer.from_gguf(path)
  for tok in (cached, again):
    assert tok.encode(text) == first.encode(text) and len(first.encode(text)) > 8
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.chat_template, tok.vocab_size) == (
        first.bos_id, first.eos_id, first.pad_id, first.chat_template, first.vocab_size)
  assert len(json.loads(entry.read_text())["tokenizer.ggml.tokens"]) == first.vocab_size  # rewritten


def test_a_file_swapped_with_its_old_size_and_mtime_changes_the_content_key(t5_files, tmp_path):
  model = shutil.copytree(t5_files[0], tmp_path / "model")
  weights = model / "model.safetensors"
  first = checkpoints.content_key(model)
  stat = weights.stat()
  data = bytearray(weights.read_bytes())
  data[-1] ^= 1  # same size, other bytes
  swapped = tmp_path / "swapped"
  swapped.write_bytes(bytes(data))
  os.replace(swapped, weights)
  os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the old timestamp, forged
  assert weights.stat().st_size == stat.st_size and weights.stat().st_mtime_ns == stat.st_mtime_ns
  assert checkpoints.content_key(model) != first


# ---- 7. multi-process variables --------------------------------------------------------------------

def test_multi_process_variables_are_checked(monkeypatch):
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  monkeypatch.setenv("SPECJAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("SPECJAX_PROCESS_ID", "0")
  with pytest.raises(ValueError, match=r"SPECJAX_NUM_PROCESSES=2 .* no coordinator is set: set "
                                       r"JAX_COORDINATOR_ADDRESS=host:port"):
    launch.initialize_distributed()
  monkeypatch.setenv("SPECJAX_PROCESS_ID", "x")
  with pytest.raises(ValueError, match=r"the environment variable SPECJAX_PROCESS_ID='x' is not a "
                                       r"whole number"):
    launch.initialize_distributed()
  monkeypatch.setenv("SPECJAX_PROCESS_ID", "2")
  with pytest.raises(ValueError, match=r"SPECJAX_PROCESS_ID=2 is not below SPECJAX_NUM_PROCESSES=2"):
    launch.initialize_distributed()
  monkeypatch.setenv("SPECJAX_NUM_PROCESSES", "1")
  monkeypatch.setenv("SPECJAX_PROCESS_ID", "0")
  assert launch.initialize_distributed() is False  # one process, as asked


# ---- 9. the planner --------------------------------------------------------------------------------

def test_the_planner_refuses_nonsense(tmp_path):
  from specjax import generation, plan
  from specjax.plan import workload
  with pytest.raises(ValueError, match=r"PlanSpec.memory_gib \(--memory_gib\) must be a finite "
                                       r"number >= 1e-09, got -1"):
    plan.PlanSpec(memory_gib=-1)
  job = generation.Generate(output_dir=str(tmp_path / "out"), mesh_shape=(0, 1))
  with pytest.raises(ValueError, match=r"Generate.mesh_shape\[0\] \(data\) must be a whole number "
                                       r">= 1, got 0"):
    workload.of_job(job)
  missing = generation.Generate(target=specs.ModelSpec(checkpoint=str(tmp_path / "no_model")))
  with pytest.raises(FileNotFoundError, match=rf"the target checkpoint '{re.escape(str(tmp_path / 'no_model'))}' "
                                              r"does not exist: fix the path"):
    plan.run_plan(missing, plan.PlanSpec(), str(tmp_path / "plan"))
  assert not (tmp_path / "plan").exists()


# ---- training checkpoints carry the fingerprint ----------------------------------------------------

def test_checkpoints_of_another_config_are_refused_without_spec_json_or_log(tmp_path):
  def hold(spec):
    return outputs.RunDirectory(tmp_path, spec, "train_log.jsonl", "spec_fingerprint",
                                other_results=("checkpoints",), fingerprinted=("checkpoints",))
  with hold({"steps": 10}):
    (tmp_path / "checkpoints" / "10").mkdir()  # what a first run left
  (tmp_path / "spec.json").unlink()
  with pytest.raises(ValueError, match=r"checkpoints holds results of another config \(its "
                                       r"\.spec_fingerprint says [0-9a-f]+; .*another output_dir"):
    with hold({"steps": 20}):
      pass
  assert not (tmp_path / "spec.json").exists()
  with hold({"steps": 10}):  # the config that wrote them resumes
    pass
  # A failed start that left only the fingerprint does not block another config.
  shutil.rmtree(tmp_path / "checkpoints" / "10")
  (tmp_path / "spec.json").unlink()
  with hold({"steps": 20}) as run_dir:
    assert (tmp_path / "checkpoints" / outputs.FINGERPRINT_FILE).read_text().strip() == \
        run_dir.fingerprint


# ---- property-based: the prompt-file reader and the settings validator -----------------------------

_TEXTS = st.one_of(st.text(max_size=12), st.integers(), st.floats(allow_nan=True), st.none(),
                   st.booleans(), st.lists(st.integers(), max_size=2),
                   st.sampled_from(["\ud800", " ", "", "\x04", "ok"]))
_LINES = st.one_of(
    st.fixed_dictionaries({"id": st.one_of(st.text(max_size=4), st.integers(0, 3), st.none()),
                           "text": _TEXTS}),
    st.fixed_dictionaries({"id": st.text(max_size=3)}),
    st.sampled_from(["", "   ", "not json", "[1, 2]", "null", '{"id": "q", "text": "\\udc00"}']))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_LINES, max_size=5), raw=st.binary(max_size=6))
def test_property_the_prompt_reader_passes_or_names_the_file(tmp_path, lines, raw):
  path = tmp_path / "p.jsonl"
  path.write_bytes("".join((l if isinstance(l, str) else json.dumps(l)) + "\n"
                           for l in lines).encode("utf-8", "surrogatepass") + raw)
  try:
    prompt_set = prompts.prompt_set_for_run(str(path), "all", None, "chat", "PromptSpec.name")
  except ValueError as error:
    assert str(path) in str(error)
    return
  assert len(prompt_set) >= 1 and len(set(prompt_set.keys)) == len(prompt_set)
  for key, text in zip(prompt_set.keys, prompt_set.prompts):
    assert isinstance(text, str) and text.strip()
    text.encode("utf-8")
    key.encode("utf-8")
  validation.prompt_digest(prompt_set)


_VALUES = st.one_of(st.integers(-3, 10 ** 10), st.floats(allow_nan=True, allow_infinity=True),
                    st.booleans(), st.none(), st.text(max_size=3))


@settings(max_examples=50, deadline=None)
@given(field=st.sampled_from(["max_new_tokens", "temperature", "top_k", "top_p"]), value=_VALUES)
def test_property_decode_settings_pass_or_are_refused_by_name(field, value):
  try:
    spec = specs.DecodeSpec(**{field: value})
  except ValueError as error:
    assert field in str(error)
    return
  assert 1 <= spec.max_new_tokens <= validation.MAX_POSITIONS
  assert np.isfinite(spec.temperature) and spec.temperature >= 0
  assert 0 < spec.top_p <= 1 and spec.top_k >= 0 and int(spec.top_k) == spec.top_k


@settings(max_examples=50, deadline=None)
@given(field=st.sampled_from(["limit", "batch_size", "bucket", "max_prompt_length", "split",
                              "style"]), value=_VALUES)
def test_property_prompt_settings_pass_or_are_refused_by_name(field, value):
  try:
    spec = specs.PromptSpec(**{field: value})
  except ValueError as error:
    assert f"PromptSpec.{field}" in str(error)
    return
  assert spec.limit is None or spec.limit >= 1
  assert spec.batch_size >= 1 and spec.bucket >= 1 and spec.max_prompt_length >= 1


@settings(max_examples=50, deadline=None)
@given(gamma=_VALUES)
def test_property_gamma_passes_or_is_refused_by_name(gamma):
  try:
    tree = Tree.chain(gamma)
  except ValueError as error:
    assert "gamma" in str(error)
    return
  assert 1 <= tree.depth <= 1024
