"""Running mean/variance normalisation as an ``(init, update)`` pair.

The state is a NamedTuple of arrays, so it jits, checkpoints and shards like params.
Batches are merged with Chan et al.'s parallel variance formula, which is exact for any
split of the data (Chan, Golub & LeVeque, 1979, "Updating formulae and a pairwise
algorithm for computing sample variances").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class RunningStats(NamedTuple):
  """Sufficient statistics of everything seen so far.

  Attributes:
    count: ``[]`` float32, number of samples merged.
    mean: ``[D]`` float32 running mean.
    m2: ``[D]`` float32 sum of squared deviations from the mean (``var * count``).
  """

  count: Array
  mean: Array
  m2: Array


def init(size: int, dtype=jnp.float32) -> RunningStats:
  """Empty statistics for ``[..., size]`` observations (normalises to identity)."""
  return RunningStats(
      count=jnp.zeros((), dtype), mean=jnp.zeros((size,), dtype), m2=jnp.zeros((size,), dtype)
  )


def update(stats: RunningStats, batch: Array, mask: Array | None = None) -> RunningStats:
  """Merges a batch ``[..., D]`` into the statistics.

  Args:
    stats: current statistics.
    batch: ``[..., D]`` float samples; all leading axes are sample axes.
    mask: optional ``[...]`` weights (1 = include, 0 = skip), same leading shape.

  Returns:
    The merged statistics.
  """
  x = batch.reshape((-1, stats.mean.shape[-1])).astype(stats.mean.dtype)
  w = (
      jnp.ones((x.shape[0],), x.dtype)
      if mask is None
      else mask.reshape((-1,)).astype(x.dtype)
  )
  n_b = jnp.sum(w)
  mean_b = jnp.sum(x * w[:, None], axis=0) / jnp.maximum(n_b, 1.0)
  m2_b = jnp.sum(w[:, None] * jnp.square(x - mean_b), axis=0)
  n = stats.count + n_b
  delta = mean_b - stats.mean
  safe_n = jnp.maximum(n, 1.0)
  mean = stats.mean + delta * n_b / safe_n
  m2 = stats.m2 + m2_b + jnp.square(delta) * stats.count * n_b / safe_n
  return RunningStats(count=n, mean=mean, m2=m2)


def std(stats: RunningStats, min_std: float = 1e-6, max_std: float = 1e6) -> Array:
  """Population standard deviation ``[D]``, clipped to ``[min_std, max_std]``; 1 when empty."""
  var = stats.m2 / jnp.maximum(stats.count, 1.0)
  s = jnp.clip(jnp.sqrt(var), min_std, max_std)
  return jnp.where(stats.count > 0, s, jnp.ones_like(s))


def normalize(stats: RunningStats, x: Array, clip: float | None = 5.0) -> Array:
  """``(x - mean) / std``, optionally clipped to ``[-clip, clip]``; ``x`` is ``[..., D]``."""
  y = (x - stats.mean) / std(stats)
  return y if clip is None else jnp.clip(y, -clip, clip)
