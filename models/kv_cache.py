"""KV cache of the decoder LMs (:mod:`rljax.models.llm`): one :class:`LayerCache` per layer.

:data:`KVCache` is a tuple of :class:`LayerCache` (keys ``[B, K, D, S]``, values ``[B, K, S, D]``),
:func:`init_cache` makes a zero one, and ``K_CACHE_AXES``/``V_CACHE_AXES`` are the logical axis
names (:mod:`rljax.models.axes`) of its keys and values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rljax.models import axes
from rljax.models.lm_config import LMConfig


class LayerCache(NamedTuple):
  """One layer's keys ``k [B, K, D, S]`` and values ``v [B, K, S, D]``, in the compute dtype.

  Keys are stored slot-minor so that both attention products are plain ``[., D] x [D, S]`` and
  ``[., S] x [S, D]`` matmuls per (batch, KV head), which XLA:CPU runs faster than the
  transposed-operand form of the score product.
  """

  k: jax.Array
  v: jax.Array


KVCache = tuple[LayerCache, ...]
K_CACHE_AXES: axes.LogicalAxes = (axes.BATCH, axes.KV_HEADS, axes.HEAD_DIM, axes.LENGTH)
V_CACHE_AXES: axes.LogicalAxes = (axes.BATCH, axes.KV_HEADS, axes.LENGTH, axes.HEAD_DIM)


def init_cache(config: LMConfig, batch_size: int, num_slots: int, dtype=None) -> KVCache:
  """Zero KV cache with ``num_slots`` positions per sequence, one :class:`LayerCache` per layer.

  ``dtype`` defaults to the model's compute dtype. An f32 cache for a bf16 model makes the
  attention products f32 (faster than bf16 batched matmuls on CPU, twice the cache memory).
  """
  b, k, d = batch_size, config.num_kv_heads, config.head_dim
  dt = config.jnp_dtype if dtype is None else jnp.dtype(dtype)
  return tuple(
      LayerCache(jnp.zeros((b, k, d, num_slots), dt), jnp.zeros((b, k, num_slots, d), dt))
      for _ in range(config.num_layers))
