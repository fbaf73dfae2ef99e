"""Alignment maths (rljax/alignment/losses.py, critic-free advantages in rljax/ppo.py): gold values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import ppo
from rljax.alignment import losses


def test_bradley_terry_gold():
  # diffs = [2, 0, -1] with margin 0:
  #   -log sigmoid(2) = log(1 + e^-2) = 0.126928;  -log sigmoid(0) = log 2 = 0.693147;
  #   -log sigmoid(-1) = log(1 + e) = 1.313262.   mean = 2.133337 / 3 = 0.711112.
  #   accuracy: only diff 2 > 0 (a tie counts as wrong) -> 1/3.
  c = jnp.array([3.0, 1.0, 0.0])
  r = jnp.array([1.0, 1.0, 1.0])
  loss, m = losses.bradley_terry_loss(c, r)
  np.testing.assert_allclose(loss, 0.711112, rtol=1e-5)
  np.testing.assert_allclose(m["accuracy"], 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["reward_margin"], 1 / 3, rtol=1e-6)
  # margin 1: diffs - 1 = [1, -1, -2] -> 0.313262 + 1.313262 + 2.126928 = 3.753452 / 3 = 1.251151
  loss, _ = losses.bradley_terry_loss(c, r, margin=1.0)
  np.testing.assert_allclose(loss, 1.251151, rtol=1e-5)


def test_wilson_interval_gold():
  # 90/100, z = 1.96 (z^2 = 3.8416): centre = (0.9 + 3.8416/200) / (1 + 3.8416/100)
  #   = 0.919208 / 1.038416 = 0.885201;
  # half = 1.96 * sqrt(0.0009 + 3.8416/40000) / 1.038416 = 1.96 * 0.0315601 / 1.038416
  #   = 0.059569 -> [0.825632, 0.944771].
  lo, hi = losses.binomial_confidence_interval(90, 100)
  np.testing.assert_allclose([lo, hi], [0.825632, 0.944771], atol=2e-6)
  with pytest.raises(ValueError, match="0 <= successes <= n"):
    losses.binomial_confidence_interval(5, 4)


def test_grpo_rloo_gold():
  # Two prompts, G = 3: scores [1, 2, 3 | 5, 5, 5].
  s = jnp.array([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
  # group 0: mean 2, population std sqrt(2/3) = 0.816497 -> [-1.224745, 0, 1.224745];
  # group 1: all equal -> 0.
  a = ppo.group_relative_advantages(s, group_size=3)
  np.testing.assert_allclose(a, [-1.224743, 0, 1.224743, 0, 0, 0], atol=1e-5)
  a = ppo.group_relative_advantages(s, group_size=3, normalize_std=False)
  np.testing.assert_allclose(a, [-1, 0, 1, 0, 0, 0], atol=1e-6)
  # RLOO: A_i = r_i - mean of the other two: 1 - 2.5 = -1.5, 2 - 2 = 0, 3 - 1.5 = 1.5.
  a = ppo.rloo_advantages(s, group_size=3)
  np.testing.assert_allclose(a, [-1.5, 0, 1.5, 0, 0, 0], atol=1e-6)
  with pytest.raises(ValueError, match="group_size=4 must be >= 1 and divide the batch size 6"):
    ppo.group_relative_advantages(s, group_size=4)
  with pytest.raises(ValueError, match="RLOO needs group_size >= 2, got 1"):
    ppo.rloo_advantages(s, group_size=1)


def test_reinforce_pp_gold():
  # Token rewards [[0, 0, 1], [0, 2, pad]] with gamma 1:
  #   returns-to-go [[1, 1, 1], [2, 2, 0]]; over the 5 real tokens mean = 7/5 = 1.4,
  #   var = (3 * 0.16 + 2 * 0.36) / 5 = 0.24, std = 0.489898.
  #   A = [(1 - 1.4)/0.489898 = -0.816497 (x3), (2 - 1.4)/0.489898 = 1.224745 (x2), pad 0].
  r = jnp.array([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
  m = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
  a = ppo.reinforce_pp_advantages(r, m)
  np.testing.assert_allclose(a, [[-0.816497] * 3, [1.224745, 1.224745, 0.0]], atol=1e-5)


def test_score_placed_at_eos_not_padding():
  # Row 0: [t, t, eos, pad, pad] -> mask [1, 1, 1, 0, 0]: the score lands at index 2.
  # Row 1: fills the whole width (no padding): index 4.
  mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
  scores = jnp.array([2.0, -1.0])
  kl = jnp.full((2, 5), 0.5)
  r = losses.token_level_rewards(scores, kl, mask, kl_coef=0.1)
  # real tokens: -0.1 * 0.5 = -0.05; EOS: score - 0.05; padding: 0.
  np.testing.assert_allclose(
      r, [[-0.05, -0.05, 1.95, 0, 0], [-0.05, -0.05, -0.05, -0.05, -1.05]], atol=1e-6)


def test_missing_eos_penalty_uses_configured_stop_ids():
  # stop ids {7, 9}. Row 0 ends with 9 (a stop id), row 1 ends with 2 (the tokenizer's usual
  # EOS, but not configured here), row 2 ends with 7 mid-width then padding.
  tokens = jnp.array([[4, 5, 9, 0], [4, 5, 6, 2], [7, 0, 0, 0]])
  mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
  pen = losses.missing_eos_penalty(tokens, mask, stop_ids=(7, 9), penalty=0.5)
  np.testing.assert_allclose(pen, [0.0, -0.5, 0.0])
  pen = losses.missing_eos_penalty(tokens, mask, stop_ids=(2,), penalty=0.5)
  np.testing.assert_allclose(pen, [-0.5, 0.0, -0.5])


def test_overlong_penalty_gold():
  # L_max = 10, L_cache = 4: lengths 6 -> 0; 8 -> (6 - 8)/4 = -0.5; 10 -> -1; 11 -> -1.
  p = losses.overlong_penalty(jnp.array([6, 8, 10, 11]), max_length=10, buffer_length=4)
  np.testing.assert_allclose(p, [0.0, -0.5, -1.0, -1.0])


@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_token_level_aggregation_is_split_invariant(num_splits):
  # Ragged masks: summing per-minibatch losses normalised by the *global* token count gives
  # the full-batch token mean (and the same gradient), whatever the split.
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (8, 6))
  lengths = jnp.array([1, 6, 3, 2, 6, 5, 1, 4])
  mask = (jnp.arange(6)[None] < lengths[:, None]).astype(jnp.float32)
  total = jnp.sum(mask)  # 28 tokens
  full = ppo.aggregate_loss(x ** 2, mask, ppo.LossAggregation.TOKEN_MEAN)

  def split_loss(w):
    parts = zip(jnp.split(w * x, num_splits), jnp.split(mask, num_splits))
    return sum(ppo.aggregate_loss(p ** 2, m, ppo.LossAggregation.TOKEN_MEAN, normalizer=total)
               for p, m in parts)

  np.testing.assert_allclose(split_loss(1.0), full, rtol=1e-6)
  g_full = jax.grad(lambda w: ppo.aggregate_loss((w * x) ** 2, mask,
                                                 ppo.LossAggregation.TOKEN_MEAN))(1.0)
  np.testing.assert_allclose(jax.grad(split_loss)(1.0), g_full, rtol=1e-5)
  # The per-minibatch mean of means is NOT invariant for uneven splits (why the normaliser).
  if num_splits == 2:
    naive = np.mean([ppo.aggregate_loss(p ** 2, m, ppo.LossAggregation.TOKEN_MEAN)
                     for p, m in zip(jnp.split(x, 2), jnp.split(mask, 2))])
    assert abs(float(naive) - float(full)) > 1e-3
