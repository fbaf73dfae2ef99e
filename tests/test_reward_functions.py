"""Reward functions from the command line (rljax.alignment.reward_functions, train_rlhf.py
--reward_fn/--prompts), the example math checker, and data files as users save them."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rljax.alignment import pipeline, reward_functions
from rljax.alignment.rlhf import Samples
from rljax.envs.text import arithmetic
from rljax.envs.text import data as text_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATH = os.path.join(REPO, "experiments", "rewards", "math_answers.py")
SCRIPT = os.path.join(REPO, "experiments", "train_rlhf.py")


def _math():
  return reward_functions.load_function(f"{MATH}:exact_match")


def _write_jsonl(path, rows, *, bom=False, crlf=False, gz=False):
  text = "".join(json.dumps(r) + ("\r\n" if crlf else "\n") for r in rows).encode("utf-8")
  if bom:
    text = b"\xef\xbb\xbf" + text
  with open(path, "wb") as f:
    f.write(gzip.compress(text) if gz else text)
  return str(path)


# -- the example math checker ---------------------------------------------------------------


@pytest.mark.parametrize("text, answer", [
    ("The total is \\boxed{1,234}.", "1234"),
    ("\\boxed{\\frac{1}{2}} ... \\boxed{42}", "42"),  # the last box
    ("She pays 3 * 4 = 12 dollars.\n#### 12", "12"),
    ("#### $1,000.00", "1000"),
    ("so 7 + 8 = 15, and then -3", "-3"),  # no box, no ####: the last number
    ("12.50", "12.50"),
    ("7", "7"),
    ("no number here", None),
    ("\\boxed{unbalanced", None),
])
def test_extract_answer_gold(text, answer):
  assert _math().__globals__["extract_answer"](text) == answer


def test_exact_match_scores_gsm8k_style_references():
  fn = _math()
  responses = ["#### 72", "I think \\boxed{72.0}", "71", "the answer is 5"]
  answers = ["Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", "72", 5]
  assert fn(responses, answer=answers, question=["q"] * 4) == [1.0, 1.0, 0.0, 1.0]
  with pytest.raises(ValueError, match="row 1: the reference answer 'n/a' holds no answer"):
    fn(["1", "2"], answer=["1", "n/a"])


# -- loading functions and prompt files -----------------------------------------------------


def test_load_function_by_module_or_file(tmp_path, monkeypatch):
  (tmp_path / "my_rewards.py").write_text("def f(responses, **kw):\n  return [1.0] * len(responses)\n"
                                          "g = 3\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  by_module = reward_functions.load_function("my_rewards:f")
  by_file = reward_functions.load_function(f"{tmp_path}/my_rewards.py:f")
  assert by_module(["a", "b"]) == by_file(["a", "b"]) == [1.0, 1.0]
  # A file runs once per process, however often it is named (the script checks, then trains).
  runs = tmp_path / "runs.txt"
  (tmp_path / "counted.py").write_text(f"open({str(runs)!r}, 'a').write('ran\\n')\n"
                                       "def f(responses):\n  return [0.0] * len(responses)\n")
  first = reward_functions.load_function(f"{tmp_path}/counted.py:f")
  assert reward_functions.load_function(f"{tmp_path}/counted.py:f") is first
  assert runs.read_text() == "ran\n"
  bad = {
      "my_rewards": "expected package.module:function or path/to/file.py:function",
      "no_such_module_xyz:f": "cannot import 'no_such_module_xyz': ModuleNotFoundError",
      "my_rewards:h": "module 'my_rewards' has no 'h'",
      "my_rewards:g": "'g' is a int, not a function",
      f"{tmp_path}/missing.py:f": "no such file",
  }
  for spec, message in bad.items():
    with pytest.raises(reward_functions.RewardFunctionError, match=message):
      reward_functions.load_function(spec)


def test_prompt_file_columns_and_errors(tmp_path):
  path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+2=", "answer": "3", "id": 7},
                                             {"prompt": "2+2=", "answer": "4"}])
  loaded = reward_functions.load_prompt_file(path)
  assert loaded.prompts == ["1+2=", "2+2="]
  assert loaded.fields == {"answer": ["3", "4"], "id": [7, None]}
  bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+2="}, {"question": "x"}])
  with pytest.raises(text_data.DataError,
                     match=r"bad.jsonl:2: 'prompt' must be a string, it is missing \(keys present: "
                     r"\['question'\]\)"):
    reward_functions.load_prompt_file(bad)
  with pytest.raises(text_data.DataError, match="empty prompt file"):
    reward_functions.load_prompt_file(_write_jsonl(tmp_path / "empty.jsonl", []))


def test_files_as_users_save_them_read_as_the_same_data(tmp_path):
  pairs = [{"prompt": "Q\u00e9?", "chosen": "yes \u2713", "rejected": "no"},
           {"prompt": "R?", "chosen": "a", "rejected": "b"}]
  plain = text_data.load_preference_pairs(_write_jsonl(tmp_path / "plain.jsonl", pairs))
  variants = {
      "bom.jsonl": dict(bom=True), "crlf.jsonl": dict(crlf=True),
      "gz.jsonl.gz": dict(gz=True), "gzip_without_suffix.jsonl": dict(gz=True),
      "all.jsonl": dict(bom=True, crlf=True, gz=True),
  }
  for name, kw in variants.items():
    path = _write_jsonl(tmp_path / name, pairs, **kw)
    assert text_data.load_preference_pairs(path) == plain, name
    assert text_data.load_prompts(path) == ["Q\u00e9?", "R?"], name
  # Really broken input keeps its errors: a BOM only at the start, not mid-file.
  broken = tmp_path / "broken.jsonl"
  broken.write_bytes(b'{"prompt": "a"}\n\xef\xbb\xbf{"prompt": "b"}\n')
  with pytest.raises(text_data.DataError, match="broken.jsonl:2: malformed JSON"):
    text_data.load_prompts(str(broken))


# -- ColumnReward: the checks on what the function returns ----------------------------------


def _samples(step=3):
  return Samples(prompt_text=["1+1=", "2+2=", "1+1="], response_text=["2", "5", "3"],
                 prompt_ids=[[1]] * 3, response_ids=[[1]] * 3, prompt_index=[0, 1, 0], step=step)


def test_column_reward_passes_each_rows_columns():
  seen = {}

  def fn(responses, answer, tag):
    seen.update(responses=responses, answer=answer, tag=tag)
    return [float(r == a) for r, a in zip(responses, answer)]

  reward = reward_functions.ColumnReward(fn, {"answer": ["2", "4"], "tag": ["x", "y"]})
  scores = reward(_samples())
  assert scores.dtype == np.float32 and scores.tolist() == [1.0, 0.0, 0.0]
  assert seen == {"responses": ["2", "5", "3"], "answer": ["2", "4", "2"], "tag": ["x", "y", "x"]}


@pytest.mark.parametrize("returned, message", [
    ([1.0, 2.0], "at RL step 3 returned 2 values for 3 responses; expected a list of 3 floats"),
    ([[1.0], [2.0], [3.0]], r"returned an array of shape \(3, 1\) for 3 responses"),
    ("abc", "returned str 'abc'; expected a list of 3 floats"),
    ([1.0, float("nan"), 2.0], r"returned nan for row 1 \(prompt '2\+2=', response '5'\); "
                               "rewards must be finite"),
    ([1.0, 2.0, float("inf")], "returned inf for row 2"),
])
def test_column_reward_refuses_bad_results(returned, message):
  reward = reward_functions.ColumnReward(lambda responses: returned, name="mod:fn")
  with pytest.raises(reward_functions.RewardFunctionError,
                     match="^reward function mod:fn at RL step 3 returned "):
    reward(_samples())
  with pytest.raises(reward_functions.RewardFunctionError, match=message):
    reward(_samples())


def test_column_reward_names_an_exception_of_the_function():
  def fn(responses):
    raise KeyError("answer")

  reward = reward_functions.ColumnReward(fn)
  with pytest.raises(reward_functions.RewardFunctionError,
                     match=r"reward function .*fn at RL step 5 raised KeyError: 'answer'"):
    reward(_samples(step=5))


# -- the embedded pipeline with a prompt file and a function --------------------------------


def _addition_by_column(responses, question):
  """The addition task's reward, from a column instead of the prompt."""
  return [arithmetic.addition_score(q, r) for q, r in zip(question, responses)]


