"""Bad input to the RLHF-side scripts (train_rlhf.py, train_sft.py, train_reward_model.py):
each case fails before anything compiles, exits 2 with a one-line message naming the bad
value (a traceback only with --verbose), and leaves an existing run's checkpoints untouched.

Library-level errors are tested where they are raised (tests/test_text_data.py: data files;
tests/test_hf_io.py: unsupported model_type, shape-mismatched tensors). The scripts' --model
(a Hugging Face model folder, rljax.alignment.pipeline.load_pretrained) has script cases here:
unsupported model_type, a tensor shape that does not match config.json, a missing folder or
config.json, and the flags it conflicts with.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from rljax import checkpoint as ckpt
from rljax.alignment import pipeline
from rljax.envs.text import data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATH_REWARDS = os.path.join(REPO, "experiments", "rewards", "math_answers.py")
GOOD = [json.dumps({"prompt": f"Question number {i} about things?", "chosen": "Yes, sure.",
                    "rejected": "No."}) for i in range(8)]


def _script(name):
  return os.path.join(REPO, "experiments", name)


def _write(path, lines):
  with open(path, "wb") as f:
    for line in lines:
      f.write(line if isinstance(line, bytes) else (line + "\n").encode())
  return str(path)


@pytest.fixture
def existing_run(tmp_path):
  """A logdir holding an (embedded, default-config) run's checkpoint files."""
  return _make_existing_run(tmp_path)


def _make_existing_run(tmp_path):
  logdir = tmp_path / "run"
  cfg = pipeline.EmbeddedConfig(rl=pipeline.default_rl_config("ppo"))
  from rljax.alignment import checkpointing

  saved = checkpointing.config_to_json(cfg)
  saved["sft_steps"] = 7  # differs from the flags' config
  (logdir / "checkpoints" / "3").mkdir(parents=True)
  (logdir / "checkpoints" / "config.json").write_text(json.dumps({"rlhf_embedded": saved}))
  (logdir / "checkpoints" / "3" / "payload").write_bytes(b"\x00\x01checkpoint bytes")
  return logdir


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
  """Hugging Face model folders for --model: a good tiny Llama and broken copies of it."""
  return _make_hf_models(tmp_path_factory.mktemp("hf_models"))


def _make_hf_models(root):
  import safetensors.numpy
  from test_pretrained_init import make_hf_folder

  good = make_hf_folder(root / "good")
  out = {"good": good}
  for name in ("gpt2", "bad_shape", "no_config"):
    out[name] = str(root / name)
    shutil.copytree(good, out[name])
  cfg = json.loads(open(os.path.join(good, "config.json")).read())
  with open(os.path.join(out["gpt2"], "config.json"), "w") as f:
    json.dump(dict(cfg, model_type="gpt2", architectures=["GPT2LMHeadModel"]), f)
  weights = os.path.join(out["bad_shape"], "model.safetensors")
  tensors = safetensors.numpy.load_file(weights)
  name = "model.layers.0.mlp.gate_proj.weight"
  assert tensors[name].shape == (64, 32)
  tensors[name] = tensors[name][:48]  # config.json's intermediate_size is 64
  safetensors.numpy.save_file(tensors, weights, metadata={"format": "pt"})
  os.remove(os.path.join(out["no_config"], "config.json"))
  return out


def _snapshot(logdir):
  """Every file under ``logdir`` (run_info.json included: a refused command must not rewrite
  it) with its bytes."""
  out = {}
  for d, _, files in os.walk(logdir):
    for f in files:
      p = os.path.join(d, f)
      out[p] = open(p, "rb").read()
  return out


