"""The MLP actor-critic's distribution maths and the observation normaliser."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax import running_stats
from rljax.models import mlp


def test_squashed_log_prob_gold():
  # One action dim, u = 0.5, loc = 0, scale = 2:
  #   log N(0.5; 0, 2) = -0.5 * 0.25^2 - log 2 - 0.5 log(2 pi) = -0.03125 - 0.693147 - 0.918939
  #   log(1 - tanh(0.5)^2) = log(1 - 0.462117^2) = log(0.786448) = -0.240229
  #   log pi(tanh u) = -1.643336 + 0.240229 = -1.403107
  lp = mlp.squashed_log_prob(jnp.array([0.5]), jnp.array([0.0]), jnp.array([2.0]))
  np.testing.assert_allclose(lp, -1.403107, rtol=1e-5)


def test_squashed_log_prob_is_a_density_over_actions():
  # Integrate exp(log pi(a)) over a in (-1, 1) with a = tanh(u): must be 1.
  loc, scale = jnp.array([0.3]), jnp.array([0.7])
  a = jnp.linspace(-0.999999, 0.999999, 200_001)
  u = jnp.arctanh(a)[:, None]
  density = jnp.exp(mlp.squashed_log_prob(u, loc, scale))
  np.testing.assert_allclose(jnp.trapezoid(density, a), 1.0, atol=1e-3)


def test_tanh_log_det_is_stable_for_large_u():
  # Naive log(1 - tanh(u)^2) is -inf at u = 20 in float32; the stable form is 2(log2 - u - softplus(-2u)).
  v = mlp.tanh_log_det_jacobian(jnp.array([20.0]))
  np.testing.assert_allclose(v, 2 * (math.log(2.0) - 20.0), rtol=1e-6)


def test_gaussian_entropy_gold():
  # Two dims with scale 1 and e: sum(0.5 + 0.5 log(2 pi) + log s) = 2 * 1.418939 + 1 = 3.837877
  np.testing.assert_allclose(mlp.gaussian_entropy(jnp.array([1.0, math.e])), 3.837877, rtol=1e-6)


def test_sample_pre_tanh_groups_draw_the_whole_batch_rows():
  """``num_rows``/``first_row``: each group of a batch gets, bit for bit, the rows of the
  whole batch's draw (as `ThreadedChunk`'s rollouts need), with a traced ``first_row`` too;
  without them the draw is ``loc + scale * N(0, 1)`` of ``loc``'s shape."""
  key = jax.random.PRNGKey(3)
  loc = jnp.arange(8 * 2, dtype=jnp.float32).reshape(8, 2) / 10
  scale = jnp.full((8, 2), 0.5)
  whole = mlp.sample_pre_tanh(key, loc, scale)
  np.testing.assert_array_equal(whole, loc + 0.5 * jax.random.normal(key, (8, 2)))
  parts = [mlp.sample_pre_tanh(key, loc[r:r + 2], scale[r:r + 2], num_rows=8, first_row=r)
           for r in range(0, 8, 2)]
  np.testing.assert_array_equal(jnp.concatenate(parts), whole)
  np.testing.assert_array_equal(jax.jit(lambda g: mlp.sample_pre_tanh(
      key, loc[4:], scale[4:], num_rows=8, first_row=g))(jnp.int32(4)), whole[4:])


def test_actor_critic_shapes_and_initial_std():
  config = mlp.ActorCriticConfig(observation_size=5, action_size=3, policy_hidden=(16,), value_hidden=(8, 8))
  model = mlp.ActorCritic(config, rngs=nnx.Rngs(0))
  obs = jnp.zeros((4, 7, 5))
  loc, scale = model.policy_params(obs)
  assert loc.shape == scale.shape == (4, 7, 3)
  np.testing.assert_allclose(scale, config.init_std, rtol=1e-5)  # zero input -> bias-free scale
  assert model.value_fn(obs).shape == (4, 7)


def test_policy_output_layer_scale_and_brax_parametrisation():
  # The output kernel is LeCun-uniform times policy_init_scale: |w| <= sqrt(3 s / fan_in),
  # and with 16 x 6 draws the largest is close to that bound.
  fan_in = 16
  for s in (0.01, 1.0):
    config = mlp.ActorCriticConfig(observation_size=5, action_size=3, policy_hidden=(fan_in,),
                                   value_hidden=(8,), policy_init_scale=s)
    w = np.abs(np.asarray(mlp.ActorCritic(config, rngs=nnx.Rngs(0)).policy.out.kernel[...]))
    bound = math.sqrt(3 * s / fan_in)
    assert w.max() <= bound and w.max() > 0.9 * bound, (s, w.max(), bound)
  # With init_std = BRAX_INIT_STD the scale is Brax's NormalTanhDistribution's,
  # softplus(raw) + 0.001, for any raw output, and loc is the raw output itself.
  from brax.training import distribution

  config = mlp.ActorCriticConfig(observation_size=5, action_size=3, policy_hidden=(16,),
                                 value_hidden=(8,), init_std=mlp.BRAX_INIT_STD,
                                 policy_init_scale=1.0)
  model = mlp.ActorCritic(config, rngs=nnx.Rngs(1))
  obs = 3.0 * jax.random.normal(jax.random.PRNGKey(2), (64, 5))
  loc, scale = model.policy_params(obs)
  brax_dist = distribution.NormalTanhDistribution(event_size=3).create_dist(model.policy(obs))
  np.testing.assert_allclose(loc, brax_dist.loc, rtol=1e-6)
  np.testing.assert_allclose(scale, brax_dist.scale, rtol=1e-5)
  assert float(jnp.std(scale)) > 0.05  # the scale varies by state at full output scale


