"""Training on 2 local processes (jax.distributed on 127.0.0.1) equals training on 1.

One 2-process run and one 1-process run of tests/_dist_train_worker.py, started together:
a control PPO chunk (environments split over the processes), an RLHF PPO step (colocated,
fsdp rules over both processes' devices), and a checkpoint saved by the 2 processes that the
1-process run restores on its 1-device mesh.
"""

import json
import os
import subprocess
import sys

import pytest
from _multiprocess import free_port, subprocess_env

WORKER = os.path.join(os.path.dirname(__file__), "_dist_train_worker.py")

pytestmark = pytest.mark.slow


def _result(out: str) -> dict:
  line = [l for l in out.splitlines() if l.startswith("RESULT ")]
  assert line, out[-3000:]
  return json.loads(line[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  logdir = str(tmp_path_factory.mktemp("dist"))
  port = free_port()
  cmd = [sys.executable, WORKER, f"--logdir={logdir}"]
  multi = [subprocess.Popen(
      cmd + [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
             "--heartbeat_timeout_s=20"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env()) for i in range(2)]
  one = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
  try:
    outs = [p.communicate(timeout=600) for p in (*multi, one)]
  finally:
    for p in (*multi, one):
      if p.poll() is None:
        p.kill()
  for p, (out, err) in zip((*multi, one), outs):
    assert p.returncode == 0, out[-2000:] + err[-4000:]
  return [_result(out) for out, _ in outs]


def test_two_processes_span_both_devices(runs):
  assert runs[0]["process"] == [0, 2, 2] and runs[1]["process"] == [1, 2, 2]
  assert runs[2]["process"] == [0, 1, 1]
  assert runs[0]["obs_spec"] == "P('data',)"    # 4 environments: 2 on each process


def test_control_chunk_equals_one_process(runs):
  one = runs[2]
  for r in runs[:2]:
    assert abs(r["loss"] - one["loss"]) < 1e-5
    assert max(abs(a - b) for a, b in zip(r["params"], one["params"])) < 1e-5


def test_evaluation_equals_one_process(runs):
  """The evaluation of the trained policy, run on the 2-process mesh as `train` runs it, gives
  the 1-process run's episode reward and length (2 eval environments of 20 steps)."""
  one = runs[2]["eval"]
  assert one["eval/episode_length"] == 20.0 and one["eval/episode_reward"] > 0.0
  for r in runs[:2]:
    assert r["eval"].keys() == one.keys()
    assert all(abs(r["eval"][k] - one[k]) < 1e-4 for k in one), (r["eval"], one)


def test_eval_video_renders_once_from_process_0(runs):
  """--eval_video's callback in a 2-process run: process 0 writes the video of the trained
  policy (the same episode as the 1-process run's), process 1 renders nothing."""
  one = runs[2]["video"]
  assert one["paths"] == ["eval_16.gif"]
  assert runs[0]["video"]["paths"] == one["paths"] and runs[1]["video"] is None
  # The parameters agree to 1e-5 (an all-reduce of two halves), so the return nearly exactly.
  assert abs(runs[0]["video"]["reward"] - one["reward"]) < 1e-3, (runs[0]["video"], one)


def test_rlhf_step_equals_one_process(runs):
  one = runs[2]["rlhf"]
  for r in (x["rlhf"] for x in runs[:2]):
    assert max(abs(a - b) for a, b in zip(r["params"], one["params"])) < 1e-5
    bad = {k: (v, one["metrics"][k]) for k, v in r["metrics"].items()
           if not abs(v - one["metrics"][k]) < 1e-5}
    assert not bad, bad


def test_two_process_checkpoint_restores_in_one_process(runs):
  r = runs[2]["restore"]
  assert r["step"] == 1 and r["num_leaves"][0] == r["num_leaves"][1] > 10
  assert r["shapes_equal"] and r["max_diff"] == 0.0   # params, optimizer, data-sharded env state
  # The policy (params and observation statistics, the checkpoint's first leaves) as
  # trainer.load_params reads it on 1 device: what load_policy, export and render use.
  assert r["policy_leaves"] > 6 and r["policy_max_diff"] == 0.0
