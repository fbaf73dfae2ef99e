"""The RLHF update: one jitted function from a step's rollouts to the new actor and critic.

Inside the jit, with the actor and critic states donated::

    old log-probs recomputed by the actor (same function and minibatch shapes as in the
    loss, so the first ratio is exactly 1) -> per-token KL (rljax.kl)
    -> token rewards = score at the EOS - beta * KL          (KL in the reward)
    -> advantages by the algorithm's estimator (rljax.alignment.advantages)
    -> ppo_update over {actor, critic}   (penalty_fn for KL in the loss)
    -> the non-finite guard (rljax.nonfinite)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax import kl as kl_lib
from rljax import nonfinite, ppo
from rljax.alignment import advantages, losses, modeling
from rljax.alignment.rlhf_config import KLPlacement, RLHFConfig


def cast_floating(tree, dtype):
  """``tree`` with its floating leaves cast to ``dtype`` (others untouched; ``dtype=None``
  returns ``tree``). Differentiable: the gradient of a cast f32 leaf is cast back to f32
  (mixed precision with f32 master weights)."""
  if dtype is None:
    return tree
  dtype = jnp.dtype(dtype)
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype
      else x, tree)



def make_update_fn(actor_graphdef, critic_graphdef, optimizer, config: RLHFConfig, *,
                   out_shardings=None):
  """The jitted update: ``(ppo_state, batch, key, kl_coef) -> (ppo_state, metrics, extras)``.

  ``batch`` holds ``prompt_tokens, prompt_mask [B, P]``, ``response_tokens, mask [B, R]``,
  ``ref_log_probs [B, R]``, ``values [B, R]`` (zeros without a critic), ``scores [B]`` and
  ``sampler_log_probs [B, R]`` (and ``policy_lag [B]`` int32 with ``max_staleness > 0``:
  see `behaviour_weights`). ``extras`` returns the computed ``log_probs``, ``advantages``,
  ``returns`` and ``token_rewards`` for inspection. ``ppo_state`` is donated.

  Non-finite guard: when a score is not finite, or a minibatch's loss or gradient is not
  (``ppo_update`` skips those minibatches), the returned ``ppo_state`` is the input one,
  selected in the jit (no host round trip); ``metrics`` then has ``nonfinite/skipped`` = 1
  and ``nonfinite/reward``, ``nonfinite/loss_or_grad`` say why.

  ``out_shardings`` (optional, ``(ppo_state shardings, metrics sharding, extras sharding)``)
  pins the output layout on a mesh, so that a step's output state is laid out like its input
  and the next step does not recompile.
  """
  pcfg = config.ppo
  m = pcfg.num_minibatches * pcfg.num_microbatches  # chunks shaped like one loss part

  def actor_apply(params, mb):
    return modeling.policy_outputs(actor_graphdef, params, mb["prompt_tokens"], mb["prompt_mask"],
                                   mb["response_tokens"], mb["mask"])

  reuse = config.reuse_rollout_log_probs

  def apply_fn(params, mb):
    params = cast_floating(params, config.compute_dtype)
    lp, ent = actor_apply(params["actor"], mb)
    if reuse:  # value: the rollout's log-prob (ratio exactly 1); gradient: grad log pi
      lp = mb["log_probs"] + (lp - jax.lax.stop_gradient(lp))
    if config.uses_critic:
      values = modeling.critic_values(critic_graphdef, params["critic"], mb["prompt_tokens"],
                                      mb["prompt_mask"], mb["response_tokens"], mb["mask"])
    else:
      values = jnp.zeros_like(lp)
    return lp, values, ent

  def penalty_fn(params, mb, log_probs, mask):
    del params
    k = kl_lib.kl_estimate(log_probs, mb["ref_log_probs"], config.kl_estimator)
    term = ppo.aggregate_loss(k, mask, pcfg.loss_aggregation)
    return mb["kl_coef"] * term, {"kl_loss": term}

  def update(state: ppo.PPOState, batch, key, kl_coef):
    mask = batch["mask"].astype(jnp.float32)
    n = mask.shape[0]
    if reuse:  # the sampler's log-probs; no extra forward pass
      old_lp = jax.lax.stop_gradient(batch["sampler_log_probs"].astype(jnp.float32) * mask)
    else:
      # Old log-probs: the actor's own function on chunks shaped like the loss's (minibatch
      # or micro-batch) rows, so that at the first minibatch the ratio is exactly 1.
      chunks = jax.tree.map(lambda x: x.reshape((m, n // m) + x.shape[1:]), batch)
      old_lp, _ = jax.lax.map(lambda mb: actor_apply(state.params["actor"], mb), chunks)
      old_lp = jax.lax.stop_gradient(old_lp.reshape(n, -1))

    ref = batch["ref_log_probs"]
    k_tok = kl_lib.kl_estimate(old_lp, ref, config.kl_estimator) * mask
    # The logged (and adaptive-controller) KL: per-sequence sum of log pi - log pi_ref (k1),
    # TRL's objective/kl and Ziegler et al.'s controller input. k3 is unbiased too but heavy-
    # tailed: a sampled token with log pi = -9.5 and log pi_ref = -1.8 has k3 = 2,113, so a
    # 64-row batch whose k1 read 0.72 nats read 33.5 with k3 (embedded run, 8 fake devices).
    kl_seq = jnp.sum(kl_lib.kl_k1(old_lp, ref) * mask, axis=-1)
    beta_reward = kl_coef if config.kl_placement == KLPlacement.REWARD else 0.0
    token_rewards = losses.token_level_rewards(batch["scores"], k_tok, mask, kl_coef=beta_reward)
    values = batch["values"] * mask

    adv, returns = advantages.get(config.algo.value)(token_rewards, values, mask, config)

    ppo_batch = dict(
        prompt_tokens=batch["prompt_tokens"], prompt_mask=batch["prompt_mask"],
        response_tokens=batch["response_tokens"], mask=mask, ref_log_probs=ref,
        log_probs=old_lp, values=values, advantages=adv, returns=returns,
        kl_coef=jnp.broadcast_to(kl_coef, (n,)))
    is_metrics = {}
    if config.max_staleness:  # the decoupled objective's behaviour weights (rljax.ppo.ppo_loss)
      ppo_batch["behaviour_weights"], is_metrics = behaviour_weights(
          old_lp, batch["sampler_log_probs"], batch["policy_lag"], mask,
          cap=config.behaviour_weight_cap)
    in_loss = config.kl_placement == KLPlacement.LOSS and config.kl_coef > 0
    old_state = state
    state, metrics = ppo.ppo_update(state, ppo_batch, key, apply_fn=apply_fn,
                                    optimizer=optimizer, config=pcfg,
                                    penalty_fn=_mean_coef(penalty_fn) if in_loss else None)
    # The non-finite guard: a non-finite score, loss or gradient never reaches the actor or
    # critic parameters or the optimizer states.
    finite_reward = nonfinite.all_finite(batch["scores"])
    finite_update = metrics["nonfinite_steps"] == 0
    apply = finite_reward & finite_update
    state = nonfinite.keep_where(apply, state, old_state)
    drift = (jnp.float32(jnp.nan) if reuse
             else jnp.max(jnp.abs(old_lp - batch["sampler_log_probs"]) * mask))
    metrics = dict(metrics, kl=jnp.mean(kl_seq), kl_token=ppo.masked_mean(k_tok, mask),
                   logprob_drift=drift, **is_metrics)
    metrics["nonfinite/reward"] = 1.0 - finite_reward.astype(jnp.float32)
    metrics["nonfinite/loss_or_grad"] = 1.0 - finite_update.astype(jnp.float32)
    metrics["nonfinite/skipped"] = 1.0 - apply.astype(jnp.float32)
    extras = dict(log_probs=old_lp, advantages=adv, returns=returns, token_rewards=token_rewards)
    return state, metrics, extras

  if out_shardings is None:
    return jax.jit(update, donate_argnums=(0,))
  return jax.jit(update, donate_argnums=(0,), out_shardings=out_shardings)



def behaviour_weights(proximal_log_probs, behaviour_log_probs, policy_lag, mask, *, cap: float):
  """Truncated importance weights of the decoupled PPO objective (`rljax.ppo.ppo_loss`).

  ``w = min(exp(log pi_prox - log pi_behav), cap)`` per token, and exactly 1 on rows whose
  ``policy_lag`` is 0 (generated by the policy being trained: behaviour and proximal policy
  are the same, and their log-probs differ only by float rounding).

  Args:
    proximal_log_probs: ``[B, R]`` float32, the current policy's (recomputed) log-probs.
    behaviour_log_probs: ``[B, R]``, the generating policy's (the sampler's ``log_probs_t1``).
    policy_lag: ``[B]`` int, updates between the generating and the current policy.
    mask: ``[B, R]`` 0/1 response tokens.
    cap: truncation (``>= 1``).

  Returns:
    ``(weights [B, R] float32, metrics)``: ``rollout/is_weight_mean`` and
    ``rollout/is_weight_max`` of the untruncated weight over real tokens of lagged rows (1
    and 1 when none lag), ``rollout/is_weight_truncated`` the fraction of those at the cap.
  """
  mask = mask.astype(jnp.float32)
  log_w = proximal_log_probs - behaviour_log_probs.astype(jnp.float32)
  raw = jnp.exp(jnp.minimum(log_w, 80.0))  # no inf from padding or a 0-probability token
  lagged = (policy_lag > 0)[:, None].astype(jnp.float32) * mask
  weights = jnp.where(lagged > 0, jnp.minimum(raw, cap), 1.0)
  count = jnp.sum(lagged)
  some = count > 0
  metrics = {
      "rollout/is_weight_mean": jnp.where(some, jnp.sum(raw * lagged) / jnp.maximum(count, 1),
                                          1.0),
      "rollout/is_weight_max": jnp.where(some, jnp.max(jnp.where(lagged > 0, raw, 0.0)), 1.0),
      "rollout/is_weight_truncated": jnp.sum((raw > cap) * lagged) / jnp.maximum(count, 1),
  }
  return weights, metrics


def _mean_coef(penalty_fn):
  """Uses the minibatch's (constant) ``kl_coef`` row as the scalar coefficient."""

  def fn(params, mb, log_probs, mask):
    value, metrics = penalty_fn(params, dict(mb, kl_coef=jnp.mean(mb["kl_coef"])), log_probs, mask)
    return value, metrics

  return fn