def _cases(tmp_path, existing, hf=None):
  bad_json = _write(tmp_path / "bad.jsonl", [GOOD[0], "{not json"])
  bad_utf8 = _write(tmp_path / "utf8.jsonl", [GOOD[0], b'{"prompt": "\xff\xfe"}\n'])
  no_rejected = _write(tmp_path / "norej.jsonl",
                       [json.dumps({"prompt": "Q?", "chosen": "A"})])
  empty = _write(tmp_path / "empty.jsonl", ["", "  "])
  good = _write(tmp_path / "good.jsonl", GOOD)
  letters = _write(tmp_path / "letters.jsonl", [json.dumps({"prompt": "1+2="}),
                                                json.dumps({"prompt": "what is 2+2?"})])
  tok_dir = str(tmp_path / "tok")
  data.save_tokenizer(data.train_bpe_tokenizer([l for l in GOOD] * 4, vocab_size=300), tok_dir)
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  e = f"--logdir={existing}"
  n = n_logdir(tmp_path)  # the one-stage scripts refuse an existing run first
  hf = hf or {}
  m = {k: f"--model={v}" for k, v in hf.items()}
  return {
      "unknown_algo": ("train_rlhf.py", ["--algo=grp"],
                       "--algo 'grp' is not one of ppo, grpo, rloo, reinforce_pp; did you mean "
                       "'grpo'"),
      "logdir_not_writable": ("train_rlhf.py", [f"--logdir={blocker}/sub"], "is not writable"),
      "malformed_json": ("train_rlhf.py", [f"--preference_data={bad_json}", n],
                         "bad.jsonl:2: malformed JSON"),
      "invalid_utf8": ("train_sft.py", [f"--preference_data={bad_utf8}", n],
                       "utf8.jsonl:2: invalid UTF-8"),
      "missing_rejected": ("train_reward_model.py", [f"--preference_data={no_rejected}", n],
                           "norej.jsonl:1: missing key 'rejected'"),
      "empty_dataset": ("train_rlhf.py", [f"--preference_data={empty}", n],
                        "empty.jsonl: empty dataset"),
      "data_is_a_directory": ("train_rlhf.py", [f"--preference_data={tmp_path}", n],
                              f"{tmp_path} is a directory; expected a .jsonl or .jsonl.gz file "
                              f"(it holds bad.jsonl, empty.jsonl, good.jsonl"),
      # One pair is held out for the reward model's accuracy, which leaves none to train on.
      "limit_leaves_no_training_pair": (
          "train_sft.py", [f"--preference_data={good}", "--limit=1", n],
          "1 preference pair(s) (--limit=1) leave no training pair after holding out 1 "
          "(eval_fraction 0.1): read at least 2 (--limit >= 2)"),
      "limit_zero": ("train_sft.py", [f"--preference_data={good}", "--limit=0", n],
                     "--limit must be >= 1, got 0"),
      "missing_file": ("train_reward_model.py", [f"--preference_data={tmp_path}/nope.jsonl", n],
                       "does not exist"),
      "overlong_prompts_rejected": (
          "train_rlhf.py", [f"--preference_data={good}", "--max_prompt_len=3",
                            "--overlong_prompts=reject", n],
          "7 of 7 prompts are longer than 3 tokens"),  # 7 of 8 pairs train (90/10 split)
      "tokenizer_exceeds_vocab": (
          "train_sft.py", [f"--preference_data={good}", f"--tokenizer={tok_dir}",
                           "--vocab_size=50", n],
          "more than the model's vocab_size 50"),
      "config_mismatch": ("train_rlhf.py", [e],
                          "holds a run with a different config (sft_steps: saved 7, now 150)"),
      # A nested field is named by its dotted path, not by printing the nested dicts.
      "config_mismatch_nested": ("train_rlhf.py", [e, "--kl_coef=0.5"],
                                 "different config (rl.kl_coef: saved 0.02, now 0.5; sft_steps: "
                                 "saved 7, now 150)"),
      "sft_steps_negative": ("train_rlhf.py", [f"--preference_data={good}", "--sft_steps=-1", e],
                             "--sft_steps must be >= 0, got -1"),
      # --num_steps: one check shared by the three scripts (rljax.alignment.flags).
      "sft_num_steps_zero": ("train_sft.py", [f"--preference_data={good}", "--num_steps=0", n],
                             "--num_steps must be >= 1, got 0"),
      "rm_num_steps_negative": ("train_reward_model.py",
                                [f"--preference_data={good}", "--num_steps=-3", n],
                                "--num_steps must be >= 1, got -3"),
      "rlhf_num_steps_zero": ("train_rlhf.py", ["--num_steps=0", n],
                              "--num_steps must be >= 1, got 0"),
      # --pretrain_steps: shared too; train_reward_model.py's own --sft_steps.
      "sft_pretrain_steps_negative": ("train_sft.py", [f"--preference_data={good}",
                                                       "--pretrain_steps=-1", n],
                                      "--pretrain_steps must be >= 0, got -1"),
      "rlhf_pretrain_steps_negative": ("train_rlhf.py", ["--pretrain_steps=-2", n],
                                       "--pretrain_steps must be >= 0, got -2"),
      # Stage flags the selected pipeline has no use for are refused, not ignored.
      "rm_steps_without_data": ("train_rlhf.py", ["--rm_steps=5", n],
                                "--rm_steps applies to --preference_data runs only"),
      "eval_prompts_with_data": ("train_rlhf.py", [f"--preference_data={good}",
                                                   "--num_eval_prompts=4", n],
                                 "--num_eval_prompts applies to the embedded addition task only"),
      "embedded_sft_steps_negative": ("train_rlhf.py", ["--sft_steps=-1", n],
                                      "--sft_steps must be >= 0, got -1"),
      "rm_margin_negative": ("train_reward_model.py", [f"--preference_data={good}",
                                                       "--margin=-0.5", n],
                             "--margin must be >= 0, got -0.5"),
      "rm_sft_steps_negative": ("train_reward_model.py", [f"--preference_data={good}",
                                                          "--sft_steps=-2", n],
                                "--sft_steps must be >= 0, got -2"),
      "lr_not_positive": ("train_sft.py", [f"--preference_data={good}", "--pretrain_lr=0", n],
                          "--pretrain_lr must be > 0, got 0.0"),
      "limit_without_data": ("train_rlhf.py", ["--limit=10", n],
                             "--limit applies to --preference_data runs only (the embedded "
                             "addition task reads no preference pairs); got --limit=10"),
      "max_prompt_len_without_data": ("train_sft.py", ["--max_prompt_len=32", n],
                                      "--max_prompt_len applies to --preference_data runs only"),
      "rm_lr_without_data": ("train_rlhf.py", ["--rm_lr=1e-5", e],
                             "--rm_lr applies to --preference_data runs only"),
      "critic_lr_without_critic": ("train_rlhf.py", ["--algo=grpo", "--critic_lr=1e-5", e],
                                   "--critic_lr applies to --algo=ppo only (grpo has no critic)"),
      "existing_run_without_resume": (
          "train_rlhf.py", [e, "--noresume"],
          "already holds a train_rlhf.py run on the embedded task (RL checkpoints up to step 3); "
          "run the command without --noresume to resume it (the default; a finished run then "
          "trains nothing)"),
      "checkpoint_every": ("train_rlhf.py", ["--checkpoint_every=0"],
                           "--checkpoint_every must be >= 1, got 0"),
      "stage_checkpoint_every": ("train_rlhf.py", ["--stage_checkpoint_every=-1"],
                                 "--stage_checkpoint_every must be >= 0, got -1"),
      # --model (a Hugging Face folder): checked before the logdir's checkpoints are looked at.
      "model_unsupported_type": (
          "train_rlhf.py", [f"--preference_data={good}", m.get("gpt2"), e],
          "unsupported model_type 'gpt2' in config.json; rljax.models supports "
          "('llama', 'qwen2')"),
      "model_tensor_shape_mismatch": (
          "train_sft.py", [f"--preference_data={good}", m.get("bad_shape"), n],
          f"tensor 'model.layers.0.mlp.gate_proj.weight' in {hf.get('bad_shape')} has shape "
          f"(48, 32), but config.json implies (64, 32)"),
      "model_missing_folder": (
          "train_reward_model.py", [f"--preference_data={good}",
                                    f"--model={tmp_path}/no-such-model", n],
          f"--model '{tmp_path}/no-such-model': no such folder"),
      "model_missing_config": (
          "train_rlhf.py", [f"--preference_data={good}", m.get("no_config"), e],
          f"--model {hf.get('no_config')!r}: no config.json in the folder"),
      # --reward_model: needs --model and the data, excludes reward-model training flags, and
      # must hold a trained reward head (a plain causal-LM folder does not).
      "reward_model_without_model": (
          "train_rlhf.py", [f"--preference_data={good}", f"--reward_model={hf.get('good')}", e],
          f"--reward_model {hf.get('good')!r} needs --model"),
      "reward_model_without_data": (
          "train_rlhf.py", [f"--reward_model={hf.get('good')}", e],
          "--reward_model applies to --preference_data runs only"),
      "reward_model_with_rm_steps": (
          "train_rlhf.py", [f"--preference_data={good}", m.get("good"),
                            f"--reward_model={hf.get('good')}", "--rm_steps=5", e],
          "--rm_steps trains a reward model; --reward_model"),
      "reward_model_not_a_reward_model": (
          "train_rlhf.py", [f"--preference_data={good}", m.get("good"),
                            f"--reward_model={hf.get('good')}", e],
          f"--reward_model {hf.get('good')!r} is not a trained reward model"),
      "model_with_tokenizer": (
          "train_sft.py", [f"--preference_data={good}", m.get("good"), f"--tokenizer={tok_dir}",
                           n],
          "--tokenizer cannot be combined with --model"),
      # A stage script does not resume (nor append to) another kind of run.
      "stage_script_existing_run": (
          "train_reward_model.py", [f"--preference_data={good}", e],
          f"--logdir {str(existing)!r} holds a train_rlhf.py run on the embedded task, not a "
          f"train_reward_model.py run (its {existing}/checkpoints/config.json says so); use a new "
          f"--logdir."),
      "model_without_data": ("train_rlhf.py", [m.get("good"), e],
                             "needs --preference_data=PATH"),
      # Asynchronous RLHF: its settings are checked before anything compiles.
      "max_staleness_negative": ("train_rlhf.py", ["--max_staleness=-1", n],
                                 "error: max_staleness must be >= 0 (0: synchronous), got -1."),
      "async_disaggregated_on_one_device": (
          "train_rlhf.py", ["--placement=disaggregated", "--max_staleness=1", n],
          "--placement=disaggregated needs >= 2 devices, got 1"),
      # Reward programs and prompt files: loaded before anything compiles.
      "reward_fn_without_colon": ("train_rlhf.py", [f"--reward_fn={MATH_REWARDS}", n],
                                  "error: --reward_fn '" + MATH_REWARDS + "': expected "
                                  "package.module:function or path/to/file.py:function"),
      "reward_fn_unknown_module": ("train_rlhf.py", ["--reward_fn=no_such_module_xyz:fn", n],
                                   "error: --reward_fn 'no_such_module_xyz:fn': cannot import "
                                   "'no_such_module_xyz': ModuleNotFoundError"),
      "reward_fn_unknown_function": ("train_rlhf.py", [f"--reward_fn={MATH_REWARDS}:nope", n],
                                     "has no 'nope'"),
      "prompts_missing_file": ("train_rlhf.py", ["--prompts=nope.jsonl", n],
                               "error: --prompts 'nope.jsonl' does not exist"),
      "prompts_outside_the_alphabet": (
          "train_rlhf.py", [f"--prompts={letters}", n],
          f"error: {letters}: prompt 2 ('what is 2+2?'): CharTokenizer: character 'w' is not in "
          f"'0123456789+= '; the embedded model reads additions only"),
      "reward_fn_with_preference_data": (
          "train_rlhf.py", [f"--preference_data={good}", f"--reward_fn={MATH_REWARDS}:exact_match",
                            n], "error: --reward_fn applies to the embedded model only"),
      "kl_controller_and_old_spelling": (
          "train_rlhf.py", ["--kl_controller=pi", "--noadaptive_kl", n],
          "error: --noadaptive_kl is the old spelling of --kl_controller=fixed; give only "
          "--kl_controller=pi"),
      "pi_controller_without_kl_coef": (
          "train_rlhf.py", ["--kl_target=2", "--kl_coef=0", n],
          "error: kl_controller='pi' needs kl_coef > 0"),
      "disaggregated_three_processes": (
          "train_rlhf.py", ["--placement=disaggregated", "--num_processes=3", "--process_id=0",
                            "--coordinator_address=127.0.0.1:1", n],
          "error: --placement=disaggregated over processes runs 2 processes (process 0 trains, "
          "process 1 generates), got 3"),
  }


