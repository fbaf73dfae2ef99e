"""The control learner: from an iteration's rollout to the updated train state, purely.

``make_learn_step(config, networks, optimizer)`` returns ``learn_step(ts, data) -> (ts,
metrics)``, traced inside the training chunk after the rollout::

    data [N, T, ...] -> observation statistics -> values V(s_t), V(s'_t)
    -> compute_gae (rljax.ppo) -> ppo_update (epochs x minibatches in lax.scan)
    -> non-finite guard (rljax.nonfinite) -> TrainState

The observation statistics used to act are the same ones the update normalises with, and
they are refreshed only after it (unless ``obs_stats_before_update``), so at the first
minibatch of the first epoch the PPO ratio is exactly 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rljax import nonfinite, ppo, running_stats
from rljax.control.config import ControlConfig
from rljax.control.networks import Networks, ppo_apply_fn, value_apply
from rljax.control.rollout import iteration_keys

Array = jax.Array


class TrainState(NamedTuple):
  """The whole learner state carried between compiled steps.

  Attributes:
    params: ``nnx.State`` of the `ActorCritic`.
    opt_state: optax state.
    obs_stats: observation normaliser statistics.
    key: ``[2]`` uint32 PRNG key.
    iteration: ``[]`` int32 number of training iterations done.
    skipped_updates: ``[]`` int32 number of iterations whose update was skipped by the
      non-finite guard (a non-finite reward, observation, loss or gradient).
  """

  params: Any
  opt_state: Any
  obs_stats: running_stats.RunningStats
  key: Array
  iteration: Array
  skipped_updates: Array


def make_optimizer(config: ControlConfig, total_iterations: int) -> optax.GradientTransformation:
  """Adam with the configured learning-rate schedule over the run's SGD steps, after a
  global-norm clip when ``max_grad_norm`` is set."""
  total_steps = max(total_iterations * config.ppo.num_epochs * config.ppo.num_minibatches, 1)
  lr = config.learning_rate
  if config.lr_schedule == "linear":
    lr = optax.linear_schedule(config.learning_rate, 0.0, total_steps)
  elif config.lr_schedule == "cosine":
    lr = optax.cosine_decay_schedule(config.learning_rate, total_steps)
  if config.max_grad_norm is None:
    return optax.adam(lr)
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr))


def bootstrap_values(networks: Networks, params, stats, final_obs: Array, truncation: Array,
                     values: Array) -> Array:
  """``[N, T]`` values of each step's successor state, ``V(s'_t)``.

  ``s'_t`` is the pre-reset state (``final_obs [N, T, D]``, normalised here with ``stats``,
  only where used). Where step ``t < T - 1`` did not end an episode it is ``s_{t+1}``, whose
  value is already in ``values[:, t + 1]``; where it ended by termination its discount is 0
  and the value is unused. Only truncated steps before the last (``truncation [N, T]``) need
  ``V(final_obs)``. So the full second value pass runs only for batches that hold such a step
  (episodes truncate together, once every ``episode_length / unroll_length`` iterations or
  so); otherwise only the last step's successors ``[N]`` are evaluated. Both branches give
  the same values.
  """
  def full(_):
    return value_apply(networks, params, running_stats.normalize(stats, final_obs))

  def shifted(_):
    last = value_apply(networks, params, running_stats.normalize(stats, final_obs[:, -1]))
    return jnp.concatenate([values[:, 1:], last[:, None]], axis=1)

  needs_full = jnp.any(truncation[:, :-1])
  return jax.lax.cond(needs_full, full, shifted, None)


def gae(config: ControlConfig, networks: Networks, params, stats, steps: dict[str, Array],
        values: Array) -> tuple[Array, Array]:
  """``(advantages, returns)`` ``[N, T]`` by `rljax.ppo.compute_gae` for the segments in
  ``steps`` (``rewards``, ``dones``, ``truncation`` ``[N, T]``, raw ``final_obs``
  ``[N, T, D]``) with values ``[N, T]``: rewards scaled by ``reward_scaling``, terminal steps
  not bootstrapped, truncated ones bootstrapped from the truncated state's value
  (`bootstrap_values`), as Brax does."""
  truncation = steps["truncation"].astype(jnp.float32)
  bootstrap = bootstrap_values(networks, params, stats, steps["final_obs"], truncation, values)
  discounts = 1.0 - steps["dones"].astype(jnp.float32) * (1.0 - truncation)
  return ppo.compute_gae(
      steps["rewards"] * config.reward_scaling,
      values,
      bootstrap,
      discounts,
      gamma=config.gamma,
      gae_lambda=config.gae_lambda,
      truncation=truncation,
  )


def advantage_fn(config: ControlConfig, networks: Networks, stats) -> ppo.AdvantageFn | None:
  """`rljax.ppo.ppo_update`'s ``advantage_fn`` where ``config.gae_per_minibatch``: GAE over
  the minibatch's segments with the values the loss computed (``stats``: the statistics
  the batch was normalised with); else None."""
  if not config.gae_per_minibatch:
    return None
  return lambda params, minibatch, values: gae(config, networks, params, stats, minibatch,
                                               values)


def make_batch(config: ControlConfig, networks: Networks, params, stats, data
               ) -> tuple[dict[str, Array], Array, Array]:
  """The update's batch (``[N, T]`` leaves, observations normalised with ``stats``) with
  values ``V(s_t)`` under ``params`` and GAE; or, where ``config.gae_per_minibatch``, with
  the rewards, flags and raw ``final_obs`` that `advantage_fn` computes them from in each
  minibatch. Also whether rewards and observations are all finite (two ``[]`` bools)."""
  obs_n = running_stats.normalize(stats, data["obs"])
  steps = {k: data[k] for k in ("rewards", "dones", "truncation", "final_obs")}
  batch = dict(
      obs=obs_n,
      raw_actions=data["raw_actions"],
      log_probs=data["log_probs"],
      mask=jnp.ones_like(data["log_probs"]),
  )
  if config.gae_per_minibatch:  # ppo_update computes them in each minibatch
    batch.update(steps)
  else:
    values = value_apply(networks, params, obs_n)
    advantages, returns = gae(config, networks, params, stats, steps, values)
    batch.update(values=values, advantages=advantages, returns=returns)
  return (batch, nonfinite.all_finite(data["rewards"]),
          nonfinite.all_finite(data["obs"], data["final_obs"]))


def fold_obs(config: ControlConfig, stats: running_stats.RunningStats, data
             ) -> tuple[running_stats.RunningStats, running_stats.RunningStats]:
  """``(batch_stats, new_stats)``: the statistics the update normalises its batch with, and
  the ones the iteration ends with (``stats`` with the rollout's ``data["obs"]``,
  ``[N, T, obs]``, folded in where observations are normalised). ``batch_stats`` is
  ``new_stats`` in Brax's order (``config.obs_stats_before_update``), else ``stats``."""
  new_stats = running_stats.update(stats, data["obs"]) if config.normalize_observations else stats
  return (new_stats if config.obs_stats_before_update else stats), new_stats


