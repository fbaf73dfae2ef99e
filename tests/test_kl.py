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


def test_pi_controller_gold():
  # beta0 = 0.1, target 2, kp = 0.5, ki = 0.2, max_error = 1:
  #   KL = 2e:     e = log(e) = 1,  I = 1     -> beta = 0.1 * exp(0.5 + 0.2)       = 0.2013753
  #   KL = 2:      e = 0,           I = 1     -> beta = 0.1 * exp(0.2)             = 0.1221403
  #   KL = 2e^-3:  e = clip(-3) = -1, I = 0   -> beta = 0.1 * exp(-0.5)            = 0.0606531
  #   KL = 0:      e = -1 (clipped), I = clamp(-1) = -0.5 (anti-windup)
  #                                           -> beta = 0.1 * exp(-0.5 - 0.1)      = 0.0548812
  ctrl = kl.pi_kl_controller(0.1, target=2.0)
  s = ctrl.init()
  expected = [(2 * np.e, 0.2013753, 1.0), (2.0, 0.1221403, 1.0), (2 * np.exp(-3), 0.0606531, 0.0),
              (0.0, 0.0548812, -0.5)]
  for current, beta, integral in expected:
    s = jax.jit(ctrl.update)(s, current, 16)
    np.testing.assert_allclose(s.kl_coef, beta, rtol=1e-6)
    np.testing.assert_allclose(s.integral, integral, atol=1e-6)
  assert s.kl_coef.dtype == jnp.float32
  s = ctrl.update(s, float("nan"), 16)  # a NaN KL counts as no error
  np.testing.assert_allclose(s.integral, -0.5)
  np.testing.assert_allclose(s.kl_coef, 0.1 * np.exp(-0.1), rtol=1e-6)
  for _ in range(3):  # the upper clamp: 10 (beta at most 0.1 * exp(0.5 + 2))
    s = ctrl.update(s, 1e9, 16)
  np.testing.assert_allclose(s.integral, 2.5)
  for _ in range(10):
    s = ctrl.update(s, 1e9, 16)
  np.testing.assert_allclose(s.integral, 10.0)
  np.testing.assert_allclose(s.kl_coef, 0.1 * np.exp(2.5), rtol=1e-6)


def _closed_loop(ctrl, steps=200, beta0=0.1, drift=6.0, lag=0.7):
  """A policy whose KL drifts towards ``drift / (1 + 20 beta)`` with a one-step lag."""
  s, kl_now, kls = ctrl.init(), 0.0, []
  for _ in range(steps):
    kl_now = lag * kl_now + (1 - lag) * drift / (1 + 20 * float(s.kl_coef))
    kls.append(kl_now)
    s = ctrl.update(s, kl_now, 16)
  return np.array(kls), float(s.kl_coef)


def test_pi_controller_holds_the_target_where_ziegler_does_not():
  # Uncontrolled (beta 0.1) the KL settles at 6 / 3 = 2 nats too high for a target of 1.
  kls_pi, beta_pi = _closed_loop(kl.pi_kl_controller(0.1, target=1.0))
  kls_zi, _ = _closed_loop(kl.adaptive_kl_controller(0.1, target=1.0, horizon=320))
  after = slice(20, None)  # the first 10% of steps
  assert np.all(kls_pi[after] <= 1.5) and np.all(kls_pi[after] >= 1 / 1.5), kls_pi[after].max()
  np.testing.assert_allclose(kls_pi[-1], 1.0, rtol=1e-3)  # no steady-state error
  np.testing.assert_allclose(beta_pi, 0.25, rtol=1e-2)  # 6 / (1 + 20 beta) = 1
  assert kls_zi[after].max() > 1.5  # the adaptive controller is still above 1.5x at step 20


def test_make_kl_controller_and_validation():
  assert isinstance(kl.make_kl_controller("pi", 0.1, target=2.0, horizon=10).init(),
                    kl.PIKLControllerState)
  s = kl.make_kl_controller("adaptive", 0.1, target=6.0, horizon=10_000).update(
      kl.KLControllerState(jnp.float32(0.1)), 9.0, 1000)
  np.testing.assert_allclose(s.kl_coef, 0.102, rtol=1e-6)
  with pytest.raises(ValueError, match="'pid'"):
    kl.make_kl_controller("pid", 0.1, target=2.0, horizon=10)
  with pytest.raises(ValueError, match="init_kl_coef must be > 0 for the PI controller"):
    kl.pi_kl_controller(0.0, target=2.0)
  with pytest.raises(ValueError, match=r"integral_range must satisfy low <= 0 <= high, got \(1, 2\)"):
    kl.pi_kl_controller(0.1, target=2.0, integral_range=(1, 2))
  with pytest.raises(ValueError, match="kp and ki must be >= 0 and not both 0"):
    kl.pi_kl_controller(0.1, target=2.0, kp=0.0, ki=0.0)


def test_kl_plot_draws_the_rl_records_and_skips_a_run_without_them(tmp_path):
  import dataclasses
  import json

  from rljax.alignment import kl_plot, rlhf_config

  config = dataclasses.replace(rlhf_config.RLHFConfig(), kl_controller="pi", kl_target=2.0)
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in [
      {"stage": "sft", "step": 1, "sft/loss": 1.0},
      *({"stage": "rl", "step": i, "kl": 0.5 * i, "kl_coef": 0.1} for i in range(1, 6))]))
  out = tmp_path / "kl.png"
  assert kl_plot.write_kl_plot(str(path), str(out), config) == str(out)
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  path.write_text(json.dumps({"stage": "sft", "step": 1}) + "\n")
  assert kl_plot.write_kl_plot(str(path), str(tmp_path / "none.png"), config) is None
  assert kl_plot.write_kl_plot(str(tmp_path / "missing.jsonl"), str(out), config) is None
  assert not (tmp_path / "none.png").exists()