CASES = ["unknown_algo", "logdir_not_writable", "malformed_json", "invalid_utf8",
         "missing_rejected", "empty_dataset", "data_is_a_directory", "limit_leaves_no_training_pair", "limit_zero",
         "missing_file", "overlong_prompts_rejected", "tokenizer_exceeds_vocab", "config_mismatch", "config_mismatch_nested", "sft_steps_negative",
         "sft_num_steps_zero", "rm_num_steps_negative", "rlhf_num_steps_zero",
         "sft_pretrain_steps_negative", "rlhf_pretrain_steps_negative", "rm_sft_steps_negative",
         "rm_steps_without_data", "eval_prompts_with_data", "embedded_sft_steps_negative",
         "rm_margin_negative",
         "lr_not_positive", "rm_lr_without_data", "limit_without_data",
         "max_prompt_len_without_data",
         "critic_lr_without_critic",
         "existing_run_without_resume",
         "checkpoint_every", "stage_checkpoint_every", "model_unsupported_type", "model_tensor_shape_mismatch",
         "model_missing_folder", "model_missing_config", "model_with_tokenizer",
         "reward_model_without_model", "reward_model_without_data", "reward_model_with_rm_steps",
         "reward_model_not_a_reward_model",
         "model_without_data", "stage_script_existing_run", "max_staleness_negative",
         "async_disaggregated_on_one_device", "disaggregated_three_processes",
         "reward_fn_without_colon", "reward_fn_unknown_module", "reward_fn_unknown_function",
         "prompts_missing_file", "prompts_outside_the_alphabet", "reward_fn_with_preference_data",
         "kl_controller_and_old_spelling", "pi_controller_without_kl_coef"]