def data_metrics(data, finite_rewards: Array, finite_obs: Array) -> dict[str, Array]:
  """An iteration's metrics of its rollout ``data``: ``train/reward_per_step``,
  ``train/episodes_done`` and the ``nonfinite/reward`` / ``nonfinite/observation`` flags."""
  return {"train/reward_per_step": jnp.mean(data["rewards"]),
          "train/episodes_done": jnp.sum(data["dones"]),
          "nonfinite/reward": 1.0 - finite_rewards,
          "nonfinite/observation": 1.0 - finite_obs}


_MAX_METRICS = ("nonfinite/reward", "nonfinite/observation", "nonfinite/loss_or_grad")


def chunk_metrics(m: dict[str, Array], skipped_updates: Array) -> dict[str, Array]:
  """Per-iteration metrics ``[I]`` -> the chunk's: means, maxima of the non-finite flags (1.0
  if it happened in any iteration), and ``nonfinite/skipped_updates`` (the run's total)."""
  out = {k: jnp.max(v) if k in _MAX_METRICS else jnp.mean(v) for k, v in m.items()}
  out["nonfinite/skipped_updates"] = skipped_updates.astype(jnp.float32)
  return out


def make_learn_step(config: ControlConfig, networks: Networks,
                    optimizer: optax.GradientTransformation
                    ) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Array]]]:
  """``learn_step(ts, data) -> (ts, metrics)``: one iteration's update from its rollout
  ``data`` (``[N, T, ...]`` segments, collected with ``ts``'s policy and the rollout key
  `iteration_keys` splits from ``ts.key``): normaliser, GAE, ``ppo_update`` and the non-finite
  guard. ``metrics`` are ``[]`` each (``loss``, ``pg_loss``, ``vf_loss``, ``entropy``,
  ``approx_kl``, ``clipfrac``, ``ratio``, ``grad_norm``, ``train/...``, ``nonfinite/...``).

  A rollout with a non-finite reward or observation, or a minibatch step with a non-finite
  loss or gradient, changes neither the parameters, the optimizer state nor the normaliser;
  the iteration counts in ``skipped_updates``.
  """
  apply_fn = ppo_apply_fn(networks)

  def learn_step(ts: TrainState, data) -> tuple[TrainState, dict[str, Array]]:
    key, _, key_update = iteration_keys(ts.key)
    batch_stats, stats = fold_obs(config, ts.obs_stats, data)
    batch, finite_rewards, finite_obs = make_batch(config, networks, ts.params, batch_stats,
                                                   data)
    state, metrics = ppo.ppo_update(
        ppo.PPOState(ts.params, ts.opt_state),
        batch,
        key_update,
        apply_fn=apply_fn,
        optimizer=optimizer,
        config=config.ppo,
        advantage_fn=advantage_fn(config, networks, batch_stats),
    )
    apply = finite_rewards & finite_obs & (metrics["nonfinite_steps"] == 0)
    new_ts = TrainState(
        params=nonfinite.keep_where(apply, state.params, ts.params),
        opt_state=nonfinite.keep_where(apply, state.opt_state, ts.opt_state),
        obs_stats=nonfinite.keep_where(apply, stats, ts.obs_stats),
        key=key,
        iteration=ts.iteration + 1,
        skipped_updates=ts.skipped_updates + (1 - apply.astype(jnp.int32)),
    )
    metrics.update(data_metrics(data, finite_rewards, finite_obs))
    metrics["nonfinite/loss_or_grad"] = (metrics["nonfinite_steps"] > 0).astype(jnp.float32)
    return new_ts, metrics

  return learn_step
