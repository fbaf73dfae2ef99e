"""Architecture configuration of the Llama/Qwen2 decoder LMs (:mod:`rljax.models.llm`).

:class:`LMConfig` (sizes, RoPE, biases, dtype, special token ids; RoPE inverse frequencies, the
parameter count, and the Hugging Face ``config.json`` round trip), :class:`RopeScaling` (the
``linear`` and Llama-3 ``rope_scaling`` variants), and the model and RoPE types supported.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


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
