"""Flax NNX MLP actor-critic for continuous control, with a tanh-squashed Gaussian policy.

The policy outputs the mean and scale of a diagonal Gaussian over *pre-tanh* actions
``u``; the environment receives ``a = tanh(u)`` in ``[-1, 1]``. Log-probs are of ``u``
under the squashed distribution (Haarnoja et al., 2018, "Soft Actor-Critic", appendix
C, eq. 21): ``log pi(a) = log N(u; mu, sigma) - sum_i log(1 - tanh(u_i)^2)``. The
rollout stores ``u``, so the log-prob is computed exactly, with no ``atanh``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array


@jax.custom_jvp
def swish(x: Array) -> Array:
  """``x * sigmoid(x)`` (SiLU; Ramachandran et al. 2017), elementwise, any shape and float dtype.

  Equal to ``flax.nnx.swish``. Its derivative is written through the forward's own
  outputs, ``s + y * (1 - s)`` with ``s = sigmoid(x)`` and ``y = x * s``, so the
  backward pass reuses them instead of recomputing the sigmoid.
  """
  return x * jax.nn.sigmoid(x)


@swish.defjvp
def _swish_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  s = jax.nn.sigmoid(x)
  y = x * s
  return y, t * (s + y * (1 - s))


_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "swish": swish,
    "relu": nnx.relu,
    "tanh": jnp.tanh,
    "elu": nnx.elu,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActorCriticConfig:
  """Sizes of the actor-critic; saved with checkpoints so the network can be rebuilt.

  Attributes:
    observation_size: length ``D`` of the flat observation vector.
    action_size: length ``A`` of the action vector.
    policy_hidden: hidden layer widths of the policy MLP.
    value_hidden: hidden layer widths of the value MLP.
    activation: one of ``swish``, ``relu``, ``tanh``, ``elu``.
    min_std: floor added to the softplus scale of the policy.
    init_std: the policy's standard deviation (pre-tanh) where its scale output is 0,
      i.e. at initialisation when ``policy_init_scale`` is small. Brax's
      ``NormalTanhDistribution`` corresponds to ``softplus(0) + min_std``
      (``BRAX_INIT_STD``, 0.694).
    policy_init_scale: variance scale of the policy's output layer (LeCun-uniform
      times this). ``0.01`` starts every state at ``loc ~ 0`` and ``std ~ init_std``
      (Andrychowicz et al. 2021, "What matters in on-policy RL", sec. 3.2); Brax's
      networks use ``1.0``.
  """

  observation_size: int
  action_size: int
  policy_hidden: tuple[int, ...] = (32, 32, 32, 32)
  value_hidden: tuple[int, ...] = (256, 256, 256, 256, 256)
  activation: str = "swish"
  min_std: float = 1e-3
  init_std: float = 1.0
  policy_init_scale: float = 0.01

  def __post_init__(self):
    if self.observation_size < 1 or self.action_size < 1:
      raise ValueError(
          f"observation_size and action_size must be >= 1, got "
          f"{self.observation_size}, {self.action_size}."
      )
    if self.activation not in _ACTIVATIONS:
      raise ValueError(
          f"activation {self.activation!r} is not one of {sorted(_ACTIVATIONS)}."
      )
    object.__setattr__(self, "policy_hidden", tuple(int(h) for h in self.policy_hidden))
    object.__setattr__(self, "value_hidden", tuple(int(h) for h in self.value_hidden))
    if any(h < 1 for h in self.policy_hidden + self.value_hidden):
      raise ValueError(f"hidden sizes must be >= 1, got {self.policy_hidden}, {self.value_hidden}.")
    if not (self.min_std > 0 and self.init_std > self.min_std):
      raise ValueError(f"need 0 < min_std < init_std, got {self.min_std}, {self.init_std}.")
    if not self.policy_init_scale > 0:
      raise ValueError(f"policy_init_scale must be > 0, got {self.policy_init_scale}.")


class MLP(nnx.Module):
  """``[..., in] -> [..., out]``: hidden Linear+activation layers, then a linear output.

  Hidden layers use LeCun-uniform (variance scaling 1, fan-in) initialisation as
  Brax's networks do; the output layer is scaled by ``out_scale``.
  """

  def __init__(
      self,
      in_size: int,
      hidden: Sequence[int],
      out_size: int,
      *,
      activation: str,
      out_scale: float = 1.0,
      rngs: nnx.Rngs,
  ):
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "uniform")
    sizes = [in_size, *hidden]
    self.hidden = nnx.List(
        [nnx.Linear(a, b, kernel_init=init, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
    )
    out_init = nnx.initializers.variance_scaling(out_scale, "fan_in", "uniform")
    self.out = nnx.Linear(sizes[-1], out_size, kernel_init=out_init, rngs=rngs)
    self.activation = activation

  def __call__(self, x: Array) -> Array:
    # Run on a 2-D [N, in] view: with several leading axes the weight gradient contracts
    # over more than one axis, and XLA's CPU dot decomposer then copies a transposed
    # [in, N] cotangent per layer (a CartpoleBalance chunk at Brax's settings ran 22%
    # faster without them).
    lead = x.shape[:-1]
    x = x.reshape((-1, x.shape[-1]))
    act = _ACTIVATIONS[self.activation]
    for layer in self.hidden:
      x = act(layer(x))
    y = self.out(x)
    return y.reshape(lead + y.shape[-1:])


class ActorCritic(nnx.Module):
  """Separate policy and value MLPs over (already normalised) observations ``[..., D]``."""

  def __init__(self, config: ActorCriticConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.policy = MLP(
        config.observation_size,
        config.policy_hidden,
        2 * config.action_size,
        activation=config.activation,
        out_scale=config.policy_init_scale,
        rngs=rngs,
    )
    self.value = MLP(
        config.observation_size, config.value_hidden, 1, activation=config.activation, rngs=rngs
    )

  def policy_params(self, obs: Array) -> tuple[Array, Array]:
    """``obs [..., D] -> (loc [..., A], scale [..., A])`` of the pre-tanh Gaussian."""
    out = self.policy(obs)
    loc, raw_scale = jnp.split(out, 2, axis=-1)
    c = self.config
    # softplus(raw + bias) + min_std == init_std at raw == 0.
    bias = math.log(math.expm1(c.init_std - c.min_std))
    return loc, jax.nn.softplus(raw_scale + bias) + c.min_std

  def value_fn(self, obs: Array) -> Array:
    """``obs [..., D] -> values [...]`` (float32)."""
    return self.value(obs)[..., 0]


# Brax's NormalTanhDistribution: std = softplus(raw) + 0.001, so raw = 0 gives this.
BRAX_INIT_STD = math.log(2.0) + 1e-3

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def gaussian_log_prob(u: Array, loc: Array, scale: Array) -> Array:
  """Diagonal Gaussian ``log N(u; loc, scale)`` summed over the last axis ``[..., A] -> [...]``."""
  z = (u - loc) / scale
  return jnp.sum(-0.5 * jnp.square(z) - jnp.log(scale) - _LOG_SQRT_2PI, axis=-1)


def tanh_log_det_jacobian(u: Array) -> Array:
  """``sum_i log(1 - tanh(u_i)^2)``, computed stably as ``2 (log 2 - u - softplus(-2u))``."""
  return jnp.sum(2.0 * (math.log(2.0) - u - jax.nn.softplus(-2.0 * u)), axis=-1)


def squashed_log_prob(u: Array, loc: Array, scale: Array) -> Array:
  """Log-density of ``a = tanh(u)`` for pre-tanh ``u [..., A]``; returns ``[...]``."""
  return gaussian_log_prob(u, loc, scale) - tanh_log_det_jacobian(u)


def gaussian_entropy(scale: Array) -> Array:
  """Entropy (nats) of the pre-tanh Gaussian, ``[..., A] -> [...]``.

  The entropy of the squashed distribution has no closed form; like most PPO
  implementations we regularise the Gaussian's entropy.
  """
  return jnp.sum(0.5 + _LOG_SQRT_2PI + jnp.log(scale), axis=-1)


def sample_pre_tanh(key: Array, loc: Array, scale: Array, *, num_rows: int | None = None,
                    first_row: Array | int = 0) -> Array:
  """Draws pre-tanh actions ``u ~ N(loc, scale)``, ``[..., A]``.

  With ``num_rows`` (``loc`` is ``[B, A]``, ``B <= num_rows``) the standard-normal draw is that
  of a ``[num_rows, A]`` batch, of which rows ``[first_row, first_row + B)`` (``first_row`` a
  Python or ``[]`` int32) are used: a group of a larger batch gets the noise the whole batch's
  draw gives its rows, bit for bit.
  """
  if num_rows is None:
    noise = jax.random.normal(key, loc.shape, loc.dtype)
  else:
    noise = jax.lax.dynamic_slice_in_dim(
        jax.random.normal(key, (num_rows,) + loc.shape[1:], loc.dtype), first_row, loc.shape[0])
  return loc + scale * noise
