"""Control trainer reliability: exact resume after SIGKILL/SIGTERM, corrupt checkpoints,
and the non-finite guard."""

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import checkpoint as ckpt
from rljax import envs
from rljax.control import trainer
from rljax.control.config import ControlConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "train_control.py")

# 6 chunks of 2 iterations each, a checkpoint after every chunk; seconds per chunk.
SETTINGS = dict(
    env="playground/CartpoleBalance", num_timesteps=6 * 2 * 16 * 8, num_envs=16, unroll_length=8,
    num_minibatches=2, num_epochs=2, num_evals=7, num_eval_envs=4, episode_length=50,
    policy_hidden=(8,), value_hidden=(8,), keep_checkpoints=10,
)
LAST_CHUNK = 6


def _flags(settings):
  return [f"--{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in settings.items()]


def _cmd(logdir, cache):
  # One persistent compilation cache for all runs of this module: the runs after the
  # first load their programs instead of compiling them (same executables, so the
  # results are unchanged).
  return [sys.executable, SCRIPT, f"--logdir={logdir}", "--noprogress",
          f"--compilation_cache_dir={cache}", *_flags(SETTINGS)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jax_cache"))


def _final_params(logdir):
  _, params, stats = trainer.load_params(logdir, step=LAST_CHUNK)
  return [np.asarray(x) for x in jax.tree.leaves((params, stats))]


def _assert_bitwise_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


def _wait_for_checkpoint(logdir, chunk, proc, timeout=240):
  path = os.path.join(logdir, "checkpoints", str(chunk))
  t0 = time.time()
  while not os.path.isdir(path):
    assert proc.poll() is None, f"training exited early: {proc.communicate()}"
    assert time.time() - t0 < timeout, f"no checkpoint {chunk} after {timeout} s"
    time.sleep(0.05)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, cache):
  """An uninterrupted run of the same command."""
  logdir = str(tmp_path_factory.mktemp("ref") / "run")
  out = subprocess.run(_cmd(logdir, cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return logdir


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_exact(reference_run, cache, tmp_path):
  logdir = str(tmp_path / "run")
  kill_after = random.Random().randint(1, LAST_CHUNK - 1)  # an arbitrary chunk
  proc = subprocess.Popen(_cmd(logdir, cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  _wait_for_checkpoint(logdir, kill_after, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  out = subprocess.run(_cmd(logdir, cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resuming" in out.stdout, out.stdout[-2000:]
  _assert_bitwise_equal(_final_params(logdir), _final_params(reference_run))


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_resumes_exactly(reference_run, cache, tmp_path):
  logdir = str(tmp_path / "run")
  proc = subprocess.Popen(_cmd(logdir, cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  _wait_for_checkpoint(logdir, 1, proc)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=240)
  assert proc.returncode == trainer.EXIT_PREEMPTED == 75, stderr[-3000:]
  assert "preempted by SIGTERM; checkpointed chunk" in stderr
  saved = sorted(int(d) for d in os.listdir(os.path.join(logdir, "checkpoints")) if d.isdigit())
  assert saved[-1] < LAST_CHUNK
  out = subprocess.run(_cmd(logdir, cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  _assert_bitwise_equal(_final_params(logdir), _final_params(reference_run))


@pytest.mark.slow
def test_sigterm_during_start_up_preempts_with_nothing_written(tmp_path, monkeypatch):
  """A SIGTERM while the environments build and the programs compile (before the trainer's
  loop) raises `Preempted` too (the scripts exit 75), once the compiles end: no checkpoint,
  no record. (Sent to this process right after the trainer is built, as SLURM would.)"""
  make = trainer.make_trainer

  def make_then_sigterm(*args, **kwargs):
    built = make(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets a flag
    return built

  monkeypatch.setattr(trainer, "make_trainer", make_then_sigterm)
  config = ControlConfig().replace(**dict(SETTINGS, num_timesteps=3 * 2 * 16 * 8, num_evals=4))
  logdir = str(tmp_path / "run")
  with pytest.raises(trainer.Preempted) as e:
    trainer.train(config, logdir, progress=False)
  assert str(e.value) == (f"preempted by SIGTERM during start-up, before training; nothing new "
                          f"to checkpoint: the run resumes from the start in {logdir}")
  assert os.listdir(os.path.join(logdir, "checkpoints")) == [ckpt.CONFIG_FILE]
  assert not os.path.exists(os.path.join(logdir, "metrics.jsonl"))


def _truncate_largest_file(directory):
  files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]
  target = max(files, key=os.path.getsize)
  with open(target, "r+b") as f:
    f.truncate(os.path.getsize(target) // 2)
  return target


@pytest.mark.slow
def test_finished_run_reruns_as_a_no_op_and_truncated_newest_checkpoint_falls_back(tmp_path):
  config = ControlConfig().replace(**dict(SETTINGS, num_timesteps=3 * 2 * 16 * 8, num_evals=4))
  logdir = str(tmp_path / "run")
  done = trainer.train(config, logdir, progress=False)
  assert [h["step"] for h in done.history] == [0, 1, 2, 3]
  # The same command again, after the end: nothing trains or compiles, the logs stay as
  # they were, and the result is the finished run's (state and every record).
  files = sorted(os.listdir(logdir))
  with open(os.path.join(logdir, "metrics.jsonl")) as f:
    jsonl = f.read()
  lines = []
  again = trainer.train(config, logdir, progress=False, log=lines.append)
  assert again.resumed_from == 3 and again.num_compiled == 0, lines
  assert any("has finished all 3 chunks" in l and "nothing left to train" in l for l in lines)
  assert sorted(os.listdir(logdir)) == files  # no new TensorBoard file
  with open(os.path.join(logdir, "metrics.jsonl")) as f:
    assert f.read() == jsonl
  assert again.history == done.history
  _assert_bitwise_equal(jax.tree.leaves(jax.device_get(again.train_state)),
                        jax.tree.leaves(jax.device_get(done.train_state)))
  # Killed before checkpoint 3 was written: the resume's restored state has the avals and
  # placement the train chunk and the evaluation were compiled for at start-up, so each
  # compiles once (orbax restores arrays committed to a device, which compiled both again,
  # 13-46 s per resumed run, before `trainer._uncommitted`).
  killed = str(tmp_path / "killed")
  shutil.copytree(logdir, killed)
  shutil.rmtree(os.path.join(killed, "checkpoints", "3"))
  compiles = []
  handler = logging.Handler()
  handler.emit = lambda r: compiles.append(r.getMessage().split(" with ")[0])
  logging.getLogger("jax").addHandler(handler)
  jax.config.update("jax_log_compiles", True)
  try:
    redone = trainer.train(config, killed, progress=False)
  finally:
    jax.config.update("jax_log_compiles", False)
    logging.getLogger("jax").removeHandler(handler)
  assert redone.resumed_from == 2
  assert compiles.count("Compiling jit(chunk)") == 1, compiles
  assert compiles.count("Compiling jit(run)") == 1, compiles
  _assert_bitwise_equal(jax.tree.leaves(jax.device_get(redone.train_state)),
                        jax.tree.leaves(jax.device_get(done.train_state)))
  _truncate_largest_file(os.path.join(logdir, "checkpoints", "3", "train_state"))
  # Corrupt the policy of chunk 3 too, then resume: chunk 3 must be reported and
  # skipped, chunk 2 restored, and chunk 3 redone to the same result.
  _truncate_largest_file(os.path.join(logdir, "checkpoints", "3", "policy"))
  lines = []
  resumed = trainer.train(config, logdir, progress=False, log=lines.append)
  assert resumed.resumed_from == 2, lines
  assert any("checkpoint 3" in l and "unreadable, skipping it" in l for l in lines), lines
  _assert_bitwise_equal(
      [np.asarray(x) for x in jax.tree.leaves(resumed.train_state.params)],
      [np.asarray(x) for x in jax.tree.leaves(done.train_state.params)],
  )


def test_start_that_saved_no_checkpoint_does_not_bind_the_next_run(tmp_path):
  # A start stopped before its first checkpoint (e.g. while compiling) left its config and a
  # record; the next command in that logdir, with another config, trains from chunk 0 and its
  # metrics.jsonl holds only its own records.
  logdir = str(tmp_path / "run")
  other = ControlConfig().replace(**dict(SETTINGS, num_timesteps=3 * 2 * 16 * 8, num_evals=4, seed=7))
  ckpt.write_json_atomic(os.path.join(ckpt.checkpoint_dir(logdir), ckpt.CONFIG_FILE),
                         {"control": json.loads(other.to_json())})
  with open(os.path.join(logdir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 0, "env_steps": 0, "eval/episode_reward": -1.0}) + "\n")
  config = dataclasses.replace(other, seed=0)
  result = trainer.train(config, logdir, progress=False)
  assert result.resumed_from is None
  with open(os.path.join(logdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [0, 1, 2, 3]
  assert records[0]["eval/episode_reward"] == result.history[0]["eval/episode_reward"] != -1.0
  assert ckpt.read_config(logdir)["control"]["seed"] == 0


@pytest.mark.slow
def test_script_nonfinite_halt_exits_3_with_the_last_good_state(tmp_path, cache):
  # reward_scaling 1e38 overflows the scaled returns to inf: the first chunk's updates are all
  # skipped (its state is the last good one), and --nonfinite=halt stops the script with
  # status 3 after checkpointing that chunk.
  logdir = str(tmp_path / "run")
  settings = dict(SETTINGS, num_evals=3, reward_scaling=1e38)
  out = subprocess.run([sys.executable, SCRIPT, f"--logdir={logdir}", "--noprogress",
                        f"--compilation_cache_dir={cache}", "--nonfinite=halt",
                        *_flags(settings)], capture_output=True, text=True, timeout=600)
  assert out.returncode == 3, out.stderr[-3000:]
  assert "error: non-finite loss_or_grad in chunk 1" in out.stderr, out.stderr[-3000:]
  assert "halted with the last good state checkpointed" in out.stderr
  assert "Traceback" not in out.stderr
  assert ckpt.newest_step(logdir) == 1
  _, params, _ = trainer.load_params(logdir, step=1)  # no non-finite update was applied
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


class _NaNRewardAt:
  """Wraps a Playground env: the reward is NaN at physics time step ``k`` only."""

  def __init__(self, env, k):
    self.env, self.k = env, k

  def reset(self, rng):
    return self.env.reset(rng)

  def step(self, state, action):
    state = self.env.step(state, action)
    at_k = jnp.abs(state.data.time - self.k * self.env.dt) < 0.5 * self.env.dt
    return state.replace(reward=jnp.where(at_k, jnp.nan, state.reward))

  def __getattr__(self, name):
    return getattr(self.env, name)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["skip", "halt"])
def test_nan_reward_is_skipped_and_counted(mode, monkeypatch, tmp_path):
  real_make = envs.make
  monkeypatch.setattr(envs, "make", lambda name, **kw: _NaNRewardAt(real_make(name, **kw), k=5))
  monkeypatch.setattr(envs, "_is_playground", lambda env: True)
  # Episodes of 1000 steps: the NaN happens once, in the first iteration.
  config = ControlConfig().replace(**dict(SETTINGS, num_timesteps=2 * 2 * 16 * 8, num_evals=3,
                                episode_length=1000, nonfinite=mode))
  lines = []
  if mode == "halt":
    with pytest.raises(trainer.NonFiniteHalt, match=r"non-finite reward.* in chunk 1"):
      trainer.train(config, str(tmp_path / "run"), progress=False, log=lines.append)
    _, params, _ = trainer.load_params(str(tmp_path / "run"), step=1)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
    return
  result = trainer.train(config, None, progress=False, log=lines.append)
  assert int(result.train_state.skipped_updates) == 1
  assert result.history[1]["nonfinite/skipped_updates"] == 1.0
  assert result.history[1]["nonfinite/reward"] == 1.0
  assert result.history[2]["nonfinite/reward"] == 0.0
  assert any("non-finite reward" in l and "in chunk 1" in l for l in lines), lines
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(result.train_state.params))
  # The other iteration did update: parameters moved from their initial values.
  _, init_params = trainer.make_trainer(config)
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(init_params), jax.tree.leaves(result.train_state.params)))
