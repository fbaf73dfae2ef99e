"""Disaggregated RLHF over two processes (`experiments/train_rlhf.py --placement=disaggregated`
with ``--num_processes=2``): process 0 trains, process 1 generates (rljax.alignment.
remote_generation), joined on 127.0.0.1.

* Asynchronous (``--max_staleness=1``) with 2 devices per process, it ends bitwise equal to
  the one-process disaggregated run on 4 devices (training on 2, generating on 2), started
  together: the same parameters, optimizer state and metrics.
* A generator killed mid-run stops the trainer within 20 s with an error naming the generator
  and the RL step; the last checkpoint is intact.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _multiprocess import free_port, subprocess_env, wait_all

from rljax.alignment import checkpointing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "train_rlhf.py")
LAST_STEP = 3
FLAGS = ["--pretrain_steps=0", "--sft_steps=0", "--num_eval_prompts=0",
         f"--num_steps={LAST_STEP}", "--prompts_per_step=8", "--checkpoint_every=1",
         "--keep_checkpoints=10", "--placement=disaggregated", "--max_staleness=1"]

pytestmark = pytest.mark.slow


def _env(devices: int) -> dict:
  return dict(subprocess_env(), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _pair(args, devices: int, port: int):
  return [subprocess.Popen([sys.executable, SCRIPT, *args, f"--coordinator_address=127.0.0.1:"
                            f"{port}", "--num_processes=2", f"--process_id={i}"],
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=_env(devices)) for i in range(2)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """A persistent compilation cache: the fault test's processes load the programs the
  equality run's compiled (the same settings but the step count)."""
  return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
  root = tmp_path_factory.mktemp("two_process")
  two, one = str(root / "two"), str(root / "one")
  procs = _pair([*FLAGS, f"--logdir={two}", f"--compilation_cache_dir={cache}"], 2, free_port())
  procs.append(subprocess.Popen([sys.executable, SCRIPT, *FLAGS, f"--logdir={one}"], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(4)))
  outs = wait_all(procs)
  return two, one, [out for out, _ in outs]


def _items(logdir):
  got, policy, train = checkpointing.load_state_items(logdir, step=LAST_STEP)
  assert got == LAST_STEP
  return {**{"policy" + k: v for k, v in policy.items()},
          **{"train" + k: v for k, v in train.items()}}


def _records(logdir):
  return [{k: v for k, v in r.items() if not k.startswith("timing/")}
          for r in checkpointing.rl_history(os.path.join(logdir, "metrics.jsonl"))]


def test_two_processes_equal_the_one_process_disaggregated_run_bitwise(runs):
  two, one, _ = runs
  a, b = _items(two), _items(one)
  assert sorted(a) == sorted(b) and any("lagged_actor" in k for k in a)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  assert _records(two) == _records(one)
  assert [r["rollout/policy_lag_max"] for r in _records(two)] == [0.0, 1.0, 1.0]


def test_the_generator_process_samples_every_batch_and_exits_when_told(runs):
  _, _, (trainer_out, generator_out, _) = runs
  assert generator_out.splitlines() == [
      "generator: sampling on 2 device(s) (tp over tensor=2) for the trainer at "
      + generator_out.split(" for the trainer at ")[1].splitlines()[0],
      f"generator: {LAST_STEP} batches sampled; the trainer finished"]
  assert "embedded ppo: mean reward" in trainer_out


def test_a_killed_generator_stops_the_trainer_naming_it_and_the_step(runs, cache, tmp_path):
  del runs  # it filled the compilation cache
  logdir = str(tmp_path / "run")
  flags = [f for f in FLAGS if not f.startswith("--num_steps")] + [
      "--num_steps=1000", f"--logdir={logdir}", "--heartbeat_timeout_s=5",
      f"--compilation_cache_dir={cache}"]
  trainer, generator = _pair(flags, 2, free_port())
  try:
    path = os.path.join(logdir, "checkpoints", "2")
    t0 = time.time()
    while not os.path.isdir(path):
      assert trainer.poll() is None, trainer.communicate()
      assert time.time() - t0 < 300, "no checkpoint 2 after 300 s"
      time.sleep(0.05)
    generator.send_signal(signal.SIGKILL)
    killed = time.time()
    _, err = trainer.communicate(timeout=60)
    waited = time.time() - killed
  finally:
    for p in (trainer, generator):
      if p.poll() is None:
        p.kill()
  assert trainer.returncode == 1, err[-3000:]
  assert waited < 20, f"the trainer took {waited:.1f} s to stop"
  last = err.strip().splitlines()[-1]
  assert last.startswith("rljax.alignment.rollouts.GeneratorError: the generator failed on the "
                         "batch of RL step "), last
  assert "the generator (process 1) stopped (no heartbeat for " in last, last
  step = int(last.split("batch of RL step ")[1].split(":")[0])
  saved = sorted(int(d) for d in os.listdir(os.path.join(logdir, "checkpoints")) if d.isdigit())
  assert 2 <= saved[-1] < step <= 1000, (saved, step)
  got, policy, train = checkpointing.load_state_items(logdir, step=saved[-1])  # intact
  assert got == saved[-1] and int(train["step"]) == saved[-1] and policy