def _tiny(**kw):
  rl = pipeline.default_rl_config("grpo", num_steps=3, prompts_per_step=4, max_new_tokens=4)
  return pipeline.EmbeddedConfig(rl=rl, hidden_size=16, num_layers=1, num_heads=2,
                                 num_kv_heads=1, pretrain_steps=2, sft_steps=2, batch_size=8,
                                 num_eval_prompts=0, **kw)


@pytest.mark.slow
def test_reward_fn_and_prompt_file_equal_the_programmatic_reward(tmp_path):
  # The prompt file holds the embedded task's own RL prompts, and the function scores them as
  # the built-in addition reward does: every RL metric equals the default run's, bit for bit.
  prompts = arithmetic.AdditionTask(max_operand=20).prompts(5_000, 0 + 3)
  path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "question": p} for p in prompts],
                      bom=True, crlf=True)
  spec = f"{__file__}:_addition_by_column"
  quiet = dict(log=lambda *_: None)
  default = pipeline.run_embedded(_tiny(), **quiet)["history"]
  by_file = pipeline.run_embedded(_tiny(prompts=path, reward_fn=spec), **quiet)["history"]
  strip = lambda h: [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in h]
  assert strip(by_file) == strip(default)
  assert len(default) == 3 and all(np.isfinite(r["reward/mean"]) for r in default)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--max_staleness=1"]])  # scored on the generator thread
def test_script_stops_on_a_function_with_the_wrong_count(tmp_path, extra):
  prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)}
                                                for i in range(8)])
  (tmp_path / "short.py").write_text("def fn(responses, answer):\n  return [1.0]\n")
  out = subprocess.run(
      [sys.executable, SCRIPT, f"--reward_fn={tmp_path}/short.py:fn", f"--prompts={prompts}",
       "--num_steps=2", "--pretrain_steps=0", "--sft_steps=0", "--num_eval_prompts=0",
       "--prompts_per_step=4", f"--logdir={tmp_path}/run", *extra],
      capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: reward function {tmp_path}/short.py:fn at RL step 1 returned 1 value for 4 "
      f"responses; expected a list of 4 floats, one per response")