def n_logdir(tmp_path) -> str:
  """The fresh ``--logdir`` flag of the cases (``n`` in :func:`_cases`)."""
  return f"--logdir={tmp_path}/fresh"


def _run_cases(root) -> dict:
  """Every case of `CASES`, each in its own folder under ``root`` with its own existing run,
  run by tests/_script_cases.py: one process per script for all its cases (each case parses
  its flags afresh and runs the script's ``main``). Returns per case its script, message, exit
  status, stderr, whether the existing run is unchanged and what the fresh logdir holds."""
  hf = _make_hf_models(root / "hf_models")
  cases, before = {}, {}
  for name in CASES:
    case_dir = root / name
    case_dir.mkdir()
    existing = _make_existing_run(case_dir)
    script, args, message = _cases(case_dir, existing, hf)[name]
    extra = "--nocompilation_cache" if script == "train_rlhf.py" else "--seed=0"
    cases[name] = dict(script=script, args=[*args, extra], message=message,
                       cwd=str(case_dir), existing=str(existing),
                       fresh=str(case_dir / "fresh") if n_logdir(case_dir) in args else None)
    before[name] = _snapshot(existing)
  results = {}
  for script in sorted({c["script"] for c in cases.values()}):
    mine = [dict(name=n, args=c["args"], cwd=c["cwd"]) for n, c in cases.items()
            if c["script"] == script]
    with open(root / f"{script}.cases.json", "w", encoding="utf-8") as f:
      json.dump(mine, f)
    out_path = root / f"{script}.results.json"
    out = subprocess.run([sys.executable, os.path.join(REPO, "tests", "_script_cases.py"),
                          _script(script), str(root / f"{script}.cases.json"), str(out_path)],
                         capture_output=True, text=True, timeout=600, cwd=str(root))
    assert out.returncode == 0, out.stderr[-3000:]
    with open(out_path, encoding="utf-8") as f:
      results.update(json.load(f))
  for name, c in cases.items():
    fresh = c["fresh"]
    results[name].update(
        script=c["script"], message=c["message"],
        unchanged=_snapshot(c["existing"]) == before[name],
        fresh=None if fresh is None else (os.listdir(fresh) if os.path.exists(fresh) else []),
        fresh_exists=fresh is not None and os.path.exists(fresh))
  return results


@pytest.fixture(scope="session")
def bad_input_results(tmp_path_factory):
  """`_run_cases` once per test session: the first xdist worker to ask runs them, under a
  file lock in the workers' shared temporary folder; the others read its JSON."""
  from filelock import FileLock

  # Under xdist each worker's basetemp is a folder of the session's; without it, basetemp is
  # the session's own (its parent holds earlier sessions' folders, whose results are stale).
  base = tmp_path_factory.getbasetemp()
  shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  path = shared / "bad_input_results.json"
  with FileLock(str(path) + ".lock"):
    if not path.exists():
      root = shared / "bad_input_cases"
      if root.exists():
        shutil.rmtree(root)
      root.mkdir()
      path.write_text(json.dumps(_run_cases(root)))
  return json.loads(path.read_text())


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_message_before_compiling(case, bad_input_results):
  r = bad_input_results[case]
  message, stderr = r["message"], r["stderr"]
  assert r["returncode"] == 2, (r["returncode"], stderr[-2000:])
  assert message in stderr, stderr[-2000:]
  assert "Traceback" not in stderr
  assert stderr.strip().splitlines()[-1].startswith("error: ")
  assert r["unchanged"]  # nothing written over an existing run
  # A bad data file or model folder creates no logdir.
  assert not r["fresh_exists"], r["fresh"]


