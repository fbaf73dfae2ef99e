"""Resume of the stage scripts' runs (train_sft.py, train_reward_model.py ->
rljax.alignment.pipeline.run_preference / run_embedded with ``stop_after``): a run SIGTERMed during
reward-model training exits 75 with its stages saved, and the rerun ends with the uninterrupted
run's exported model, bit for bit; a rerun of a finished run trains nothing."""

import functools
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy

from rljax import checkpoint as ckpt
from rljax.alignment import checkpointing, pipeline, sft
from rljax.alignment import stages as stages_lib
from rljax.alignment import reward_model as rm_lib
from rljax.metrics import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config():
  # A tiny HH-RLHF run: BPE tokenizer of <= 300 tokens on 40 dialogue pairs, 10 steps each of
  # pre-training, SFT and reward-model training (a record every 2 reward-model steps).
  return pipeline.PreferenceConfig(vocab_size=300, pretrain_steps=10, sft_steps=10, rm_steps=10)


def _weights(logdir):
  return safetensors.numpy.load_file(os.path.join(logdir, "hf_model", "model.safetensors"))


def _records(logdir):
  return [{k: v for k, v in r.items() if not k.endswith("wall_s")}
          for r in read_jsonl(os.path.join(logdir, "metrics.jsonl"))]


@pytest.mark.slow
def test_reward_model_run_sigtermed_resumes_exactly_and_a_finished_rerun_trains_nothing(
    tmp_path, monkeypatch):
  from test_rlhf_preference_resume import _write_pairs

  data = str(tmp_path / "pairs.jsonl")
  _write_pairs(data)
  config = _config()
  quiet = lambda *_: None  # noqa: E731
  reference = str(tmp_path / "reference")
  pipeline.run_preference(data, config, logdir=reference, stop_after="rm", log=quiet)

  logdir = str(tmp_path / "run")
  check_stop = sft.check_stop

  def sigterm_at_rm_step_4(should_stop, prefix, step, num_steps):
    if (prefix, step) == ("rm/", 4):
      os.kill(os.getpid(), signal.SIGTERM)  # the flag's handler only sets it
    check_stop(should_stop, prefix, step, num_steps)

  monkeypatch.setattr(sft, "check_stop", sigterm_at_rm_step_4)
  status = checkpointing.run_preemptible(lambda sigterm: pipeline.run_preference(
      data, config, logdir=logdir, stop_after="rm", log=quiet, sigterm=sigterm,
      stage_checkpoint_every=3))
  monkeypatch.setattr(sft, "check_stop", check_stop)
  assert status == checkpointing.EXIT_PREEMPTED == 75
  assert {k: (m["step"], m["done"]) for k, m in stages_lib.saved_stages(logdir).items()} == {
      "pretrain": (10, True), "sft": (10, True), "rm": (4, False)}
  assert not os.path.exists(os.path.join(logdir, "hf_model"))
  # Refused: --noresume on it, another config, and an RLHF run in its folder.
  with pytest.raises(ValueError, match=re.escape(
      "already holds a train_reward_model.py run (saved stages: pretrain ended at step 10, sft "
      "ended at step 10, rm stopped after step 4); run the command without --noresume")):
    ckpt.check_logdir(logdir, pipeline.saved_run(config, data, stop_after="rm"), resume=False)
  with pytest.raises(ValueError, match=r"different config \(rm_steps \(--num_steps\): saved "
                                       r"10, now 12\)"):
    ckpt.check_logdir(logdir, pipeline.saved_run(
        pipeline.PreferenceConfig(vocab_size=300, pretrain_steps=10, sft_steps=10, rm_steps=12),
        data, stop_after="rm"), resume=True, flag_names={"rm_steps": "--num_steps"})
  with pytest.raises(ValueError, match=r"holds a train_reward_model.py run, not a train_rlhf.py "
                                       r"--preference_data run \(its .*config.json says so\)"):
    ckpt.check_logdir(logdir, pipeline.saved_run(config, data), resume=True)

  lines = []
  s = pipeline.run_preference(data, config, logdir=logdir, stop_after="rm", log=lines.append)
  stages = os.path.join(logdir, "stages")
  assert f"sft: loaded the finished stage (10 steps) from {stages}/sft-10-done" in lines
  assert f"rm: resuming after step 4 from {stages}/rm-4" in lines
  assert not [l for l in lines if "nothing left to train" in l]
  ref_weights, weights = _weights(reference), _weights(logdir)
  assert weights.keys() == ref_weights.keys()
  for k in ref_weights:
    np.testing.assert_array_equal(weights[k], ref_weights[k], err_msg=k)
  assert _records(logdir) == _records(reference)  # each stage's records once, as uninterrupted

  def must_not_train(*args, **kwargs):
    raise AssertionError("a finished stage was trained again")

  monkeypatch.setattr(sft, "train_sft", must_not_train)
  monkeypatch.setattr(rm_lib, "train_reward_model", must_not_train)
  lines = []
  again = pipeline.run_preference(data, config, logdir=logdir, stop_after="rm", log=lines.append)
  assert f"{logdir} has finished its stages (pretrain, sft, rm): nothing left to train" in lines
  assert again["rm_accuracy"] == s["rm_accuracy"] and again["rm_ci"] == s["rm_ci"]
  for k, v in _weights(logdir).items():
    np.testing.assert_array_equal(v, ref_weights[k], err_msg=k)
  assert _records(logdir) == _records(reference)


@pytest.mark.slow
def test_sft_script_reruns_a_finished_run_and_refuses_noresume(tmp_path):
  """train_sft.py (embedded task): a second run of the same command loads both finished stages
  and trains nothing; ``--noresume`` or another ``--seed`` is refused with status 2."""
  logdir = str(tmp_path / "sft")
  cmd = [sys.executable, os.path.join(REPO, "experiments", "train_sft.py"), f"--logdir={logdir}",
         "--pretrain_steps=3", "--num_steps=2"]
  env = dict(os.environ, RLJAX_COMPILATION_CACHE=str(tmp_path / "cache"))
  run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=300, env=env)
  first = run(cmd)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "pretrain step 3/3: loss" in first.stdout and "sft step 2/2: loss" in first.stdout
  again = run(cmd)
  assert again.returncode == 0, again.stderr[-3000:]
  stages = os.path.join(os.path.abspath(logdir), "stages")
  assert f"pretrain: loaded the finished stage (3 steps) from {stages}/pretrain-3-done" in (
      again.stdout)
  assert "sft step" not in again.stdout and "pretrain step" not in again.stdout
  assert (f"{logdir} has finished its stages (pretrain, sft): nothing left to train"
          in again.stdout.splitlines()), again.stdout
  assert "nothing left to train" not in first.stdout
  assert first.stdout.splitlines()[-1].split(";")[0] == again.stdout.splitlines()[-1].split(";")[0]
  for extra, message in ((["--noresume"], "already holds a train_sft.py run on the embedded "
                                          "task (saved stages: pretrain ended at step 3, sft "
                                          "ended at step 2)"),
                         (["--num_steps=3"], "sft_steps (--num_steps): saved 2, now 3"),
                         (["--seed=1"], "seed: saved 0, now 1")):
    out = run(cmd + extra)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-3000:]
