r"""KL estimators (k1, k2, k3) and the fixed/adaptive KL-coefficient controllers.

RLHF keeps the policy ``pi`` near a frozen reference ``pi_ref`` with a penalty on
``KL(pi || pi_ref) = E_{x~pi}[log pi(x) - log pi_ref(x)]``. The expectation over the
vocabulary (and over whole responses) is not computed; it is estimated per sampled token from
the two log-probs of the token that was sampled from ``pi``. With the log-ratio
``log_r = log pi_ref(x) - log pi(x)`` (J. Schulman, "Approximating KL divergence", 2020,
http://joschu.net/blog/kl-approx.html)::

    k1 = -log_r                   = log pi - log pi_ref
    k2 = 0.5 * log_r ** 2
    k3 = (exp(log_r) - 1) - log_r = pi_ref / pi - 1 - log(pi_ref / pi)

Two uses, which differ in what must be unbiased:

* **in the reward** (Ziegler et al. 2019; InstructGPT; OpenRLHF/verl default): the estimate
  is a number, ``r_t -= kl_coef * k(x_t)``, with no gradient through it. What matters is that
  its *value* is unbiased for ``KL(pi || pi_ref)``: true for k1 and k3, not for k2.
* **in the loss** (GRPO, Shao et al. 2024, arXiv:2402.03300, uses k3): ``loss += kl_coef *
  mean(k(x_t))`` and the gradient flows through ``log pi``; the samples ``x_t ~ pi`` carry no
  gradient. What matters is that the *gradient* is unbiased for ``grad KL(pi || pi_ref)``:
  true for k2 only. k1's expected gradient is ``E_pi[grad log pi] = 0``; k3's is
  ``grad KL(pi_ref || pi)``, the reverse KL (Liu et al. 2025, "On the design of
  KL-regularized policy gradient algorithms for LLM reasoning", arXiv:2505.17508; Tang &
  Munos 2025, arXiv:2506.09477). ``tests/test_kl.py`` checks each statement exactly on a small
  vocabulary.

Layout: all estimators take ``[B, T]`` (or any equal shapes) f32 log-probs and return the same
shape; reduce with a mask yourself (``rljax.ppo.masked_mean``).

The KL controllers are ``(init, update)`` pairs with a NamedTuple state holding ``kl_coef``,
like optax transformations: :func:`fixed_kl_controller`, :func:`adaptive_kl_controller`
(Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
arXiv:1909.08593, Sec. 2.2) and :func:`pi_kl_controller`, a proportional-integral controller
on ``log(KL / target)`` that holds its target. `KL_CONTROLLERS` names them and
`make_kl_controller` builds one by name.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class KLEstimator(enum.Enum):
  """Which per-token estimator of ``KL(pi || pi_ref)`` to use; see the module docstring."""

  K1 = "k1"
  K2 = "k2"
  K3 = "k3"


def kl_k1(log_probs: Array, ref_log_probs: Array) -> Array:
  """``k1 = log pi(x) - log pi_ref(x)`` per sampled token.

  Value: unbiased for ``KL(pi || pi_ref)`` (``E_pi[k1] = KL``) but high variance and negative
  on single tokens. As a loss term its expected gradient is ``E_pi[grad log pi] = 0``: biased
  (it does not pull towards the reference at all in expectation).

  Args:
    log_probs: ``[B, T]`` f32 log-probs of the sampled tokens under the policy ``pi``.
    ref_log_probs: same shape, under the reference ``pi_ref``.

  Returns:
    ``[B, T]`` f32.
  """
  return log_probs - ref_log_probs


def kl_k2(log_probs: Array, ref_log_probs: Array) -> Array:
  """``k2 = 0.5 * (log pi(x) - log pi_ref(x))^2`` per sampled token (always >= 0).

  Value: biased for ``KL(pi || pi_ref)`` (it estimates an f-divergence that agrees with KL only
  to second order as ``pi -> pi_ref``). As a loss term with ``x ~ pi`` its expected gradient is
  ``E_pi[(log pi - log pi_ref) grad log pi] = grad KL(pi || pi_ref)``: unbiased. It is the
  right choice for KL *in the loss*.

  Args / Returns: as :func:`kl_k1`.
  """
  d = log_probs - ref_log_probs
  return 0.5 * d * d


def kl_k3(log_probs: Array, ref_log_probs: Array) -> Array:
  """``k3 = (r - 1) - log r`` with ``r = pi_ref(x) / pi(x)`` per sampled token (always >= 0).

  Value: unbiased for ``KL(pi || pi_ref)`` (``E_pi[r] = 1``) with low variance while ``r``
  stays near 1: the right choice for KL *in the reward*. Its tail is heavy where the policy
  samples a token the reference finds far likelier (``r`` grows as ``exp``): ``log pi = -9.5``,
  ``log pi_ref = -1.8`` gives 2,113 nats, so the trainer logs the k1 sum instead. As a loss
  term (GRPO's choice) its expected gradient is ``grad KL(pi_ref || pi)``, the *reverse* KL:
  biased for ``KL(pi || pi_ref)``. The log-ratio
  is clipped to ``[-20, 20]`` before ``exp`` so a token the reference finds impossible cannot
  overflow.

  Args / Returns: as :func:`kl_k1`.
  """
  log_r = jnp.clip(ref_log_probs - log_probs, -20.0, 20.0)
  return jnp.expm1(log_r) - log_r


# The estimators by name: a new one adds a `KLEstimator` value and an entry here.
KL_ESTIMATORS: Mapping[KLEstimator, Callable[[Array, Array], Array]] = types.MappingProxyType({
    KLEstimator.K1: kl_k1,
    KLEstimator.K2: kl_k2,
    KLEstimator.K3: kl_k3,
})


def kl_estimate(log_probs: Array, ref_log_probs: Array, estimator: KLEstimator | str) -> Array:
  """The per-token estimate ``estimator`` (`KL_ESTIMATORS`: ``k1``, ``k2`` or ``k3``), ``[...]``
  f32 in the inputs' shape.

  Raises:
    ValueError: for an unknown estimator name.
  """
  return KL_ESTIMATORS[KLEstimator(estimator)](log_probs, ref_log_probs)


class KLControllerState(NamedTuple):
  """State of a KL controller: the current coefficient ``beta`` (f32 scalar)."""

  kl_coef: Array


class KLController(NamedTuple):
  """An ``(init, update)`` pair.

  ``init() -> KLControllerState``;
  ``update(state, current_kl, num_steps) -> KLControllerState`` where ``current_kl`` is the
  measured mean per-sequence KL of the last batch (nats) and ``num_steps`` the number of
  samples (sequences) it came from.
  """

  init: Callable[[], KLControllerState]
  update: Callable[[KLControllerState, Array | float, Array | int], KLControllerState]


def fixed_kl_controller(kl_coef: float) -> KLController:
  """A constant coefficient ``beta = kl_coef``.

  Raises:
    ValueError: if ``kl_coef < 0``.
  """
  if kl_coef < 0:
    raise ValueError(f"kl_coef must be >= 0, got {kl_coef}.")

  def init():
    return KLControllerState(jnp.asarray(kl_coef, jnp.float32))

  def update(state, current_kl, num_steps):
    del current_kl, num_steps
    return state

  return KLController(init, update)


def adaptive_kl_controller(init_kl_coef: float, *, target: float, horizon: int) -> KLController:
  r"""Ziegler et al. 2019 (arXiv:1909.08593, eq. 2): a proportional controller on ``log beta``.

  ::

      e        = clip(KL_t / target - 1, -0.2, 0.2)
      beta_t+1 = beta_t * (1 + e * n / horizon)

  with ``n`` the samples seen since the last update. ``beta`` rises while the measured KL is
  above ``target`` and falls while it is below.

  Args:
    init_kl_coef: starting ``beta`` (>= 0).
    target: target KL in nats per sequence (> 0).
    horizon: samples over which the error is corrected (> 0); Ziegler et al. use 10,000.

  Raises:
    ValueError: naming the bad argument.
  """
  if init_kl_coef < 0:
    raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}.")
  if not target > 0:
    raise ValueError(f"target must be > 0, got {target}.")
  if not horizon > 0:
    raise ValueError(f"horizon must be > 0, got {horizon}.")

  def init():
    return KLControllerState(jnp.asarray(init_kl_coef, jnp.float32))

  def update(state, current_kl, num_steps):
    error = jnp.clip(jnp.asarray(current_kl, jnp.float32) / target - 1.0, -0.2, 0.2)
    mult = 1.0 + error * jnp.asarray(num_steps, jnp.float32) / horizon
    return KLControllerState(state.kl_coef * mult)

  return KLController(init, update)


class PIKLControllerState(NamedTuple):
  """State of :func:`pi_kl_controller`: the coefficient ``beta`` and the integral of the
  clipped log-errors (both f32 scalars)."""

  kl_coef: Array
  integral: Array


def pi_kl_controller(init_kl_coef: float, *, target: float, kp: float = 0.5, ki: float = 0.2,
                     max_error: float = 1.0,
                     integral_range: tuple[float, float] = (-0.5, 10.0)) -> KLController:
  r"""A proportional-integral (PI) controller on ``log beta`` that holds ``KL`` at ``target``.

  ::

      e_t      = clip(log(KL_t / target), -max_error, max_error)
      I_t      = clip(I_{t-1} + e_t, *integral_range)      (I_0 = 0)
      beta_t+1 = init_kl_coef * exp(kp * e_t + ki * I_t)

  The integral term drives the steady-state error to zero (a constant KL above the target keeps
  raising ``beta`` until the KL falls to it); the proportional term reacts at once to a jump, so
  the KL does not overshoot for the many steps a pure integral controller needs. Ziegler et
  al.'s rule (:func:`adaptive_kl_controller`) is a pure integral controller of gain
  ``n / horizon`` with its error clipped to +-0.2: at ``n / horizon = 0.05`` it changes
  ``beta`` by at most 1% a step, too slowly to hold a target over a few hundred steps. The
  penalty coefficient as a PI(D)-controlled Lagrange multiplier follows Stooke, Achiam &
  Abbeel 2020, "Responsive Safety in Reinforcement Learning by PID Lagrangian Methods",
  arXiv:2007.03964; it works on ``log beta`` and ``log KL`` here, so that the gains do not
  depend on the scale of either. The log-error is clipped to ``+-max_error`` so that one
  extreme batch (or ``KL <= 0``, read as the lower clip) cannot move ``beta`` by more than
  ``exp((kp + ki) * max_error)`` in a step. The integral is clamped (anti-windup): a run
  starts at the reference, with a KL far below any target, and an unclamped integral would
  pile up those first steps' errors and let the KL overshoot for as many steps as it takes to
  unwind them. The default range lets ``beta`` fall to ``exp(-0.1) = 0.90`` of its start by the
  integral (a KL below the target needs no correction: the target acts as a limit, as a
  constraint's multiplier does) and rise to ``exp(2) = 7.4`` times it.

  Args:
    init_kl_coef: starting ``beta`` (> 0: the controller works on its logarithm).
    target: target KL in nats per sequence (> 0).
    kp, ki: proportional and integral gains (>= 0, not both 0).
    max_error: clip of the log-error (> 0).
    integral_range: ``(low, high)`` clamp of the integral, ``low <= 0 <= high``.

  Raises:
    ValueError: naming the bad argument.
  """
  if not init_kl_coef > 0:
    raise ValueError(f"init_kl_coef must be > 0 for the PI controller (it scales log beta), "
                     f"got {init_kl_coef}.")
  if not target > 0:
    raise ValueError(f"target must be > 0, got {target}.")
  if not (kp >= 0 and ki >= 0 and kp + ki > 0):
    raise ValueError(f"kp and ki must be >= 0 and not both 0, got kp={kp}, ki={ki}.")
  if not max_error > 0:
    raise ValueError(f"max_error must be > 0, got {max_error}.")
  low, high = integral_range
  if not low <= 0 <= high:
    raise ValueError(f"integral_range must satisfy low <= 0 <= high, got {integral_range}.")

  def init():
    return PIKLControllerState(jnp.asarray(init_kl_coef, jnp.float32),
                               jnp.zeros((), jnp.float32))

  def update(state, current_kl, num_steps):
    del num_steps
    kl = jnp.asarray(current_kl, jnp.float32)
    log_error = jnp.log(jnp.maximum(kl, 1e-30) / target)
    error = jnp.clip(jnp.where(jnp.isnan(log_error), 0.0, log_error), -max_error, max_error)
    integral = jnp.clip(state.integral + error, low, high)
    kl_coef = init_kl_coef * jnp.exp(kp * error + ki * integral)
    return PIKLControllerState(kl_coef.astype(jnp.float32), integral)

  return KLController(init, update)


class KLControl(enum.Enum):
  """Which controller sets ``beta`` (`rljax.alignment.rlhf_config.RLHFConfig.kl_controller`)."""

  FIXED = "fixed"        # fixed_kl_controller
  ADAPTIVE = "adaptive"  # adaptive_kl_controller (Ziegler et al. 2019)
  PI = "pi"              # pi_kl_controller


# The controllers by name, each built from ``(kl_coef, target, horizon)``: a new one adds a
# `KLControl` value and an entry here.
KL_CONTROLLERS: Mapping[KLControl, Callable[[float, float, int], KLController]] = (
    types.MappingProxyType({
        KLControl.FIXED: lambda kl_coef, target, horizon: fixed_kl_controller(kl_coef),
        KLControl.ADAPTIVE: lambda kl_coef, target, horizon: adaptive_kl_controller(
            kl_coef, target=target, horizon=horizon),
        KLControl.PI: lambda kl_coef, target, horizon: pi_kl_controller(kl_coef, target=target),
    }))


def make_kl_controller(kind: KLControl | str, kl_coef: float, *, target: float,
                       horizon: int) -> KLController:
  """The controller ``kind`` (`KLControl` or its value; `KL_CONTROLLERS`) started at
  ``kl_coef``; ``target`` (nats per sequence) is used by ``adaptive`` and ``pi``, ``horizon``
  (samples) by ``adaptive``.

  Raises:
    ValueError: an unknown ``kind``, or the controller's own argument errors.
  """
  return KL_CONTROLLERS[KLControl(kind)](kl_coef, target, horizon)