def test_sft_script_has_no_reward_model_flag(tmp_path):
  """train_sft.py trains no reward model, so it does not define --rm_lr: absl rejects the flag
  (exit 1, its own message) before anything runs; the two scripts that train a reward model
  list it in their --help."""
  out = subprocess.run([sys.executable, _script("train_sft.py"), "--rm_lr=1e-5"],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
  assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
  assert "Unknown command line flag 'rm_lr'" in out.stderr, out.stderr[-2000:]
  assert not os.listdir(tmp_path)  # no run folder
  for script in ("train_reward_model.py", "train_rlhf.py"):
    shown = subprocess.run([sys.executable, _script(script), "--help"], capture_output=True,
                           text=True, timeout=300, cwd=str(tmp_path))
    assert "--rm_lr: --preference_data: reward-model learning rate" in shown.stdout, \
        (script, shown.stdout[-2000:])  # (absl's --help exits 1)


def test_resume_check_compares_nested_fields_and_implies_class_defaults(tmp_path):
  """A field missing from a saved alignment config (added to a config class later) counts as
  that class's declared default; nested fields are compared one by one."""
  from rljax import checkpoint as ckpt
  from rljax import ppo as ppo_lib
  from rljax.alignment import checkpointing, rlhf

  defaults = ckpt.dataclass_defaults(pipeline.EmbeddedConfig)
  # Nested fields carry their own class's declared defaults, not the values the outer class's
  # factory sets (default_rl_config("ppo"): kl_coef 0.02, ppo.num_epochs 2), in JSON form.
  assert defaults["rl.kl_coef"] == rlhf.RLHFConfig().kl_coef == 0.05
  assert defaults["rl.ppo.num_epochs"] == ppo_lib.PPOConfig().num_epochs == 4
  assert defaults["rl.kl_estimator"] == "k1" and defaults["rl.stop_ids"] == []
  assert defaults["sft_steps"] == 150 and "rl" not in defaults
  cfg = pipeline.EmbeddedConfig()
  now = checkpointing.config_to_json(cfg)
  old = json.loads(json.dumps(now))
  del old["rl"]["ppo"]["vf_coef"], old["num_eval_prompts"]  # "added later"
  (tmp_path / "checkpoints" / "1").mkdir(parents=True)  # a saved step: the config binds
  (tmp_path / "checkpoints" / "config.json").write_text(json.dumps({"rlhf_embedded": old}))
  prepare = lambda config_json: checkpointing.prepare(  # noqa: E731
      str(tmp_path), ckpt.SavedRun("rlhf_embedded", config_json, defaults), resume=True)
  assert prepare(now) is False  # both now equal their defaults (0.5, 256): resumes
  changed = checkpointing.config_to_json(dataclasses.replace(
      cfg, num_eval_prompts=8, rl=dataclasses.replace(
          cfg.rl, kl_coef=0.5, ppo=dataclasses.replace(cfg.rl.ppo, vf_coef=1.0))))
  (tmp_path / "checkpoints" / "config.json").write_text(json.dumps({"rlhf_embedded": old}))
  with pytest.raises(ValueError) as err:
    prepare(changed)
  assert ("different config (num_eval_prompts: not saved, so the default 256, now 8; "
          "rl.kl_coef: saved 0.02, now 0.5; rl.ppo.vf_coef: not saved, so the default 0.5, "
          "now 1.0)") in str(err.value)
  # Without defaults a missing field differs from any value.
  with pytest.raises(ValueError, match=r"num_eval_prompts: saved None, now 256"):
    ckpt.check_same_config(str(tmp_path), "rlhf_embedded", now)


def test_preference_config_rejects_bad_step_counts_and_rates():
  for name, bad in (("rm_steps", 0), ("rm_batch_size", 0)):
    with pytest.raises(ValueError, match=f"^{name} must be >= 1, got {bad}.$"):
      pipeline.PreferenceConfig(**{name: bad})
  for name in ("pretrain_steps", "sft_steps"):
    with pytest.raises(ValueError, match=rf"^{name} must be >= 0, got -1.$"):
      pipeline.PreferenceConfig(**{name: -1})
  with pytest.raises(ValueError, match=r"^--reward_model 'rm' needs --model"):
    pipeline.PreferenceConfig(reward_model="rm")
  assert pipeline.PreferenceConfig(pretrain_steps=0).pretrain_steps == 0
  # The rates, where the library (not only the scripts' flags) builds the config.
  for name, bad in (("pretrain_lr", 0.0), ("rm_lr", -1e-5), ("pretrain_lr", float("nan"))):
    with pytest.raises(ValueError, match=rf"^{name} must be > 0, got {bad}.$"):
      pipeline.PreferenceConfig(**{name: bad})


@pytest.mark.parametrize("module,cls", [("sft", "SFTConfig"), ("reward_model", "RewardModelConfig")])
def test_sft_and_reward_model_configs_reject_bad_fields(module, cls):
  """Both configs validate their shared optimizer and step fields the same way (one check,
  ``rljax.alignment.sft.check_training_fields``), naming the value."""
  import importlib

  config = getattr(importlib.import_module(f"rljax.alignment.{module}"), cls)
  cases = [
      (dict(num_steps=0), r"^num_steps must be >= 1, got 0\.$"),
      (dict(batch_size=-2), r"^batch_size must be >= 1, got -2\.$"),
      (dict(log_every=0), r"^log_every must be >= 1, got 0\.$"),
      (dict(learning_rate=float("nan")), r"^learning_rate must be > 0, got nan\.$"),
      (dict(warmup_steps=-1), r"max_grad_norm > 0; got -1, 0\.0, 1\.0\.$"),
      (dict(weight_decay=-0.1), r"max_grad_norm > 0; got 10, -0\.1, 1\.0\.$"),
      (dict(max_grad_norm=0.0), r"max_grad_norm > 0; got 10, 0\.0, 0\.0\.$"),
      (dict(length_buckets=(64, 32)), r"^length_buckets must be increasing ints >= 2, got \(64, 32\)\.$"),
      (dict(length_buckets=()), r"^length_buckets must be increasing ints >= 2, got \(\)\.$"),
  ]
  if cls == "SFTConfig":  # its own fields
    cases += [
        (dict(group_size=-1), r"^group_size must be >= 0 \(0 or 1: no grouping\), got -1\.$"),
        (dict(pack_length=1), r"^pack_length must be 0 \(largest bucket\) or >= 2, got 1\.$"),
    ]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=message):
      config(**kwargs)
  # Buckets given as a list (e.g. from a flag) are stored as a tuple of ints.
  assert config(length_buckets=[8, 16.0]).length_buckets == (8, 16)
  assert type(config(length_buckets=[8, 16.0]).length_buckets[1]) is int


