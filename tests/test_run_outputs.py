"""What every run leaves behind besides metrics: run_info.json, W&B offline runs, eval videos,
and train_control.py's --algo switch."""

import dataclasses
import glob
import importlib.metadata
import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from rljax import metrics, run_info
from rljax.control.config import ControlConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "train_control.py")

# As tests/test_control.py's TINY: compiles and trains in seconds.
TINY_PPO = dict(
    env="playground/CartpoleBalance", num_timesteps=4 * 16 * 8, num_envs=16, unroll_length=8,
    num_minibatches=2, num_epochs=2, num_evals=3, num_eval_envs=4, episode_length=50,
    policy_hidden=(8,), value_hidden=(8,),
)
# As tests/test_apg.py's run: PendulumSwingup has no constraint solver, the cheapest to compile.
TINY_APG = dict(
    env="playground/PendulumSwingup", num_envs=4, horizon_length=4, truncation_length=2,
    num_updates=4, num_evals=3, num_eval_envs=2, episode_length=8, policy_hidden=(8,),
)


def _flags(d):
  return [f"--{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in d.items()]


def _run_script(args, timeout):
  return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                        timeout=timeout, cwd=REPO)


def read_wandb_records(run_dir):
  """Parses an offline run's ``run-*.wandb`` file into ``wandb_internal_pb2.Record`` s.

  The file is a LevelDB-style log (wandb's own format, which the Python package no longer
  ships a reader for): a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
  chunks, each with a 7-byte header (CRC32, little-endian uint16 length, type: 1 full,
  2 first, 3 middle, 4 last) and a piece of a serialised protobuf Record.
  """
  from wandb.proto import wandb_internal_pb2 as pb

  (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B"
  block, pos, buf, records = 32768, 7, b"", []
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # block trailer padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if length == 0 and kind == 0:
      break
    chunk = data[pos + 7:pos + 7 + length]
    pos += 7 + length
    buf = chunk if kind in (1, 2) else buf + chunk
    if kind in (1, 4):
      record = pb.Record()
      record.ParseFromString(buf)
      records.append(record)
  return records


def _finished_records(run_dir, timeout_s: float = 120.0):
  """The run's records, read once the file holds its ``exit`` record (the last one written).

  wandb writes the file from a separate service process. In one CI run on two overloaded
  cores the file held none of the ``run.log`` records after ``run.finish()`` had returned;
  this waits (up to ``timeout_s``) for the writer instead of reading a file it may still be
  writing. Records that are lost rather than late still fail the callers' assertions.
  """
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      records = read_wandb_records(run_dir)
    except Exception:  # not yet created, or a chunk still being written
      if time.monotonic() > deadline:
        raise
    else:
      if any(r.WhichOneof("record_type") == "exit" for r in records):
        return records
      if time.monotonic() > deadline:
        return records
    time.sleep(0.5)


def wandb_history(run_dir):
  """``[{metric: value}]`` of the ``run.log`` calls, and the run's config dict."""
  history, config = [], {}
  for r in _finished_records(run_dir):
    kind = r.WhichOneof("record_type")
    if kind == "history":
      history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                      for i in r.history.item})
    elif kind == "run":
      config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
  return history, config


# -- run_info.json -------------------------------------------------------------------------


def test_run_info_records_config_versions_and_command(tmp_path):
  config = ControlConfig().replace(**TINY_PPO)
  argv = ["experiments/train_control.py", "--logdir=x y", "--num_envs=16"]
  path = run_info.write_run_info(str(tmp_path), config, argv=argv, extra={"algo": "ppo"})
  assert path == str(tmp_path / "run_info.json")
  with open(path) as f:
    info = json.load(f)
  assert info["config"] == json.loads(config.to_json())
  assert info["config_type"] == "ControlConfig" and info["algo"] == "ppo"
  assert info["argv"] == argv
  assert info["command"] == "experiments/train_control.py '--logdir=x y' --num_envs=16"
  versions = info["versions"]
  assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
  for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "brax", "mujoco",
               "mujoco-mjx", "playground", "rljax"):
    assert versions[name] == importlib.metadata.version(name), name
  assert versions["rljax"] == "0.1.0"
  assert "previous" not in info
  # A resume (same logdir) records its own command and keeps the earlier starts'.
  for resume in (["--num_processes=1"], ["--seed=3"]):
    run_info.write_run_info(str(tmp_path), config, argv=argv + resume)
  with open(path) as f:
    info = json.load(f)
  assert info["argv"] == argv + ["--seed=3"]
  assert [p["command"] for p in info["previous"]] == [
      "experiments/train_control.py '--logdir=x y' --num_envs=16",
      "experiments/train_control.py '--logdir=x y' --num_envs=16 --num_processes=1"]
  assert info["previous"][0]["versions"] == versions and "config" not in info["previous"][0]


