"""Two processes on 127.0.0.1 decode as one: `generation.Generate` with a T5 target and a T5 draft sharded
on one ('data' 2, 'model' 4) mesh spanning both processes (4 simulated CPU devices each, gloo
collectives) writes exactly the tokens of the single-process, unsharded run, greedy and at
temperature 0.8 with a fixed seed; process 0 alone writes. The worker is tests/two_process_check.py."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from conftest import random_t5_params, tiny_t5_files
from specjax import outputs
from specjax.checkpoints import hf_t5
from specjax.models import t5

import two_process_check

HERE = pathlib.Path(__file__).parent
TIMEOUT_S = 180  # both processes together; a hung collective fails the test instead of CI


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


@pytest.mark.slow  # two fresh processes compile the loop: about a minute on 2 cores
def test_two_processes_decode_the_single_process_tokens(tmp_path):
  target_dir, _, vocab_path, prompts, _ = tiny_t5_files(tmp_path / "files")
  draft_dir = hf_t5.save(tmp_path / "draft", t5.SIZES["tiny"],
                         random_t5_params(t5.SIZES["tiny"], seed=22), vocabulary=vocab_path)
  reference = {}
  for name, temperature in two_process_check.SETTINGS:
    out = tmp_path / "single" / name
    two_process_check.generate(str(target_dir), str(draft_dir), str(prompts), str(out), temperature,
                               (1, 1))
    reference[name] = {row["key"]: row["new_tokens"] for row in outputs.read_rows(
        out / "generations.jsonl")}

  env = {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}",
         "SPECJAX_NUM_PROCESSES": "2", "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
  start = time.perf_counter()
  workers = [subprocess.Popen(
      [sys.executable, str(HERE / "two_process_check.py"), str(target_dir), str(draft_dir),
       str(prompts), str(tmp_path / "multi")], env={**env, "SPECJAX_PROCESS_ID": str(i)},
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    logs = [worker.communicate(timeout=TIMEOUT_S)[0] for worker in workers]
  finally:
    for worker in workers:
      worker.kill()
  for i, (worker, log) in enumerate(zip(workers, logs)):
    assert worker.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
  print(f"two processes: {time.perf_counter() - start:.0f} s for both decodes")

  for name, _ in two_process_check.SETTINGS:
    out = tmp_path / "multi" / name
    rows = outputs.read_rows(out / "generations.jsonl")
    assert len(rows) == len(reference[name]) == 5  # one row per prompt: process 1 wrote none
    assert {row["key"]: row["new_tokens"] for row in rows} == reference[name], name
    environment = json.loads((out / "environment.json").read_text())
    assert environment["process_count"] == 2 and environment["process_index"] == 0
    assert len(environment["devices"]) == 8
  # The sampled run is a real test of the accept rule: some drafts accepted, some rejected.
  sampled = outputs.read_rows(tmp_path / "multi" / "sampled" / "generations.jsonl")
  assert any(row["target_calls"] < row["num_generated"] for row in sampled)
