"""KL estimators and controllers (rljax/kl.py): closed forms on a small vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import kl

# A 3-token vocabulary: pi = [0.5, 0.3, 0.2], pi_ref = [0.25, 0.25, 0.5].
PI = np.array([0.5, 0.3, 0.2])
REF = np.array([0.25, 0.25, 0.5])


def test_estimators_gold_values():
  # Token 0: log pi - log ref = log 2 = 0.693147.
  #   k1 = 0.693147; k2 = 0.5 * 0.693147^2 = 0.240227; k3 = (0.5 - 1) - log 0.5 = 0.193147.
  lp, ref = jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25]))
  np.testing.assert_allclose(kl.kl_k1(lp, ref), [0.693147], rtol=1e-5)
  np.testing.assert_allclose(kl.kl_k2(lp, ref), [0.240227], rtol=1e-5)
  np.testing.assert_allclose(kl.kl_k3(lp, ref), [0.193147], rtol=1e-5)


def test_expectations_match_closed_forms():
  lp, ref = jnp.log(PI), jnp.log(REF)
  exact = float(np.sum(PI * np.log(PI / REF)))  # KL(pi || ref) = 0.218012
  expect = lambda k: float(jnp.sum(PI * k))
  # k1 and k3 are unbiased for KL(pi || ref).
  np.testing.assert_allclose(expect(kl.kl_k1(lp, ref)), exact, rtol=1e-6)
  np.testing.assert_allclose(expect(kl.kl_k3(lp, ref)), exact, rtol=1e-6)
  # k2 is biased: E[k2] = 0.5 * E[(log pi/ref)^2], a different number.
  k2_closed = 0.5 * float(np.sum(PI * np.log(PI / REF) ** 2))
  np.testing.assert_allclose(expect(kl.kl_k2(lp, ref)), k2_closed, rtol=1e-6)
  assert abs(k2_closed - exact) > 0.005  # 0.209058 vs 0.218012


def _exact_in_loss_grad(estimator, logits, ref_lp):
  """Gradient of E_{x~pi}[k(x)] with the sampling distribution held fixed (what an on-policy
  loss estimates): sum_x stop_grad(pi(x)) * grad k(x)."""

  def surrogate(lg):
    lp = jax.nn.log_softmax(lg)
    weights = jax.lax.stop_gradient(jnp.exp(lp))
    return jnp.sum(weights * kl.kl_estimate(lp, ref_lp, estimator))

  return jax.grad(surrogate)(logits)


def test_in_loss_gradients_where_unbiased():
  logits = jnp.log(jnp.array(PI))
  ref_lp = jnp.log(jnp.array(REF))
  forward_kl = lambda lg: jnp.sum(jax.nn.softmax(lg) * (jax.nn.log_softmax(lg) - ref_lp))
  reverse_kl = lambda lg: jnp.sum(jnp.exp(ref_lp) * (ref_lp - jax.nn.log_softmax(lg)))
  g_fwd = jax.grad(forward_kl)(logits)
  # k2 in the loss: unbiased gradient of KL(pi || ref).
  np.testing.assert_allclose(_exact_in_loss_grad("k2", logits, ref_lp), g_fwd, atol=1e-6)
  # k3 in the loss: the gradient of the reverse KL(ref || pi), not of KL(pi || ref).
  g3 = _exact_in_loss_grad("k3", logits, ref_lp)
  np.testing.assert_allclose(g3, jax.grad(reverse_kl)(logits), atol=1e-6)
  assert float(jnp.max(jnp.abs(g3 - g_fwd))) > 1e-2
  # k1 in the loss: expected gradient E[grad log pi] = 0.
  np.testing.assert_allclose(_exact_in_loss_grad("k1", logits, ref_lp), 0.0, atol=1e-6)


def test_docstrings_state_bias():
  assert "biased" in kl.kl_k1.__doc__ and "unbiased" in kl.kl_k2.__doc__
  assert "reverse" in kl.kl_k3.__doc__


def test_adaptive_controller_gold():
  # beta = 0.1, target 6, horizon 10000, n = 1000 samples:
  #   KL = 9:  e = clip(9/6 - 1, -0.2, 0.2) = 0.2   -> beta = 0.1 * (1 + 0.2 * 0.1) = 0.102
  #   KL = 3:  e = clip(3/6 - 1) = -0.2              -> 0.102 * (1 - 0.02) = 0.09996
  #   KL = 6.6: e = 0.1                              -> 0.09996 * 1.01 = 0.1009596
  ctrl = kl.adaptive_kl_controller(0.1, target=6.0, horizon=10_000)
  s = ctrl.init()
  s = ctrl.update(s, 9.0, 1000)
  np.testing.assert_allclose(s.kl_coef, 0.102, rtol=1e-6)
  s = ctrl.update(s, 3.0, 1000)
  np.testing.assert_allclose(s.kl_coef, 0.09996, rtol=1e-6)
  s = jax.jit(ctrl.update)(s, 6.6, 1000)
  np.testing.assert_allclose(s.kl_coef, 0.1009596, rtol=1e-5)


def test_fixed_controller_and_validation():
  ctrl = kl.fixed_kl_controller(0.05)
  s = ctrl.update(ctrl.init(), 100.0, 10)
  np.testing.assert_allclose(s.kl_coef, 0.05)
  with pytest.raises(ValueError, match="target must be > 0, got 0"):
    kl.adaptive_kl_controller(0.1, target=0.0, horizon=10)
  with pytest.raises(ValueError, match="kl_coef must be >= 0, got -1"):
    kl.fixed_kl_controller(-1)
  with pytest.raises(ValueError, match="'k4'"):
    kl.kl_estimate(jnp.zeros(1), jnp.zeros(1), "k4")
