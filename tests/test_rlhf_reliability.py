"""RLHF trainer reliability: exact resume after SIGKILL/SIGTERM, truncated checkpoints,
determinism (rljax/alignment/checkpointing.py, experiments/train_rlhf.py)."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rljax import checkpoint as ckpt
from rljax.alignment import checkpointing
from rljax.alignment import stages as stages_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "train_rlhf.py")

# The embedded default (addition task, tiny Llama-style LM, PPO with a critic) with no
# pre-training/SFT and no accuracy evaluation: 6 RL steps of 8 prompts, a checkpoint after
# every step, asynchronous (--max_staleness=1: a batch is always in flight on the generator
# thread when a checkpoint is written or the process is killed, so resume must regenerate it
# from the weights the checkpoint holds). The synchronous trainer's SIGKILL resume is tested
# on the preference pipeline (tests/test_rlhf_preference_resume.py).
LAST_STEP = 6
FLAGS = ["--pretrain_steps=0", "--sft_steps=0", "--num_eval_prompts=0",
         f"--num_steps={LAST_STEP}", "--prompts_per_step=8", "--checkpoint_every=1",
         "--keep_checkpoints=10", "--max_staleness=1"]


def _cmd(logdir, cache):
  # One persistent compilation cache for the module: later runs load the programs the first
  # compiled (the same executables, so the results are unchanged).
  return [sys.executable, SCRIPT, f"--logdir={logdir}", f"--compilation_cache_dir={cache}",
          *FLAGS]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, cache):
  """An uninterrupted run of the same command."""
  logdir = str(tmp_path_factory.mktemp("ref") / "run")
  out = subprocess.run(_cmd(logdir, cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return logdir


def _final_items(logdir):
  step, policy, train = checkpointing.load_state_items(logdir, step=LAST_STEP)
  assert step == LAST_STEP
  assert any(k.startswith("['critic']") for k in train) and "key" in train
  assert any("lagged_actor" in k for k in train)  # the in-flight batch's generating weights
  return policy, train


def _assert_items_equal(a, b):
  """Bitwise: actor params (policy item) and critic params, optimizer states, KL state, step,
  data position and PRNG key (train_state item)."""
  for x, y in zip(a, b):
    assert sorted(x) == sorted(y)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _rl_records(logdir):
  """metrics.jsonl's RL records without wall times (which differ between runs)."""
  return [{k: v for k, v in r.items() if not k.startswith("timing/")}
          for r in checkpointing.rl_history(os.path.join(logdir, "metrics.jsonl"))]


def _wait_for_checkpoint(logdir, step, proc, timeout=300):
  path = os.path.join(logdir, "checkpoints", str(step))
  t0 = time.time()
  while not os.path.isdir(path):
    assert proc.poll() is None, f"training exited early: {proc.communicate()}"
    assert time.time() - t0 < timeout, f"no checkpoint {step} after {timeout} s"
    time.sleep(0.01)


