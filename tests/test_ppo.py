"""Gold values for the shared PPO core (rljax/ppo.py), derived by hand in comments."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import ppo


def test_gae_terminal_and_truncated_gold():
  # One env, 4 steps, gamma = 0.9, lambda = 0.8  (gamma * lambda = 0.72).
  #   t=0 ordinary step         bootstrap V(s_1) = values[1] = 1
  #   t=1 truncated (time limit) bootstrap from the truncated state's value 9
  #   t=2 terminal              no bootstrap (discount 0)
  #   t=3 ordinary, last step   bootstrap 5
  rewards = jnp.array([[1.0, 2.0, 3.0, 4.0]])
  values = jnp.array([[0.5, 1.0, 1.5, 2.0]])
  bootstrap = jnp.array([[1.0, 9.0, 2.0, 5.0]])
  discounts = jnp.array([[1.0, 1.0, 0.0, 1.0]])
  truncation = jnp.array([[0.0, 1.0, 0.0, 0.0]])
  # delta_3 = 4 + 0.9 * 5 - 2        = 6.5      A_3 = 6.5
  # delta_2 = 3 + 0         - 1.5    = 1.5      A_2 = 1.5   (terminal: no carry)
  # delta_1 = 2 + 0.9 * 9   - 1      = 9.1      A_1 = 9.1   (truncated: no carry)
  # delta_0 = 1 + 0.9 * 1   - 0.5    = 1.4      A_0 = 1.4 + 0.72 * 9.1 = 7.952
  # returns = A + V = [8.452, 10.1, 3.0, 8.5]
  adv, ret = jax.jit(ppo.compute_gae, static_argnames=("gamma", "gae_lambda"))(
      rewards, values, bootstrap, discounts, None, gamma=0.9, gae_lambda=0.8,
      truncation=truncation,
  )
  np.testing.assert_allclose(adv, [[7.952, 9.1, 1.5, 6.5]], rtol=1e-6)
  np.testing.assert_allclose(ret, [[8.452, 10.1, 3.0, 8.5]], rtol=1e-6)


def test_gae_truncation_differs_from_termination():
  # The same step marked terminal instead of truncated must not bootstrap from 9:
  # delta_1 = 2 - 1 = 1 -> A_1 = 1, A_0 = 1.4 + 0.72 * 1 = 2.12.
  rewards = jnp.array([[1.0, 2.0, 3.0, 4.0]])
  values = jnp.array([[0.5, 1.0, 1.5, 2.0]])
  bootstrap = jnp.array([[1.0, 9.0, 2.0, 5.0]])
  discounts = jnp.array([[1.0, 0.0, 0.0, 1.0]])
  adv, _ = ppo.compute_gae(rewards, values, bootstrap, discounts, gamma=0.9, gae_lambda=0.8)
  np.testing.assert_allclose(adv, [[2.12, 1.0, 1.5, 6.5]], rtol=1e-6)


def test_gae_masked_sequence():
  # gamma = lambda = 1, values 0, the last two steps are padding:
  # A_3 = A_2 = 0 (masked); A_1 = 1.0 + A_2 = 1.0; A_0 = 1.5 + A_1 = 2.5.
  rewards = jnp.array([[1.5, 1.0, 2.0, 2.0]])
  zeros = jnp.zeros_like(rewards)
  mask = jnp.array([[1.0, 1.0, 0.0, 0.0]])
  adv, ret = ppo.compute_gae(
      rewards, zeros, zeros, jnp.ones_like(rewards), mask, gamma=1.0, gae_lambda=1.0
  )
  np.testing.assert_allclose(adv, [[2.5, 1.0, 0.0, 0.0]])
  np.testing.assert_allclose(ret, [[2.5, 1.0, 0.0, 0.0]])


def test_gae_batch_rows_independent():
  # Row 1 is row 0 shifted to a different batch position; results must not mix rows.
  key = jax.random.PRNGKey(0)
  r, v, b = jax.random.normal(key, (3, 2, 7))
  d = jnp.ones((2, 7))
  adv, _ = ppo.compute_gae(r, v, b, d, gamma=0.99, gae_lambda=0.95)
  adv0, _ = ppo.compute_gae(r[:1], v[:1], b[:1], d[:1], gamma=0.99, gae_lambda=0.95)
  np.testing.assert_allclose(adv[:1], adv0, rtol=1e-6)


def test_gae_rejects_mismatched_shapes():
  with pytest.raises(ValueError, match=r"values has shape \(1, 3\), expected \(1, 4\)"):
    ppo.compute_gae(
        jnp.zeros((1, 4)), jnp.zeros((1, 3)), jnp.zeros((1, 4)), jnp.ones((1, 4)),
        gamma=1.0, gae_lambda=1.0,
    )


def _loss(ratios, advantages, **config_kwargs):
  ratios = jnp.asarray(ratios)
  n = ratios.shape[0]
  old = jnp.zeros(n)
  config = ppo.PPOConfig(normalize_advantages=False, vf_coef=0.0, **config_kwargs)

  def f(log_probs):
    return ppo.ppo_loss(
        log_probs, old, jnp.asarray(advantages), jnp.zeros(n), jnp.zeros(n), jnp.zeros(n),
        jnp.ones(n), jnp.zeros(n), config=config,
    )

  (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.log(ratios))
  return loss, metrics, grad


def test_ppo_loss_clipping_gold():
  # clip_eps = 0.2, so the ratio is clipped to [0.8, 1.2].
  #   r=1.5, A=+1: min(1.5, 1.2)   = 1.2   upper side, clip active   (grad 0)
  #   r=1.5, A=-1: min(-1.5, -1.2) = -1.5  upper side, clip inactive (grad -A r / 5 = 0.3)
  #   r=0.5, A=-1: min(-0.5, -0.8) = -0.8  lower side, clip active   (grad 0)
  #   r=0.5, A=+1: min(0.5, 0.8)   = 0.5   lower side, clip inactive (grad -0.5 / 5 = -0.1)
  #   r=1.1, A=+2: 2.2                      inside the range          (grad -2.2 / 5 = -0.44)
  # pg_loss = -(1.2 - 1.5 - 0.8 + 0.5 + 2.2) / 5 = -1.6 / 5 = -0.32; clipfrac = 2/5.
  loss, m, grad = _loss([1.5, 1.5, 0.5, 0.5, 1.1], [1.0, -1.0, -1.0, 1.0, 2.0], clip_eps=0.2)
  np.testing.assert_allclose(m["pg_loss"], -0.32, rtol=1e-6)
  np.testing.assert_allclose(loss, -0.32, rtol=1e-6)
  np.testing.assert_allclose(m["clipfrac"], 0.4, rtol=1e-6)
  np.testing.assert_allclose(grad, [0.0, 0.3, 0.0, -0.1, -0.44], rtol=1e-5, atol=1e-7)
  # approx_kl = mean((r - 1) - log r)
  r = np.array([1.5, 1.5, 0.5, 0.5, 1.1])
  np.testing.assert_allclose(m["approx_kl"], np.mean((r - 1) - np.log(r)), rtol=1e-5)


def test_ppo_loss_clip_higher():
  # DAPO clip-higher: eps_high = 0.28 -> r=1.5, A=+1 gives min(1.5, 1.28) = 1.28;
  # the lower side still clips at 0.8: r=0.5, A=-1 -> -0.8.  pg = -(1.28 - 0.8) / 2 = -0.24.
  _, m, _ = _loss([1.5, 0.5], [1.0, -1.0], clip_eps=0.2, clip_eps_high=0.28)
  np.testing.assert_allclose(m["pg_loss"], -0.24, rtol=1e-6)


def test_ppo_loss_ratio_exactly_one_and_value_clipping():
  # Same log-probs: ratio exactly 1, no clipping, approx_kl exactly 0.
  lp = jnp.array([-1.3, -0.2, -2.0])
  values = jnp.array([1.0, 2.0, 3.0])
  old_values = jnp.array([0.0, 2.0, 3.5])
  returns = jnp.array([2.0, 2.5, 3.0])
  config = ppo.PPOConfig(normalize_advantages=False, value_clip_eps=0.5, vf_coef=1.0)
  loss, m = ppo.ppo_loss(
      lp, lp, jnp.array([1.0, -1.0, 0.5]), values, old_values, returns, jnp.ones(3),
      jnp.zeros(3), config=config,
  )
  assert float(m["ratio"]) == 1.0
  assert float(m["clipfrac"]) == 0.0
  assert float(m["approx_kl"]) == 0.0
  # pg = -mean(A) = -(1 - 1 + 0.5) / 3 = -1/6.
  # value errors, unclipped vs clipped (old +- 0.5):
  #   v=1.0, old=0.0 -> clipped 0.5: max((1-2)^2, (0.5-2)^2) = 2.25
  #   v=2.0, old=2.0 -> clipped 2.0: max(0.25, 0.25)         = 0.25
  #   v=3.0, old=3.5 -> clipped 3.0: max(0, 0)                = 0
  # vf_loss = 0.5 * (2.25 + 0.25 + 0) / 3 = 0.41666...
  np.testing.assert_allclose(m["pg_loss"], -1.0 / 6.0, rtol=1e-6)
  np.testing.assert_allclose(m["vf_loss"], 0.5 * 2.5 / 3.0, rtol=1e-6)
  np.testing.assert_allclose(loss, -1.0 / 6.0 + 0.5 * 2.5 / 3.0, rtol=1e-6)


def test_ppo_loss_masks_padding_and_aggregations():
  # Two sequences of 3 tokens; the second has one padding token. Advantages 1, ratio 1.
  # per-token pg = -1 on real tokens.
  #   token_mean:          -5 / 5                  = -1
  #   seq_mean_token_sum:  mean(-3, -2)            = -2.5
  #   seq_mean_token_mean: mean(-3/3, -2/2)        = -1
  mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
  z = jnp.zeros((2, 3))
  for agg, gold in [("token_mean", -1.0), ("seq_mean_token_sum", -2.5), ("seq_mean_token_mean", -1.0)]:
    config = ppo.PPOConfig(normalize_advantages=False, vf_coef=0.0, loss_aggregation=agg)
    _, m = ppo.ppo_loss(z, z, jnp.ones((2, 3)), z, z, z, mask, z, config=config)
    np.testing.assert_allclose(m["pg_loss"], gold, rtol=1e-6, err_msg=agg)


def test_normalize_advantages_ignores_padding():
  adv = jnp.array([1.0, 3.0, 100.0])
  mask = jnp.array([1.0, 1.0, 0.0])
  # Real entries 1, 3: mean 2, std 1 -> [-1, 1], padding -> 0.
  np.testing.assert_allclose(ppo.normalize_advantages(adv, mask), [-1.0, 1.0, 0.0], rtol=1e-6)


def test_ppo_update_first_ratio_is_one_and_learns():
  # A linear-softmax "policy" over 3 actions on random features; the batch's old
  # log-probs come from the same parameters, so the first minibatch's ratio is 1.
  key = jax.random.PRNGKey(0)
  k1, k2, k3, k4 = jax.random.split(key, 4)
  n, d = 64, 5
  obs = jax.random.normal(k1, (n, d))
  actions = jax.random.randint(k2, (n,), 0, 3)
  params = {"w": 0.1 * jax.random.normal(k3, (d, 3)), "v": jnp.zeros((d,))}

  def apply_fn(p, mb):
    logits = mb["obs"] @ p["w"]
    logp_all = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(logp_all, mb["actions"][:, None], axis=1)[:, 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, mb["obs"] @ p["v"], ent

  old_lp, old_v, _ = apply_fn(params, {"obs": obs, "actions": actions})
  advantages = jnp.where(actions == 0, 1.0, -0.5)
  batch = dict(obs=obs, actions=actions, log_probs=old_lp, values=old_v,
               advantages=advantages, returns=advantages, mask=jnp.ones(n))
  opt = optax.sgd(0.1)
  config = ppo.PPOConfig(num_epochs=3, num_minibatches=4, normalize_advantages=False)
  update = jax.jit(lambda s, b, k: ppo.ppo_update(s, b, k, apply_fn=apply_fn, optimizer=opt, config=config))
  state, m = update(ppo.PPOState(params, opt.init(params)), batch, k4)
  assert float(m["ratio_first"]) == 1.0
  # The update must raise the advantage-weighted log-likelihood of the taken actions
  # and the mean probability of action 0 (the only action with positive advantage).
  new_lp, _, _ = apply_fn(state.params, {"obs": obs, "actions": actions})
  assert float(jnp.mean(advantages * new_lp)) > float(jnp.mean(advantages * old_lp)) + 1e-3
  zeros = jnp.zeros(n, jnp.int32)
  p0_new = jnp.exp(apply_fn(state.params, {"obs": obs, "actions": zeros})[0]).mean()
  p0_old = jnp.exp(apply_fn(params, {"obs": obs, "actions": zeros})[0]).mean()
  assert float(p0_new) > float(p0_old)


def test_ppo_update_rejects_indivisible_batch():
  batch = {k: jnp.zeros((10,)) for k in ppo.BATCH_KEYS}
  config = ppo.PPOConfig(num_minibatches=4)
  with pytest.raises(ValueError, match="batch size 10 is not divisible by num_minibatches=4"):
    ppo.ppo_update(ppo.PPOState({}, ()), batch, jax.random.PRNGKey(0),
                   apply_fn=None, optimizer=optax.sgd(1.0), config=config)


def _microbatch_case(shape, seed=0):
  """A softmax policy over 3 actions with a linear value head, and a batch of ``shape``
  (``[N]`` flat steps or ``[B, T]`` sequences) with about 30% padding (rows 0 and 4 all
  padding)."""
  rng = np.random.default_rng(seed)
  mask = (rng.random(shape) < 0.7).astype(np.float32)
  mask[0] = mask[4] = 0
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  obs = f32(rng.normal(size=shape + (3,)))
  params = {"w": jnp.linspace(-1.0, 1.0, 9).reshape(3, 3), "v": jnp.full((3,), 0.1)}

  def apply_fn(p, mb):
    logp_all = jax.nn.log_softmax(mb["obs"] @ p["w"])
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp_all[..., 0], mb["obs"] @ p["v"], entropy

  old_lp, old_v, _ = apply_fn(params, {"obs": obs})
  batch = dict(obs=obs, log_probs=old_lp, values=old_v, mask=f32(mask),
               advantages=f32(rng.normal(size=shape) + 0.5), returns=f32(rng.normal(size=shape)))
  return params, apply_fn, batch


@pytest.mark.parametrize("shape, aggregation", [((64,), ppo.LossAggregation.TOKEN_MEAN)] + [
    ((16, 5), a) for a in ppo.LossAggregation])
@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_ppo_update_microbatches_equal_one_pass(shape, aggregation, num_microbatches):
  # Gradient accumulation over parts of each minibatch is the same update: advantages are
  # whitened over the whole minibatch, and each part's loss, gradient and metrics are
  # weighted by its share of the minibatch's tokens (or sequences, for SEQ_MEAN_*).
  params, apply_fn, batch = _microbatch_case(shape)
  opt = optax.sgd(0.5)

  def penalty_fn(p, mb, log_probs, mask):  # a KL-like term aggregated like the loss
    term = ppo.aggregate_loss(jnp.square(log_probs - mb["log_probs"]), mask, aggregation)
    return 0.3 * term, {"kl_loss": term}

  def run(g):
    config = ppo.PPOConfig(num_epochs=2, num_minibatches=2, num_microbatches=g,
                           entropy_coef=0.01, value_clip_eps=0.2, loss_aggregation=aggregation)
    update = jax.jit(lambda s, b, k: ppo.ppo_update(
        s, b, k, apply_fn=apply_fn, optimizer=opt, config=config, penalty_fn=penalty_fn))
    return update(ppo.PPOState(params, opt.init(params)), batch, jax.random.PRNGKey(3))

  (one, m1), (acc, mg) = run(1), run(num_microbatches)
  assert sorted(m1) == sorted(mg)
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(acc.params)):
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-6)
  for k in m1:
    np.testing.assert_allclose(mg[k], m1[k], rtol=0, atol=2e-6, err_msg=k)
  assert float(mg["ratio_first"]) == 1.0  # token-weighted mean of exact ones
  assert float(jnp.max(jnp.abs(acc.params["w"] - params["w"]))) > 1e-3  # it did train


def test_ppo_update_microbatches_whiten_over_the_minibatch():
  # Part j holds rows j, j + 2, ...: here even rows have advantages 5 higher than odd ones.
  # Whitening each part alone would remove that offset (the update a per-part whitening
  # would make is `per_part` below, clearly different); the accumulated update whitens over
  # the minibatch, as one pass does.
  params, apply_fn, batch = _microbatch_case((64,))
  batch = dict(batch, mask=jnp.ones(64),
               advantages=batch["advantages"] + 5.0 * (jnp.arange(64) % 2 == 0))
  opt = optax.sgd(0.5)

  def run(g, b, whiten=True):
    config = ppo.PPOConfig(num_epochs=1, num_minibatches=1, num_microbatches=g,
                           normalize_advantages=whiten)
    return ppo.ppo_update(ppo.PPOState(params, opt.init(params)), b, jax.random.PRNGKey(0),
                          apply_fn=apply_fn, optimizer=opt, config=config)[0].params["w"]

  one, two = run(1, batch), run(2, batch)
  adv = batch["advantages"]
  whitened_per_part = jnp.zeros(64)
  for j in range(2):
    whitened_per_part = whitened_per_part.at[j::2].set(
        ppo.normalize_advantages(adv[j::2], jnp.ones(32)))
  per_part = run(1, dict(batch, advantages=whitened_per_part), whiten=False)
  np.testing.assert_allclose(two, one, rtol=0, atol=2e-6)
  assert float(jnp.max(jnp.abs(per_part - one))) > 1e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_accumulated_gradient_with_an_empty_part(dtype):
  # `_accumulated` on one minibatch (no shuffle), rows 0, 4, 8 and 12 all padding: part 0 of
  # 4 has no real token and must count for nothing. bf16 parameters and log-probs: the sums
  # are kept in f32 and the results come back in the one-pass dtypes.
  params, apply_fn, batch = _microbatch_case((16, 5))
  mask = batch["mask"].at[0::4].set(0.0)
  batch = dict(batch, mask=mask)
  params = jax.tree.map(lambda x: x.astype(dtype), params)
  batch = dict(batch, obs=batch["obs"].astype(dtype))

  def make_loss(config):
    def loss_fn(p, mb):
      log_probs, values, entropy = apply_fn(p, mb)
      return ppo.ppo_loss(log_probs, mb["log_probs"], mb["advantages"], values, mb["values"],
                          mb["returns"], mb["mask"], entropy, config=config)
    return loss_fn

  config = ppo.PPOConfig(entropy_coef=0.01, num_microbatches=4)
  (loss1, m1), g1 = jax.value_and_grad(make_loss(config), has_aux=True)(params, batch)
  no_whitening = ppo.PPOConfig(entropy_coef=0.01, normalize_advantages=False)
  (loss4, m4), g4 = ppo._accumulated(make_loss(no_whitening), config)(params, batch)
  tol = 2e-6 if dtype == jnp.float32 else 2e-2
  assert loss4.dtype == loss1.dtype and {k: v.dtype for k, v in m4.items()} == {
      k: v.dtype for k, v in m1.items()}
  np.testing.assert_allclose(np.float32(loss4), np.float32(loss1), rtol=tol, atol=tol)
  for k in m1:
    np.testing.assert_allclose(np.float32(m4[k]), np.float32(m1[k]), rtol=tol, atol=tol, err_msg=k)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
    assert b.dtype == a.dtype == dtype
    np.testing.assert_allclose(np.float32(b), np.float32(a), rtol=tol, atol=tol)


def test_ppo_update_rejects_indivisible_minibatch():
  batch = {k: jnp.zeros((12,)) for k in ppo.BATCH_KEYS}
  config = ppo.PPOConfig(num_minibatches=2, num_microbatches=4)
  with pytest.raises(ValueError, match=r"minibatch size 6 .* not divisible by num_microbatches=4"):
    ppo.ppo_update(ppo.PPOState({}, ()), batch, jax.random.PRNGKey(0),
                   apply_fn=None, optimizer=optax.sgd(1.0), config=config)


def _sequence_case(seed=0):
  """A softmax policy over 3 actions with a linear value head on ``[8, 6]`` sequences, and
  an ``advantage_fn`` that runs GAE (gamma 0.9, lambda 0.8) from the loss's values, the
  next step's value and ``V(final_obs)`` for the last step; plus a function that computes
  the same advantages, returns and values for the whole batch ahead of the update."""
  rng = np.random.default_rng(seed)
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  obs = f32(rng.normal(size=(8, 7, 3)))  # 7 observations: the 6 steps and the last successor
  params = {"w": jnp.linspace(-1.0, 1.0, 9).reshape(3, 3), "v": jnp.array([0.5, -0.3, 0.8])}

  def apply_fn(p, mb):
    logp_all = jax.nn.log_softmax(mb["obs"] @ p["w"])
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp_all[..., 0], mb["obs"] @ p["v"], entropy

  def advantage_fn(p, mb, values):
    last = mb["final_obs"] @ p["v"]                                  # [M]
    bootstrap = jnp.concatenate([values[:, 1:], last[:, None]], axis=1)
    return ppo.compute_gae(mb["rewards"], values, bootstrap, jnp.ones_like(values),
                           gamma=0.9, gae_lambda=0.8)

  batch = dict(obs=obs[:, :-1], final_obs=obs[:, -1], rewards=f32(rng.normal(size=(8, 6))),
               mask=jnp.ones((8, 6)))
  batch["log_probs"] = apply_fn(params, batch)[0]

  def ahead(p):  # the batch's values, advantages and returns, computed before an update
    values = apply_fn(p, batch)[1]
    advantages, returns = advantage_fn(p, batch, values)
    return dict(batch, values=values, advantages=advantages, returns=returns)

  return params, apply_fn, advantage_fn, batch, ahead


@pytest.mark.slow
def test_advantage_fn_estimates_advantages_with_the_current_value_network():
  # With advantage_fn, each SGD step computes GAE from the value network as that step finds
  # it (Brax's PPO). One epoch of one minibatch is then the update with GAE computed ahead
  # of it; two epochs are two such updates in a row (the minibatch holds the whole batch,
  # and its loss does not depend on the row order), not two epochs on advantages from the
  # first values.
  params, apply_fn, advantage_fn, batch, ahead = _sequence_case()
  opt = optax.adam(0.05)

  @functools.partial(jax.jit, static_argnames=("epochs", "fn"))
  def update(state, b, epochs, fn=None, key=0):
    config = ppo.PPOConfig(num_epochs=epochs, num_minibatches=1, entropy_coef=0.01)
    return ppo.ppo_update(state, b, jax.random.PRNGKey(key), apply_fn=apply_fn, optimizer=opt,
                          config=config, advantage_fn=fn)

  start = ppo.PPOState(params, opt.init(params))
  inside, m_inside = update(start, batch, 1, advantage_fn)
  outside, m_outside = update(start, ahead(params), 1)
  for a, b in zip(jax.tree.leaves(outside), jax.tree.leaves(inside)):
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
  for k in m_outside:
    np.testing.assert_allclose(m_inside[k], m_outside[k], rtol=1e-6, atol=1e-6, err_msg=k)
  assert float(m_inside["ratio_first"]) == 1.0

  twice, _ = update(start, batch, 2, advantage_fn)
  step1, _ = update(start, ahead(params), 1)
  step2, _ = update(step1, ahead(step1.params), 1, key=1)
  for a, b in zip(jax.tree.leaves(step2), jax.tree.leaves(twice)):
    np.testing.assert_allclose(b, a, rtol=0, atol=2e-6)
  once_ahead, _ = update(start, ahead(params), 2)  # advantages from the first values only
  assert float(jnp.max(jnp.abs(once_ahead.params["w"] - twice.params["w"]))) > 1e-3


def test_advantage_fn_refuses_value_clipping_and_microbatches():
  params, apply_fn, advantage_fn, batch, _ = _sequence_case()
  opt = optax.sgd(0.1)
  state = ppo.PPOState(params, opt.init(params))
  update = lambda config, b=batch: ppo.ppo_update(  # noqa: E731
      state, b, jax.random.PRNGKey(0), apply_fn=apply_fn, optimizer=opt, config=config,
      advantage_fn=advantage_fn)
  with pytest.raises(ValueError, match=r"advantage_fn cannot be combined with "
                                       r"value_clip_eps=0.2 .*; use None"):
    update(ppo.PPOConfig(num_minibatches=2, value_clip_eps=0.2))
  with pytest.raises(ValueError, match="advantage_fn needs num_microbatches=1, got 2"):
    update(ppo.PPOConfig(num_minibatches=2, num_microbatches=2))
  # The batch needs no values, advantages or returns then, but still the rollout's
  # log-probs and mask.
  with pytest.raises(KeyError, match=r"missing keys \['log_probs'\]; it needs "
                                     r"\['log_probs', 'mask'\]"):
    update(ppo.PPOConfig(num_minibatches=2), {k: v for k, v in batch.items() if k != "log_probs"})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clip_eps=0.0), "clip_eps must be > 0, got 0.0"),
        (dict(num_minibatches=0), "num_minibatches must be >= 1, got 0"),
        (dict(num_microbatches=0), "num_microbatches must be >= 1, got 0"),
        (dict(loss_aggregation="mean"), "'mean' is not a valid LossAggregation"),
    ],
)
def test_ppo_config_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ppo.PPOConfig(**kwargs)
