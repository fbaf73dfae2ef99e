"""Exact resume of the --preference_data pipeline (experiments/train_rlhf.py ->
rljax.alignment.pipeline.run_preference): a run SIGTERMed during reward-model training, resumed,
SIGKILLed after its checkpoint of RL step 2 and resumed again ends with the same state, bit for
bit, as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rljax.alignment import checkpointing
from rljax.alignment import stages as stages_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "train_rlhf.py")

# A tiny HH-RLHF run: BPE tokenizer of <= 300 tokens on 40 dialogue pairs, 10 steps each of
# pre-training, SFT and reward-model training, then PPO (reward model, critic from it,
# adaptive KL) for LAST_STEP steps of 4 prompts, a checkpoint after every step.
LAST_STEP = 6
KILL_AFTER = 2
FLAGS = ["--vocab_size=300", "--pretrain_steps=10", "--sft_steps=10", "--rm_steps=10",
         f"--num_steps={LAST_STEP}", "--prompts_per_step=4", "--checkpoint_every=1",
         "--keep_checkpoints=10"]
TOPICS = ["cats", "the weather", "cooking rice", "a bike", "the moon", "tea", "running", "books"]


def _write_pairs(path, n=40):
  """HH-RLHF lines: two dialogues sharing the prompt up to the last "\\n\\nAssistant:"."""
  with open(path, "w", encoding="utf-8") as f:
    for i in range(n):
      t = TOPICS[i % len(TOPICS)]
      prompt = f"\n\nHuman: Tell me about {t}, please ({i}).\n\nAssistant:"
      if i % 3 == 0:  # some two-turn dialogues
        prompt = f"\n\nHuman: Hi!\n\nAssistant: Hello.\n\nHuman: And {t}? ({i})\n\nAssistant:"
      f.write(json.dumps({
          "chosen": prompt + f" Sure, here is a short helpful answer about {t}.",
          "rejected": prompt + f" No. Go away, {t} is boring.",
      }) + "\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("pref")
  data = str(root / "pairs.jsonl")
  _write_pairs(data)
  return data, str(root / "jax_cache")


def _cmd(data, logdir, cache):
  # One persistent compilation cache: later runs load the programs the first compiled.
  return [sys.executable, SCRIPT, f"--preference_data={data}", f"--logdir={logdir}",
          f"--compilation_cache_dir={cache}", *FLAGS]


def _final_items(logdir):
  step, policy, train = checkpointing.load_state_items(logdir, step=LAST_STEP)
  assert step == LAST_STEP
  assert any(k.startswith("['critic']") for k in train) and "key" in train
  return policy, train


def _rl_records(logdir):
  """metrics.jsonl's RL records without wall times (which differ between runs)."""
  return [{k: v for k, v in r.items() if not k.startswith("timing/")}
          for r in checkpointing.rl_history(os.path.join(logdir, "metrics.jsonl"))]


def _stage_records(logdir):
  """metrics.jsonl's records of the stages before RL, without wall times."""
  from rljax.metrics import read_jsonl

  return [{k: v for k, v in r.items() if not k.endswith("wall_s")}
          for r in read_jsonl(os.path.join(logdir, "metrics.jsonl"))
          if r.get("stage") in ("pretrain", "sft", "rm", "rm_norm")]


