"""Position ids, the last-token index and the causal attention mask of the decoder LMs.

Pure functions of a padding mask or of packed rows' segment ids (:mod:`rljax.models.llm`):
:func:`positions_from_mask` (left padding), :func:`segment_positions` (packed rows),
:func:`last_token_index` (where the reward head reads) and :func:`attention_mask_for` (the
boolean ``[B, T, S]`` visibility of keys, with or without a KV cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def positions_from_mask(mask: jax.Array) -> jax.Array:
  """Position ids ``cumsum(mask) - 1`` (clipped at 0 on leading padding), ``[B, T]`` int32.

  With left padding ``[0, 0, 1, 1, 1]`` this is ``[0, 0, 0, 1, 2]``: the first real token is at
  position 0, whatever the amount of padding.
  """
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """Positions that restart at 0 where ``segment_ids [B, T]`` changes, ``[B, T]`` int32.

  ``[1, 1, 1, 2, 2, 0] -> [0, 1, 2, 0, 1, 0]`` (a packed row: two segments, then padding).
  """
  t = segment_ids.shape[-1]
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
  change = jnp.concatenate([jnp.ones_like(segment_ids[..., :1], bool),
                            segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
  start = jax.lax.cummax(jnp.where(change, idx, 0), axis=segment_ids.ndim - 1)
  return idx - start


def last_token_index(mask: jax.Array) -> jax.Array:
  """Index of the last non-padding token in each row of ``mask [B, T]``, ``[B]`` int32.

  Works for left and right padding: ``[1, 1, 1, 0, 0] -> 2``, ``[0, 1, 1, 1, 0] -> 3``.
  A row without any real token gives ``T - 1``.
  """
  t = mask.shape[-1]
  return (t - 1 - jnp.argmax(mask[..., ::-1].astype(jnp.int32), axis=-1)).astype(jnp.int32)



def attention_mask_for(
    key_mask: jax.Array, num_queries: int, query_offset: jax.Array | int = 0) -> jax.Array:
  """Boolean ``[B, T, S]`` mask: key ``s`` is visible to query ``t`` iff it is valid and causal.

  Query ``t`` sits at slot ``query_offset + t``; keys at slots ``s <= query_offset + t`` with
  ``key_mask[b, s]`` set are visible. Without a cache, ``query_offset = 0`` and ``S = T``.
  """
  s = key_mask.shape[-1]
  q_slot = query_offset + jnp.arange(num_queries, dtype=jnp.int32)[:, None]
  causal = jnp.arange(s, dtype=jnp.int32)[None, :] <= q_slot
  return causal[None] & key_mask.astype(bool)[:, None, :]
