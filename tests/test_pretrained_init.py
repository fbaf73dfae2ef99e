"""``--model=HF_FOLDER`` (rljax.alignment.pipeline.load_pretrained): the alignment scripts start
from a pretrained Hugging Face model (tokenizer and weights), as OpenRLHF's ``--pretrain``.

Bad model folders (unsupported model_type, shape-mismatched tensors, missing folder or
config.json) are script cases in tests/test_bad_input.py, which builds its folders with
:func:`make_hf_folder` from here.
"""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rljax.alignment import pipeline, sft
from rljax.envs.text import data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIALOGUES = [
    ("What is the capital of France?", "Paris is the capital of France.", "I do not know."),
    ("How do I boil an egg?", "Put it in boiling water for eight minutes.", "Eggs are bad."),
    ("Tell me a joke.", "Why did the chicken cross the road? To get to the other side.", "No."),
    ("What is two plus two?", "Two plus two is four.", "Five."),
]


def hh_lines(n: int = 12) -> list[str]:
  """``n`` HH-RLHF JSON lines (``chosen``/``rejected`` dialogues)."""
  out = []
  for i in range(n):
    q, good, bad = DIALOGUES[i % len(DIALOGUES)]
    head = f"\n\nHuman: Hello {i}.\n\nAssistant: Hi!\n\nHuman: {q}\n\nAssistant:"
    out.append(json.dumps({"chosen": f"{head} {good}", "rejected": f"{head} {bad}"}))
  return out


def make_hf_folder(folder, *, seed: int = 0) -> str:
  """A tiny Llama checkpoint folder as ``transformers`` writes one: config.json,
  model.safetensors, tokenizer.json + tokenizer_config.json (a BPE tokenizer with a chat
  template, no pad token, as Llama's), with a model vocabulary padded past the tokenizer's."""
  import torch
  import transformers

  folder = str(folder)
  texts = [json.loads(line)["chosen"] for line in hh_lines()] * 4
  tok = data.train_bpe_tokenizer(texts, vocab_size=300)
  hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend,
                                                bos_token=data.BOS, eos_token=data.EOS)
  hf_tok.chat_template = tok.chat_template
  hf_tok.save_pretrained(folder)
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(
      vocab_size=tok.vocab_size + 7, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2,
      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
  transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
  return folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
  return make_hf_folder(tmp_path_factory.mktemp("hf") / "tiny-llama")


def _hf_logits(folder, tokens):
  import torch
  import transformers

  hf = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
  with torch.no_grad():
    return hf(torch.tensor(tokens)).logits.numpy()


def test_load_pretrained_matches_transformers(hf_folder):
  import transformers

  model, tok = pipeline.load_pretrained(hf_folder)
  hf_tok = transformers.AutoTokenizer.from_pretrained(hf_folder)
  text = "Hello. What is two plus two?"
  assert tok.encode(text) == hf_tok(text).input_ids
  assert tok.eos_token_id == hf_tok.eos_token_id == model.config.eos_token_id[0]
  assert tok.pad_token_id == tok.eos_token_id  # no pad token in the folder: pads with EOS
  assert model.config.vocab_size == tok.vocab_size + 7
  tokens = np.asarray([tok.encode(text)])
  np.testing.assert_allclose(np.asarray(model(tokens)), _hf_logits(hf_folder, tokens),
                             atol=1e-4)


def test_sft_stage_starts_from_the_pretrained_model(hf_folder, tmp_path, monkeypatch):
  """run_preference with ``model``: no pre-training; the model handed to SFT has the
  checkpoint's logits (checked against transformers on an SFT example of the data)."""
  path = tmp_path / "hh.jsonl"
  path.write_text("\n".join(hh_lines()) + "\n")
  calls = []

  def fake_train_sft(model, examples, config, *, prefix="", **kw):
    prompt, response = examples[0]
    tokens = np.asarray([list(prompt) + list(response)])
    calls.append((prefix, tokens, np.asarray(model(tokens)), config.learning_rate))
    return model, sft.fresh_state(model, config), [{f"{prefix}loss": 0.0}]

  monkeypatch.setattr(sft, "train_sft", fake_train_sft)
  cfg = dataclasses.replace(pipeline.preference_defaults(hf_folder), pretrain_steps=5,
                            sft_steps=2)
  s = pipeline.run_preference(str(path), cfg, logdir=str(tmp_path / "run"), stop_after="sft",
                              log=lambda msg: None)
  assert s["num_pairs"] == 12
  assert [c[0] for c in calls] == ["sft/"]  # pre-training skipped
  _, tokens, logits, lr = calls[0]
  assert lr == 5e-6  # OpenRLHF's SFT rate for a pretrained model, not the from-scratch 1e-3
  np.testing.assert_allclose(logits, _hf_logits(hf_folder, tokens), atol=1e-4)
  # The run's saved tokenizer is the model's (so a resumed run tokenizes the same way).
  saved = os.path.join(str(tmp_path / "run"), "tokenizer")
  from rljax.models.tokenizer import load_tokenizer

  assert load_tokenizer(saved).encode("What is two plus two?") == \
      pipeline.load_pretrained(hf_folder)[1].encode("What is two plus two?")


def test_pretrained_model_defaults_to_fine_tuning_learning_rates():
  """With a pretrained model the SFT, RM, actor and critic rates drop to OpenRLHF's (the
  from-scratch defaults are 200x, 56x, 100x and 56x higher); nothing else changes."""
  scratch, tuned = pipeline.preference_defaults(), pipeline.preference_defaults("m")
  assert scratch == pipeline.PreferenceConfig()
  assert (tuned.pretrain_lr / 2, tuned.rm_lr, tuned.rl.actor_lr, tuned.rl.critic_lr) == \
      (5e-6, 9e-6, 5e-7, 9e-6)
  assert (scratch.pretrain_lr / 2, scratch.rm_lr, scratch.rl.actor_lr, scratch.rl.critic_lr) == \
      (1e-3, 5e-4, 5e-5, 5e-4)
  same = dataclasses.replace(tuned, model=None, pretrain_lr=scratch.pretrain_lr,
                             rm_lr=scratch.rm_lr, rl=scratch.rl)
  assert same == scratch


def test_train_rlhf_with_model_starts_from_the_pretrained_rates(hf_folder, tmp_path):
  """train_rlhf.py's config with --model, read back from the resume check against a saved
  from-scratch config (the script stops there, before compiling): every learning rate is the
  pretrained one, and --critic_lr overrides its own."""
  from rljax.alignment import checkpointing

  path = tmp_path / "hh.jsonl"
  path.write_text("\n".join(hh_lines()) + "\n")
  logdir = tmp_path / "run"
  (logdir / "checkpoints" / "1").mkdir(parents=True)  # a saved step: the config binds
  saved = dict(checkpointing.config_to_json(pipeline.PreferenceConfig()), data=str(path))
  (logdir / "checkpoints" / "config.json").write_text(json.dumps({"rlhf_preference": saved}))
  out = subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "train_rlhf.py"),
       f"--preference_data={path}", f"--model={hf_folder}", "--critic_lr=2e-5",
       f"--logdir={logdir}", "--nocompilation_cache"],
      capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
  assert out.returncode == 2, out.stderr[-3000:]
  for diff in (f"(model: saved None, now {hf_folder!r};", "pretrain_lr: saved 0.002, now 1e-05;",
               "rl.actor_lr: saved 5e-05, now 5e-07;", "rl.critic_lr: saved 0.0005, now 2e-05;",
               "rm_lr: saved 0.0005, now 9e-06)"):
    assert diff in out.stderr, out.stderr[-3000:]


