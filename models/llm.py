"""Decoder-only language models in Flax NNX: the Llama 2/3 and Qwen2 families.

One implementation covers both families (Touvron et al. 2023, "Llama 2", arXiv:2307.09288;
Llama 3 herd, arXiv:2407.21783; Qwen2 technical report, arXiv:2407.10671):

* pre-norm blocks with RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467);
* rotary position embeddings (Su et al. 2021, arXiv:2104.09864) with ``rope_theta`` and the
  ``linear`` and Llama-3 ``rope_scaling`` variants;
* grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245), optional q/k/v (Qwen2) and
  output biases;
* SwiGLU feed-forward (Shazeer 2020, arXiv:2002.05202).

Three heads read the final hidden states ``h [B, T, E]``:

* the language-model head, ``logits = h @ W_vocab`` (tied to the embedding as an option), f32;
* a value head (critic), one f32 scalar per token, ``values [B, T]``;
* a reward head, one f32 scalar per sequence read at the last non-padding token, ``rewards [B]``.

Every parameter carries logical axis names (:mod:`rljax.models.axes`) in its ``out_sharding``
metadata, and activations are annotated with :func:`rljax.models.axes.constrain`. With
``dtype='bfloat16'`` parameters and activations are bf16 while logits, attention softmax, norms'
statistics and the scalar heads stay f32.

Layout conventions (shape letters): ``B`` batch, ``T`` query positions, ``S`` key positions or
KV-cache slots, ``E`` hidden size, ``H`` query heads, ``K`` KV heads, ``G = H / K`` queries per KV
head, ``D`` head dim, ``M`` MLP hidden size, ``V`` vocabulary. Kernels are ``[in, out]``; keys and
values share one kernel ``[E, 2, K, D]`` and gate and up one ``[E, 2, M]`` (fewer, larger matmuls;
the fused axis of size 2 is never sharded). :mod:`rljax.models.hf_io` maps them to and from the
Hugging Face tensors.

The pieces the modules are built from live in their own modules, and every public name among them
is importable from here too (``rljax.models.llm.LMConfig`` etc.):

* :mod:`rljax.models.lm_config`: :class:`LMConfig`, :class:`RopeScaling`,
  ``SUPPORTED_MODEL_TYPES``, ``SUPPORTED_ROPE_TYPES``;
* :mod:`rljax.models.kv_cache`: :class:`LayerCache`, :data:`KVCache`, :func:`init_cache`,
  ``K_CACHE_AXES``, ``V_CACHE_AXES``;
* :mod:`rljax.models.rope`: :func:`rope_tables`, :func:`apply_rope`;
* :mod:`rljax.models.positions`: :func:`positions_from_mask`, :func:`segment_positions`,
  :func:`last_token_index`, :func:`attention_mask_for`;
* :mod:`rljax.models.dots`: :func:`rljax.models.dots.dot`, the f32-accumulated ``einsum`` with a
  bf16 backward pass for bf16 operands, that every matmul here uses;
* :mod:`rljax.models.log_probs`: :func:`token_log_probs`, :func:`sequence_log_probs`.

This module holds the Flax NNX modules: :class:`RMSNorm`, :class:`Attention`, :class:`MLP`,
:class:`DecoderLayer`, :class:`ScalarHead` and :class:`DecoderLM`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.models import axes
from rljax.models.dots import dot
from rljax.models.kv_cache import K_CACHE_AXES, V_CACHE_AXES, KVCache, LayerCache, init_cache
from rljax.models.lm_config import (
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    LMConfig,
    RopeScaling,
)
from rljax.models.log_probs import sequence_log_probs, token_log_probs
from rljax.models.positions import (
    attention_mask_for,
    last_token_index,
    positions_from_mask,
    segment_positions,
)
from rljax.models.rope import apply_rope, rope_tables

__all__ = [
    "SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES", "LMConfig", "RopeScaling",
    "K_CACHE_AXES", "V_CACHE_AXES", "KVCache", "LayerCache", "init_cache",
    "rope_tables", "apply_rope",
    "positions_from_mask", "segment_positions", "last_token_index", "attention_mask_for",
    "token_log_probs", "sequence_log_probs",
    "RMSNorm", "Attention", "MLP", "DecoderLayer", "ScalarHead", "DecoderLM",
]

# Finite stand-in for -inf in attention scores: a fully masked row (a padding query) then gives
# a uniform distribution instead of NaN. Same choice as maxtext's DEFAULT_MASK_VALUE.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _param(rngs: nnx.Rngs, shape, dtype, names: axes.LogicalAxes, *, init: str = "normal",
           stddev: float = 0.02) -> nnx.Param:
  if init == "zeros":
    value = jnp.zeros(shape, dtype)
  elif init == "ones":
    value = jnp.ones(shape, dtype)
  else:
    value = (stddev * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  # eager_sharding=False: keep the names as metadata only; the sharding layer places the arrays.
  return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class RMSNorm(nnx.Module):
  """``y = scale * x / sqrt(mean(x^2) + eps)``, statistics in f32 (Zhang & Sennrich 2019)."""

  def __init__(self, dim: int, *, eps: float, dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = _param(rngs, (dim,), dtype, (axes.EMBED,), init="ones")

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [..., E]`` -> the same shape and dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    # Scaled in f32 and rounded once: for bf16 the scale's gradient is then an f32 reduction
    # (XLA CPU turns a bf16 one into a slow precision-preserving reduce-window).
    return (self.scale[...].astype(jnp.float32) * y).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE and an optional KV cache (`LayerCache`).

  Parameters: ``q_kernel [E, H, D]``, ``kv_kernel [E, 2, K, D]`` (keys and values in one matmul:
  fewer, larger dots are faster on CPU), ``o_kernel [H, D, E]``, optional ``q_bias [H, D]``,
  ``kv_bias [2, K, D]``, ``o_bias [E]``. Query head ``h`` reads KV head ``h // G``.
  """

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
    c = config
    e, h, k, d, dt = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.jnp_dtype
    self.num_kv_heads, self.num_groups, self.head_dim = k, c.num_groups, d
    self.q_kernel = _param(rngs, (e, h, d), dt, (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
    self.kv_kernel = _param(rngs, (e, 2, k, d), dt,
                            (axes.EMBED, None, axes.KV_HEADS, axes.HEAD_DIM))
    self.o_kernel = _param(rngs, (h, d, e), dt, (axes.HEADS, axes.HEAD_DIM, axes.EMBED))
    if c.qkv_bias:
      self.q_bias = _param(rngs, (h, d), dt, (axes.HEADS, axes.HEAD_DIM), init="zeros")
      self.kv_bias = _param(rngs, (2, k, d), dt, (None, axes.KV_HEADS, axes.HEAD_DIM), init="zeros")
    else:
      self.q_bias = self.kv_bias = None
    self.o_bias = _param(rngs, (e,), dt, (axes.EMBED,), init="zeros") if c.o_bias else None

  def __call__(
      self,
      x: jax.Array,
      cos: jax.Array,
      sin: jax.Array,
      mask: jax.Array,
      cache: LayerCache | None = None,
      cache_index: jax.Array | int = 0,
      kv_limit: int | None = None,
  ) -> tuple[jax.Array, LayerCache | None]:
    """``x [B, T, E]`` -> ``([B, T, E], cache)``.

    ``mask [B, T, S]`` is boolean visibility (see :func:`attention_mask_for`). With a cache the
    new keys/values are written at slots ``cache_index .. cache_index + T - 1`` (the same for every
    row: prompts are left-padded) and attention runs over all ``S`` cache slots, or over the
    first ``kv_limit`` slots when that static bound is given (prefill: later slots are empty).
    """
    b, t, _ = x.shape
    q = dot("BTE,EHD->BTHD", x, self.q_kernel[...])
    kv = dot("BTE,ECKD->BTCKD", x, self.kv_kernel[...])
    if self.q_bias is not None:
      q = q + self.q_bias[...]
      kv = kv + self.kv_bias[...]
    q = axes.constrain(apply_rope(q, cos, sin),
                       (axes.BATCH, axes.LENGTH, axes.HEADS, axes.HEAD_DIM))
    k = jnp.transpose(apply_rope(kv[:, :, 0], cos, sin), (0, 2, 3, 1))  # [B, K, D, T]
    v = jnp.swapaxes(kv[:, :, 1], 1, 2)                                   # [B, K, T, D]
    q = q * jnp.asarray(self.head_dim ** -0.5, q.dtype)
    qg = q.reshape(b, t, self.num_kv_heads, self.num_groups, self.head_dim)
    qg = jnp.swapaxes(qg, 1, 2)                                      # [B, K, T, G, D]
    if cache is not None:
      k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
    if cache is not None and b * t == 1 and kv_limit is None and jax.default_backend() == "cpu":
      # One sequence, one step: attend over the cache before this step's write plus the new
      # key, then write (see `_one_step_attention`).
      out = _one_step_attention(qg, cache, k, v, mask, cache_index)
      cache = LayerCache(jax.lax.dynamic_update_slice(cache.k, k, (0, 0, 0, cache_index)),
                         jax.lax.dynamic_update_slice(cache.v, v, (0, 0, cache_index, 0)))
    else:
      if cache is not None:
        k = jax.lax.dynamic_update_slice(cache.k, k, (0, 0, 0, cache_index))
        v = jax.lax.dynamic_update_slice(cache.v, v, (0, 0, cache_index, 0))
        cache = LayerCache(k, v)
        if kv_limit is not None and kv_limit < v.shape[2]:
          k, v = k[..., :kv_limit], v[:, :, :kv_limit]
      k = axes.constrain(k, K_CACHE_AXES)
      v = axes.constrain(v, V_CACHE_AXES)
      # Dot operands and results are kept in the order XLA's batched matmul produces
      # ([batch dims, lhs free, rhs free]), with the slot axis S minor, so no large transposes
      # are inserted on CPU (with T = 1 the two swaps below are free reshapes).
      scores = dot("BKTGD,BKDS->BKTGS", qg, k, out_dtype=jnp.float32)
      scores = jnp.where(mask[:, None, :, None, :], scores, _MASK_VALUE)
      probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
      out = dot("BKTGS,BKSD->BKTGD", probs, v)
    out = out.astype(x.dtype)
    out = jnp.swapaxes(out, 1, 2).reshape(b, t, -1)                 # [B, T, H*D]
    o_kernel = self.o_kernel[...]
    y = dot("BTF,FE->BTE", out, o_kernel.reshape(-1, o_kernel.shape[-1]))
    if self.o_bias is not None:
      y = y + self.o_bias[...]
    return y, cache


def _one_step_attention(qg: jax.Array, old: LayerCache, k_new: jax.Array, v_new: jax.Array,
                        mask: jax.Array, cache_index: jax.Array | int) -> jax.Array:
  """One decoding step's attention over the cache *before* this step's write, plus the new key.

  Args:
    qg: ``[B, K, 1, G, D]`` scaled queries (``G`` query heads per KV head).
    old: the layer's cache ``k [B, K, D, S]``, ``v [B, K, S, D]`` without this step's entry.
    k_new, v_new: this step's key ``[B, K, D, 1]`` and value ``[B, K, 1, D]``, cache dtype.
    mask: ``[B, 1, S]`` bool visibility of the slots; slot ``cache_index`` is the new one.
    cache_index: the slot written, clamped to ``[0, S - 1]`` as ``dynamic_update_slice`` does.

  Returns:
    ``[B, K, 1, G, D]`` f32: the attention over the cache with this step written (one softmax
    over the same scores, summed in another order), including a row that sees no slot (the
    uniform mean of the ``S`` updated values). Computed this way the updated cache feeds only the
    decode loop's output, so that XLA:CPU (batch 1) copies each layer's keys and values fewer
    times a step than when the attention reads the updated cache too. With several rows the
    plain path has no such copies and this one would add them, so `Attention` takes it for one
    row on CPU only.
  """
  s = old.v.shape[2]
  is_new = jnp.arange(s, dtype=jnp.int32) == jnp.clip(cache_index, 0, s - 1)  # [S]
  scores_old = dot("BKTGD,BKDS->BKTGS", qg, old.k, out_dtype=jnp.float32)
  scores_old = jnp.where(mask[:, None, :, None, :], scores_old, _MASK_VALUE)
  # The slot being overwritten holds a stale entry: no weight at all, even in a row that sees
  # nothing (where the masked scores tie and the plain path averages the S updated slots).
  scores_old = jnp.where(is_new, -jnp.inf, scores_old)
  scores_new = dot("BKTGD,BKDN->BKTGN", qg, k_new, out_dtype=jnp.float32)  # [B, K, 1, G, 1]
  new_visible = jnp.any(mask & is_new, axis=-1)                               # [B, 1]
  scores_new = jnp.where(new_visible[:, None, :, None, None], scores_new, _MASK_VALUE)
  probs = jax.nn.softmax(jnp.concatenate([scores_old, scores_new], axis=-1), axis=-1)
  probs = probs.astype(old.v.dtype)
  return (dot("BKTGS,BKSD->BKTGD", probs[..., :s], old.v, out_dtype=jnp.float32)
          + dot("BKTGN,BKND->BKTGD", probs[..., s:], v_new, out_dtype=jnp.float32))


class MLP(nnx.Module):
  """SwiGLU: ``down(silu(x @ gate) * (x @ up))`` (Shazeer 2020).

  Parameters: ``gate_up_kernel [E, 2, M]`` (gate and up in one matmul), ``down_kernel [M, E]``,
  optional ``gate_up_bias [2, M]`` and ``down_bias [E]``.
  """

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
    e, m, dt = config.hidden_size, config.intermediate_size, config.jnp_dtype
    self.gate_up_kernel = _param(rngs, (e, 2, m), dt, (axes.EMBED, None, axes.MLP))
    self.down_kernel = _param(rngs, (m, e), dt, (axes.MLP, axes.EMBED))
    if config.mlp_bias:
      self.gate_up_bias = _param(rngs, (2, m), dt, (None, axes.MLP), init="zeros")
      self.down_bias = _param(rngs, (e,), dt, (axes.EMBED,), init="zeros")
    else:
      self.gate_up_bias = self.down_bias = None

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [B, T, E]`` -> ``[B, T, E]`` in the compute dtype."""
    gate_up = dot("BTE,ECM->BTCM", x, self.gate_up_kernel[...])
    if self.gate_up_bias is not None:
      gate_up = gate_up + self.gate_up_bias[...]
    h = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
    h = axes.constrain(h, (axes.BATCH, axes.LENGTH, axes.MLP))
    y = dot("BTM,ME->BTE", h, self.down_kernel[...])
    if self.down_bias is not None:
      y = y + self.down_bias[...]
    return y


class DecoderLayer(nnx.Module):
  """Pre-norm block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
    dt = config.jnp_dtype
    self.input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dt, rngs=rngs)
    self.attn = Attention(config, rngs=rngs)
    self.post_attn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dt, rngs=rngs)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, cos, sin, mask, cache=None, cache_index=0, kv_limit=None):
    """``x [B, T, E]`` -> ``(x [B, T, E], cache)``; ``cos, sin [B, T, D/2]`` (`rope_tables`),
    ``mask``, ``cache``, ``cache_index`` and ``kv_limit`` as for :class:`Attention`."""
    y, cache = self.attn(self.input_norm(x), cos, sin, mask, cache, cache_index, kv_limit)
    x = x + y
    x = x + self.mlp(self.post_attn_norm(x))
    return axes.constrain(x, (axes.BATCH, axes.LENGTH, axes.EMBED)), cache


