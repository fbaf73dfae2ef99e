"""A real SLURM cluster on this machine (tests/slurm/slurm_up.sh): srun -n2, sbatch of the control
template, and a 2-node emulation. Skips with a reason when the cluster cannot be started (not root,
no apt/slurm). In CI `.ci/run` starts it first (SLURM_CONF exported) and these tests reuse it.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
UP, DOWN = os.path.join(HERE, "slurm", "slurm_up.sh"), os.path.join(HERE, "slurm", "slurm_down.sh")
WORKER = os.path.join(HERE, "_dist_worker.py")
PREEMPT_WORKER = os.path.join(HERE, "slurm", "preempt_worker.py")
TEMPLATE = os.path.join(ROOT, "experiments", "slurm", "control.sbatch")
SLURM_DIR = "/tmp/rljax-slurm-test"


def _run(cmd, env, timeout=120):
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _up(nnodes: int) -> dict:
  env = dict(os.environ, SLURM_DIR=SLURM_DIR, NNODES=str(nnodes), NCPU="8")
  env.pop("XLA_FLAGS", None)
  r = _run(["bash", UP], env, timeout=240)
  if r.returncode:
    _run(["bash", DOWN], env)
    pytest.skip(f"slurm could not be started: {(r.stdout + r.stderr)[-500:]}")
  env["SLURM_CONF"] = f"{SLURM_DIR}/slurm.conf"
  env["PATH"] = os.path.dirname(sys.executable) + ":" + env["PATH"]
  return env


def _text(path):
  return path.read_text() if path.exists() else ""


def _wait_for(predicate, what, timeout):
  t0 = time.time()
  while not predicate():
    assert time.time() - t0 < timeout, f"no {what} after {timeout} s"
    time.sleep(0.2)


def _preempt_and_requeue(env, tmp_path):
  """The template's preemption path: SIGTERM to the batch shell (as --signal=B:TERM@120 sends
  it) reaches every task, not srun (which would SIGKILL them); the tasks exit 75 and the job
  is requeued."""
  out = tmp_path / "preempt.out"
  env_p = dict(env, RLJAX_DIR=ROOT, RLJAX_SCRIPT=PREEMPT_WORKER, RLJAX_LOGDIR=str(tmp_path / "p"))
  r = _run(["sbatch", "--parsable", "--ntasks=2", "--ntasks-per-node=2", "--overcommit",
            f"--output={out}", TEMPLATE], env_p)
  assert r.returncode == 0, r.stdout + r.stderr
  job = r.stdout.strip().split(";")[0]
  try:
    _wait_for(lambda: _text(out).count("READY ") == 2, "2 tasks running", 60)
    r = _run(["scancel", "--batch", "--signal=TERM", job], env)
    assert r.returncode == 0, r.stdout + r.stderr
    _wait_for(lambda: "requeueing" in _text(out), "requeue", 60)
    text = _text(out)
    assert sorted(l for l in text.splitlines() if l.startswith("TERM ")) == ["TERM 0", "TERM 1"]
    assert "Exited with exit code 75" in text and "Killed" not in text, text[-3000:]
    assert "Restarts=1" in _run(["scontrol", "show", "job", job], env).stdout
  finally:
    _run(["scancel", job], env)


def _disaggregated_rlhf(env, tmp_path):
  """``srun -n2`` of train_rlhf.py --placement=disaggregated: task 0 trains, task 1 generates
  (the coordinator and the ranks from SLURM), asynchronously."""
  logdir = tmp_path / "rlhf"
  r = _run(["srun", "-N1", "-n2", "--overcommit", sys.executable,
            os.path.join(ROOT, "experiments", "train_rlhf.py"), "--placement=disaggregated",
            "--max_staleness=1", "--pretrain_steps=0", "--sft_steps=0", "--num_eval_prompts=0",
            "--num_steps=2", "--prompts_per_step=4", f"--logdir={logdir}"],
           dict(env, JAX_PLATFORMS="cpu"), timeout=240)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert "generator: 2 batches sampled; the trainer finished" in r.stdout, r.stdout[-2000:]
  assert r.stdout.count("embedded ppo: mean reward") == 1, r.stdout[-2000:]
  lags = [rec["rollout/policy_lag_max"] for rec in map(json.loads, open(logdir / "metrics.jsonl"))
          if rec.get("stage") == "rl"]
  assert lags == [0.0, 1.0], lags


def _results(out):
  return sorted(l.split() for l in out.splitlines() if l.startswith("RESULT "))


@pytest.fixture(scope="module")
def can_run():
  if os.geteuid() != 0:
    pytest.skip("the local slurm cluster needs root")
  if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
    pytest.skip("no slurm and no apt-get to install it")


@pytest.mark.slow
def test_slurm_srun_sbatch_and_two_nodes(can_run, tmp_path):
  # One test, sequential steps: a single cluster at a time even under pytest -n 2.
  t0 = time.time()
  env = _up(1)
  try:
    r = _run(["srun", "-N1", "-n2", "--overcommit", sys.executable, WORKER, "--heartbeat_timeout_s=10"],
             env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = _results(r.stdout)
    assert [x[1:4] for x in res] == [["0", "2", "2"], ["1", "2", "2"]], r.stdout
    assert res[0][4:] == res[1][4:]
    out = tmp_path / "sbatch.out"
    env_b = dict(env, RLJAX_DIR=ROOT, RLJAX_SCRIPT=WORKER, RLJAX_LOGDIR=str(tmp_path / "run"))
    r = _run(["sbatch", "--wait", "--ntasks=2", "--ntasks-per-node=2", "--overcommit", f"--output={out}",
              TEMPLATE], env_b, timeout=150)
    text = out.read_text() if out.exists() else ""
    assert r.returncode == 0, r.stdout + r.stderr + text[-3000:]
    assert len(_results(text)) == 2, text[-3000:]
    _preempt_and_requeue(env, tmp_path)
    _disaggregated_rlhf(env, tmp_path)
  finally:
    _run(["bash", DOWN], dict(env, SLURM_DIR=SLURM_DIR))
  env = _up(2)
  try:
    r = _run(["srun", "-N2", "-n2", sys.executable, WORKER, "--heartbeat_timeout_s=10"], env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = _results(r.stdout)
    assert [x[1:4] for x in res] == [["0", "2", "2"], ["1", "2", "2"]], r.stdout
  finally:
    _run(["bash", DOWN], dict(env, SLURM_DIR=SLURM_DIR))
  assert time.time() - t0 < 360
