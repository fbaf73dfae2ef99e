"""Rollouts: the policy acting in the batched environments, traced inside the training step.

One unroll is a ``lax.scan`` over ``unroll_length`` steps of::

    normalise(obs) -> policy -> u ~ N(loc, scale), a = tanh(u) -> vmapped env.step

(the libraries' auto-reset wrappers reset finished episodes; the pre-reset observation is kept
as ``final_obs`` for bootstrapping). An iteration collects ``batch_size / num_envs`` unrolls of
all environments and lays them out as ``[N, T, ...]`` trajectory segments.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rljax import envs, running_stats
from rljax.control.config import ControlConfig
from rljax.control.networks import Networks, policy_apply
from rljax.models import mlp

Array = jax.Array


def iteration_keys(key: Array) -> tuple[Array, Array, Array]:
  """One training iteration's keys from the train state's: ``(next key, rollout key, update
  key)``. Every chunk (one program, threaded, overlapped) splits them here, so they draw the
  same rollouts and minibatches."""
  return tuple(jax.random.split(key, 3))


def strong_types(tree):
  """``tree`` with no weakly typed leaves.

  Environment states can hold weakly typed leaves (Playground's CheetahRun resets
  ``data.time`` to a Python float; Brax's ant steps some metrics to weak types). The reset and
  the train chunk both return strong types, so a chunk's outputs match its inputs: a jitted
  function called with another weak type would compile again.
  """
  return jax.tree.map(lambda x: jnp.asarray(x, dtype=x.dtype), tree)


class Rollout(NamedTuple):
  """The rollouts of a run: its batched training environment, networks and sizes.

  Attributes:
    env: the batched environment (``rljax.envs.wrap_for_training``), leading axis ``B``.
    networks: the actor-critic.
    config: the run's config (``num_envs``, ``unroll_length``, unrolls per iteration).
  """

  env: Any
  networks: Networks
  config: ControlConfig

  def unroll(self, params, stats, env_state, key: Array, group: Array | None = None):
    """``unroll_length`` steps of the environments in ``env_state``; returns ``(env_state,
    data)`` with ``data`` leaves ``[T, B, ...]``: ``obs``, ``raw_actions`` (pre-tanh),
    ``log_probs``, ``rewards``, ``dones``, ``truncation``, ``final_obs``.

    With ``group`` (``[]`` int32, a threaded chunk) ``env_state`` holds the ``group``-th of
    equal groups of the ``num_envs`` environments, whose rows of the all-environment action
    noise it draws, so the groups together draw the one-program rollout's noise.
    """
    networks, num_envs = self.networks, self.config.num_envs

    def step(state, step_key):
      obs_n = running_stats.normalize(stats, state.obs)
      loc, scale = policy_apply(networks, params, obs_n)
      if group is None:
        u = mlp.sample_pre_tanh(step_key, loc, scale)
      else:
        u = mlp.sample_pre_tanh(step_key, loc, scale, num_rows=num_envs,
                                first_row=group * loc.shape[0])
      next_state = self.env.step(state, jnp.tanh(u))
      transition = dict(
          obs=state.obs,
          raw_actions=u,
          log_probs=mlp.squashed_log_prob(u, loc, scale),
          rewards=next_state.reward,
          dones=next_state.done,
          truncation=next_state.info["truncation"],
          final_obs=next_state.info[envs.FINAL_OBS_KEY],
      )
      return next_state, transition

    keys = jax.random.split(key, self.config.unroll_length)
    return jax.lax.scan(step, env_state, keys)

  def unrolls(self, params, stats, env_state, key_roll: Array, group: Array | None = None):
    """The iteration's ``batch_size / num_envs`` unrolls of the environments in
    ``env_state`` (all, or one ``group`` as in `unroll`); leaves ``[U, T, B, ...]``."""
    def one_unroll(env_state, k):
      return self.unroll(params, stats, env_state, k, group)

    keys = jax.random.split(key_roll, self.config.unrolls_per_iteration)
    return jax.lax.scan(one_unroll, env_state, keys)

  def segments(self, data):
    """``[U, T, B, ...] -> [U * B, T, ...]``: one row per trajectory segment."""
    t = self.config.unroll_length
    return jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2).reshape((-1, t) + x.shape[3:]), data)

  def collect(self, params, stats, env_state, key_roll: Array):
    """``batch_size / num_envs`` unrolls with the policy in ``params``; returns ``(env_state,
    segments)`` with leaves ``[N, T, ...]``."""
    env_state, data = self.unrolls(params, stats, env_state, key_roll)
    return env_state, self.segments(data)
