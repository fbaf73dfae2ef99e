"""Rotary position embeddings (Su et al. 2021, RoFormer, arXiv:2104.09864).

:func:`rope_tables` gives the ``cos``/``sin`` tables of the angles ``positions * inv_freq``
(inverse frequencies from :meth:`rljax.models.lm_config.LMConfig.inv_freq`), and
:func:`apply_rope` rotates queries or keys by them in Hugging Face's half-split convention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """``cos, sin [B, T, D/2]`` (f32) of angles ``positions * inv_freq``.

  ``positions [B, T]`` (int; left-padded rows use ``cumsum(mask) - 1``), ``inv_freq [D/2]``
  from :meth:`rljax.models.lm_config.LMConfig.inv_freq` (Su et al. 2021, RoFormer).
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates ``x [B, T, N, D]`` in the half-split convention of Hugging Face's ``rotate_half``.

  ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]`` with ``x1, x2`` the two halves of ``D``.
  Computed in f32, returned in ``x.dtype``.
  """
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
