"""Roles and the forward passes the alignment trainers run on a decoder LM.

Sequence layout of one RLHF sample: the prompt left-padded to ``P`` tokens, then the response
right-padded to ``R`` tokens, concatenated into ``tokens [B, P + R]`` with
``attention_mask = [prompt_mask, response_mask]``. Real tokens are contiguous, so the model's
default positions ``cumsum(mask) - 1`` start every prompt at 0.

Response token ``r`` sits at column ``P + r`` and is predicted by the logits at column
``P + r - 1``; its value (the critic's estimate of the state *before* emitting it) is read at
the same column (OpenRLHF/TRL convention). The sequence score is read at the last real token
(:func:`rljax.models.llm.last_token_index`), i.e. the EOS when there is one.

All functions take a ``graphdef`` and a parameter ``State`` and ``nnx.merge`` them, so they can
be called inside a plain ``jax.jit``.
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models import llm

Array = jax.Array


class Role(enum.Enum):
  """The four models of RLHF PPO (tunix ``Role``; OpenRLHF's actor/critic/reward/initial)."""

  ACTOR = "actor"          # the policy, trained
  CRITIC = "critic"        # value model, trained (PPO only)
  REWARD = "reward"        # frozen reward model (or a programmatic reward function)
  REFERENCE = "reference"  # frozen initial policy, for the KL penalty


def concat(prompt_tokens: Array, prompt_mask: Array, response_tokens: Array, response_mask: Array
           ) -> tuple[Array, Array]:
  """``tokens, mask [B, P + R]`` from a left-padded prompt and a right-padded response."""
  tokens = jnp.concatenate([prompt_tokens, response_tokens], axis=1).astype(jnp.int32)
  mask = jnp.concatenate([prompt_mask, response_mask], axis=1).astype(jnp.int32)
  return tokens, mask


def entropy_from_logits(logits: Array) -> Array:
  """Entropy ``H = logsumexp(l) - sum softmax(l) * l`` (nats) over the last axis, f32."""
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  p = jnp.exp(logits - lse[..., None])
  return lse - jnp.sum(p * logits, axis=-1)


def response_hidden(graphdef, params, prompt_tokens, prompt_mask, response_tokens, response_mask
                    ) -> tuple[Any, Array, Array]:
  """Runs the transformer; returns ``(model, hidden [B, R, E] at the predicting columns,
  full hidden [B, P + R, E])``."""
  model: llm.DecoderLM = nnx.merge(graphdef, params)
  tokens, mask = concat(prompt_tokens, prompt_mask, response_tokens, response_mask)
  hidden, _ = model.hidden_states(tokens, attention_mask=mask)
  p = prompt_tokens.shape[1]
  r = response_tokens.shape[1]
  return model, hidden[:, p - 1:p + r - 1], hidden


def policy_outputs(graphdef, params, prompt_tokens, prompt_mask, response_tokens, response_mask,
                   *, with_entropy: bool = True) -> tuple[Array, Array]:
  """Per-token log-probs and entropies of the response under the policy.

  Args:
    prompt_tokens, prompt_mask: ``[B, P]`` int, left-padded.
    response_tokens, response_mask: ``[B, R]`` int, right-padded.

  Returns:
    ``(log_probs, entropy)``, both ``[B, R]`` f32, 0 on response padding (entropy zeros when
    ``with_entropy`` is False).
  """
  model, h, _ = response_hidden(graphdef, params, prompt_tokens, prompt_mask, response_tokens,
                                response_mask)
  logits = model.logits(h)
  m = response_mask.astype(jnp.float32)
  lp = llm.token_log_probs(logits, response_tokens) * m
  ent = entropy_from_logits(logits) * m if with_entropy else jnp.zeros_like(lp)
  return lp, ent


def critic_values(graphdef, params, prompt_tokens, prompt_mask, response_tokens, response_mask
                  ) -> Array:
  """Value-head outputs ``[B, R]`` f32 for each response token's preceding state; 0 on padding."""
  model, h, _ = response_hidden(graphdef, params, prompt_tokens, prompt_mask, response_tokens,
                                response_mask)
  return model.values(h) * response_mask.astype(jnp.float32)


def sequence_scores(graphdef, params, tokens: Array, mask: Array) -> Array:
  """Reward-head scores ``[B]`` f32 of ``tokens [B, L]``, read at each row's last real token."""
  model: llm.DecoderLM = nnx.merge(graphdef, params)
  hidden, _ = model.hidden_states(tokens, attention_mask=mask)
  return model.rewards(hidden, mask)


def lm_log_probs(graphdef, params, tokens: Array, mask: Array) -> Array:
  """``[B, L]`` f32 log-prob of each token given its prefix (0 at the first real token and on
  padding); :func:`rljax.models.llm.sequence_log_probs` on split parameters."""
  model: llm.DecoderLM = nnx.merge(graphdef, params)
  return llm.sequence_log_probs(model, tokens, mask)


def pad_right(rows, length: int, pad_id: int):
  """Right-pads int lists into numpy ``tokens, mask [N, length]`` (int32)."""
  import numpy as np

  n = len(rows)
  tokens = np.full((n, length), pad_id, np.int32)
  mask = np.zeros((n, length), np.int32)
  for i, row in enumerate(rows):
    row = list(row)[:length]
    tokens[i, :len(row)] = row
    mask[i, :len(row)] = 1
  return tokens, mask


def pad_left(rows, length: int, pad_id: int):
  """Left-pads int lists into numpy ``tokens, mask [N, length]`` (int32); keeps the last
  ``length`` tokens of longer rows."""
  import numpy as np

  n = len(rows)
  tokens = np.full((n, length), pad_id, np.int32)
  mask = np.zeros((n, length), np.int32)
  for i, row in enumerate(rows):
    row = list(row)[-length:]
    if row:
      tokens[i, length - len(row):] = row
      mask[i, length - len(row):] = 1
  return tokens, mask
