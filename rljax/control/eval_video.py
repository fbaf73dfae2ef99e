"""Videos of the PPO policy at every evaluation: the ``on_eval`` callback of ``trainer.train``.

    from rljax.control import eval_video, trainer
    on_eval = eval_video.eval_video_callback(config, logdir, formats=("mp4",))
    trainer.train(config, logdir, on_eval=on_eval)
    # -> <logdir>/videos/eval_0.mp4, eval_<env_steps>.mp4, ... (one per evaluation)

The rollout (`rljax.control.render.EvalVideo`) is compiled once, with the policy's
parameters and observation statistics as arguments, on the run's unwrapped environment
(same ``env_kwargs``, ``episode_length`` and ``action_repeat`` as training), with the
deterministic action ``tanh(loc)``. Every video starts from the same resets
(``PRNGKey(config.seed)``), so successive videos show the same episodes as the policy
learns.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from rljax import envs, running_stats, runtime
from rljax.control import render
from rljax.control.learner import TrainState
from rljax.control.networks import policy_apply
from rljax.control.trainer import make_networks
from rljax.control.config import ControlConfig

OnEval = Callable[[int, TrainState, dict], Any]


def eval_video_callback(
    config: ControlConfig,
    logdir: str,
    *,
    formats: Sequence[str] = ("mp4",),
    height: int = 240,
    width: int = 320,
    num_envs: int = 1,
    camera: str | int | None = None,
    max_fps: float = 50.0,
) -> OnEval:
  """Builds ``on_eval(chunk, train_state, record)`` writing ``<logdir>/videos/eval_<env_steps>.<fmt>``.

  ``record["env_steps"]`` (the environment steps trained so far, an int) names the file;
  the callback returns the `rljax.control.render.RenderResult`. In a multi-process run every
  process calls it (the policy is gathered to the host) and process 0 renders and writes
  (the others return ``None``).

  Args:
    config: the run's config (environment, episode length, action repeat, seed).
    logdir: the run's directory.
    formats: subset of ``("mp4", "gif")``.
    height, width: pixels per environment (even numbers for MP4).
    num_envs: episodes side by side.
    camera: camera name or index (``None``: the environment's default).
    max_fps: frame-rate ceiling (`render.EvalVideo`).

  Raises:
    ValueError: bad formats, sizes or camera, before anything compiles.
    rljax.envs.UnknownEnvError: unknown ``config.env``.
  """
  formats = render.check_video_options(formats, height, width)
  env = envs.make(config.env, **dict(config.env_kwargs))
  # The graph definition only: the parameters come from the train state at each call.
  networks, _ = make_networks(config, env, None)

  def policy_fn(policy_params, obs):
    params, obs_stats = policy_params
    loc, _ = policy_apply(networks, params, running_stats.normalize(obs_stats, obs))
    return jnp.tanh(loc)

  video = render.EvalVideo(
      env, policy_fn, num_envs=num_envs,
      episode_length=config.episode_length or envs.default_episode_length(config.env),
      action_repeat=config.action_repeat, camera=camera, height=height, width=width,
      max_fps=max_fps, formats=formats)
  key = jax.random.PRNGKey(config.seed)
  out_dir = os.path.join(logdir, "videos")

  def on_eval(chunk: int, train_state: TrainState, record: dict):
    del chunk
    # The policy as host arrays: in a multi-process run its arrays span other processes'
    # devices (every process takes part in the gather); process 0 alone renders and writes.
    policy = runtime.to_host((train_state.params, train_state.obs_stats))
    if not runtime.is_primary():
      return None
    path = os.path.join(out_dir, f"eval_{int(record['env_steps'])}")
    return video(policy, path, key)

  return on_eval


__all__ = ["OnEval", "eval_video_callback"]
