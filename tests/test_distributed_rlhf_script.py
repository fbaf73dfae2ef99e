"""`experiments/train_rlhf.py` unchanged as 2 processes (jax.distributed on 127.0.0.1).

A 2-process run (colocated on both processes' devices, the frozen roles offloaded to host
memory with ``--offload_frozen``) and a plain 1-process run of the same command, started
together, end with the same parameters and metrics; the 2-process run logs each step once; and
its checkpoint resumes in 1 process.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from _multiprocess import free_port, subprocess_env, wait_all

from rljax.alignment import checkpointing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "train_rlhf.py")
LAST_STEP = 3
FLAGS = ["--pretrain_steps=4", "--sft_steps=4", "--num_eval_prompts=0",
         f"--num_steps={LAST_STEP}", "--prompts_per_step=8", "--checkpoint_every=1",
         "--keep_checkpoints=10"]
_STDOUTS: list[str] = []  # the 2-process run's console output, filled by the fixture
TOL = 1e-5  # the 2-process gradient is an all-reduce of 2 halves: equal up to f32 rounding

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("dist_rlhf")
  two, one = str(root / "two"), str(root / "one")
  port = free_port()
  spawn = lambda args: subprocess.Popen([sys.executable, SCRIPT, *FLAGS, *args], text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env())
  procs = [spawn([f"--logdir={two}", "--offload_frozen", f"--coordinator_address=127.0.0.1:{port}",
                  "--num_processes=2", f"--process_id={i}", "--heartbeat_timeout_s=30"])
           for i in range(2)]
  procs.append(spawn([f"--logdir={one}"]))
  outs = wait_all(procs)
  _STDOUTS[:] = [out for out, _ in outs[:2]]  # processes 0 and 1 of the 2-process run
  return two, one, str(root)


def _items(logdir, step=LAST_STEP):
  got, policy, train = checkpointing.load_state_items(logdir, step=step)
  assert got == step
  return {**{"policy" + k: v for k, v in policy.items()}, **{"train" + k: v for k, v in train.items()}}


def _assert_close(a, b):
  assert a.keys() == b.keys()
  worst = {k: float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64))))
           for k in a if a[k].size}
  assert max(worst.values()) < TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


def _rl_records(logdir):
  return checkpointing.rl_history(os.path.join(logdir, "metrics.jsonl"))


def test_two_processes_equal_one(runs):
  two, one, _ = runs
  _assert_close(_items(two), _items(one))
  a, b = _rl_records(two), _rl_records(one)
  assert [r["step"] for r in a] == list(range(1, LAST_STEP + 1))  # logged once, by process 0
  for ra, rb in zip(a, b):
    for k in ("reward/mean", "pg_loss", "vf_loss", "kl", "response_length/mean"):
      assert abs(ra[k] - rb[k]) < TOL, (ra["step"], k, ra[k], rb[k])


def test_two_process_outputs_are_written_once(runs):
  two, _, _ = runs
  # Console: progress and summary lines come from process 0 only (runtime.primary_print).
  out0, out1 = _STDOUTS
  for line in ("sft: 4 steps", "embedded ppo: mean reward"):
    assert line in out0 and line not in out1, (line, out0[-1000:], out1[-1000:])
  assert len([f for f in os.listdir(two) if f.startswith("events.out.tfevents")]) == 1
  with open(os.path.join(two, "run_info.json")) as f:
    assert "--process_id=0" in json.load(f)["command"]
  assert checkpointing.has_frozen(two)


def test_two_process_checkpoint_resumes_in_one_process(runs):
  two, _, root = runs
  resumed = os.path.join(root, "resumed")
  shutil.copytree(two, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", str(LAST_STEP)))
  out = subprocess.run([sys.executable, SCRIPT, *FLAGS, f"--logdir={resumed}"], text=True,
                       capture_output=True, env=subprocess_env(), timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"resuming {resumed} after RL step {LAST_STEP - 1}" in out.stdout + out.stderr
  _assert_close(_items(resumed), _items(two))
