"""The control actor-critic: built for an environment, and applied as the PPO core expects.

The networks are `rljax.models.mlp.ActorCritic` (a tanh-squashed Gaussian policy and a value
MLP that share no parameter). `Networks` holds the NNX graph definition and sizes; parameters
travel separately as ``nnx.State`` (split/merge around plain ``jax.jit``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from flax import nnx

from rljax import ppo, runtime
from rljax.models import mlp

Array = jax.Array


class Networks(NamedTuple):
  """Static pieces: the NNX graph definition and the network config."""

  graphdef: Any
  config: mlp.ActorCriticConfig


def observation_size(env) -> int:
  """The length ``D`` of ``env``'s flat observation vector, from the abstract shape of a reset.

  (Brax's ``PipelineEnv.observation_size`` runs ``reset`` eagerly, op by op: tens of seconds
  for brax/ant on CPU.)

  Raises:
    ValueError: the observation is not one flat vector (e.g. a dict of observations).
  """
  obs = jax.eval_shape(env.reset, jax.random.PRNGKey(0)).obs
  size = obs.shape if hasattr(obs, "shape") else jax.tree.map(lambda x: x.shape, obs)
  if isinstance(size, tuple) and len(size) == 1:
    return int(size[0])
  raise ValueError(
      f"rljax's MLP policy needs a flat observation vector; this environment's "
      f"observation_size is {size!r}."
  )


def actor_critic_config(env, *, policy_hidden, value_hidden, activation: str,
                        init_std: float | None = None, policy_init_scale: float | None = None
                        ) -> mlp.ActorCriticConfig:
  """The `mlp.ActorCriticConfig` for ``env``'s observation and action sizes with these layer
  sizes and initialisation (None: the network's defaults).

  Raises:
    ValueError: non-flat observations (`observation_size`), or sizes the network refuses.
  """
  init = {k: v for k, v in (("init_std", init_std), ("policy_init_scale", policy_init_scale))
          if v is not None}
  return mlp.ActorCriticConfig(observation_size=observation_size(env),
                               action_size=int(env.action_size), policy_hidden=policy_hidden,
                               value_hidden=value_hidden, activation=activation, **init)


def make_networks(net_config: mlp.ActorCriticConfig, key: Array | None
                  ) -> tuple[Networks, Any]:
  """Builds the actor-critic of ``net_config``; returns ``(networks, params)``, or ``(networks,
  None)`` for ``key=None`` (the graph definition only: nothing compiles or runs).

  The parameters come from one compiled program (without LLVM optimisation: it runs once)
  instead of NNX's eager initialisers run op by op; they are bitwise the eager ones.
  """
  make = lambda key: mlp.ActorCritic(net_config, rngs=nnx.Rngs(params=key))  # noqa: E731
  graphdef, _ = nnx.split(nnx.eval_shape(make, jax.random.PRNGKey(0)), nnx.Param)
  networks = Networks(graphdef, net_config)
  if key is None:
    return networks, None
  init = jax.jit(lambda key: nnx.split(make(key), nnx.Param)[1],
                 compiler_options=runtime.run_once_compiler_options())
  return networks, init(key)


def policy_apply(networks: Networks, params, obs_norm: Array) -> tuple[Array, Array]:
  """``obs [..., D]`` (normalised, float32) -> ``(loc, scale)``, each ``[..., A]``: the mean
  and standard deviation of the pre-tanh Gaussian policy (actions are ``tanh`` of a sample)."""
  model = nnx.merge(networks.graphdef, params)
  return model.policy_params(obs_norm)


def value_apply(networks: Networks, params, obs_norm: Array) -> Array:
  """``obs [..., D]`` (normalised, float32) -> state values ``[...]`` of the value network."""
  model = nnx.merge(networks.graphdef, params)
  return model.value_fn(obs_norm)


def ppo_apply_fn(networks: Networks) -> ppo.ApplyFn:
  """The control side of ``ppo_update``: ``(params, minibatch) -> (log_probs, values, entropy)``.

  ``minibatch["obs"]`` is ``[M, D]`` (normalised) and ``minibatch["raw_actions"]`` ``[M, A]``
  (pre-tanh samples); the three outputs are ``[M]`` (log-probability of the squashed action,
  value, entropy of the pre-tanh Gaussian).
  """

  def apply(params, minibatch):
    model = nnx.merge(networks.graphdef, params)
    loc, scale = model.policy_params(minibatch["obs"])
    log_probs = mlp.squashed_log_prob(minibatch["raw_actions"], loc, scale)
    values = model.value_fn(minibatch["obs"])
    return log_probs, values, mlp.gaussian_entropy(scale)

  return apply


def policy_only_apply_fn(networks: Networks) -> ppo.ApplyFn:
  """`ppo_apply_fn` with the value predictions taken from the batch: the loss's gradient
  then reaches only the policy network."""

  def apply(params, minibatch):
    loc, scale = policy_apply(networks, params, minibatch["obs"])
    log_probs = mlp.squashed_log_prob(minibatch["raw_actions"], loc, scale)
    return log_probs, minibatch["values"], mlp.gaussian_entropy(scale)

  return apply


def value_only_apply_fn(networks: Networks) -> ppo.ApplyFn:
  """`ppo_apply_fn` with the rollout's log-probs (ratio 1) and no entropy: the loss's
  gradient then reaches only the value network."""

  def apply(params, minibatch):
    values = value_apply(networks, params, minibatch["obs"])
    return minibatch["log_probs"], values, jax.numpy.zeros_like(values)

  return apply


def policy_mask(params):
  """``params``' structure with ``True`` at the policy network's leaves."""
  return jax.tree_util.tree_map_with_path(lambda path, _: path[0].key == "policy", params)
