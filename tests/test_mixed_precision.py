"""Mixed precision (bf16 compute, f32 master weights) and the entropy-as-metric gradient.

* ``rljax.models.dots.dot`` with two bf16 operands has a hand-written backward pass whose dots
  take the bf16 cotangent (as PyTorch's bf16 autocast). Its gradients equal autodiff of the
  same dot computed in f32 from the same bf16 values, to bf16 rounding; the f32 path is plain
  autodiff, bit for bit.
* ``RLHFConfig.compute_dtype="bfloat16"``: a training step keeps parameters and optimizer
  states in f32, and the update's gradient is the f32 one to bf16 accuracy.
* ``ppo_loss`` with ``entropy_coef == 0`` gives the entropy no gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_rlhf import _model, _trainer

from rljax import ppo
from rljax.alignment import modeling, rlhf
from rljax.models import dots, llm

# The model's dot equations (attention, MLP, LM head with a leading ellipsis).
EQUATIONS = [
    ("BTE,EHD->BTHD", (2, 3, 8), (8, 2, 4)),
    ("BKTGD,BKDS->BKTGS", (2, 2, 3, 2, 4), (2, 2, 4, 5)),
    ("BKTGS,BKSD->BKTGD", (2, 2, 3, 2, 5), (2, 2, 5, 4)),
    ("BTE,ECM->BTCM", (2, 3, 8), (8, 2, 6)),
    ("BTM,ME->BTE", (2, 3, 6), (6, 8)),
    ("...E,EV->...V", (2, 3, 8), (8, 16)),
    ("...E,VE->...V", (2, 3, 8), (16, 8)),
]


def _inputs(xs, ws, seed=0):
  kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
  return jax.random.normal(kx, xs), jax.random.normal(kw, ws)


@pytest.mark.slow
@pytest.mark.parametrize("equation,xs,ws", EQUATIONS)
@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_bf16_dot_gradient_matches_f32_autodiff(equation, xs, ws, out_dtype):
  x, w = _inputs(xs, ws)
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  out_shape = jnp.einsum(equation, x, w).shape
  c = jax.random.normal(jax.random.key(7), out_shape)

  def loss(fn, a, b):
    return jnp.sum(fn(a, b).astype(jnp.float32) * c)

  mixed = jax.grad(lambda a, b: loss(lambda p, q: dots.dot(equation, p, q, out_dtype), a, b),
                   argnums=(0, 1))(xb, wb)
  # Reference: the same bf16 values, dot and gradient in f32.
  ref = jax.grad(lambda a, b: loss(lambda p, q: jnp.einsum(equation, p, q), a, b),
                 argnums=(0, 1))(xb.astype(jnp.float32), wb.astype(jnp.float32))
  for g, r, orig in zip(mixed, ref, (xb, wb)):
    assert g.dtype == jnp.bfloat16 and g.shape == orig.shape
    # bf16 has an 8-bit mantissa: the cotangent and the result are rounded once each.
    scale = float(jnp.max(jnp.abs(r)))
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r), atol=2e-2 * scale)
  # The forward value is unchanged: f32 accumulation, one rounding.
  value = dots.dot(equation, xb, wb, out_dtype)
  expect = jnp.einsum(equation, xb, wb, preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(np.asarray(value, np.float32),
                                np.asarray(expect.astype(value.dtype), np.float32))


def test_f32_dot_is_plain_autodiff():
  equation, xs, ws = EQUATIONS[3]
  x, w = _inputs(xs, ws)
  c = jax.random.normal(jax.random.key(7), jnp.einsum(equation, x, w).shape)
  ours = jax.grad(lambda a, b: jnp.sum(dots.dot(equation, a, b) * c), argnums=(0, 1))(x, w)
  plain = jax.grad(lambda a, b: jnp.sum(
      jnp.einsum(equation, a, b, preferred_element_type=jnp.float32) * c), argnums=(0, 1))(x, w)
  for a, b in zip(ours, plain):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_bf16_compute_policy_gradient_close_to_f32():
  """Mixed precision on the whole policy: f32 gradients, close to the f32 computation."""
  model = _model()
  gd, params = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(0)
  vocab = model.config.vocab_size
  pt = jnp.asarray(rng.integers(3, vocab, (4, 6)), jnp.int32)
  pm = jnp.ones((4, 6), bool).at[0, :2].set(False)
  rt = jnp.asarray(rng.integers(3, vocab, (4, 5)), jnp.int32)
  rm = jnp.ones((4, 5), bool).at[1, 3:].set(False)

  def loss(p, dtype):
    lp, _ = modeling.policy_outputs(gd, rlhf.cast_floating(p, dtype), pt, pm, rt, rm)
    return jnp.sum(lp)

  g32 = jax.grad(loss)(params, None)
  g16 = jax.grad(loss)(params, "bfloat16")
  for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g16)):
    assert b.dtype == jnp.float32  # the gradient of the f32 master weights
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    if np.linalg.norm(a) == 0:
      continue
    assert np.linalg.norm(a - b) <= 0.05 * np.linalg.norm(a)
    assert np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.998


def test_cast_floating_leaves_ints_and_none():
  tree = {"w": jnp.ones(3), "i": jnp.arange(3), "h": jnp.ones(2, jnp.bfloat16)}
  assert rlhf.cast_floating(tree, None) is tree
  out = rlhf.cast_floating(tree, "bfloat16")
  assert out["w"].dtype == jnp.bfloat16 and out["i"].dtype == jnp.int32
  assert out["h"] is tree["h"]


@pytest.mark.slow
def test_rlhf_step_bf16_compute_keeps_f32_state_and_tracks_f32_update():
  kw = dict(algo="grpo", group_size=2, prompts_per_step=4, kl_coef=0.0,
            ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=1, normalize_advantages=False))
  tr16 = _trainer(compute_dtype="bfloat16", **kw)
  tr32 = _trainer(**kw)
  assert tr16.sampler.config.dtype == "bfloat16" and tr16.sampler.config.cache_dtype == "float32"
  p0 = [np.array(x) for x in jax.tree.leaves(tr32.actor_params())]
  rec = tr16.step()
  assert np.isfinite(rec["pg_loss"]) and tr16.state.skipped_updates == 0
  leaves = jax.tree.leaves(tr16.state.ppo_state)
  assert all(x.dtype == jnp.float32 for x in leaves if jnp.issubdtype(x.dtype, jnp.floating))
  # Same rollout in f32: feed the bf16 run's batch to the f32 update and compare the steps.
  b = tr16.last_batch
  batch = {k: b[k] for k in ("prompt_tokens", "prompt_mask", "response_tokens", "mask",
                             "ref_log_probs", "values", "scores", "sampler_log_probs")}
  batch["scores"] = np.arange(len(batch["scores"]), dtype=np.float32)  # nonzero advantages
  key = jax.random.key(3)
  upd16 = rlhf.make_update_fn(tr16.graphdefs[rlhf.Role.ACTOR], None, tr16.optimizer, tr16.config)
  upd32 = rlhf.make_update_fn(tr32.graphdefs[rlhf.Role.ACTOR], None, tr32.optimizer, tr32.config)
  s16, m16, _ = upd16(tr32.state.ppo_state._replace(
      params=jax.tree.map(jnp.copy, tr32.state.ppo_state.params),
      opt_state=jax.tree.map(jnp.copy, tr32.state.ppo_state.opt_state)), batch, key, 0.0)
  s32, m32, _ = upd32(tr32.state.ppo_state, batch, key, 0.0)
  np.testing.assert_allclose(m16["grad_norm"], m32["grad_norm"], rtol=0.05)
  d16 = np.concatenate([np.ravel(a - b) for a, b in
                        zip(jax.tree.leaves(s16.params["actor"]), p0)])
  d32 = np.concatenate([np.ravel(a - b) for a, b in
                        zip(jax.tree.leaves(s32.params["actor"]), p0)])
  assert np.linalg.norm(d32) > 0
  cos = np.dot(d16, d32) / (np.linalg.norm(d16) * np.linalg.norm(d32))
  assert cos > 0.99


def test_compute_dtype_rejects_unknown():
  with pytest.raises(ValueError, match="compute_dtype.*'float16'"):
    rlhf.RLHFConfig(compute_dtype="float16")


@pytest.mark.parametrize("coef", [0.0, 0.3])
def test_entropy_gradient_only_with_a_coefficient(coef):
  """With entropy_coef == 0 the entropy is a metric (no gradient, even if it is NaN-free);
  with a coefficient its gradient is -coef * d agg(H) / dH = -coef * mask / sum(mask)."""
  shape = (2, 3)
  mask = jnp.asarray([[1, 1, 0], [1, 1, 1]], jnp.float32)
  z = jnp.zeros(shape)
  cfg = ppo.PPOConfig(entropy_coef=coef, normalize_advantages=False)

  def loss(ent):
    return ppo.ppo_loss(z, z, jnp.ones(shape), z, z, z, mask, ent, config=cfg)[0]

  g = jax.grad(loss)(jnp.ones(shape))
  agg_grad = jax.grad(lambda e: ppo.aggregate_loss(e, mask, cfg.loss_aggregation))(jnp.ones(shape))
  np.testing.assert_allclose(np.asarray(g), -coef * np.asarray(agg_grad), atol=1e-7)
  if coef == 0:
    assert not np.any(np.asarray(g))
  else:
    assert np.all(np.asarray(g)[np.asarray(mask) > 0] < 0)
