"""Losses and reward shaping of the alignment trainers: pure array functions.

* :func:`bradley_terry_loss`: the reward-model loss (Bradley & Terry 1952; Ouyang et al. 2022,
  arXiv:2203.02155, eq. 1; Llama 2's margin, arXiv:2307.09288, eq. 2).
* :func:`sft_loss_terms`: next-token NLL on response tokens only, as (sum, count).
* :func:`place_scores`, :func:`token_level_rewards`: the sequence score at the EOS (last real)
  token minus ``kl_coef`` times a per-token KL estimate (Ziegler et al. 2019, arXiv:1909.08593;
  Stiennon et al. 2020, eq. 1).
* :func:`ends_with_stop`, :func:`missing_eos_penalty`, :func:`overlong_penalty` (DAPO, Yu et al.
  2025, arXiv:2503.14476, eq. 13).
* :func:`binomial_confidence_interval`: Wilson score interval for held-out accuracy.

Layout: responses are right-padded ``[B, R]`` with ``mask [B, R]`` (1 up to and including the
EOS); sequence scores are ``[B]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

Array = jax.Array


def bradley_terry_loss(
    chosen_scores: Array, rejected_scores: Array, *, margin: Array | float = 0.0
) -> tuple[Array, dict[str, Array]]:
  r"""``loss = mean_i -log sigmoid(r_c,i - r_r,i - m_i)`` and pairwise accuracy.

  ``-log sigmoid(x) = softplus(-x)`` is used for stability.

  Args:
    chosen_scores: ``[B]`` f32 reward-model scores of the preferred responses.
    rejected_scores: ``[B]`` f32 scores of the other responses.
    margin: a scalar or ``[B]`` margin ``m`` (Llama 2: larger for clearer preferences).

  Returns:
    ``(loss, metrics)`` with scalars ``accuracy`` (fraction with ``r_c > r_r``; a tie counts as
    wrong), ``reward_chosen``, ``reward_rejected``, ``reward_margin`` (mean ``r_c - r_r``).
  """
  diff = chosen_scores - rejected_scores
  loss = jnp.mean(jax.nn.softplus(-(diff - margin)))
  metrics = dict(
      accuracy=jnp.mean((diff > 0).astype(jnp.float32)),
      reward_chosen=jnp.mean(chosen_scores),
      reward_rejected=jnp.mean(rejected_scores),
      reward_margin=jnp.mean(diff),
  )
  return loss, metrics


def sft_loss_terms(log_probs: Array, loss_mask: Array) -> tuple[Array, Array]:
  """``(sum of -log p over loss tokens, number of loss tokens)``, kept apart so
  the loss does not depend on how the batch is split.

  Args:
    log_probs: ``[B, L]`` f32 log-prob of each target token given its prefix.
    loss_mask: ``[B, L]``, 1 on response tokens (the ones trained on).
  """
  m = loss_mask.astype(log_probs.dtype)
  return -jnp.sum(log_probs * m), jnp.sum(m)


def last_index(mask: Array) -> Array:
  """Index of the last 1 in each row of a right-padded ``mask [B, R]`` (0 for an empty row)."""
  return jnp.maximum(jnp.sum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def place_scores(scores: Array, mask: Array) -> Array:
  """``[B] -> [B, R]``: each score at its row's last real token (the EOS), 0 elsewhere.

  A row with an empty mask gets nothing.
  """
  r = mask.shape[-1]
  idx = last_index(mask)
  onehot = (jnp.arange(r)[None, :] == idx[:, None]).astype(scores.dtype)
  return onehot * scores[:, None] * (jnp.sum(mask, axis=-1) > 0)[:, None].astype(scores.dtype)


def token_level_rewards(scores: Array, kl: Array, mask: Array, *, kl_coef: Array | float
                        ) -> Array:
  r"""``r_t = score * [t == EOS index] - kl_coef * kl_t``, 0 on padding. ``[B, R]`` f32.

  Args:
    scores: ``[B]`` f32 sequence scores (reward model or programmatic, penalties included).
    kl: ``[B, R]`` f32 per-token KL estimate (``rljax.kl``); pass zeros for KL in the loss.
    mask: ``[B, R]`` response mask.
    kl_coef: ``beta``.
  """
  m = mask.astype(scores.dtype)
  return place_scores(scores, m) - kl_coef * kl * m


def ends_with_stop(tokens: Array, mask: Array, stop_ids: Sequence[int]) -> Array:
  """``[B]`` bool: the row's last real token is one of ``stop_ids`` (it emitted an EOS).

  Args:
    tokens: ``[B, R]`` int response tokens.
    mask: ``[B, R]`` response mask.
    stop_ids: every id that ends a response (the configured EOS ids).
  """
  idx = last_index(mask)
  last = jnp.take_along_axis(tokens, idx[:, None], axis=-1)[:, 0]
  hit = jnp.zeros(last.shape, bool)
  for s in stop_ids:
    hit = hit | (last == s)
  return hit & (jnp.sum(mask, axis=-1) > 0)


def missing_eos_penalty(tokens: Array, mask: Array, *, stop_ids: Sequence[int], penalty: float
                        ) -> Array:
  """``[B]`` f32 to *add* to scores: ``-penalty`` for rows that never emitted a stop id, else 0.

  (TRL's ``missing_eos_penalty`` convention: a positive number subtracted from the score.)
  """
  return jnp.where(ends_with_stop(tokens, mask, stop_ids), 0.0, -penalty).astype(jnp.float32)


def overlong_penalty(lengths: Array, *, max_length: int, buffer_length: int,
                     factor: float = 1.0) -> Array:
  r"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), ``[B]`` f32 to add to scores::

      0                                  if |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
      -1                                 if |y| > L_max

  times ``factor``. Here ``L_max = max_length``, ``L_cache = buffer_length``.
  """
  lengths = lengths.astype(jnp.float32)
  start = max_length - buffer_length
  ramp = (start - lengths) / max(buffer_length, 1)
  pen = jnp.where(lengths <= start, 0.0, jnp.where(lengths <= max_length, ramp, -1.0))
  return factor * pen


def binomial_confidence_interval(successes: int, n: int, *, z: float = 1.96
                                 ) -> tuple[float, float]:
  """Wilson score interval for a proportion (Wilson 1927); ``z = 1.96`` is 95%.

  Raises:
    ValueError: ``n < 1`` or ``successes`` outside ``[0, n]``.
  """
  if n < 1 or not 0 <= successes <= n:
    raise ValueError(f"need 0 <= successes <= n and n >= 1, got {successes}/{n}")
  p = successes / n
  denom = 1 + z * z / n
  centre = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  return centre - half, centre + half
