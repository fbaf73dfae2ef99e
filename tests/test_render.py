"""Rollout rendering: a tiny trained run renders MP4 and GIF of the requested size, moving."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from rljax import envs
from rljax.control import render, trainer
from rljax.control.config import ControlConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "render_policy.py")

# The same seconds-long run as tests/test_control.py's TINY.
TINY = dict(
    env="playground/CartpoleBalance", num_timesteps=4 * 16 * 8, num_envs=16, unroll_length=8,
    num_minibatches=2, num_epochs=2, num_evals=3, num_eval_envs=4, episode_length=50,
    policy_hidden=(8,), value_hidden=(8,),
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  logdir = str(tmp_path_factory.mktemp("render") / "run")
  trainer.train(ControlConfig().replace(**TINY), logdir, progress=False)
  return logdir


def _gif_frames(path):
  im = Image.open(path)
  frames = []
  for i in range(im.n_frames):
    im.seek(i)
    frames.append(np.asarray(im.convert("RGB")))
  return np.stack(frames)


@pytest.mark.slow
def test_render_policy_writes_moving_mp4_and_gif(run, tmp_path):
  # CartpoleBalance: dt = 0.01 s, so max_fps=50 keeps every 2nd of 40 steps:
  # steps 0, 2, ..., 38 plus the last (40) = 21 frames at 50 fps.
  result = render.render_policy(run, str(tmp_path / "clip"), num_envs=2, episode_length=40,
                                height=48, width=64, camera="fixed")
  assert result.paths == (str(tmp_path / "clip.mp4"), str(tmp_path / "clip.gif"))
  assert result.frames_shape == (21, 48, 128, 3)  # two environments side by side
  assert result.fps == pytest.approx(50.0)
  assert result.episode_rewards.shape == (2,) and np.all(result.episode_rewards > 0)

  gif = _gif_frames(result.paths[1])
  assert gif.shape == (21, 48, 128, 3)
  assert Image.open(result.paths[1]).info["duration"] == 20  # ms per frame = 1000 / 50
  # Frames differ over time (the cart-pole moves), and the two episodes differ.
  assert np.abs(gif[0].astype(int) - gif[-1].astype(int)).max() > 20
  assert len({f.tobytes() for f in gif}) > 10
  assert not np.array_equal(gif[-1, :, :64], gif[-1, :, 64:])

  import mediapy

  mp4 = mediapy.read_video(result.paths[0])
  assert mp4.shape == (21, 48, 128, 3)
  assert mp4.metadata.fps == pytest.approx(50.0)
  # H.264 is lossy; the MP4 shows the same pictures as the lossless GIF frames
  # up to compression error (8-bit values; mean absolute difference of a few levels).
  assert np.mean(np.abs(mp4.astype(float) - gif.astype(float))) < 8.0


def test_gif_keeps_a_small_bright_body_and_one_palette(tmp_path):
  """A blue gradient (the floor) with a 3x3 orange square moving across it: each frame is
  read back within 16/255 per channel, the square included (0.1% of the pixels), and all
  frames index one palette, so unchanged pixels keep their index between frames."""
  h, w, n = 48, 64, 30
  y, x = np.mgrid[:h, :w]
  floor = np.stack([20 + x // 2, 60 + y, 120 + x // 2 + y // 2], -1).astype(np.uint8)
  frames = np.repeat(floor[None], n, axis=0)
  for i in range(n):
    frames[i, 20:23, 2 * i:2 * i + 3] = (230, 140, 60)
  path = render.write_video(frames, str(tmp_path / "v.gif"), fps=25.0)
  back = _gif_frames(path)
  assert back.shape == frames.shape
  err = np.abs(back.astype(int) - frames.astype(int))
  assert err.max() <= 16, err.max()  # every pixel, the square's included
  palettes = {bytes(im.getpalette()) for im in render._gif_images(frames)}
  assert len(palettes) == 1


@pytest.mark.slow
def test_rollout_freezes_after_done_and_checks_camera(tmp_path):
  """A Brax env, a hand-written policy, and a frozen frame after termination."""
  env = envs.make("brax/inverted_pendulum")
  push = lambda obs: jnp.ones(obs.shape[:-1] + (1,))
  # Pushing the cart hard one way topples the pole (|angle| > 0.2): done before 40 steps.
  rollout = render.make_rollout_fn(env, lambda _, obs: push(obs), num_envs=1, num_steps=40)
  fields, dones, rewards = rollout((), jax.random.PRNGKey(0))
  assert fields["q"].shape == (41, 1, 2) and dones.shape == (41, 1) and rewards.shape == (40, 1)
  length = int(np.argmax(dones[:, 0]))
  assert 1 <= length < 40 and bool(dones[-1, 0])
  # inverted_pendulum pays 1 per step while alive; nothing after done.
  assert float(rewards[:, 0].sum()) == length
  frames = render.render_frames(env, fields, height=32, width=32)
  assert frames.shape == (41, 32, 32, 3) and frames.dtype == np.uint8
  for t in range(length, 41):
    np.testing.assert_array_equal(frames[t], frames[length])  # frozen after done
  assert not np.array_equal(frames[0], frames[length])
  with pytest.raises(ValueError, match=r"camera 'top' is not in this model; its cameras are"):
    render.render_rollout(env, push, str(tmp_path / "x.gif"), camera="top")
  with pytest.raises(ValueError, match="MP4 needs even height and width, got 33x32"):
    render.render_rollout(env, push, str(tmp_path / "x.mp4"), height=33, width=32)


@pytest.mark.slow
def test_eval_video_compiles_once_for_changing_params(tmp_path):
  """What the trainer calls after each evaluation: new parameters, no recompilation."""
  env = envs.make("brax/inverted_pendulum")
  video = render.EvalVideo(env, lambda w, obs: jnp.tanh(obs @ w), episode_length=10,
                           height=16, width=16, formats=("gif",))
  a = video(jnp.full((4, 1), 0.5), str(tmp_path / "a"))
  b = video(jnp.full((4, 1), -0.5), str(tmp_path / "b"))
  assert video.rollout._cache_size() == 1
  assert a.paths == (str(tmp_path / "a.gif"),) and os.path.exists(b.paths[0])
  frames_a, frames_b = _gif_frames(a.paths[0]), _gif_frames(b.paths[0])
  assert frames_a.shape[1:] == (16, 16, 3)
  assert not np.array_equal(frames_a[-1], frames_b[-1])  # pushed the other way


def test_script_rejects_missing_logdir(tmp_path):
  out = subprocess.run([sys.executable, SCRIPT, f"--logdir={tmp_path}/nothing"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr
  assert "No checkpoint config at" in out.stderr and "Traceback" not in out.stderr
