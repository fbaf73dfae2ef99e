"""Executes notebooks/*.ipynb with nbclient at small sizes; any cell error fails the test.

Each notebook has one code cell tagged ``parameters`` (as papermill uses it); the test
replaces its source with small values, appends a cell that writes the notebook's result
variables to JSON, and runs the notebook in a fresh ``python3`` kernel (ipykernel in this
environment) with the working directory in ``tmp_path``.
"""

import json
import math
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(REPO, "notebooks")


def run_notebook(name, parameters, results, tmp_path, timeout=600):
  """Runs ``notebooks/<name>`` with its parameters cell replaced; returns ``(nb, results)``.

  Args:
    name: notebook file name.
    parameters: ``{variable: value}``; values must round-trip through ``repr``.
    results: names of variables to read back after the run (JSON-serialisable ones).
    tmp_path: the kernel's working directory.

  Raises:
    nbclient.exceptions.CellExecutionError: a cell raised (its traceback in the message).
    AssertionError: the notebook has no single ``parameters`` cell, or a parameter is not
      one of its variables.
  """
  nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
  tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
  assert len(tagged) == 1, f"{name} needs exactly one cell tagged 'parameters'"
  defined = {line.split("=")[0].strip() for line in tagged[0].source.splitlines()
             if "=" in line and not line.startswith("#")}
  unknown = set(parameters) - defined
  assert not unknown, f"{sorted(unknown)} are not parameters of {name} ({sorted(defined)})"
  tagged[0].source = "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
  out_file = tmp_path / "notebook_results.json"
  nb.cells.append(nbformat.v4.new_code_cell(
      "import json as _json\n"
      f"with open({str(out_file)!r}, 'w') as _f:\n"
      f"    _json.dump({{k: globals()[k] for k in {list(results)!r}}}, _f,\n"
      "               default=lambda x: x.tolist() if hasattr(x, 'tolist') else str(x))"))
  client = nbclient.NotebookClient(
      nb, timeout=timeout, kernel_name="python3",
      resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  timings = []
  for c in nb.cells:
    t = c.get("metadata", {}).get("execution", {})
    if "iopub.execute_input" in t and "shell.execute_reply" in t:
      timings.append((t["iopub.execute_input"], t["shell.execute_reply"], c.source[:40]))
  print("\n".join(f"{a[11:19]}-{b[11:19]} {src!r}" for a, b, src in timings))  # -s shows it
  with open(out_file) as f:
    return nb, json.load(f)


def _has_image(nb):
  return any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
             for o in c.get("outputs", []))


@pytest.mark.slow
def test_quickstart_control_notebook(tmp_path):
  logdir = str(tmp_path / "run")
  overrides = dict(num_envs=16, unroll_length=8, num_minibatches=2, num_epochs=2,
                   num_eval_envs=4, episode_length=50, policy_hidden=(8,), value_hidden=(8,))
  nb, res = run_notebook(
      "quickstart_control.ipynb",
      dict(ENV="playground/CartpoleBalance", NUM_TIMESTEPS=4 * 16 * 8, NUM_EVALS=3,
           OVERRIDES=overrides, LOGDIR=logdir, VIDEO_ENVS=1, VIDEO_SIZE=(48, 64)),
      ["FINAL_EVAL_REWARD", "EXPORTED_ACTIONS", "IN_PROCESS_ACTIONS", "MAX_ACTION_DIFF"],
      tmp_path)
  from rljax.metrics import read_jsonl

  records = read_jsonl(os.path.join(logdir, "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 1, 2]
  assert res["FINAL_EVAL_REWARD"] == records[-1]["eval/episode_reward"]
  assert 0 < res["FINAL_EVAL_REWARD"] <= 50  # CartpoleBalance: at most 1 per step, 50 steps
  # The exported artifact acts exactly like the in-process policy: [16, 1] actions.
  assert len(res["EXPORTED_ACTIONS"]) == 16 and len(res["EXPORTED_ACTIONS"][0]) == 1
  assert res["MAX_ACTION_DIFF"] <= 1e-6
  for a, b in zip(res["EXPORTED_ACTIONS"], res["IN_PROCESS_ACTIONS"]):
    assert a == pytest.approx(b, abs=1e-6)
  assert len({round(a[0], 6) for a in res["EXPORTED_ACTIONS"]}) > 1  # not a constant policy
  assert os.path.exists(os.path.join(logdir, "export", "manifest.json"))
  assert os.path.getsize(os.path.join(logdir, "videos", "quickstart.mp4")) > 0
  assert _has_image(nb)  # the learning curve was drawn


@pytest.mark.slow
def test_quickstart_rlhf_notebook(tmp_path):
  nb, res = run_notebook(
      "quickstart_rlhf.ipynb",
      dict(MAX_OPERAND=20, PRETRAIN_STEPS=20, SFT_STEPS=10, PPO_STEPS=3, PROMPTS_PER_STEP=8,
           KL_COEF=0.02, NUM_EVAL_PROMPTS=16, SEED=0, RM_PAIRS=200, RM_STEPS=10, RM_PPO_STEPS=2),
      ["PPO_HISTORY", "ACCURACY_BEFORE", "ACCURACY_AFTER", "SAMPLES_BEFORE", "SAMPLES_AFTER",
       "RM_PPO_HISTORY", "ACCURACY_AFTER_RM"],
      tmp_path)
  history = res["PPO_HISTORY"]
  assert [h["step"] for h in history] == [1, 2, 3]
  for h in history:
    assert math.isfinite(h["reward/mean"]) and math.isfinite(h["kl"]), h
  assert history[0]["kl"] == pytest.approx(0.0, abs=1e-4)  # actor == reference at step 1
  # Part 2: PPO against the learned reward model, scored by it.
  assert [h["step"] for h in res["RM_PPO_HISTORY"]] == [1, 2]
  assert all(math.isfinite(h["score/mean"]) for h in res["RM_PPO_HISTORY"])
  for key in ("ACCURACY_BEFORE", "ACCURACY_AFTER", "ACCURACY_AFTER_RM"):
    assert 0.0 <= res[key] <= 1.0 and res[key] * 16 == round(res[key] * 16)  # k of 16 right
  assert len(res["SAMPLES_BEFORE"]) == len(res["SAMPLES_AFTER"]) == 8
  assert all(isinstance(s, str) for s in res["SAMPLES_BEFORE"] + res["SAMPLES_AFTER"])
  assert _has_image(nb)  # reward and KL plots