def test_config_of_a_run_that_saved_nothing_does_not_bind_the_retry(tmp_path):
  """A run stopped by bad input after writing its config (e.g. --overlong_prompts=reject)
  leaves no state: the corrected command, with another config, starts afresh in the same
  logdir. Once there is state (a step checkpoint or the frozen roles), a config mismatch is
  refused as before."""
  from rljax.alignment import checkpointing

  logdir = str(tmp_path / "run")
  saved = {"overlong_prompts": "reject", "sft_steps": 7}
  now = {"overlong_prompts": "truncate", "sft_steps": 7}
  said = []
  assert checkpointing.prepare(logdir, ckpt.SavedRun("rlhf_preference", saved), resume=True,
                               log=said.append) is False
  assert said == []  # a first start: nothing to say
  # The earlier start logged two records before it was killed, with nothing saved: the
  # retry says that it starts from the beginning, and drops them.
  with open(os.path.join(logdir, "metrics.jsonl"), "w") as f:
    f.write('{"step": 1, "stage": "pretrain"}\n{"step": 2, "stage": "pretrain"}\n')
  assert checkpointing.prepare(logdir, ckpt.SavedRun("rlhf_preference", now), resume=True,
                               log=said.append) is False
  assert said == [f"{logdir}: an earlier start of this run saved no state (it stopped before "
                  "its first save), so it starts from the beginning; its 2 record(s) in "
                  "metrics.jsonl are dropped"]
  assert os.path.getsize(os.path.join(logdir, "metrics.jsonl")) == 0
  with open(os.path.join(logdir, "checkpoints", "config.json")) as f:
    assert json.load(f) == {"rlhf_preference": now}
  os.makedirs(os.path.join(logdir, "checkpoints", "2"))
  with pytest.raises(ValueError, match="overlong_prompts: saved 'truncate', now 'reject'"):
    checkpointing.prepare(logdir, ckpt.SavedRun("rlhf_preference", saved), resume=True)
  with pytest.raises(ValueError, match="already holds a train_rlhf.py --preference_data run"):
    checkpointing.prepare(logdir, ckpt.SavedRun("rlhf_preference", now), resume=False)