def test_run_info_serialises_nested_configs_with_enums():
  from rljax.alignment import pipeline

  config = pipeline.EmbeddedConfig(rl=pipeline.default_rl_config("grpo", num_steps=3))
  d = run_info.config_to_dict(config)
  assert d["rl"]["algo"] == "grpo" and d["rl"]["num_steps"] == 3 and d["rl"]["group_size"] == 4
  assert d["rl"]["ppo"]["num_epochs"] == 2  # nested dataclass
  assert d["rl"]["kl_estimator"] == "k1"
  assert json.loads(json.dumps(d)) == d
  with pytest.raises(TypeError, match="config must be a dataclass instance, a mapping or None, got int"):
    run_info.config_to_dict(3)


# -- Weights & Biases ------------------------------------------------------------------------


def test_wandb_offline_run_receives_metrics_writer_records(tmp_path):
  logdir = str(tmp_path / "run")
  run = metrics.init_wandb(logdir, {"lr": 0.5, "env": "x"})
  try:
    assert metrics.active_wandb_run() is run
    with metrics.MetricsWriter(logdir) as w:  # mirrors to the active run by default
      for step in range(3):
        w.write(step, {"loss": 1.0 / (step + 1), "bad": float("nan")},
                stage="sft" if step == 2 else None)
    with metrics.MetricsWriter(logdir, wandb=False) as w:  # opted out
      w.write(10, {"loss": 123.0})
  finally:
    run.finish()
  assert metrics.active_wandb_run() is None
  (run_dir,) = glob.glob(os.path.join(logdir, "wandb", "offline-run-*"))
  history, config = wandb_history(run_dir)
  assert [h["step"] for h in history] == [0, 1, 2]
  assert [h["loss"] for h in history] == [1.0, 0.5, 1.0 / 3.0]
  assert all(h["bad"] == "NaN" or h["bad"] != h["bad"] for h in history)  # NaN survives
  assert config["lr"] == 0.5 and config["env"] == "x"
  # The stage goes to metrics.jsonl only (W&B and TensorBoard tell stages by metric names).
  records = metrics.read_jsonl(os.path.join(logdir, "metrics.jsonl"))
  assert [r.get("stage") for r in records] == [None, None, "sft", None]
  assert list(records[2])[:2] == ["step", "stage"]
  assert all("stage" not in h for h in history)


def test_metrics_writer_creates_its_files_at_the_first_record(tmp_path):
  """A writer that records nothing (a finished run's re-run) leaves no empty metrics.jsonl or
  event file; the first record creates both; a resume's truncation that drops nothing leaves
  the file untouched."""
  from rljax import checkpoint as ckpt

  logdir = str(tmp_path / "run")
  with metrics.MetricsWriter(logdir, wandb=False):
    pass
  assert os.listdir(logdir) == []
  with metrics.MetricsWriter(logdir, wandb=False) as w:
    w.write(1, {"loss": 2.0})
    w.write(2, {"loss": 1.0})
  names = sorted(os.listdir(logdir))
  assert names[0].startswith("events.out.tfevents") and names[1:] == ["metrics.jsonl"], names
  path = os.path.join(logdir, "metrics.jsonl")
  os.utime(path, ns=(1, 1))
  ckpt.truncate_jsonl(path, 2, in_place=True)  # nothing after step 2
  assert os.stat(path).st_mtime_ns == 1
  ckpt.truncate_jsonl(path, 1, in_place=True)
  assert [r["step"] for r in metrics.read_jsonl(path)] == [1]
  assert os.stat(path).st_mtime_ns != 1


