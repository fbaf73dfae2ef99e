"""Evaluation: one full episode in each evaluation environment, traced in one program.

The evaluation environment is wrapped in Brax's ``EvalWrapper``, which freezes each episode's
return and length at its first ``done``; `run_eval_episodes` stops stepping the physics once
every episode has ended (environments that terminate gain; DM Control tasks, which only
truncate, run every step), with metrics bitwise those of running all ``episode_length`` steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from rljax import running_stats, runtime
from rljax.control.config import ControlConfig
from rljax.control.networks import Networks, policy_apply
from rljax.models import mlp

Array = jax.Array


def run_eval_episodes(eval_env, reset_keys: Array, act: Callable[[Array, Any], Array],
                      step_keys: Array | None = None, *, num_steps: int | None = None
                      ) -> dict[str, Array]:
  """One episode per environment of a Brax ``EvalWrapper``-wrapped env, traced in ``lax.scan``.

  Each of the ``T`` steps runs the environment only while some environment's first episode is
  still running (``lax.cond``); after that the state passes through unchanged. ``EvalWrapper``
  freezes each episode's return and length at its first ``done``, so the steps skipped (which
  Brax's evaluator runs, up to ``T``) cannot change the result, and the metrics are bitwise
  those of running every step.

  Args:
    eval_env: wrapped with ``brax.envs.wrappers.training.EvalWrapper`` (over the episode and
      action-repeat wrappers), so that ``state.info["eval_metrics"]`` holds each episode's
      return and length, frozen at its first ``done``.
    reset_keys: ``[E, 2]`` uint32 PRNG keys, one per environment.
    act: ``(obs [E, D] f32, key or None) -> action [E, A]`` f32 in ``[-1, 1]``.
    step_keys: ``[T, 2]`` keys; step ``t`` passes ``step_keys[t]`` to ``act``. None: ``act``
      gets None and ``num_steps`` gives ``T``.
    num_steps: ``T`` (steps after action repeat) when ``step_keys`` is None.

  Returns:
    f32 scalars ``eval/episode_reward`` (mean undiscounted return), ``eval/episode_reward_std``
    and ``eval/episode_length`` (mean steps).
  """
  def step(state, k):
    running = jnp.any(state.info["eval_metrics"].active_episodes > 0)
    state = jax.lax.cond(running, lambda s: eval_env.step(s, act(s.obs, k)), lambda s: s, state)
    return state, ()

  state, _ = jax.lax.scan(step, eval_env.reset(reset_keys), step_keys, length=num_steps)
  return episode_metrics(state.info["eval_metrics"])


def episode_metrics(eval_metrics) -> dict[str, Array]:
  """`run_eval_episodes`'s f32 scalars from a Brax ``EvalMetrics`` (``[E]`` episode returns and
  lengths): ``eval/episode_reward`` (mean), ``eval/episode_reward_std``, ``eval/episode_length``."""
  rewards = eval_metrics.episode_metrics["reward"]
  return {
      "eval/episode_reward": jnp.mean(rewards),
      "eval/episode_reward_std": jnp.std(rewards),
      "eval/episode_length": jnp.mean(eval_metrics.episode_steps),
  }


def make_evaluate(config: ControlConfig, networks: Networks, eval_env, episode_length: int
                  ) -> Callable:
  """``jit((params, obs_stats, key) -> metrics)``: one full episode in each of
  ``num_eval_envs`` environments, with the mean action ``tanh(loc)`` (``deterministic_eval``)
  or sampled actions; metrics as `run_eval_episodes` returns them."""
  n_steps = episode_length // config.action_repeat

  def run(params, obs_stats, key):
    key_reset, key_act = jax.random.split(key)

    def act(obs, k):
      loc, scale = policy_apply(networks, params, running_stats.normalize(obs_stats, obs))
      return jnp.tanh(loc if config.deterministic_eval else mlp.sample_pre_tanh(k, loc, scale))

    return run_eval_episodes(eval_env, jax.random.split(key_reset, config.num_eval_envs), act,
                             jax.random.split(key_act, n_steps))

  return jax.jit(run, compiler_options=runtime.control_compiler_options())