class ScalarHead(nnx.Module):
  """``h [..., E] -> [...]`` f32: ``h @ w + b``. Used for the value and the reward heads.

  Initialised as in Ziegler et al. 2019 (arXiv:1909.08593): ``w ~ N(0, 1 / (E + 1))``, ``b = 0``.
  """

  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.kernel = _param(rngs, (dim,), jnp.float32, (axes.EMBED,), stddev=1.0 / math.sqrt(dim + 1))
    self.bias = _param(rngs, (), jnp.float32, (), init="zeros")

  def __call__(self, h: jax.Array) -> jax.Array:
    """``h [..., E]`` (any float dtype) -> ``[...]`` f32."""
    return jnp.einsum("...E,E->...", h.astype(jnp.float32), self.kernel[...]) + self.bias[...]


class DecoderLM(nnx.Module):
  """Llama/Qwen2 decoder with an LM head, a per-token value head and a per-sequence reward head.

  Example::

    model = DecoderLM(LMConfig(vocab_size=..., ...), rngs=nnx.Rngs(0))
    logits = model(tokens, attention_mask=mask)              # [B, T, V] f32
    hidden, _ = model.hidden_states(tokens, attention_mask=mask)
    values = model.values(hidden)                            # [B, T] f32
    scores = model.rewards(hidden, mask)                     # [B] f32

  In hot paths split it (``graphdef, state = nnx.split(model)``) and call ``nnx.merge`` inside a
  plain ``jax.jit`` (see :mod:`rljax.sampling`).
  """

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
    self.config = config
    c = config
    self.embed = _param(rngs, (c.vocab_size, c.hidden_size), c.jnp_dtype, (axes.VOCAB, axes.EMBED))
    self.layers = nnx.List([DecoderLayer(c, rngs=rngs) for _ in range(c.num_layers)])
    self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.jnp_dtype, rngs=rngs)
    if c.tie_word_embeddings:
      self.lm_head = None
    else:
      self.lm_head = _param(rngs, (c.hidden_size, c.vocab_size), c.jnp_dtype,
                            (axes.EMBED, axes.VOCAB))
    self.value_head = ScalarHead(c.hidden_size, rngs=rngs)
    self.reward_head = ScalarHead(c.hidden_size, rngs=rngs)

  def hidden_states(
      self,
      tokens: jax.Array,
      *,
      attention_mask: jax.Array | None = None,
      positions: jax.Array | None = None,
      cache: KVCache | None = None,
      cache_index: jax.Array | int = 0,
      segment_ids: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """Final-normalised hidden states ``[B, T, E]`` (compute dtype) and the updated cache.

    Args:
      tokens: ``[B, T]`` int token ids.
      attention_mask: key validity. Without a cache ``[B, T]`` (1 = real token, 0 = padding;
        default all ones). With a cache ``[B, S]`` over the cache slots (default all ones).
      positions: ``[B, T]`` RoPE positions; default ``cumsum(mask) - 1`` without a cache. With a
        cache they must be given.
      cache: a :data:`KVCache` from :func:`init_cache`; keys/values of ``tokens`` are written at
        slots ``cache_index ..`` and queries attend causally over all slots.
      cache_index: scalar slot of ``tokens[:, 0]`` in the cache.
      segment_ids: ``[B, T]`` int, packed rows (no cache only): a query sees only keys of its own
        segment, so the mask is block-diagonal causal; default positions restart at 0 at each
        segment start (a change of id). Padding keeps ``attention_mask = 0``.

    Raises:
      ValueError: if ``positions`` is missing in cache mode, the cache has the wrong depth, or
        ``segment_ids`` is given with a cache.
    """
    b, t = tokens.shape
    kv_limit = None
    if cache is None:
      key_mask = jnp.ones((b, t), bool) if attention_mask is None else attention_mask
      if positions is None:
        positions = (positions_from_mask(key_mask) if segment_ids is None
                     else segment_positions(segment_ids))
      mask = attention_mask_for(key_mask, t)
      if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    elif segment_ids is not None:
      raise ValueError("hidden_states: segment_ids are not supported with a cache")
    else:
      if positions is None:
        raise ValueError("hidden_states: positions are required when decoding with a cache")
      if len(cache) != len(self.layers):
        raise ValueError(f"cache has {len(cache)} layers, model has {len(self.layers)}")
      s = cache[0].v.shape[2]
      key_mask = jnp.ones((b, s), bool) if attention_mask is None else attention_mask
      if isinstance(cache_index, int):
        # Static offset (prefill): slots after the last query are invisible, skip them.
        kv_limit = min(s, cache_index + t)
        key_mask = key_mask[:, :kv_limit]
      mask = attention_mask_for(key_mask, t, cache_index)
    cos, sin = rope_tables(positions, self.config.inv_freq())
    x = jnp.take(self.embed[...], tokens, axis=0)
    x = axes.constrain(x, (axes.BATCH, axes.LENGTH, axes.EMBED))
    new_cache = []
    for i, layer in enumerate(self.layers):
      x, layer_cache = layer(x, cos, sin, mask, None if cache is None else cache[i], cache_index,
                             kv_limit)
      new_cache.append(layer_cache)
    x = self.final_norm(x)
    return x, (None if cache is None else tuple(new_cache))

  def logits(self, hidden: jax.Array) -> jax.Array:
    """LM head: ``[..., E] -> [..., V]`` f32 (f32 accumulation also for bf16 weights)."""
    if self.lm_head is None:
      return dot("...E,VE->...V", hidden, self.embed[...], out_dtype=jnp.float32)
    return dot("...E,EV->...V", hidden, self.lm_head[...], out_dtype=jnp.float32)

  def values(self, hidden: jax.Array) -> jax.Array:
    """Value (critic) head: one f32 scalar per token, ``[B, T, E] -> [B, T]``."""
    return self.value_head(hidden)

  def rewards(self, hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Reward head: ``[B]`` f32 scores read at :func:`last_token_index` of ``attention_mask``."""
    idx = last_token_index(attention_mask)
    last = jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]
    return self.reward_head(last)

  def __call__(self, tokens: jax.Array, attention_mask: jax.Array | None = None,
               positions: jax.Array | None = None, segment_ids: jax.Array | None = None
               ) -> jax.Array:
    """Full forward without a cache: logits ``[B, T, V]`` f32 (``segment_ids``: packed rows)."""
    hidden, _ = self.hidden_states(tokens, attention_mask=attention_mask, positions=positions,
                                   segment_ids=segment_ids)
    return self.logits(hidden)