@pytest.mark.slow
def test_asynchronous_run_writes_timeline_policy_lag_and_overlap(reference_run):
  """``train_rlhf.py --max_staleness=1 --logdir=D``: D/timeline.png, a per-step
  ``rollout/policy_lag_max`` in D/metrics.jsonl (batch 1 from the starting weights, then one
  update old) and the overlap figures in D/summary.json."""
  for picture in ("timeline.png", "kl.png"):  # kl.png: the KL to the reference per step
    with open(os.path.join(reference_run, picture), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", picture
  lags = [r["rollout/policy_lag_max"]
          for r in checkpointing.rl_history(os.path.join(reference_run, "metrics.jsonl"))]
  assert lags == [0.0] + [1.0] * (LAST_STEP - 1)
  summary = json.load(open(os.path.join(reference_run, "summary.json")))
  assert 0 <= summary["overlap_fraction"] <= 1 and summary["step_generation_s"] > 0
  assert summary["step_overlap_s"] <= summary["step_update_s"] + 1e-9


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_exact(reference_run, cache, tmp_path):
  logdir = str(tmp_path / "run")
  kill_after = random.Random().randint(1, LAST_STEP - 2)  # an arbitrary step
  proc = subprocess.Popen(_cmd(logdir, cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  _wait_for_checkpoint(logdir, kill_after, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  saved = sorted(int(d) for d in os.listdir(os.path.join(logdir, "checkpoints")) if d.isdigit())
  assert kill_after <= saved[-1] < LAST_STEP, saved
  out = subprocess.run(_cmd(logdir, cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"resuming {logdir} after RL step {saved[-1]}" in out.stdout, out.stdout[-2000:]
  assert "loaded the SFT model from" in out.stdout  # the frozen reference, not re-trained
  _assert_items_equal(_final_items(logdir), _final_items(reference_run))
  # The metrics of every step (rewards, KL, losses, ...) equal the uninterrupted run's too.
  assert _rl_records(logdir) == _rl_records(reference_run)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_resumes_exactly(reference_run, cache, tmp_path):
  logdir = str(tmp_path / "run")
  proc = subprocess.Popen(_cmd(logdir, cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  _wait_for_checkpoint(logdir, 1, proc)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode == ckpt.EXIT_PREEMPTED == 75, stderr[-3000:]
  assert "preempted by SIGTERM; checkpointed step" in stderr
  saved = sorted(int(d) for d in os.listdir(os.path.join(logdir, "checkpoints")) if d.isdigit())
  assert saved[-1] < LAST_STEP
  assert f"checkpointed step {saved[-1]} in {logdir}; exiting with status 75" in stderr
  out = subprocess.run(_cmd(logdir, cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  _assert_items_equal(_final_items(logdir), _final_items(reference_run))
  assert _rl_records(logdir) == _rl_records(reference_run)


def _truncate_largest_file(directory):
  files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]
  target = max(files, key=os.path.getsize)
  with open(target, "r+b") as f:
    f.truncate(os.path.getsize(target) // 2)


@pytest.mark.slow
def test_finished_run_resumes_to_nothing_left_to_train(reference_run, cache, tmp_path):
  """The same command on a finished run says so, trains nothing and changes no result."""
  logdir = str(tmp_path / "run")
  shutil.copytree(reference_run, logdir)
  kept = {name: open(os.path.join(logdir, name), "rb").read()
          for name in ("summary.json", "metrics.jsonl")}
  events = sorted(f for f in os.listdir(logdir) if f.startswith("events.out.tfevents"))
  jsonl_mtime = os.stat(os.path.join(logdir, "metrics.jsonl")).st_mtime_ns
  out = subprocess.run(_cmd(logdir, cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  said = out.stdout + out.stderr
  assert f"{logdir} has finished all {LAST_STEP} RL steps: nothing left to train" in said, said
  assert "resuming" not in said
  _assert_items_equal(_final_items(logdir), _final_items(reference_run))
  assert _rl_records(logdir) == _rl_records(reference_run)
  # Nothing is logged again, and summary.json keeps the training run's times,
  # which the summary line prints again.
  for name, data in kept.items():
    assert open(os.path.join(logdir, name), "rb").read() == data, name
  # ... not even an empty event file, and metrics.jsonl is not rewritten.
  assert sorted(f for f in os.listdir(logdir) if f.startswith("events.out.tfevents")) == events
  assert os.stat(os.path.join(logdir, "metrics.jsonl")).st_mtime_ns == jsonl_mtime
  wall = json.loads(kept["summary.json"])["wall_s"]
  assert f"wall {wall:.0f} s (the finished run's, from summary.json); logdir {logdir}" \
      in out.stdout, out.stdout[-1000:]


@pytest.mark.slow
def test_truncated_newest_checkpoint_falls_back_to_previous(reference_run, tmp_path):
  logdir = str(tmp_path / "run")
  shutil.copytree(reference_run, logdir)
  _truncate_largest_file(os.path.join(logdir, "checkpoints", str(LAST_STEP), "train_state"))
  _, policy_prev, train_prev = checkpointing.load_state_items(logdir, step=LAST_STEP - 1)
  lines = []
  # The restore the trainer runs on resume (templates: any tree of the same structure).
  with ckpt.make_manager(logdir, max_to_keep=10) as manager:
    step, policy, train = ckpt.restore(manager, policy_prev, train_prev, log=lines.append)
    assert step == LAST_STEP - 1, lines
    assert max(manager.all_steps()) == LAST_STEP - 1  # the bad one is set aside...
  assert any(f"checkpoint {LAST_STEP} in" in l and "unreadable, skipping it" in l
             for l in lines), lines
  assert os.path.isdir(os.path.join(logdir, "checkpoints", f"{LAST_STEP}.unreadable"))  # ...kept
  for k in policy_prev:
    np.testing.assert_array_equal(np.asarray(policy[k]), policy_prev[k])
  for k in train_prev:
    np.testing.assert_array_equal(np.asarray(train[k]), train_prev[k])


@pytest.mark.slow
def test_same_seed_gives_identical_rollouts_and_metrics():
  # Two runs of 2 steps from the same seed's initial state, on one trainer (one compilation;
  # across processes the subprocess tests above compare every step's metrics as well).
  from test_rlhf import _trainer

  from rljax import ppo

  tr = _trainer(algo="ppo", num_steps=2, kl_controller="adaptive",
                ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=2))
  init = checkpointing.state_items(tr.state)
  init = tuple({k: np.array(v) for k, v in item.items()} for item in init)
  runs = []
  for _ in range(2):
    tr.state = checkpointing.state_from_items(tr.state, *init)
    recs, tokens = [], []
    for _ in range(2):
      rec = tr.step()
      recs.append({k: v for k, v in rec.items() if not k.startswith("timing/")})
      tokens.append(tr.last_batch["response_tokens"].copy())
    runs.append((recs, tokens, checkpointing.state_items(tr.state)))
  (recs_a, tok_a, items_a), (recs_b, tok_b, items_b) = runs
  for a, b in zip(tok_a, tok_b):
    np.testing.assert_array_equal(a, b)
  assert recs_a == recs_b
  assert not np.array_equal(tok_a[0], tok_a[1])  # the key stream advanced between steps
  _assert_items_equal(items_a, items_b)


@pytest.mark.slow
def test_sigterm_in_sft_saves_it_resumes_it_and_after_sft_checkpoints_rl_step_0(
    tmp_path, monkeypatch):
  """In-process, as the script's SIGTERM flag sees it. A SIGTERM during SFT stops it at the
  next step (`StageInterrupted`, exit 75 in the script) with the ended pre-training and SFT's
  state saved under ``<logdir>/stages``. The rerun skips pre-training, continues SFT from its
  step, and a SIGTERM after SFT takes effect when RL starts: the SFT model is in
  ``<logdir>/frozen`` (the stages' folder is removed), RL step 0 is checkpointed. The third run
  loads both (no training before RL) and ends equal to an uninterrupted run."""
  from rljax.alignment import pipeline, sft

  config = pipeline.EmbeddedConfig(
      pretrain_steps=3, sft_steps=2, batch_size=8, num_eval_prompts=0,
      rl=pipeline.default_rl_config("ppo", num_steps=2, prompts_per_step=8))
  reference = str(tmp_path / "reference")
  pipeline.run_embedded(config, logdir=reference, log=lambda *_: None)
  logdir = str(tmp_path / "run")

  check_stop = sft.check_stop
  steps_run = []

  def sigterm_at_sft_step_1(should_stop, prefix, step, num_steps):
    steps_run.append((prefix, step))
    if (prefix, step) == ("sft/", 1):
      os.kill(os.getpid(), signal.SIGTERM)  # the flag's handler only sets it
    check_stop(should_stop, prefix, step, num_steps)

  monkeypatch.setattr(sft, "check_stop", sigterm_at_sft_step_1)
  save_stage, saves = stages_lib.save_stage, []

  def recorded_save(logdir, stage, state, *, done, **kw):
    saves.append((stage, state.step, done))
    return save_stage(logdir, stage, state, done=done, **kw)

  monkeypatch.setattr(stages_lib, "save_stage", recorded_save)
  lines = []
  with ckpt.SigtermFlag() as flag, pytest.raises(checkpointing.StageInterrupted) as e:
    pipeline.run_embedded(config, logdir=logdir, log=lines.append, sigterm=flag,
                          stage_checkpoint_every=2)
  # Saved every 2 steps, at the stage's end and on the SIGTERM; each logged record printed.
  assert saves == [("pretrain", 2, False), ("pretrain", 3, True), ("sft", 1, False)], saves
  assert [l.split(":")[0] for l in lines if " step " in l] == [
      "pretrain step 1/3", "pretrain step 2/3", "pretrain step 3/3", "sft step 1/2"], lines
  stages = os.path.join(os.path.abspath(logdir), "stages")
  assert str(e.value) == (f"preempted by SIGTERM during sft (after step 1 of 2): its "
                          f"state is saved in {stages}/sft-1, and the same command resumes it")
  assert steps_run[-1] == ("sft/", 1) and not checkpointing.has_frozen(logdir)
  assert ckpt.newest_step(logdir) is None
  assert {k: (m["step"], m["done"]) for k, m in stages_lib.saved_stages(logdir).items()} == {
      "pretrain": (3, True), "sft": (1, False)}
  monkeypatch.setattr(sft, "check_stop", check_stop)
  from rljax.metrics import read_jsonl

  def stage_steps():
    return [(r["stage"], r["step"]) for r in read_jsonl(os.path.join(logdir, "metrics.jsonl"))]

  assert stage_steps()[-1] == ("sft", 1)  # the interrupted start's records
  # A --noresume start is refused: the saved stages are the run's state.
  with pytest.raises(ValueError, match=re.escape(
      "already holds a train_rlhf.py run on the embedded task (saved stages: pretrain ended at "
      "step 3, sft stopped after step 1); run the command without --noresume to resume it")):
    pipeline.run_embedded(config, logdir=logdir, log=lambda *_: None, resume=False)

  train_sft = sft.train_sft
  calls = []

  def train_sft_then_sigterm(*args, **kwargs):
    calls.append((kwargs.get("prefix"), kwargs.get("state") and kwargs["state"].step))
    out = train_sft(*args, **kwargs)
    if kwargs.get("prefix") == "sft/":
      os.kill(os.getpid(), signal.SIGTERM)
    return out

  monkeypatch.setattr(sft, "train_sft", train_sft_then_sigterm)
  lines = []
  with ckpt.SigtermFlag() as flag, pytest.raises(checkpointing.Preempted) as e:
    pipeline.run_embedded(config, logdir=logdir, log=lines.append, sigterm=flag)
  assert e.value.step == 0 and calls == [("sft/", 1)], calls  # pre-training was not re-run
  assert f"pretrain: loaded the finished stage (3 steps) from {stages}/pretrain-3-done" in lines
  assert f"sft: resuming after step 1 from {stages}/sft-1" in lines
  # The interrupted start's records were kept up to its saved steps: each stage logged once.
  assert stage_steps() == [("pretrain", 1), ("pretrain", 2), ("pretrain", 3), ("sft", 1),
                           ("sft", 2)], stage_steps()
  assert os.path.isdir(checkpointing.frozen_dir(logdir)) and not os.path.exists(stages)
  assert sorted(d for d in os.listdir(os.path.join(logdir, "checkpoints")) if d.isdigit()) == ["0"]

  lines = []
  s = pipeline.run_embedded(config, logdir=logdir, log=lines.append)
  assert calls == [("sft/", 1)], "the rerun trained SFT again"
  assert s["resumed_from"] == 0
  assert f"loaded the SFT model from {checkpointing.frozen_dir(logdir)}" in lines
  for item_run, item_ref in zip(checkpointing.load_state_items(logdir)[1:],
                                checkpointing.load_state_items(reference)[1:]):
    assert item_run.keys() == item_ref.keys()
    for k in item_ref:
      np.testing.assert_array_equal(item_run[k], item_ref[k], err_msg=k)
