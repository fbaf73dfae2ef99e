"""Log-probabilities of tokens under a decoder LM (f32), from logits or from the model.

:func:`token_log_probs` reads ``log softmax(logits)`` at given tokens; :func:`sequence_log_probs`
scores each token of a left-padded batch given its prefix, with a
:class:`rljax.models.llm.DecoderLM`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


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


def sequence_log_probs(model: Callable[[jax.Array, jax.Array], jax.Array], tokens: jax.Array,
                       attention_mask: jax.Array, *, temperature: float = 1.0) -> jax.Array:
  """Log-probs of each token given its prefix: ``[B, T]`` f32, entry ``t`` scores ``tokens[:, t]``.

  ``model`` is a :class:`rljax.models.llm.DecoderLM` (called as ``model(tokens, attention_mask)``
  for logits ``[B, T, V]``), ``tokens [B, T]`` int32 and ``attention_mask [B, T]`` (1 for real
  tokens, left padding 0).

  Entries without a real previous token (position 0, the first real token after left padding)
  and padding entries are 0. This is what a trainer uses to re-score sampled responses (policy,
  reference).
  """
  logits = model(tokens, attention_mask)
  lp = token_log_probs(logits[:, :-1], tokens[:, 1:], temperature=temperature)
  mask = attention_mask.astype(bool)
  return jnp.pad(jnp.where(mask[:, 1:] & mask[:, :-1], lp, 0.0), ((0, 0), (1, 0)))