@pytest.mark.slow
def test_preference_sigkill_then_resume_is_bitwise_exact(setup, tmp_path):
  data, cache = setup
  ref = str(tmp_path / "ref")
  out = subprocess.run(_cmd(data, ref, cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]

  logdir = str(tmp_path / "run")
  # A SIGTERM once SFT has ended (its summary line printed) stops reward-model training at its
  # next step: exit 75, with the ended pre-training and SFT and the reward model's state saved.
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  with open(tmp_path / "stderr.txt", "w+", encoding="utf-8") as err:
    proc = subprocess.Popen(_cmd(data, logdir, cache), stdout=subprocess.PIPE, stderr=err,
                            text=True, env=env)
    for line in proc.stdout:
      if line.startswith("sft: "):
        proc.send_signal(signal.SIGTERM)
        break
    assert proc.wait(timeout=300) == 75, proc.stdout.read()
    err.seek(0)
    stderr = err.read()
  marker = {k: (m["step"], m["done"]) for k, m in stages_lib.saved_stages(logdir).items()}
  assert marker.keys() == {"pretrain", "sft", "rm"} and marker["pretrain"] == marker["sft"] == (
      10, True) and not marker["rm"][1] and marker["rm"][0] < 10, marker
  stages = os.path.join(logdir, "stages")
  assert (f"preempted by SIGTERM during rm (after step {marker['rm'][0]} of 10): its "
          f"state is saved in {stages}/rm-{marker['rm'][0]}, and the same command resumes it; "
          f"exiting with status 75") in stderr, stderr[-2000:]

  proc = subprocess.Popen(_cmd(data, logdir, cache), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
  path, t0 = os.path.join(logdir, "checkpoints", str(KILL_AFTER)), time.time()
  while not os.path.isdir(path):
    assert proc.poll() is None, f"training exited early: {proc.communicate()}"
    assert time.time() - t0 < 300, f"no checkpoint {KILL_AFTER} after 300 s"
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  stdout = proc.communicate(timeout=60)[0]
  assert proc.returncode == -signal.SIGKILL
  # It resumed the stages: pre-training and SFT loaded, the reward model continued.
  assert (f"pretrain: loaded the finished stage (10 steps) from {stages}/pretrain-10-done"
          in stdout), stdout[-2000:]
  assert f"sft: loaded the finished stage (10 steps) from {stages}/sft-10-done" in stdout
  assert f"rm: resuming after step {marker['rm'][0]} from {stages}/rm-{marker['rm'][0]}" in stdout
  assert not os.path.exists(stages)  # removed once the frozen roles were saved
  saved = sorted(int(d) for d in os.listdir(os.path.join(logdir, "checkpoints")) if d.isdigit())
  assert KILL_AFTER <= saved[-1] < LAST_STEP, saved

  out = subprocess.run(_cmd(data, logdir, cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"resuming {logdir} after RL step {saved[-1]}" in out.stdout, out.stdout[-2000:]
  # The frozen roles and the tokenizer come from the interrupted run, not re-trained.
  assert "loaded the SFT and reward models from" in out.stdout
  assert not [l for l in out.stdout.splitlines() if l.startswith(("pretrain:", "sft:",
                                                                   "reward model"))], out.stdout
  # Actor (policy item); critic, both optimizer states, KL controller, step, data position
  # and PRNG key (train_state item): bit for bit.
  for a, b in zip(_final_items(logdir), _final_items(ref)):
    assert sorted(a) == sorted(b)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  # Every RL step's metrics (rewards, KL, losses, ...) equal the uninterrupted run's too.
  assert _rl_records(logdir) == _rl_records(ref)
  # And so do the stages' records (the reward model's window spans its interruption).
  assert _stage_records(logdir) == _stage_records(ref) != []
  from rljax.metrics import read_jsonl

  for d in (logdir, ref):  # one record per stage and step
    keys = [(r.get("stage"), r["step"]) for r in read_jsonl(os.path.join(d, "metrics.jsonl"))]
    assert len(keys) == len(set(keys)) and ("rm_norm", 10) in keys, keys
  # summary.json, as the embedded pipeline writes it: the resumed run's whole-history summary
  # equals the uninterrupted run's, and it names the step it resumed after.
  summaries = []
  for d in (logdir, ref):
    with open(os.path.join(d, "summary.json"), encoding="utf-8") as f:
      summaries.append(json.load(f))
  assert summaries[0]["resumed_from"] == saved[-1] and summaries[1]["resumed_from"] is None
  assert summaries[0]["hf_model"] == os.path.join(logdir, "hf_model")
  for k in ("reward_first", "reward_last", "kl_max", "kl_last", "summary_steps", "rm_accuracy",
            "num_pairs"):
    assert summaries[0][k] == summaries[1][k], k
  assert summaries[0]["summary_steps"] == LAST_STEP // 2
  # The console's per-step line is the embedded pipeline's (first and last step shown).
  assert f"rl step {LAST_STEP:4d}: reward " in out.stdout and "ppo step" not in out.stdout
  # Both export the trained actor in Hugging Face format, identically, and transformers loads
  # it with the tokenizer.
  import safetensors.numpy
  import torch
  import transformers

  tensors = [safetensors.numpy.load_file(os.path.join(d, "hf_model", "model.safetensors"))
             for d in (logdir, ref)]
  assert sorted(tensors[0]) == sorted(tensors[1])
  for k in tensors[0]:
    np.testing.assert_array_equal(tensors[0][k], tensors[1][k], err_msg=k)
  hf_tok = transformers.AutoTokenizer.from_pretrained(os.path.join(logdir, "hf_model"))
  hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(logdir, "hf_model"))
  with torch.no_grad():
    logits = hf(torch.tensor([hf_tok("Tell me about tea.").input_ids])).logits
  assert torch.isfinite(logits).all()
  # Stage times, each run's own (as in the embedded pipeline's summary): the uninterrupted run
  # times each stage; the resumed one loaded frozen/ (its pretrain_s) and trained no stage.
  assert summaries[1]["pretrain_s"] > 0 and summaries[1]["sft_s"] > 0 and summaries[1]["rm_s"] > 0
  assert summaries[0]["pretrain_s"] > 0 and summaries[0]["sft_s"] == summaries[0]["rm_s"] == 0
  for s in summaries:
    assert s["pretrain_s"] + s["sft_s"] + s["rm_s"] + s["rl_s"] <= s["wall_s"] + 0.01, s
  # The same command on the finished run trains nothing and keeps its Hugging Face folder.
  weights = os.path.join(ref, "hf_model", "model.safetensors")
  before = os.stat(weights)
  with open(os.path.join(ref, "summary.json"), "rb") as f:
    summary_bytes = f.read()
  out = subprocess.run(_cmd(data, ref, cache), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"has finished all {LAST_STEP} RL steps: nothing left to train" in out.stdout
  assert f"kept {os.path.join(ref, 'hf_model')}" in out.stdout, out.stdout[-2000:]
  after = os.stat(weights)
  assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
  # summary.json keeps the training run's stage times (the re-run's own are a few seconds).
  with open(os.path.join(ref, "summary.json"), "rb") as f:
    assert f.read() == summary_bytes
  assert (f"wall {json.loads(summary_bytes)['wall_s']:.0f} s (the finished run's, from "
          f"summary.json); logdir {ref}") in out.stdout
