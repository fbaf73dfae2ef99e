"""The shared PPO core: GAE, the clipped surrogate loss and the minibatch-epoch update.

Everything here is a pure function over arrays or pytrees and knows nothing of MuJoCo
or tokens. Both trainers (``rljax.control`` and ``rljax.alignment``) feed it.

Layout: time-indexed arrays are **batch-major**, ``[B, T]`` (``B`` sequences or
environments, ``T`` steps or tokens). ``mask`` is 1.0 for real steps and 0.0 for padding.

References:
  Schulman et al., 2016, "High-Dimensional Continuous Control Using Generalized
  Advantage Estimation" (GAE), https://arxiv.org/abs/1506.02438.
  Schulman et al., 2017, "Proximal Policy Optimization Algorithms",
  https://arxiv.org/abs/1707.06347.
  Yu et al., 2025, "DAPO" (clip-higher, token-level aggregation),
  https://arxiv.org/abs/2503.14476.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

Array = jax.Array
PyTree = Any


def compute_gae(
    rewards: Array,
    values: Array,
    bootstrap_values: Array,
    discounts: Array,
    mask: Array | None = None,
    *,
    gamma: float,
    gae_lambda: float,
    truncation: Array | None = None,
) -> tuple[Array, Array]:
  r"""Generalized advantage estimation, as a reverse ``lax.scan`` over time.

  For every step ``t`` (Schulman et al. 2016, eq. 16)::

      delta_t = r_t + gamma * d_t * V'_t - V_t
      A_t     = m_t * (delta_t + gamma * lambda * d_t * (1 - u_t) * A_{t+1})
      R_t     = m_t * (A_t + V_t)

  where ``V'_t = bootstrap_values[t]`` is the value of the state reached *after* step
  ``t`` (for a time-limit truncation: the truncated state's own value, before any
  auto-reset), ``d_t = discounts[t]`` is 0 at a terminal step and 1 otherwise,
  ``u_t = truncation[t]`` is 1 where the episode was cut by a time limit and
  ``m_t = mask[t]``. So:

  * a terminal step (``d_t = 0``) neither bootstraps nor passes the advantage of
    the next episode back;
  * a truncated step (``d_t = 1, u_t = 1``) bootstraps from ``V'_t`` but does not
    pass back the next episode's advantage;
  * a masked step (``m_t = 0``) gets advantage and return 0 and contributes nothing
    to the steps before it.

  Args:
    rewards: ``[B, T]`` float rewards ``r_t``.
    values: ``[B, T]`` float values ``V(s_t)``.
    bootstrap_values: ``[B, T]`` float values ``V(s_{t+1})`` of the next state of
      each step. Within an episode ``bootstrap_values[:, t] == values[:, t + 1]``.
    discounts: ``[B, T]`` float continuation flags ``1 - terminal`` (values in
      ``[0, 1]``; ``gamma`` is applied on top).
    mask: ``[B, T]`` float or bool, 1 for real steps, 0 for padding. ``None``
      means all ones.
    gamma: discount factor ``gamma``.
    gae_lambda: GAE's ``lambda`` in ``[0, 1]``.
    truncation: ``[B, T]`` float or bool, 1 where the episode was truncated (time
      limit) at step ``t``. ``None`` means no truncation.

  Returns:
    ``(advantages, returns)``, both ``[B, T]`` in the dtype of ``rewards``, with
    ``stop_gradient`` applied.

  Raises:
    ValueError: if the inputs do not all have the same rank-2 shape.
  """
  shape = rewards.shape
  named = dict(values=values, bootstrap_values=bootstrap_values, discounts=discounts)
  if mask is not None:
    named["mask"] = mask
  if truncation is not None:
    named["truncation"] = truncation
  if len(shape) != 2:
    raise ValueError(f"compute_gae expects [B, T] rewards, got shape {shape}.")
  for name, x in named.items():
    if x.shape != shape:
      raise ValueError(
          f"compute_gae: {name} has shape {x.shape}, expected {shape} (same as rewards)."
      )
  dtype = rewards.dtype
  mask = jnp.ones(shape, dtype) if mask is None else mask.astype(dtype)
  truncation = jnp.zeros(shape, dtype) if truncation is None else truncation.astype(dtype)
  discounts = discounts.astype(dtype)

  deltas = rewards + gamma * discounts * bootstrap_values - values
  carry_coef = gamma * gae_lambda * discounts * (1.0 - truncation)

  def step(acc, xs):
    delta_t, coef_t, mask_t = xs
    acc = mask_t * (delta_t + coef_t * acc)
    return acc, acc

  # Scan over time (axis 1), last step first.
  xs = (deltas.T, carry_coef.T, mask.T)
  _, adv_tb = jax.lax.scan(step, jnp.zeros(shape[0], dtype), xs, reverse=True)
  advantages = adv_tb.T
  returns = mask * (advantages + values)
  return jax.lax.stop_gradient(advantages), jax.lax.stop_gradient(returns)


class LossAggregation(enum.Enum):
  """How per-token (per-step) losses are reduced to a scalar.

  * ``TOKEN_MEAN``: sum over all real tokens / number of real tokens (DAPO's
    token-level aggregation; the control default).
  * ``SEQ_MEAN_TOKEN_MEAN``: mean over tokens within each sequence, then mean over
    sequences (the original GRPO / many RLHF codebases).
  * ``SEQ_MEAN_TOKEN_SUM``: sum over tokens within each sequence, then mean over
    sequences (Dr. GRPO style, when divided by a constant length).
  """

  TOKEN_MEAN = "token_mean"
  SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
  SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
  """Hyperparameters of the PPO loss and update, shared by both domains.

  Attributes:
    clip_eps: lower clip range ``eps_low``: the ratio is clipped to
      ``[1 - clip_eps, 1 + clip_eps_high]``.
    clip_eps_high: upper clip range (DAPO's clip-higher). ``None`` means
      ``clip_eps``.
    value_clip_eps: if set, the value prediction is clipped to
      ``old_values +- value_clip_eps`` and the larger of the clipped and unclipped
      squared errors is used (PPO2). ``None`` disables value clipping.
    vf_coef: weight of the value loss.
    entropy_coef: weight of the entropy bonus (subtracted from the loss).
    normalize_advantages: normalise advantages per minibatch to zero mean and unit
      variance over real (unmasked) steps.
    loss_aggregation: how per-step losses are reduced; see `LossAggregation`.
    num_epochs: passes over the batch per update (``num_updates_per_batch`` in Brax).
    num_minibatches: minibatches per epoch; must divide the batch's leading size.
    num_microbatches: gradient accumulation: each minibatch's gradient is the weighted
      sum of the gradients of this many equal parts, computed one after another
      (``lax.scan``), so a step holds one part's activations at a time. The step is the
      same as with one part up to floating-point reassociation: advantages are
      normalised over the whole minibatch, and each part's loss and metrics are
      weighted by its share of the minibatch's tokens (``TOKEN_MEAN``, flat steps) or
      sequences (``SEQ_MEAN_*``); a ``penalty_fn`` must aggregate its term the same way
      (``aggregate_loss`` with ``loss_aggregation``). Must divide the minibatch size.
      OpenRLHF's ``micro_train_batch_size`` and verl's ``ppo_micro_batch_size`` are the
      minibatch size divided by this.
  """

  clip_eps: float = 0.2
  clip_eps_high: float | None = None
  value_clip_eps: float | None = None
  vf_coef: float = 0.5
  entropy_coef: float = 0.0
  normalize_advantages: bool = True
  loss_aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
  num_epochs: int = 4
  num_minibatches: int = 4
  num_microbatches: int = 1

  def __post_init__(self):
    if not self.clip_eps > 0:
      raise ValueError(f"clip_eps must be > 0, got {self.clip_eps}.")
    if self.clip_eps_high is not None and not self.clip_eps_high > 0:
      raise ValueError(f"clip_eps_high must be > 0 or None, got {self.clip_eps_high}.")
    if self.value_clip_eps is not None and not self.value_clip_eps > 0:
      raise ValueError(f"value_clip_eps must be > 0 or None, got {self.value_clip_eps}.")
    if self.vf_coef < 0 or self.entropy_coef < 0:
      raise ValueError(
          f"vf_coef and entropy_coef must be >= 0, got {self.vf_coef}, {self.entropy_coef}."
      )
    if not isinstance(self.loss_aggregation, LossAggregation):
      object.__setattr__(self, "loss_aggregation", LossAggregation(self.loss_aggregation))
    if self.num_epochs < 1:
      raise ValueError(f"num_epochs must be >= 1, got {self.num_epochs}.")
    if self.num_minibatches < 1:
      raise ValueError(f"num_minibatches must be >= 1, got {self.num_minibatches}.")
    if self.num_microbatches < 1:
      raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}.")


def masked_mean(x: Array, mask: Array) -> Array:
  """Mean of ``x`` over entries where ``mask`` is 1; 0 when the mask is empty.

  Args:
    x: any shape (e.g. ``[T, B]`` per-step losses), float.
    mask: the same shape, 1 for real entries and 0 for padding (bool or float).

  Returns:
    A scalar ``[]`` of ``x``'s dtype.
  """
  mask = mask.astype(x.dtype)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def normalize_advantages(advantages: Array, mask: Array, eps: float = 1e-8) -> Array:
  """Whitens ``advantages`` over real steps: ``(A - mean) / (std + eps)``, 0 on padding.

  Mean and (biased) standard deviation are taken over the entries where ``mask`` is 1, as in
  the PPO implementations of Brax and OpenAI Baselines (per minibatch).

  Args:
    advantages: ``[...]`` float, e.g. ``[T, B]`` or a flat minibatch ``[M]``.
    mask: the same shape, 1 for real steps and 0 for padding.
    eps: added to the standard deviation.

  Returns:
    The same shape and dtype as ``advantages``.
  """
  mask = mask.astype(advantages.dtype)
  mean = masked_mean(advantages, mask)
  var = masked_mean(jnp.square(advantages - mean), mask)
  return mask * (advantages - mean) / (jnp.sqrt(var) + eps)


def aggregate_loss(
    per_step: Array,
    mask: Array,
    aggregation: LossAggregation,
    normalizer: Array | float | None = None,
) -> Array:
  """Reduces a per-step loss to a scalar (STYLE: numerator and denominator kept apart).

  Args:
    per_step: ``[B, T]`` (or ``[N]`` for flat transitions) per-step loss.
    mask: same shape, 1 for real steps.
    aggregation: the reduction.
    normalizer: for ``TOKEN_MEAN``, divide the masked sum by this instead of the
      minibatch's own token count. Passing the global token count of a batch makes
      the summed loss independent of how that batch is split into micro-batches.

  Returns:
    A scalar.
  """
  mask = mask.astype(per_step.dtype)
  if aggregation == LossAggregation.TOKEN_MEAN or per_step.ndim == 1:
    denom = jnp.maximum(jnp.sum(mask), 1.0) if normalizer is None else normalizer
    return jnp.sum(per_step * mask) / denom
  seq_sum = jnp.sum(per_step * mask, axis=-1)
  if aggregation == LossAggregation.SEQ_MEAN_TOKEN_MEAN:
    seq_val = seq_sum / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
  else:
    seq_val = seq_sum
  return jnp.mean(seq_val)


def ppo_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    values: Array,
    old_values: Array,
    returns: Array,
    mask: Array,
    entropy: Array,
    *,
    config: PPOConfig,
    normalizer: Array | float | None = None,
    behaviour_weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  r"""The clipped PPO objective with value loss and entropy bonus.

  With ``rho = exp(log_probs - old_log_probs)``, ``eps_l = clip_eps`` and
  ``eps_h = clip_eps_high`` (Schulman et al. 2017, eq. 7; DAPO eq. 10)::

      pg_loss  = agg( -min(rho * A, clip(rho, 1 - eps_l, 1 + eps_h) * A) )
      vf_loss  = agg( 0.5 * (V - R)^2 )           (or the max with the clipped form)
      loss     = pg_loss + vf_coef * vf_loss - entropy_coef * agg(entropy)

  With ``behaviour_weights`` ``w`` the policy term is the decoupled PPO objective (Hilton
  et al. 2022, arXiv:2110.00641, eq. 2; used off-policy by AReaL, Fu et al. 2025,
  arXiv:2505.24298, eq. 5): ``old_log_probs`` are then the *proximal* policy's (the one the
  clip is centred on) and ``w = pi_prox / pi_behav`` (truncated, no gradient) corrects for
  samples drawn by an older behaviour policy::

      pg_loss  = agg( -w * min(rho * A, clip(rho, 1 - eps_l, 1 + eps_h) * A) )

  Args:
    log_probs: ``[B, T]`` (or ``[N]``) float32 log-probs of the taken actions
      (tokens) under the current policy.
    old_log_probs: same shape, log-probs under the behaviour policy (rollout).
    advantages: same shape, advantage estimates (normalised here if
      ``config.normalize_advantages``).
    values: same shape, current value predictions.
    old_values: same shape, value predictions of the rollout.
    returns: same shape, value targets.
    mask: same shape, 1.0 for real steps, 0.0 for padding.
    entropy: same shape, per-step policy entropy (nats). With ``config.entropy_coef == 0``
      it is only a metric and gets no gradient (``stop_gradient``).
    config: the loss hyperparameters.
    normalizer: optional global token count for ``TOKEN_MEAN`` aggregation.
    behaviour_weights: optional, same shape, ``pi_prox / pi_behav`` per step (see above);
      None is the plain PPO objective (``w = 1``, bit for bit).

  Returns:
    ``(loss, metrics)``: a scalar loss and a dict with scalars ``pg_loss``,
    ``vf_loss``, ``entropy``, ``approx_kl`` (the k3 estimator
    ``E[(rho - 1) - log rho]``), ``clipfrac`` (fraction of real steps where the
    clipped term was active) and ``ratio`` (mean probability ratio).
  """
  mask = mask.astype(log_probs.dtype)
  agg = lambda x: aggregate_loss(x, mask, config.loss_aggregation, normalizer)
  if config.normalize_advantages:
    advantages = normalize_advantages(advantages, mask)
  advantages = jax.lax.stop_gradient(advantages)

  log_ratio = log_probs - old_log_probs
  ratio = jnp.exp(log_ratio)
  eps_high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
  clipped_ratio = jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + eps_high)
  surrogate = ratio * advantages
  surrogate_clipped = clipped_ratio * advantages
  pg_term = -jnp.minimum(surrogate, surrogate_clipped)
  if behaviour_weights is not None:
    pg_term = jax.lax.stop_gradient(behaviour_weights) * pg_term
  pg_loss = agg(pg_term)

  v_err = jnp.square(values - returns)
  if config.value_clip_eps is not None:
    values_clipped = old_values + jnp.clip(
        values - old_values, -config.value_clip_eps, config.value_clip_eps
    )
    v_err = jnp.maximum(v_err, jnp.square(values_clipped - returns))
  vf_loss = 0.5 * agg(v_err)
  if config.entropy_coef == 0:
    # A metric only: without this, 0 * H still back-propagates through the entropy (XLA
    # keeps 0 * x for NaN semantics), a full softmax-sized backward pass for nothing.
    entropy = jax.lax.stop_gradient(entropy)
  entropy_mean = agg(entropy)
  loss = pg_loss + config.vf_coef * vf_loss - config.entropy_coef * entropy_mean

  clipped = (surrogate_clipped < surrogate).astype(log_probs.dtype)
  metrics = dict(
      pg_loss=pg_loss,
      vf_loss=vf_loss,
      entropy=entropy_mean,
      approx_kl=jax.lax.stop_gradient(masked_mean((ratio - 1.0) - log_ratio, mask)),
      clipfrac=jax.lax.stop_gradient(masked_mean(clipped, mask)),
      ratio=jax.lax.stop_gradient(masked_mean(ratio, mask)),
  )
  return loss, metrics


class PPOState(NamedTuple):
  """What ``ppo_update`` trains: parameters and the optax optimizer state."""

  params: PyTree
  opt_state: optax.OptState


ApplyFn = Callable[[PyTree, Mapping[str, Array]], tuple[Array, Array, Array]]

PenaltyFn = Callable[[PyTree, Mapping[str, Array], Array, Array], tuple[Array, dict[str, Array]]]

AdvantageFn = Callable[[PyTree, Mapping[str, Array], Array], tuple[Array, Array]]

# Keys of the batch that ``ppo_update`` reads besides what ``apply_fn`` reads.
BATCH_KEYS = ("log_probs", "values", "advantages", "returns", "mask")
# The keys an ``advantage_fn`` computes in each minibatch instead (see `ppo_update`).
ADVANTAGE_FN_KEYS = ("values", "advantages", "returns")


def _check_batch(batch: Mapping[str, Array], num_minibatches: int,
                 num_microbatches: int = 1, *, computes: tuple[str, ...] = ()) -> int:
  needed = [k for k in BATCH_KEYS if k not in computes]
  missing = [k for k in needed if k not in batch]
  if missing:
    raise KeyError(f"ppo_update: batch is missing keys {missing}; it needs {needed}.")
  sizes = {x.shape[0] for x in jax.tree.leaves(batch)}
  if len(sizes) != 1:
    raise ValueError(f"ppo_update: batch leaves have different leading sizes {sorted(sizes)}.")
  (n,) = sizes
  if n % num_minibatches:
    raise ValueError(
        f"ppo_update: batch size {n} is not divisible by num_minibatches={num_minibatches}."
    )
  if (n // num_minibatches) % num_microbatches:
    raise ValueError(
        f"ppo_update: minibatch size {n // num_minibatches} (batch {n} / num_minibatches="
        f"{num_minibatches}) is not divisible by num_microbatches={num_microbatches}."
    )
  return n


def ppo_update(
    state: PPOState,
    batch: Mapping[str, Array],
    key: Array,
    *,
    apply_fn: ApplyFn,
    optimizer: optax.GradientTransformation,
    config: PPOConfig,
    penalty_fn: PenaltyFn | None = None,
    advantage_fn: AdvantageFn | None = None,
) -> tuple[PPOState, dict[str, Array]]:
  """``num_epochs x num_minibatches`` steps of SGD on the PPO loss, inside ``lax.scan``.

  Each epoch draws a fresh permutation of the batch's leading axis and splits it into
  ``num_minibatches`` equal minibatches. Call it inside ``jax.jit``.

  Args:
    state: parameters and optimizer state.
    batch: a dict of arrays sharing the leading size ``N`` (``N`` transitions for
      control, ``N`` sequences for alignment). It holds the keys in ``BATCH_KEYS``
      (``log_probs``, ``values``, ``advantages``, ``returns``, ``mask``: each
      ``[N]`` or ``[N, T]``) plus whatever ``apply_fn`` reads (observations,
      actions, tokens...). An optional ``behaviour_weights`` key (same shape as ``mask``)
      turns the policy term into the decoupled objective (`ppo_loss`).
    key: PRNG key for the permutations.
    apply_fn: ``apply_fn(params, minibatch) -> (log_probs, values, entropy)``, each
      shaped like ``minibatch['mask']``; the only domain-specific piece.
    optimizer: the optax transformation (gradient clipping belongs in it).
    config: loss and update hyperparameters.
    penalty_fn: optional extra differentiable term added to each minibatch's loss:
      ``penalty_fn(params, minibatch, log_probs, mask) -> (scalar, metrics)``, where
      ``log_probs`` are ``apply_fn``'s (the gradient flows through them). The
      alignment trainer uses it for a KL penalty *in the loss* (GRPO, Shao et al.
      2024, eq. 3: ``loss += beta * agg(k(log pi, log pi_ref))``). With
      ``config.num_microbatches > 1`` it sees one part at a time and must aggregate
      with ``aggregate_loss(..., config.loss_aggregation)`` for the sum to be exact.
    advantage_fn: optional ``advantage_fn(params, minibatch, values) -> (advantages,
      returns)``, each shaped like ``minibatch['mask']``: estimates the advantages inside
      each minibatch's loss from the ``values`` that ``apply_fn`` just computed and the
      current ``params`` (both through ``stop_gradient``: no gradient flows through the
      advantages), as Brax's PPO computes GAE in its loss. The batch then needs no
      ``values``, ``advantages`` or ``returns`` (`ADVANTAGE_FN_KEYS`), the minibatches
      must be whole sequences (``[N, T]`` leaves), and a step's advantages come from the
      value network as that step finds it, not as the rollout left it. It saves the separate value pass over the batch.
      Incompatible with ``config.value_clip_eps`` (no rollout values to clip to) and
      ``config.num_microbatches > 1`` (advantages are whitened over the minibatch
      before it is split).

  Returns:
    ``(new_state, metrics)``; metrics are means over all minibatch steps of the
    ``ppo_loss`` metrics plus ``loss`` and ``grad_norm``; ``ratio_first``: the
    mean ratio of the first minibatch of the first epoch (exactly 1.0 when the
    rollout's log-probs were computed with the same parameters) and
    ``clipfrac_first`` likewise; and
    ``nonfinite_steps``: how many minibatch steps were skipped because the loss or
    the gradient was not finite (those steps leave params and optimizer state as
    they were).

  Raises:
    KeyError: a required batch key is missing.
    ValueError: the leading sizes differ, ``num_minibatches`` does not divide them,
      ``num_microbatches`` does not divide the minibatch size, or ``advantage_fn`` is
      given with ``value_clip_eps`` or ``num_microbatches > 1``.
  """
  if advantage_fn is not None:
    if config.value_clip_eps is not None:
      raise ValueError(
          f"ppo_update: advantage_fn cannot be combined with value_clip_eps="
          f"{config.value_clip_eps} (there are no rollout values to clip to); use None.")
    if config.num_microbatches > 1:
      raise ValueError(
          f"ppo_update: advantage_fn needs num_microbatches=1, got {config.num_microbatches}.")
  n = _check_batch(batch, config.num_minibatches, config.num_microbatches,
                   computes=ADVANTAGE_FN_KEYS if advantage_fn is not None else ())
  mb = n // config.num_minibatches

  def make_loss_fn(loss_config: PPOConfig):
    def loss_fn(params, minibatch):
      log_probs, values, entropy = apply_fn(params, minibatch)
      if advantage_fn is not None:
        # No tangents in: autodiff then leaves the advantages' computation alone (with live
        # params it would linearise a bootstrap pass only to discard its tangents).
        old_values = jax.lax.stop_gradient(values)
        advantages, returns = advantage_fn(jax.lax.stop_gradient(params), minibatch, old_values)
        minibatch = dict(minibatch, values=old_values,
                         advantages=jax.lax.stop_gradient(advantages),
                         returns=jax.lax.stop_gradient(returns))
      loss, metrics = ppo_loss(
          log_probs,
          minibatch["log_probs"],
          minibatch["advantages"],
          values,
          minibatch["values"],
          minibatch["returns"],
          minibatch["mask"],
          entropy,
          config=loss_config,
          behaviour_weights=minibatch.get("behaviour_weights"),
      )
      if penalty_fn is None:
        return loss, metrics
      penalty, penalty_metrics = penalty_fn(params, minibatch, log_probs, minibatch["mask"])
      return loss + penalty, dict(metrics, **penalty_metrics)

    return loss_fn

  if config.num_microbatches > 1:  # advantages normalised over the minibatch, not each part
    grad_fn = _accumulated(
        make_loss_fn(dataclasses.replace(config, normalize_advantages=False)), config)
  else:
    grad_fn = jax.value_and_grad(make_loss_fn(config), has_aux=True)

  def sgd_step(state: PPOState, minibatch):
    (loss, metrics), grads = grad_fn(state.params, minibatch)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # Non-finite guard: a NaN/inf loss or gradient never reaches the parameters or the
    # optimizer state; the step is skipped and counted.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = jax.tree.map(
        lambda new, old: jnp.where(finite, new, old), PPOState(params, opt_state), state
    )
    metrics = dict(metrics, loss=loss, grad_norm=grad_norm, nonfinite=1.0 - finite)
    return new_state, metrics

  def epoch(state: PPOState, epoch_key):
    perm = jax.random.permutation(epoch_key, n)
    shuffled = jax.tree.map(
        lambda x: jnp.take(x, perm, axis=0).reshape((config.num_minibatches, mb) + x.shape[1:]),
        dict(batch),
    )
    return jax.lax.scan(sgd_step, state, shuffled)

  state, metrics = jax.lax.scan(epoch, state, jax.random.split(key, config.num_epochs))
  # metrics leaves: [num_epochs, num_minibatches].
  out = jax.tree.map(jnp.mean, metrics)
  out["ratio_first"] = metrics["ratio"][0, 0]
  out["clipfrac_first"] = metrics["clipfrac"][0, 0]
  out["nonfinite_steps"] = jnp.sum(metrics.pop("nonfinite"))
  del out["nonfinite"]
  return state, out


# Metrics of `ppo_loss` that are means over tokens whatever the loss aggregation.
_TOKEN_MEAN_METRICS = ("approx_kl", "clipfrac", "ratio")


def _accumulated(loss_fn, config: PPOConfig):
  """``value_and_grad(loss_fn, has_aux=True)`` over a minibatch, computed as a weighted sum
  over ``config.num_microbatches`` parts (see `PPOConfig.num_microbatches`). ``loss_fn``
  must not normalise advantages itself: they are normalised here, over the minibatch.

  Part ``j`` holds rows ``j, j + G, j + 2G, ...`` of the (already shuffled) minibatch. A part
  counts for its real tokens (``TOKEN_MEAN``, or flat ``[N]`` steps) or for 1 (``SEQ_MEAN_*``:
  the parts hold equally many sequences); the loss, its gradient and the metrics are the
  count-weighted means over parts, which are the minibatch's own as long as every term of the
  loss is aggregated with ``config.loss_aggregation``. The token-mean metrics (``approx_kl``,
  ``clipfrac``, ``ratio``) are always weighted by tokens; every other metric (``penalty_fn``'s
  included) like the loss. Sums are kept in at least f32 (bf16 gradients and metrics are
  accumulated in f32 and cast back once).
  """
  g = config.num_microbatches

  def part_loss(params, part, weight):
    loss, metrics = loss_fn(params, part)
    return loss * weight, (loss, metrics)

  part_grad = jax.value_and_grad(part_loss, has_aux=True)
  wide = lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32))  # noqa: E731

  def grad_fn(params, minibatch):
    mask = minibatch["mask"]
    if config.normalize_advantages:
      minibatch = dict(minibatch, advantages=normalize_advantages(minibatch["advantages"], mask))
    parts = jax.tree.map(
        lambda x: jnp.swapaxes(x.reshape((x.shape[0] // g, g) + x.shape[1:]), 0, 1), minibatch)
    tokens = jnp.sum(parts["mask"].reshape(g, -1).astype(jnp.float32), axis=-1)   # [G]
    by_tokens = config.loss_aggregation == LossAggregation.TOKEN_MEAN or mask.ndim == 1
    counts = tokens if by_tokens else jnp.ones((g,), jnp.float32)
    weights = counts / jnp.maximum(jnp.sum(counts), 1.0)

    def body(acc, xs):
      part, w, count, token_count = xs
      (_, (loss, metrics)), grads = part_grad(params, part, w)
      sums = {k: wide(v) * (token_count if k in _TOKEN_MEAN_METRICS else count)
              for k, v in dict(metrics, loss=loss).items()}
      return jax.tree.map(jnp.add, acc, (sums, jax.tree.map(wide, grads))), None

    # One abstract evaluation gives the accumulators' (widened) and the results' dtypes.
    first_part = jax.tree.map(lambda x: x[0], parts)
    (_, (loss_shape, metric_shapes)), grad_shapes = jax.eval_shape(
        part_grad, params, first_part, weights[0])
    zeros = jax.tree.map(lambda x: wide(jnp.zeros(x.shape, x.dtype)),
                         (dict(metric_shapes, loss=loss_shape), grad_shapes))
    (sums, grads), _ = jax.lax.scan(body, zeros, (parts, weights, counts, tokens))
    total, total_tokens = jnp.maximum(jnp.sum(counts), 1.0), jnp.maximum(jnp.sum(tokens), 1.0)
    metrics = {k: v / (total_tokens if k in _TOKEN_MEAN_METRICS else total)
               for k, v in sums.items()}
    loss = metrics.pop("loss")
    metrics = {k: v.astype(metric_shapes[k].dtype) for k, v in metrics.items()}
    grads = jax.tree.map(lambda gr, p: gr.astype(p.dtype), grads, params)
    return (loss.astype(loss_shape.dtype), metrics), grads

  return grad_fn


# ----------------------------------------------------------------------------------------------
# Critic-free advantages (alignment): GRPO, RLOO, REINFORCE++. They feed the same `ppo_loss`.
# Layout: ``scores [B]`` hold one scalar per sequence, grouped as ``B = num_prompts x G``
# consecutive rows per prompt (rows ``g*G .. g*G + G - 1`` answer prompt ``g``).
# ----------------------------------------------------------------------------------------------


def _grouped(scores: Array, group_size: int) -> Array:
  if scores.ndim != 1:
    raise ValueError(f"expected [B] sequence scores, got shape {scores.shape}.")
  if group_size < 1 or scores.shape[0] % group_size:
    raise ValueError(
        f"group_size={group_size} must be >= 1 and divide the batch size {scores.shape[0]}."
    )
  return scores.reshape(-1, group_size)


def group_relative_advantages(
    scores: Array, *, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> Array:
  r"""GRPO's outcome advantages (Shao et al. 2024, arXiv:2402.03300, Sec. 4.1.2).

  For the ``G`` responses ``i`` of one prompt with scores ``r_i``::

      A_i = (r_i - mean_j r_j) / (std_j r_j + eps)        (normalize_std=True)
      A_i =  r_i - mean_j r_j                             (normalize_std=False, Dr. GRPO)

  ``std`` is the population standard deviation (``ddof=0``), so a group of equal scores gets
  advantages exactly 0.

  Args:
    scores: ``[B]`` f32 sequence rewards, ``B = num_prompts * group_size``, grouped in
      consecutive rows.
    group_size: ``G``, responses per prompt.
    normalize_std: divide by the group's std.
    eps: added to the std.

  Returns:
    ``[B]`` advantages (``stop_gradient``); broadcast to tokens with
    :func:`sequence_to_token_advantages`.

  Raises:
    ValueError: ``scores`` is not rank 1 or ``group_size`` does not divide ``B``.
  """
  g = _grouped(scores, group_size)
  centred = g - jnp.mean(g, axis=1, keepdims=True)
  if normalize_std:
    centred = centred / (jnp.std(g, axis=1, keepdims=True) + eps)
  return jax.lax.stop_gradient(centred.reshape(-1))


def rloo_advantages(scores: Array, *, group_size: int) -> Array:
  r"""REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024,
  arXiv:2402.14740, eq. 6).

  ``A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean_j r_j)``.

  Args:
    scores: ``[B]`` f32, grouped as in :func:`group_relative_advantages`.
    group_size: ``G >= 2``.

  Returns:
    ``[B]`` advantages (``stop_gradient``).

  Raises:
    ValueError: ``group_size < 2`` or it does not divide ``B``.
  """
  if group_size < 2:
    raise ValueError(f"RLOO needs group_size >= 2, got {group_size}.")
  g = _grouped(scores, group_size)
  baseline = (jnp.sum(g, axis=1, keepdims=True) - g) / (group_size - 1)
  return jax.lax.stop_gradient((g - baseline).reshape(-1))


def sequence_to_token_advantages(advantages: Array, mask: Array) -> Array:
  """Broadcasts ``[B]`` sequence advantages to ``[B, T]`` tokens, 0 on padding."""
  return advantages[:, None] * mask.astype(advantages.dtype)


def discounted_returns(rewards: Array, mask: Array, *, gamma: float = 1.0) -> Array:
  """Reward-to-go ``G_t = sum_{k >= t} gamma^(k-t) r_k`` over real steps, ``[B, T]``.

  A reverse ``lax.scan`` (``compute_gae`` with ``V = 0`` and ``lambda = 1``); padding gets 0.
  """
  zeros = jnp.zeros_like(rewards)
  adv, _ = compute_gae(
      rewards, zeros, zeros, jnp.ones_like(rewards), mask, gamma=gamma, gae_lambda=1.0
  )
  return adv


def reinforce_pp_advantages(
    token_rewards: Array, mask: Array, *, gamma: float = 1.0, eps: float = 1e-8
) -> Array:
  r"""REINFORCE++ advantages (Hu 2025, arXiv:2501.03262, Sec. 3).

  Per-token rewards (score at the last token minus the per-token KL penalty) are summed to
  reward-to-go and then whitened over **all real tokens of the batch** (global, not per
  group)::

      G_t = sum_{k >= t} gamma^(k-t) r_k
      A_t = (G_t - mean(G)) / (std(G) + eps)

  Args:
    token_rewards: ``[B, T]`` f32.
    mask: ``[B, T]``, 1 for real response tokens.
    gamma: discount (1 for LLMs).
    eps: added to the std.

  Returns:
    ``[B, T]`` advantages, 0 on padding (``stop_gradient``).
  """
  returns = discounted_returns(token_rewards, mask, gamma=gamma)
  return jax.lax.stop_gradient(normalize_advantages(returns, mask, eps))
