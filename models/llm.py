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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.models import axes

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")

# Finite stand-in for -inf in attention scores: a fully masked row (a padding query) then gives
# a uniform distribution instead of NaN. Same choice as maxtext's DEFAULT_MASK_VALUE.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """RoPE frequency scaling, as in Hugging Face's ``rope_scaling``/``rope_parameters``.

  Attributes:
    rope_type: ``'linear'`` (every inverse frequency divided by ``factor``) or ``'llama3'``
      (Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between).
    factor: the context extension factor, > 0.
    low_freq_factor: Llama 3 only: wavelengths above ``original_max / low_freq_factor`` are scaled.
    high_freq_factor: Llama 3 only: wavelengths below ``original_max / high_freq_factor`` are kept.
    original_max_position_embeddings: Llama 3 only: the pre-training context length.
  """

  rope_type: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in ("linear", "llama3"):
      raise ValueError(f"rope_type must be 'linear' or 'llama3', got {self.rope_type!r}")
    if self.factor <= 0:
      raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
    if self.rope_type == "llama3":
      if not 0 < self.low_freq_factor < self.high_freq_factor:
        raise ValueError(
            "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
            f"{self.low_freq_factor}, {self.high_freq_factor}")
      if self.original_max_position_embeddings <= 0:
        raise ValueError("original_max_position_embeddings must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig:
  """Architecture of a Llama/Qwen2 decoder LM. Frozen and hashable (usable as a static jit arg).

  Attributes:
    model_type: ``'llama'`` or ``'qwen2'``; only used to name the family when saving.
    vocab_size: ``V``, rows of the embedding table.
    hidden_size: ``E``, width of the residual stream.
    intermediate_size: ``M``, SwiGLU hidden width.
    num_layers: number of decoder blocks.
    num_heads: ``H``, query heads.
    num_kv_heads: ``K``, key/value heads; must divide ``num_heads`` (``K == H`` is plain MHA).
    head_dim: ``D``; ``None`` means ``hidden_size // num_heads``.
    rms_norm_eps: epsilon inside RMSNorm's square root.
    rope_theta: RoPE base wavelength.
    rope_scaling: optional :class:`RopeScaling`.
    max_position_embeddings: recorded for Hugging Face export; not a hard limit here.
    qkv_bias: biases on the q/k/v projections (Qwen2: True; Llama: ``attention_bias``).
    o_bias: bias on the output projection (Llama ``attention_bias``; Qwen2: False).
    mlp_bias: biases on the three MLP projections (Llama ``mlp_bias``).
    tie_word_embeddings: the LM head reuses the embedding table.
    dtype: ``'float32'`` or ``'bfloat16'``, for parameters and activations. Logits, softmax,
      normalisation statistics and the value/reward heads are always f32.
    bos_token_id, eos_token_id, pad_token_id: carried for Hugging Face round trips;
      ``eos_token_id`` is a tuple (possibly empty) because checkpoints may list several.
  """

  model_type: str = "llama"
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int | None = None
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  max_position_embeddings: int = 2048
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  tie_word_embeddings: bool = False
  dtype: str = "float32"
  bos_token_id: int | None = None
  eos_token_id: tuple[int, ...] = ()
  pad_token_id: int | None = None

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"unsupported model_type {self.model_type!r}; rljax.models supports "
          f"{SUPPORTED_MODEL_TYPES}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
    if self.head_dim is None:
      if self.hidden_size % self.num_heads:
        raise ValueError(
            f"hidden_size ({self.hidden_size}) is not a multiple of num_heads ({self.num_heads}); "
            "give head_dim explicitly")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.head_dim <= 0 or self.head_dim % 2:
      raise ValueError(f"head_dim must be a positive even number, got {self.head_dim}")
    if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
      raise ValueError("rms_norm_eps and rope_theta must be > 0")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
    eos = self.eos_token_id
    if eos is None:
      eos = ()
    elif isinstance(eos, int):
      eos = (eos,)
    object.__setattr__(self, "eos_token_id", tuple(int(e) for e in eos))

  @property
  def num_groups(self) -> int:
    """``G``: query heads per KV head."""
    return self.num_heads // self.num_kv_heads

  @property
  def jnp_dtype(self) -> jnp.dtype:
    """``dtype`` (the parameter and activation dtype, e.g. ``"bfloat16"``) as a ``jnp.dtype``."""
    return jnp.dtype(self.dtype)

  def inv_freq(self) -> np.ndarray:
    """RoPE inverse frequencies ``[D/2]`` (f32), with ``rope_scaling`` applied.

    ``inv_freq_i = theta^(-2i/D)``. Llama 3 scaling (arXiv:2407.21783, Sec. 3.3) maps wavelength
    ``w = 2 pi / inv_freq`` through: ``w < L/high``: unchanged; ``w > L/low``: divided by
    ``factor``; in between, ``(1 - s) * f / factor + s * f`` with
    ``s = (L / w - low) / (high - low)`` and ``L`` the original context length.
    """
    d = self.head_dim
    inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    inv = inv.astype(np.float32)
    rs = self.rope_scaling
    if rs is None:
      return inv
    if rs.rope_type == "linear":
      return (inv / rs.factor).astype(np.float32)
    old_len = rs.original_max_position_embeddings
    low_wavelen = old_len / rs.low_freq_factor
    high_wavelen = old_len / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)

  def num_params(self) -> int:
    """Parameters of the transformer and LM head (the value/reward heads excluded)."""
    e, d, m = self.hidden_size, self.head_dim, self.intermediate_size
    h, k = self.num_heads, self.num_kv_heads
    attn = e * h * d * 2 + e * k * d * 2
    attn += (h * d + 2 * k * d) * self.qkv_bias + e * self.o_bias
    mlp = 3 * e * m + (2 * m + e) * self.mlp_bias
    per_layer = attn + mlp + 2 * e
    head = 0 if self.tie_word_embeddings else e * self.vocab_size
    return self.vocab_size * e + self.num_layers * per_layer + e + head

  # ---- Hugging Face config.json ------------------------------------------------------------

  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any], *, dtype: str = "float32") -> "LMConfig":
    """Builds a config from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x keys).

    Reads ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x).

    Raises:
      ValueError: for an unsupported ``model_type``, activation, RoPE type, or sliding-window
        attention, naming the offending key.
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"unsupported model_type {model_type!r} in config.json; rljax.models supports "
          f"{SUPPORTED_MODEL_TYPES}")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
      raise ValueError(f"unsupported hidden_act {act!r} (only 'silu' SwiGLU is implemented)")
    if model_type == "qwen2":
      layer_types = hf.get("layer_types") or ()
      if hf.get("use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError("unsupported Qwen2 config: use_sliding_window / sliding_attention layers")

    rope = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    params = rope if rope.get("rope_type", rope.get("type")) not in (None, "default") else legacy
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(
          f"unsupported rope_type {rope_type!r} in config.json; supported: {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
      raise ValueError("unsupported partial_rotary_factor != 1.0")
    scaling = None
    if rope_type != "default":
      scaling = RopeScaling(
          rope_type=rope_type,
          factor=float(params["factor"]),
          low_freq_factor=float(params.get("low_freq_factor", 1.0)),
          high_freq_factor=float(params.get("high_freq_factor", 4.0)),
          original_max_position_embeddings=int(
              params.get("original_max_position_embeddings",
                         hf.get("max_position_embeddings", 8192))),
      )

    heads = int(hf["num_attention_heads"])
    if model_type == "qwen2":
      qkv_bias, o_bias, mlp_bias = True, False, False
    else:
      qkv_bias = o_bias = bool(hf.get("attention_bias", False))
      mlp_bias = bool(hf.get("mlp_bias", False))
    return cls(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=hf.get("head_dim") or None,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )

  def to_hf_config(self, *, torch_dtype: str | None = None) -> dict[str, Any]:
    """The ``config.json`` dict for ``transformers`` (and vLLM) to rebuild this architecture.

    Both the transformers-5 ``rope_parameters`` key and the 4.x ``rope_theta``/``rope_scaling``
    keys are written, so old and new readers agree.
    """
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
    rope_parameters: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
    rope_scaling = None
    if self.rope_scaling is not None:
      rs = self.rope_scaling
      rope_scaling = {"rope_type": rs.rope_type, "factor": rs.factor}
      if rs.rope_type == "llama3":
        rope_scaling.update(
            low_freq_factor=rs.low_freq_factor,
            high_freq_factor=rs.high_freq_factor,
            original_max_position_embeddings=rs.original_max_position_embeddings)
      rope_parameters.update(rope_scaling)
    eos: int | list[int] | None = list(self.eos_token_id) or None
    if eos is not None and len(eos) == 1:
      eos = eos[0]
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "max_position_embeddings": self.max_position_embeddings,
        "rope_theta": self.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": self.tie_word_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": self.pad_token_id,
        "use_cache": True,
        "torch_dtype": torch_dtype or self.dtype,
        "dtype": torch_dtype or self.dtype,
    }
    if self.model_type == "llama":
      if self.qkv_bias != self.o_bias:
        raise ValueError("Llama export needs qkv_bias == o_bias (HF has one attention_bias flag)")
      cfg.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
    else:
      if not self.qkv_bias or self.o_bias or self.mlp_bias:
        raise ValueError("Qwen2 export needs qkv_bias=True, o_bias=False, mlp_bias=False")
      cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
    return cfg


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


class LayerCache(NamedTuple):
  """One layer's keys ``k [B, K, D, S]`` and values ``v [B, K, S, D]``, in the compute dtype.

  Keys are stored slot-minor so that both attention products are plain ``[., D] x [D, S]`` and
  ``[., S] x [S, D]`` matmuls per (batch, KV head); on CPU the transposed-operand form of the
  score product was nearly twice as slow.
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


# --------------------------------------------------------------------------------------------
# Small pure functions
# --------------------------------------------------------------------------------------------


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


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """``cos, sin [B, T, D/2]`` (f32) of angles ``positions * inv_freq``.

  ``positions [B, T]`` (int; left-padded rows use ``cumsum(mask) - 1``), ``inv_freq [D/2]``
  from :meth:`LMConfig.inv_freq` (Su et al. 2021, RoFormer).
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


def _dot(equation: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
  """``einsum`` accumulated in f32 and returned in ``out_dtype`` (default ``x.dtype``).

  For bf16 operands this is both more accurate and, on CPU, about twice as fast as a dot with a
  bf16 result (XLA then uses the native bf16 dot-product instructions). When both operands are
  bf16 the backward pass is bf16 too (:func:`_dot_low_precision`).
  """
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  if x.dtype == w.dtype and x.dtype != jnp.float32:
    return _dot_low_precision(equation, out_dtype, x, w)
  return _f32_product(equation, x, w).astype(out_dtype)


def _f32_product(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """``einsum(equation, x, w)`` accumulated and returned in f32: by `_split_k_matvec` where
  `_is_cpu_matvec` allows, else by one einsum."""
  if _is_cpu_matvec(equation, x, w):
    return _split_k_matvec(x, w)
  return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)


def _is_cpu_matvec(equation: str, x: jax.Array, w: jax.Array) -> bool:
  """Whether ``einsum(equation, x, w)`` is a matrix-vector product that `_split_k_matvec` computes:
  on one CPU device (no mesh whose sharding the split could cross), ``x`` holds one row (all its
  axes but the last are 1), the contracted index is ``x``'s last axis and ``w``'s first, of even
  size, and the output is ``x``'s other axes followed by ``w``'s in order (true of the model's
  projections and untied LM head, e.g. ``"BTE,EHD->BTHD"`` and ``"...E,EV->...V"``, where a
  leading ``...`` on ``x`` and the output stands for ``x``'s leading axes; not of the tied head,
  which contracts the embedding's last axis)."""
  if (jax.default_backend() != "cpu" or jax.device_count() != 1
      or math.prod(x.shape[:-1]) != 1 or x.shape[-1] % 2):
    return False
  try:
    lhs, out = equation.replace(" ", "").split("->")
    xs, ws = lhs.split(",")
  except ValueError:
    return False
  ellipsis = xs.startswith("...") and out.startswith("...")
  if ellipsis:
    xs, out = xs[3:], out[3:]
  if not xs or "." in xs + ws + out or len(ws) != w.ndim:
    return False
  if len(xs) > x.ndim if ellipsis else len(xs) != x.ndim:
    return False
  return xs[-1] == ws[0] and out == xs[:-1] + ws[1:]


def _split_k_matvec(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x [1.., K] @ w [K, ...]`` (f32 accumulation) as two half-``K`` products summed, shaped
  like the einsum: ``[1.., *w.shape[1:]]`` f32.

  Decoding one sequence streams every weight once per token through matrix-vector products.
  XLA:CPU runs ``[1, K] x [K, N]`` at about 24 GB/s on 2 cores (PyTorch's reaches 37); the same
  product as a batched dot over two halves of ``K`` (one per core) streamed at 36-38 GB/s. In the
  generation benchmark's batch-1 decode (a 28M-parameter Qwen2) the products took 28% less time
  (profiled). Measured on 2 cores only. Sums in another order than one dot (differences of about
  1e-7 relative).
  """
  k = w.shape[0]
  halves = jnp.einsum("prk,pkn->prn", x.reshape(2, 1, k // 2), w.reshape(2, k // 2, -1),
                      preferred_element_type=jnp.float32)
  return jnp.sum(halves, axis=0).reshape(x.shape[:-1] + w.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dot_low_precision(equation: str, out_dtype, x: jax.Array, w: jax.Array) -> jax.Array:
  """:func:`_dot` for two operands of one low-precision dtype (bf16), with a backward pass whose
  dots also take low-precision operands (the cotangent is cast to it; accumulation is f32), as
  PyTorch's bf16 autocast does.

  Plain autodiff would carry an f32 cotangent (of the ``astype`` or of an f32 result) into the
  backward dots, which then run in f32 at half the speed. ``equation`` is ``"a,b->c"`` without
  an index that is summed inside one operand alone (true of every dot in this model), so the
  transposes are ``dx = einsum("c,b->a", g, w)`` and ``dw = einsum("a,c->b", x, g)``.
  """
  return _f32_product(equation, x, w).astype(out_dtype)


def _dot_low_precision_fwd(equation, out_dtype, x, w):
  return _dot_low_precision(equation, out_dtype, x, w), (x, w)


def _dot_low_precision_bwd(equation, out_dtype, residuals, g):
  del out_dtype
  x, w = residuals
  inputs, out = equation.split("->")
  a, b = inputs.split(",")
  g = g.astype(x.dtype)
  dx = jnp.einsum(f"{out},{b}->{a}", g, w, preferred_element_type=jnp.float32)
  dw = jnp.einsum(f"{a},{out}->{b}", x, g, preferred_element_type=jnp.float32)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_dot_low_precision.defvjp(_dot_low_precision_fwd, _dot_low_precision_bwd)


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
    q = _dot("BTE,EHD->BTHD", x, self.q_kernel[...])
    kv = _dot("BTE,ECKD->BTCKD", x, self.kv_kernel[...])
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
      scores = _dot("BKTGD,BKDS->BKTGS", qg, k, out_dtype=jnp.float32)
      scores = jnp.where(mask[:, None, :, None, :], scores, _MASK_VALUE)
      probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
      out = _dot("BKTGS,BKSD->BKTGD", probs, v)
    out = out.astype(x.dtype)
    out = jnp.swapaxes(out, 1, 2).reshape(b, t, -1)                 # [B, T, H*D]
    o_kernel = self.o_kernel[...]
    y = _dot("BTF,FE->BTE", out, o_kernel.reshape(-1, o_kernel.shape[-1]))
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
    decode loop's output. When the attention read it too, XLA:CPU (batch 1) duplicated each
    cache write into two fusions and copied every layer's keys and values four times a step;
    this way it copies them twice, and a batch-1 decode step of the generation benchmark's model
    ran about 6% faster. With several rows the plain path has no such copies and this one would
    add them, so `Attention` takes it for one row on CPU only.
  """
  s = old.v.shape[2]
  is_new = jnp.arange(s, dtype=jnp.int32) == jnp.clip(cache_index, 0, s - 1)  # [S]
  scores_old = _dot("BKTGD,BKDS->BKTGS", qg, old.k, out_dtype=jnp.float32)
  scores_old = jnp.where(mask[:, None, :, None, :], scores_old, _MASK_VALUE)
  # The slot being overwritten holds a stale entry: no weight at all, even in a row that sees
  # nothing (where the masked scores tie and the plain path averages the S updated slots).
  scores_old = jnp.where(is_new, -jnp.inf, scores_old)
  scores_new = _dot("BKTGD,BKDN->BKTGN", qg, k_new, out_dtype=jnp.float32)  # [B, K, 1, G, 1]
  new_visible = jnp.any(mask & is_new, axis=-1)                               # [B, 1]
  scores_new = jnp.where(new_visible[:, None, :, None, None], scores_new, _MASK_VALUE)
  probs = jax.nn.softmax(jnp.concatenate([scores_old, scores_new], axis=-1), axis=-1)
  probs = probs.astype(old.v.dtype)
  return (_dot("BKTGS,BKSD->BKTGD", probs[..., :s], old.v, out_dtype=jnp.float32)
          + _dot("BKTGN,BKND->BKTGD", probs[..., s:], v_new, out_dtype=jnp.float32))


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
    gate_up = _dot("BTE,ECM->BTCM", x, self.gate_up_kernel[...])
    if self.gate_up_bias is not None:
      gate_up = gate_up + self.gate_up_bias[...]
    h = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
    h = axes.constrain(h, (axes.BATCH, axes.LENGTH, axes.MLP))
    y = _dot("BTM,ME->BTE", h, self.down_kernel[...])
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
      return _dot("...E,VE->...V", hidden, self.embed[...], out_dtype=jnp.float32)
    return _dot("...E,EV->...V", hidden, self.lm_head[...], out_dtype=jnp.float32)

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


def token_log_probs(logits: jax.Array, tokens: jax.Array, *, temperature: float = 1.0) -> jax.Array:
  """``log softmax(logits / temperature)[tokens]``, f32, without materialising the log-softmax.

  Args:
    logits: ``[..., V]``.
    tokens: ``[...]`` int ids.
  """
  logits = logits.astype(jnp.float32)
  if temperature != 1.0:
    logits = logits / temperature
  picked = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def sequence_log_probs(model: DecoderLM, tokens: jax.Array, attention_mask: jax.Array,
                       *, temperature: float = 1.0) -> jax.Array:
  """Log-probs of each token given its prefix: ``[B, T]`` f32, entry ``t`` scores ``tokens[:, t]``.

  ``tokens [B, T]`` int32 and ``attention_mask [B, T]`` (1 for real tokens, left padding 0).

  Entries without a real previous token (position 0, the first real token after left padding)
  and padding entries are 0. This is what a trainer uses to re-score sampled responses (policy,
  reference).
  """
  logits = model(tokens, attention_mask)
  lp = token_log_probs(logits[:, :-1], tokens[:, 1:], temperature=temperature)
  mask = attention_mask.astype(bool)
  return jnp.pad(jnp.where(mask[:, 1:] & mask[:, :-1], lp, 0.0), ((0, 0), (1, 0)))