def test_tokenizer_with_model_is_refused():
  with pytest.raises(ValueError, match="--tokenizer cannot be combined with --model"):
    pipeline.PreferenceConfig(model="m", tokenizer="t")


@pytest.mark.slow
def test_sft_stage_exports_the_trained_model_for_transformers(tmp_path, monkeypatch):
  """run_preference from scratch (BPE tokenizer, tiny pre-training and SFT), stop_after="sft":
  ``<logdir>/hf_model`` holds the SFT-trained model, whose logits in ``transformers`` equal
  rljax's, and the run's tokenizer, which ``transformers`` encodes with identically."""
  import torch
  import transformers

  path = tmp_path / "hh.jsonl"
  path.write_text("\n".join(hh_lines()) + "\n")
  trained = []
  real_train_sft = sft.train_sft

  rates = []

  def keep_model(*args, **kw):
    out = real_train_sft(*args, **kw)
    trained.append(out[0])
    rates.append(args[2].learning_rate)
    return out

  monkeypatch.setattr(sft, "train_sft", keep_model)
  cfg = dataclasses.replace(pipeline.PreferenceConfig(), vocab_size=300, pretrain_steps=2,
                            sft_steps=2, hidden_size=32, num_layers=1, sft_lr=7e-4)
  logdir = str(tmp_path / "run")
  logged = []
  s = pipeline.run_preference(str(path), cfg, logdir=logdir, stop_after="sft",
                              log=logged.append)
  # 12 pairs hold out round(0.1 * 12) = 1, under MIN_HELD_OUT (30 = 0.1 * 300 pairs), but an
  # SFT-only run scores no held-out pair, so it notes nothing; it names the SFT rate it used.
  assert pipeline.held_out_note(1, 0.1) == (
      "note: 1 held-out pair(s) measure the reward model's accuracy only roughly (see its "
      "95% CI); 30 or more need about 300 pairs (--limit)")
  assert pipeline.held_out_note(30, 0.1) is None and pipeline.held_out_note(0, 0.0) is None
  assert not any(m.startswith("note:") for m in logged), logged
  assert "sft: 2 steps at learning rate 0.0007, response loss " in "\n".join(logged), logged
  assert rates == [2e-3, 7e-4]  # pre-training at lr, then SFT at sft_lr (not lr / 2)
  # Both stages count steps from 1 into one metrics.jsonl; each record names its stage.
  from rljax.metrics import read_jsonl

  records = read_jsonl(os.path.join(logdir, "metrics.jsonl"))
  assert [(r["stage"], r["step"]) for r in records] == [("pretrain", 2), ("sft", 2)]
  assert all(k.startswith(r["stage"] + "/") for r in records for k in r if "/" in k)
  assert s["hf_model"] == os.path.join(logdir, "hf_model")
  assert not os.path.exists(s["hf_model"] + ".partial")
  text = "Human: What is two plus two? Assistant:"
  hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(s["hf_model"])
  from rljax.models.tokenizer import load_tokenizer

  tokens = load_tokenizer(s["hf_model"]).encode(text)
  assert hf_tok(text, add_special_tokens=False).input_ids == \
      load_tokenizer(os.path.join(logdir, "tokenizer")).encode(text, add_special_tokens=False)
  hf = transformers.AutoModelForCausalLM.from_pretrained(s["hf_model"]).eval()
  with torch.no_grad():
    hf_logits = hf(torch.tensor([tokens])).logits.numpy()
  np.testing.assert_allclose(hf_logits, np.asarray(trained[-1](np.asarray([tokens]))),
                             atol=1e-4)