def test_swish_matches_flax_in_value_and_derivatives():
  # Gold: swish(1) = 1 * sigmoid(1) = 0.7310586; swish'(1) = s + x s (1 - s) = 0.7310586
  # + 0.7310586 * 0.2689414 = 0.9276705. Grad and forward-mode jvp both use the custom rule.
  np.testing.assert_allclose(mlp.swish(jnp.array(1.0)), 0.7310586, rtol=1e-6)
  np.testing.assert_allclose(jax.grad(mlp.swish)(1.0), 0.9276705, rtol=1e-6)
  x = jnp.linspace(-30.0, 30.0, 1001)
  np.testing.assert_allclose(mlp.swish(x), nnx.swish(x), rtol=1e-6, atol=1e-7)
  reference = jax.vmap(jax.grad(nnx.swish))(x)
  np.testing.assert_allclose(jax.vmap(jax.grad(mlp.swish))(x), reference, rtol=1e-5, atol=1e-7)
  _, tangent = jax.jvp(mlp.swish, (x,), (jnp.ones_like(x),))
  np.testing.assert_allclose(tangent, reference, rtol=1e-5, atol=1e-7)
  hess = jax.grad(jax.grad(mlp.swish))(0.0)  # swish''(0) = 2 s'(0) = 0.5
  np.testing.assert_allclose(hess, 0.5, rtol=1e-6)


def test_mlp_over_leading_axes_equals_row_by_row():
  # The MLP flattens [..., D] to rows; values and parameter gradients must equal the
  # same network applied to each row on its own.
  config = mlp.ActorCriticConfig(observation_size=5, action_size=2, policy_hidden=(16,), value_hidden=(8, 8))
  model = mlp.ActorCritic(config, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  obs = jax.random.normal(jax.random.PRNGKey(1), (3, 4, 5))

  def value_sum(params, obs):
    return jnp.sum(nnx.merge(graphdef, params).value_fn(obs))

  def value_rows(params, obs):
    m = nnx.merge(graphdef, params)
    return jnp.sum(jax.vmap(jax.vmap(lambda o: m.value_fn(o[None])[0]))(obs))

  np.testing.assert_allclose(value_sum(params, obs), value_rows(params, obs), rtol=1e-5)
  g3, g1 = jax.grad(value_sum)(params, obs), jax.grad(value_rows)(params, obs)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g3, g1)
  loc, scale = model.policy_params(obs)
  loc_rows, scale_rows = model.policy_params(obs.reshape(12, 5))
  np.testing.assert_allclose(loc, loc_rows.reshape(3, 4, 2), rtol=1e-6)
  np.testing.assert_allclose(scale, scale_rows.reshape(3, 4, 2), rtol=1e-6)


def test_actor_critic_config_errors():
  with pytest.raises(ValueError, match="activation 'gelu' is not one of"):
    mlp.ActorCriticConfig(observation_size=5, action_size=3, activation="gelu")
  with pytest.raises(ValueError, match="observation_size and action_size must be >= 1, got 0, 3"):
    mlp.ActorCriticConfig(observation_size=0, action_size=3)
  with pytest.raises(ValueError, match="policy_init_scale must be > 0, got 0.0"):
    mlp.ActorCriticConfig(observation_size=5, action_size=3, policy_init_scale=0.0)


def test_running_stats_split_invariance_and_mask():
  x = jax.random.normal(jax.random.PRNGKey(0), (100, 3)) * jnp.array([1.0, 5.0, 0.1]) + 2.0
  whole = running_stats.update(running_stats.init(3), x)
  parts = running_stats.init(3)
  for chunk in (x[:7], x[7:50], x[50:]):
    parts = running_stats.update(parts, chunk)
  np.testing.assert_allclose(whole.mean, x.mean(0), rtol=1e-5)
  np.testing.assert_allclose(running_stats.std(whole), x.std(0), rtol=1e-4)
  np.testing.assert_allclose(parts.mean, whole.mean, rtol=1e-5)
  np.testing.assert_allclose(parts.m2, whole.m2, rtol=1e-4)
  # Masked-out rows are ignored.
  masked = running_stats.update(running_stats.init(3), jnp.concatenate([x, 1e6 * jnp.ones((5, 3))]),
                                mask=jnp.concatenate([jnp.ones(100), jnp.zeros(5)]))
  np.testing.assert_allclose(masked.mean, whole.mean, rtol=1e-5)


def test_normalize_is_identity_when_empty_and_clips():
  stats = running_stats.init(2)
  x = jnp.array([[3.0, -7.0]])
  np.testing.assert_array_equal(running_stats.normalize(stats, x, clip=None), x)
  np.testing.assert_array_equal(running_stats.normalize(stats, x, clip=5.0), [[3.0, -5.0]])