# -- train_control.py: --algo, bad flags -----------------------------------------------------


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--algo=sac"], "--algo must be one of ppo, apg; got 'sac'."),
        (["--horizon_length=4"], "--horizon_length: APG settings, valid only with --algo=apg."),
        (["--algo=apg", "--num_minibatches=4"],
         "--num_minibatches does not apply to --algo=apg; APG's settings "
         "(rljax.control.apg.APGConfig) are --action_repeat, "),
        (["--algo=apg", "--eval_video=mp4"], "--eval_video works with --algo=ppo only"),
        # The video flags are checked before the environment's name (whose lookup imports
        # Playground), so a bad name does not hide them.
        (["--env=playground/Nope", "--eval_video=avi"],
         "video formats must be a non-empty subset of ('mp4', 'gif'), got ('avi',)."),
        (["--eval_video=mp4", "--video_size=241,320"], "MP4 needs even height and width, got 241x320."),
        (["--eval_video=gif", "--video_size=a,b"], "--video_size must be two integers HEIGHT,WIDTH, got 'a,b'."),
    ],
)
def test_script_rejects_bad_algo_and_video_flags(flags, match, tmp_path):
  out = _run_script([f"--logdir={tmp_path}/run", *flags], timeout=120)
  assert out.returncode == 2, out.stderr
  assert match in out.stderr
  assert "Traceback" not in out.stderr
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_script_algo_apg_writes_metrics_run_info_and_wandb(tmp_path):
  logdir = tmp_path / "run"
  out = _run_script([f"--logdir={logdir}", "--algo=apg", "--noprogress", "--wandb",
                     *_flags(TINY_APG)], timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "playground/PendulumSwingup: final eval episode reward" in out.stdout
  records = metrics.read_jsonl(str(logdir / "metrics.jsonl"))
  # 2 chunks x 2 updates x 4 envs x 4 steps = 64 env steps.
  assert [(r["step"], r["env_steps"]) for r in records] == [(0, 0), (1, 32), (2, 64)]
  assert "grad_norm" in records[-1] and "pg_loss" not in records[-1]  # APG, not PPO
  with open(logdir / "checkpoints" / "config.json") as f:
    assert json.load(f)["algo"] == "apg"
  with open(logdir / "run_info.json") as f:
    info = json.load(f)
  assert info["algo"] == "apg" and info["config_type"] == "APGConfig"
  assert info["config"]["horizon_length"] == 4 and info["config"]["policy_hidden"] == [8]
  assert info["argv"][1:3] == [f"--logdir={logdir}", "--algo=apg"]
  assert info["versions"]["brax"] == importlib.metadata.version("brax")
  (run_dir,) = glob.glob(str(logdir / "wandb" / "offline-run-*"))
  history, config = wandb_history(run_dir)
  assert [h["step"] for h in history] == [0, 1, 2]
  assert [h["env_steps"] for h in history] == [0, 32, 64]
  assert [h["eval/episode_reward"] for h in history] == [r["eval/episode_reward"] for r in records]
  assert config["horizon_length"] == 4
  assert config["_versions"]["jax"] == importlib.metadata.version("jax")


# -- videos at each evaluation ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(formats=("avi",)), r"video formats must be a non-empty subset of \('mp4', 'gif'\), got \('avi',\)"),
        (dict(formats=()), "video formats must be a non-empty subset"),
        (dict(formats=("mp4",), height=49), "MP4 needs even height and width, got 49x320."),
    ],
)
def test_eval_video_callback_rejects_bad_settings_before_building(kwargs, match, tmp_path):
  from rljax.control import eval_video

  with pytest.raises(ValueError, match=match):
    eval_video.eval_video_callback(ControlConfig().replace(**TINY_PPO), str(tmp_path), **kwargs)
  assert not os.path.exists(tmp_path / "videos")


@pytest.mark.slow

def test_script_eval_video_writes_one_video_per_evaluation(tmp_path):
  import mediapy
  from PIL import Image

  logdir = tmp_path / "run"
  out = _run_script([f"--logdir={logdir}", "--noprogress", "--eval_video=mp4,gif",
                     "--video_size=48,64", *_flags(TINY_PPO)], timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  records = metrics.read_jsonl(str(logdir / "metrics.jsonl"))
  steps = [int(r["env_steps"]) for r in records]
  assert len(steps) == TINY_PPO["num_evals"] and steps[0] == 0 and steps[-1] > 0
  names = sorted(os.listdir(logdir / "videos"))
  assert names == sorted(f"eval_{s}.{ext}" for s in steps for ext in ("mp4", "gif"))
  # CartpoleBalance: dt 0.01 s, so at <= 50 fps every 2nd of the 50 steps is a frame,
  # plus the reset frame: 26 frames of 48 x 64 pixels.
  video = mediapy.read_video(str(logdir / "videos" / f"eval_{steps[-1]}.mp4"))
  assert video.shape == (26, 48, 64, 3)
  assert video.std() > 0  # not a blank picture
  with Image.open(logdir / "videos" / f"eval_{steps[0]}.gif") as gif:
    assert gif.size == (64, 48) and gif.n_frames == 26
  with open(logdir / "run_info.json") as f:
    info = json.load(f)
  from rljax.control.config import default_config

  tiny = {k: v for k, v in TINY_PPO.items() if k != "env"}
  expected = default_config(TINY_PPO["env"]).replace(**tiny)
  assert info["config"] == json.loads(expected.to_json())
