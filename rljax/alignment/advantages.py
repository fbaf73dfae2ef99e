"""The RLHF trainer's advantage estimators, chosen by name from one table.

Every estimator maps the update's per-token rewards to ``(advantages, returns)`` in the same
layout, ``[B, R]`` f32 with 0 on padding::

    fn(token_rewards [B, R], values [B, R], mask [B, R], config) -> (advantages, returns)

``token_rewards`` hold the sequence score at each response's last token minus the per-token
KL penalty (`rljax.alignment.losses.token_level_rewards`); ``values`` are the critic's (zeros
without one); ``config`` is the run's `rljax.alignment.rlhf_config.RLHFConfig`. `ESTIMATORS`
maps each `rljax.alignment.rlhf_config.Algorithm` value to its estimator; a new algorithm adds
an enum value and an entry here. The critic-free ones return zero returns (no value loss).

References: Schulman et al. 2016 GAE (arXiv:1506.02438); Shao et al. 2024 GRPO
(arXiv:2402.03300); Ahmadian et al. 2024 RLOO (arXiv:2402.14740); Hu 2025 REINFORCE++
(arXiv:2501.03262).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from rljax import ppo

Array = jax.Array
Estimator = Callable[[Array, Array, Array, Any], tuple[Array, Array]]


def gae(token_rewards: Array, values: Array, mask: Array, config) -> tuple[Array, Array]:
  """PPO's GAE over response tokens (`rljax.ppo.compute_gae`, ``config.gamma`` and
  ``config.gae_lambda``), bootstrapping each token from the next one's value and the last
  real token from 0."""
  bootstrap = jnp.pad(values[:, 1:], ((0, 0), (0, 1)))
  return ppo.compute_gae(token_rewards, values, bootstrap, jnp.ones_like(mask), mask,
                         gamma=config.gamma, gae_lambda=config.gae_lambda)


def grpo(token_rewards: Array, values: Array, mask: Array, config) -> tuple[Array, Array]:
  """GRPO: each response's summed reward standardised within its group of
  ``config.group_size`` (`rljax.ppo.group_relative_advantages`; Dr. GRPO without
  ``config.grpo_normalize_std``), broadcast to its tokens."""
  del values
  seq_reward = jnp.sum(token_rewards, axis=-1)  # score - beta * sum_t k_t
  seq_adv = ppo.group_relative_advantages(seq_reward, group_size=config.group_size,
                                          normalize_std=config.grpo_normalize_std)
  adv = ppo.sequence_to_token_advantages(seq_adv, mask)
  return adv, jnp.zeros_like(adv)


def rloo(token_rewards: Array, values: Array, mask: Array, config) -> tuple[Array, Array]:
  """RLOO: each response's summed reward less the mean of the rest of its group
  (`rljax.ppo.rloo_advantages`), broadcast to its tokens."""
  del values
  seq_reward = jnp.sum(token_rewards, axis=-1)
  adv = ppo.sequence_to_token_advantages(
      ppo.rloo_advantages(seq_reward, group_size=config.group_size), mask)
  return adv, jnp.zeros_like(adv)


def reinforce_pp(token_rewards: Array, values: Array, mask: Array, config
                 ) -> tuple[Array, Array]:
  """REINFORCE++: token reward-to-go whitened over the whole batch
  (`rljax.ppo.reinforce_pp_advantages`, ``config.gamma``)."""
  del values
  adv = ppo.reinforce_pp_advantages(token_rewards, mask, gamma=config.gamma)
  return adv, jnp.zeros_like(adv)


ESTIMATORS: Mapping[str, Estimator] = types.MappingProxyType({
    "ppo": gae,
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
})


def get(name: str) -> Estimator:
  """The estimator registered as ``name`` in `ESTIMATORS`.

  Raises:
    ValueError: an unknown name, listing the registered ones.
  """
  try:
    return ESTIMATORS[name]
  except KeyError:
    raise ValueError(f"no advantage estimator {name!r}; registered: "
                     f"{', '.join(ESTIMATORS)}") from None