@pytest.mark.slow
def test_train_sft_script_with_model(hf_folder, tmp_path):
  path = tmp_path / "hh.jsonl"
  path.write_text("\n".join(hh_lines()) + "\n")
  logdir = tmp_path / "run"
  out = subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "train_sft.py"),
       f"--preference_data={path}", f"--model={hf_folder}", "--num_steps=2",
       f"--logdir={logdir}"],
      capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
  assert out.returncode == 0, out.stderr[-3000:]
  assert "SFT on 11 chosen responses (of 12 pairs; the rest held out)" in out.stdout
  assert os.path.exists(logdir / "hf_model" / "model.safetensors")
  assert "pretrain:" not in out.stdout + out.stderr
  records = [json.loads(line) for line in open(logdir / "metrics.jsonl")]
  assert any("sft/loss" in r for r in records)
  assert not any("pretrain/loss" in r for r in records)
  # The script starts from the pretrained defaults: SFT at pretrain_lr / 2 = 5e-6.
  info = json.loads((logdir / "run_info.json").read_text())
  assert info["config"]["pretrain_lr"] == 1e-5 and info["config"]["rm_lr"] == 9e-6, info["config"]


@pytest.mark.slow
def test_scripts_chain_reward_model_into_rlhf(hf_folder, tmp_path):
  """OpenRLHF's chain: train_reward_model.py --model=M writes a reward model that transformers
  loads as ``AutoModelForSequenceClassification`` (no missing weight), and train_rlhf.py
  --model=M --sft_steps=0 --reward_model=<that hf_model> trains PPO against it without
  training another: its held-out accuracy (same split, same weights) is the reward-model
  script's."""
  import re

  import transformers

  path = tmp_path / "hh.jsonl"
  path.write_text("\n".join(hh_lines(40)) + "\n")
  script = lambda name: os.path.join(REPO, "experiments", name)  # noqa: E731
  rm = subprocess.run(
      [sys.executable, script("train_reward_model.py"), f"--preference_data={path}",
       f"--model={hf_folder}", "--sft_steps=0", "--num_steps=3", f"--logdir={tmp_path / 'rm'}"],
      capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
  assert rm.returncode == 0, rm.stderr[-3000:]
  assert "sft: skipped (sft_steps=0)" in rm.stdout, rm.stdout[-2000:]
  accuracy = re.search(r"held-out accuracy (\S+) \(95% CI (\S+)-(\S+), n=4 ", rm.stdout)
  assert accuracy, rm.stdout[-2000:]
  rm_folder = str(tmp_path / "rm" / "hf_model")
  _, info = transformers.AutoModelForSequenceClassification.from_pretrained(
      rm_folder, output_loading_info=True)
  assert not info["missing_keys"], info

  logdir = tmp_path / "rl"
  rl = subprocess.run(
      [sys.executable, script("train_rlhf.py"), f"--preference_data={path}",
       f"--model={hf_folder}", "--sft_steps=0", f"--reward_model={rm_folder}", "--num_steps=2",
       "--prompts_per_step=4", f"--logdir={logdir}", "--nocompilation_cache"],
      capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
  assert rl.returncode == 0, rl.stderr[-3000:]
  assert f"reward model: loaded from {rm_folder}" in rl.stdout, rl.stdout[-2000:]
  summary = json.loads((logdir / "summary.json").read_text())
  lo, hi = summary["rm_ci"]
  assert (f"{summary['rm_accuracy']:.3f}", f"{lo:.3f}", f"{hi:.3f}") == accuracy.groups()
  records = [json.loads(line) for line in open(logdir / "metrics.jsonl")]
  assert not any("rm/loss" in r or "sft/loss" in r for r in records)  # neither stage trained
  assert sum("kl" in r for r in records) == 2


def test_run_folder_given_as_model_points_at_its_hf_model(tmp_path):
  """A run's folder instead of its exported model: the error names ``<run>/hf_model``."""
  (tmp_path / "run" / "hf_model").mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match=r"no config\.json in the folder .*; a run's "
                     r"exported model is in .*/run/hf_model"):
    pipeline.load_pretrained(str(tmp_path / "run"))