def test_verbose_shows_the_traceback(tmp_path, existing_run):
  script, args, message = _cases(tmp_path, existing_run)["malformed_json"]
  out = subprocess.run([sys.executable, _script(script), *args, "--verbose"],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
  assert out.returncode == 2
  assert "Traceback" in out.stderr and message in out.stderr


def test_overlong_prompts_truncated_with_a_count():
  lines = []
  out = pipeline.check_prompt_lengths([[1, 2, 3, 4, 5], [1, 2], [9, 8, 7, 6]], max_prompt_len=3,
                                      context=2048, response_len=8, mode="truncate",
                                      log=lines.append)
  assert out == [[3, 4, 5], [1, 2], [8, 7, 6]]  # the last 3 tokens of each long prompt
  assert lines == ["2 of 3 prompts are longer than 3 tokens (max_prompt_len 3, model context "
                   "2048 - response length 8; the longest has 5): truncated to their last 3 "
                   "tokens"]
  # The context is the limit when it is the smaller one: 10 - 8 = 2 tokens.
  assert pipeline.check_prompt_lengths([[1, 2, 3]], max_prompt_len=64, context=10,
                                       response_len=8, mode="truncate",
                                       log=lines.append) == [[2, 3]]
  with pytest.raises(ValueError, match="context of 8 tokens leaves no room for a prompt"):
    pipeline.check_prompt_lengths([[1]], max_prompt_len=4, context=8, response_len=8,
                                  mode="truncate")


@pytest.fixture
def real_checkpoint(tmp_path):
  """A logdir with a real orbax checkpoint of 513 KiB of state (step 5)."""
  import numpy as np

  from rljax import checkpoint as ckpt

  logdir = tmp_path / "big"
  with ckpt.make_manager(str(logdir)) as manager:
    ckpt.save(manager, 5, {"w": np.ones((512, 256), np.float32)},
              {"opt": np.zeros((256,), np.float32)})
  return logdir


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_rlhf.py", "train_control.py"])
def test_restore_onto_a_mesh_that_cannot_hold_the_state(script, real_checkpoint, tmp_path):
  # 513 KiB of saved state; one device of 0.0004 GiB (about 419 KiB) cannot hold it.
  before = _snapshot(real_checkpoint)
  cmd = [sys.executable, _script(script), f"--logdir={real_checkpoint}",
         "--device_memory_gb=0.0004", "--nocompilation_cache"]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
  assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
  assert (f"cannot restore {str(real_checkpoint)!r} onto this mesh: the state of checkpoint 5 "
          f"is 0.000489 GiB, at least 0.000489 GiB per device on 1 device(s), but a device "
          f"holds 0.0004 GiB") in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert _snapshot(real_checkpoint) == before


def test_check_fits_divides_the_state_over_the_devices(real_checkpoint):
  from rljax import checkpoint as ckpt

  size = 512 * 256 * 4 + 256 * 4
  ckpt.check_fits(str(real_checkpoint), num_devices=4, device_bytes=size // 4 + 1)  # fits
  with pytest.raises(ValueError, match=r"on 4 device\(s\), but a device holds"):
    ckpt.check_fits(str(real_checkpoint), num_devices=4, device_bytes=size // 4 - 1)
  ckpt.check_fits(str(real_checkpoint), num_devices=1, device_bytes=None)  # CPU: no limit
  with pytest.raises(ValueError, match="--device_memory_gb must be > 0, got 0.0"):
    ckpt.device_bytes_from_flag(0.0)


@pytest.mark.parametrize("script", ["train_sft.py", "train_reward_model.py", "train_rlhf.py"])
def test_help_lists_the_shared_flags(script):
  """``--help`` shows the flags the scripts share (rljax.alignment.flags, the process flags,
  ``--wandb``) beside each script's own, not only under ``--helpfull``."""
  out = subprocess.run([sys.executable, _script(script), "--help"], capture_output=True,
                       text=True, timeout=120)
  assert "Traceback" not in out.stderr, out.stderr[-2000:]  # (absl's --help exits 1)
  listed = {line.split(":")[0].strip() for line in out.stdout.splitlines()
            if line.startswith("  --")}
  for name in ("--preference_data", "--logdir", "--num_steps", "--pretrain_steps", "--seed",
               "--mesh",
               "--sharding_rules", "--model", "--tokenizer", "--max_prompt_len",
               "--coordinator_address", "--[no]wandb", "--[no]verbose"):
    assert name in listed, (script, name, sorted(listed))
  # The stage sizes' defaults are given as numbers (rljax.alignment.flags.STEP_DEFAULTS).
  text = " ".join(out.stdout.split())
  for shown in _STEP_HELP[script]:
    assert shown in text, (script, shown)


_STEP_HELP = {
    "train_sft.py": [
        "SFT steps (default: 150 on the embedded task, 100 with --preference_data)",
        "Pre-training steps before SFT (default: 800 on the embedded task, 150 with "
        "--preference_data; 0 skips it"],
    "train_reward_model.py": [
        "Reward-model steps (default: 150)",
        "which starts from the SFT model (default: 100; 0 starts it",
        "Pre-training steps before SFT (default: 150; 0 skips it"],
    "train_rlhf.py": [
        "RL steps (default: 200 on the embedded task, 100 with --preference_data)",
        "SFT steps (default: 150 on the embedded task, 100 with --preference_data; 0 skips SFT",
        "reward-model steps (default: 150)"],
}


def test_step_defaults_in_the_help_are_the_configs():
  """The numbers the scripts' --help gives (`STEP_DEFAULTS`, written out so the flags are
  defined before JAX is imported) are the pipeline configs' defaults."""
  from rljax.alignment import flags as alignment_flags
  from rljax.alignment import pipeline

  def sizes(cfg, names):
    return {n: (cfg.rl.num_steps if n == "rl.num_steps" else getattr(cfg, n)) for n in names}

  for kind, cfg in (("embedded", pipeline.EmbeddedConfig()),
                    ("preference", pipeline.PreferenceConfig())):
    shown = alignment_flags.STEP_DEFAULTS[kind]
    assert shown == sizes(cfg, shown), kind
  assert set(alignment_flags.STEP_DEFAULTS["preference"]) == {
      "pretrain_steps", "sft_steps", "rm_steps", "rl.num_steps"}


def test_logdir_that_is_a_file_is_named_as_such(tmp_path):
  from rljax.checkpoint import check_writable

  (tmp_path / "a_file").write_text("x")
  with pytest.raises(ValueError, match=r"--logdir '.*a_file' is a file; expected a directory"):
    check_writable(str(tmp_path / "a_file"))
  with pytest.raises(ValueError, match="is not writable"):
    check_writable(str(tmp_path / "a_file" / "sub"))
  check_writable(str(tmp_path / "new" / "run"))
  assert (tmp_path / "new" / "run").is_dir()


@pytest.mark.slow
def test_stage_step_flags_reach_the_config(tmp_path):
  """train_reward_model.py's --pretrain_steps (shared) and --sft_steps shorten its stages: the
  run's config records them, and --pretrain_steps=0 skips pre-training (no 'pretrain:' line)."""
  data = _write(tmp_path / "good.jsonl", GOOD)
  logdir = tmp_path / "rm"
  out = subprocess.run(
      [sys.executable, _script("train_reward_model.py"), f"--preference_data={data}",
       "--pretrain_steps=0", "--sft_steps=2", "--num_steps=3", f"--logdir={logdir}"],
      capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  config = json.loads((logdir / "run_info.json").read_text())["config"]
  assert (config["pretrain_steps"], config["sft_steps"], config["rm_steps"]) == (0, 2, 3)
  assert "pretrain:" not in out.stdout + out.stderr
  assert "reward model: held-out accuracy" in out.stdout


def test_stage_flag_check_names_the_flag_and_its_bound():
  """``rljax.alignment.flags.checked``, which every alignment script's stage flags go through:
  None when not given, the value when in range, else one error naming the flag and bound."""
  from absl import flags as absl_flags

  from rljax.alignment import flags as alignment_flags

  fv = absl_flags.FlagValues()
  steps = absl_flags.DEFINE_integer("steps", None, "", flag_values=fv)
  lr = absl_flags.DEFINE_float("lr", None, "", flag_values=fv)
  fv(["prog"])
  assert alignment_flags.checked(steps, at_least=1) is None
  fv(["prog", "--steps=0", "--lr=nan"])
  assert alignment_flags.checked(steps, at_least=0) == 0
  with pytest.raises(ValueError, match=r"^--steps must be >= 1, got 0$"):
    alignment_flags.checked(steps, at_least=1)
  with pytest.raises(ValueError, match=r"^--lr must be > 0, got nan$"):
    alignment_flags.checked(lr, above=0)
  fv(["prog", "--lr=2e-5"])
  assert alignment_flags.checked(lr, above=0) == 2e-5


def test_sft_lr_flag_sets_the_sft_learning_rate():
  """``--sft_lr`` (rljax.alignment.flags.DataFlags) sets SFT's rate; without it SFT runs at
  ``--pretrain_lr / 2`` (1e-3 from scratch, 5e-6 with ``--model``: OpenRLHF's). ``--pretrain_lr`` beside both
  ``--model`` and ``--sft_lr`` would set nothing, so it is refused."""
  from absl import flags as absl_flags

  from rljax.alignment import flags as alignment_flags
  from rljax.alignment import pipeline

  fv = absl_flags.FlagValues()
  holders = {name: absl_flags.DEFINE_string(name, None, "", flag_values=fv)
             for name in ("tokenizer", "model")}
  holders.update({name: absl_flags.DEFINE_integer(name, None, "", flag_values=fv)
                  for name in ("max_prompt_len", "vocab_size")})
  holders.update({name: absl_flags.DEFINE_float(name, None, "", flag_values=fv)
                  for name in ("pretrain_lr", "sft_lr", "rm_lr")})
  holders["overlong_prompts"] = absl_flags.DEFINE_string("overlong_prompts", "truncate", "",
                                                         flag_values=fv)
  data_flags = alignment_flags.DataFlags(**holders)

  def config(*argv):
    fv.unparse_flags()
    fv(["prog", *argv])
    base = pipeline.preference_defaults(fv["model"].value)
    return dataclasses.replace(base, **data_flags.overrides())

  assert config().sft_learning_rate == 1e-3
  assert config("--pretrain_lr=4e-3").sft_learning_rate == 2e-3
  assert config("--pretrain_lr=4e-3", "--sft_lr=3e-4").sft_learning_rate == 3e-4
  assert config("--model=m").sft_learning_rate == 5e-6
  assert config("--model=m", "--sft_lr=2e-5").sft_learning_rate == 2e-5
  with pytest.raises(ValueError, match=r"^--sft_lr must be > 0, got -1.0$"):
    config("--sft_lr=-1")
  with pytest.raises(ValueError, match=r"^--pretrain_lr=1e-05 would set nothing: it is the pre-training "
                                       r"learning rate, --model skips pre-training, and "
                                       r"--sft_lr=2e-05 sets SFT's; drop --pretrain_lr$"):
    config("--model=m", "--pretrain_lr=1e-5", "--sft_lr=2e-5")


def test_split_that_leaves_no_training_pair_names_what_would():
  """``pipeline.split_preference_pairs``: one pair is held out (``eval_fraction`` 0.1 rounds up
  to one), so one pair leaves none to train on; the error names the smallest count that does,
  as a ``--limit`` where one was given."""
  from rljax.alignment import pipeline

  config = pipeline.PreferenceConfig()
  with pytest.raises(ValueError, match=r"^1 preference pair\(s\) leave no training pair after "
                                       r"holding out 1 \(eval_fraction 0.1\): the data needs "
                                       r"at least 2 pairs$"):
    pipeline.split_preference_pairs(["a"], config)
  train, held = pipeline.split_preference_pairs(list("abcdefghijk"), config)
  assert (len(train), len(held)) == (10, 1) and sorted(train + held) == list("abcdefghijk")


def test_config_mismatch_names_fields_one_flag_sets_together(tmp_path):
  """``--seed`` sets ``seed`` and ``rl.seed``: a resume with another seed names them once,
  together; fields that differ otherwise stay apart."""
  from rljax import checkpoint as ckpt

  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "checkpoints" / "config.json").write_text(json.dumps(
      {"s": {"seed": 0, "rl": {"seed": 0, "lr": 1.0, "ppo": {"lr": 2.0}}}}))
  with pytest.raises(ValueError) as err:
    ckpt.check_same_config(str(tmp_path), "s", {"seed": 1, "rl": {"seed": 1, "lr": 3.0,
                                                                  "ppo": {"lr": 3.0}}})
  assert ("different config (rl.lr: saved 1.0, now 3.0; rl.ppo.lr: saved 2.0, now 3.0; "
          "seed and rl.seed: saved 0, now 1)") in str(err.value)
  with pytest.raises(ValueError, match=r"\(rl.num_steps \(--num_steps\): not saved, so the "
                                       r"default 2, now 3; seed and rl.seed: saved 0, now 1\)"):
    ckpt.check_same_config(str(tmp_path), "s", {"seed": 1, "rl": {"seed": 1, "lr": 1.0,
                                                                  "num_steps": 3,
                                                                  "ppo": {"lr": 2.0}}},
                           defaults={"rl.num_steps": 2}, flag_names={"rl.num_steps": "--num_steps"})


def test_stage_scripts_refuse_a_finished_run_that_saved_no_state(tmp_path):
  """A folder with an exported model and metrics but no saved state (a finished stage-script run
  of an earlier version, which did not save its stages) is refused and left as it was; a folder
  with an interrupted run's records only is not (they are redone)."""
  cfg = pipeline.EmbeddedConfig()
  (tmp_path / "metrics.jsonl").write_text('{"step": 50, "stage": "pretrain", "pretrain/loss": 2.5}\n')
  ckpt.check_logdir(str(tmp_path), pipeline.saved_run(cfg, stop_after="sft"), resume=True)  # records only: redone
  (tmp_path / "hf_model").mkdir()
  with pytest.raises(ValueError, match=r"holds a finished run's hf_model but no saved state to "
                     r"resume it from; use a new --logdir \(nothing in it was changed\)"):
    ckpt.check_logdir(str(tmp_path), pipeline.saved_run(cfg, stop_after="sft"), resume=True)
  with pytest.raises(ValueError, match="no saved state"):
    pipeline.run_embedded(cfg, logdir=str(tmp_path), stop_after="sft", log=lambda *_: None)
  assert sorted(os.listdir(tmp_path)) == ["hf_model", "metrics.jsonl"]
  assert (tmp_path / "metrics.jsonl").read_text() == (
      '{"step": 50, "stage": "pretrain", "pretrain/loss": 2.5}\n')


def test_another_kind_of_run_is_named_in_the_commands_words(tmp_path):
  """A control run's folder (its config.json also holds the network's section) given to an
  RLHF command: both kinds are named, the network's section is not a kind."""
  from rljax import checkpoint as ckpt

  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "checkpoints" / "config.json").write_text(
      json.dumps({"control": {}, "network": {}}))
  ckpt.check_same_kind(str(tmp_path), "control")  # its own kind passes
  with pytest.raises(ValueError) as err:
    ckpt.check_same_kind(str(tmp_path), "rlhf_preference")
  assert str(err.value) == (
      f"--logdir {str(tmp_path)!r} holds a train_control.py run, not a train_rlhf.py "
      f"--preference_data run (its {tmp_path}/checkpoints/config.json says so); use a new "
      f"--logdir.")
