"""A trained control policy, rebuilt from its run's folder alone (PPO and APG runs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rljax import checkpoint as ckpt
from rljax import running_stats
from rljax.control.networks import Networks, policy_apply
from rljax.models import mlp

Array = jax.Array


def load_params(logdir: str, *, step: int | None = None):
  """Restores ``(networks, params, obs_stats)`` of a run from ``<logdir>/checkpoints``
  (the newest checkpoint, or ``step``), whatever mesh or process count saved it.

  Raises:
    FileNotFoundError: no checkpoint or config under ``logdir`` (or none of ``step``).
    ValueError: ``logdir`` holds another kind of run (e.g. an RLHF run).
  """
  saved = ckpt.read_config(logdir)
  if "network" not in saved:
    raise ValueError(
        f"{logdir!r} is not a control run: its checkpoints/config.json has "
        f"{sorted(saved) or 'no sections'}, not the policy network that train_control.py "
        f"saves (load_policy, export and render read control runs)")
  net_config = mlp.ActorCriticConfig(
      **{k: tuple(v) if isinstance(v, list) else v for k, v in saved["network"].items()}
  )
  abstract = nnx.eval_shape(lambda: mlp.ActorCritic(net_config, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract, nnx.Param)
  target = {
      "params": nnx.to_pure_dict(params),
      "obs_stats": running_stats.init(net_config.observation_size)._asdict(),
  }
  restored = ckpt.restore_policy(logdir, target, step)
  nnx.replace_by_pure_dict(params, restored["params"])
  stats = running_stats.RunningStats(**restored["obs_stats"])
  return Networks(graphdef, net_config), params, stats


def load_policy(logdir: str, *, step: int | None = None, deterministic: bool = True):
  """Rebuilds the trained policy from ``<logdir>/checkpoints`` alone.

  Returns:
    ``policy(obs [..., D] float32, key=None) -> actions [..., A]`` in ``[-1, 1]``, jitted;
    the observation normaliser is applied inside. With ``deterministic=True`` the action is
    ``tanh(loc)`` and a key is ignored; with ``deterministic=False`` it is sampled with
    ``key``, which is then required.

  Raises:
    FileNotFoundError: no checkpoint or config under ``logdir``.
    ValueError: (when ``policy`` is called) ``obs``'s last axis is not the run's
      observation size ``D`` (a width of 1 would otherwise broadcast silently against the
      normaliser's ``[D]`` statistics); ``deterministic=False`` and no ``key``.
  """
  networks, params, stats = load_params(logdir, step=step)
  obs_size = networks.config.observation_size

  @jax.jit
  def policy(obs: Array, key: Array | None = None) -> Array:
    if obs.ndim == 0 or obs.shape[-1] != obs_size:
      raise ValueError(
          f"load_policy({logdir!r}): observations of shape {tuple(obs.shape)}; expected "
          f"[..., {obs_size}] (this run's observation size).")
    if not deterministic and key is None:
      raise ValueError(f"load_policy({logdir!r}, deterministic=False): the policy samples, so "
                       f"call it with a PRNG key: policy(obs, key).")
    loc, scale = policy_apply(networks, params, running_stats.normalize(stats, obs))
    if deterministic:
      return jnp.tanh(loc)
    return jnp.tanh(mlp.sample_pre_tanh(key, loc, scale))

  return policy
