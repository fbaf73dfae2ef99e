"""Supervised fine-tuning: next-token NLL on response tokens only, length-grouped buckets.

Each example is ``(prompt_ids, response_ids)``; a batch is the concatenation right-padded to a
length bucket (``SFTConfig.length_buckets``), so a run compiles once per bucket. Batches are
drawn in length-grouped order (:func:`rljax.envs.text.data.epoch_order`), so padding stays a
small fraction of each batch (reported as ``padding_fraction``). The loss is
``sum(-log p(response tokens)) / #response tokens`` (numerator and denominator kept apart).
Pre-training is the same step with ``prompt_ids = [BOS]``: every text token is a target.

The step is one plain ``jax.jit`` over ``nnx.split`` parameters with the parameters and the
optimizer state donated (STYLE 8, 9). The data position is part of :class:`SFTState`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rljax.alignment import losses, modeling
from rljax.envs.text import data as text_data
from rljax.sampling import bucket_size

DEFAULT_LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)

Example = tuple[Sequence[int], Sequence[int]]  # (prompt_ids, response_ids)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
  """SFT hyperparameters.

  Attributes:
    num_steps: optimizer steps (> 0).
    batch_size: sequences per step (> 0).
    learning_rate: AdamW peak learning rate (> 0), linear warm-up then constant.
    warmup_steps: warm-up steps (>= 0).
    weight_decay: AdamW decay (>= 0).
    max_grad_norm: global-norm gradient clip (> 0).
    length_buckets: allowed padded lengths, increasing.
    group_size: examples per length-sorting window (0 or 1: no grouping).
    seed: data shuffle seed.
    log_every: steps between metric records.
  """

  num_steps: int = 200
  batch_size: int = 32
  learning_rate: float = 1e-3
  warmup_steps: int = 10
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  length_buckets: tuple[int, ...] = DEFAULT_LENGTH_BUCKETS
  group_size: int = 512
  seed: int = 0
  log_every: int = 10

  def __post_init__(self):
    for name in ("num_steps", "batch_size", "log_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    if not self.learning_rate > 0:
      raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}.")
    if self.warmup_steps < 0 or self.weight_decay < 0 or not self.max_grad_norm > 0:
      raise ValueError(
          f"need warmup_steps >= 0, weight_decay >= 0, max_grad_norm > 0; got "
          f"{self.warmup_steps}, {self.weight_decay}, {self.max_grad_norm}.")
    b = tuple(int(x) for x in self.length_buckets)
    if not b or list(b) != sorted(set(b)) or b[0] < 2:
      raise ValueError(f"length_buckets must be increasing ints >= 2, got {self.length_buckets}.")
    object.__setattr__(self, "length_buckets", b)


class SFTState(NamedTuple):
  """Train state: parameters (``nnx.State``), optimizer state, step, data position."""

  params: Any
  opt_state: Any
  step: int
  data_position: text_data.DataPosition


def make_optimizer(learning_rate: float, *, warmup_steps: int = 0, weight_decay: float = 0.0,
                   max_grad_norm: float = 1.0) -> optax.GradientTransformation:
  """``clip_by_global_norm -> adamw`` with a linear warm-up to a constant learning rate."""
  sched = optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1))
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(sched, b2=0.99, weight_decay=weight_decay))


def make_batch(examples: Sequence[Example], length: int, pad_id: int) -> dict[str, np.ndarray]:
  """``tokens, mask, loss_mask [N, length]`` int32: prompt + response, right-padded.

  ``loss_mask`` is 1 on response positions (each scored given its prefix).

  Raises:
    ValueError: an example longer than ``length`` or with an empty response.
  """
  n = len(examples)
  tokens = np.full((n, length), pad_id, np.int32)
  mask = np.zeros((n, length), np.int32)
  loss_mask = np.zeros((n, length), np.int32)
  for i, (p, r) in enumerate(examples):
    p, r = list(p), list(r)
    if not r:
      raise ValueError(f"example {i} has an empty response")
    if len(p) + len(r) > length:
      raise ValueError(f"example {i} has {len(p) + len(r)} tokens > length {length}")
    tokens[i, :len(p) + len(r)] = p + r
    mask[i, :len(p) + len(r)] = 1
    loss_mask[i, len(p):len(p) + len(r)] = 1
  return dict(tokens=tokens, mask=mask, loss_mask=loss_mask)


def sft_loss(graphdef, params, batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean NLL over response tokens of ``batch`` (see :func:`make_batch`)."""
  lp = modeling.lm_log_probs(graphdef, params, batch["tokens"], batch["mask"])
  nll_sum, count = losses.sft_loss_terms(lp, batch["loss_mask"])
  loss = nll_sum / jnp.maximum(count, 1.0)
  return loss, dict(loss=loss, tokens=count)


def make_sft_step(graphdef, optimizer: optax.GradientTransformation):
  """A jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)``; params and
  optimizer state are donated."""

  def step(params, opt_state, batch):
    (loss, metrics), grads = jax.value_and_grad(
        lambda p: sft_loss(graphdef, p, batch), has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, dict(metrics, grad_norm=optax.tree.norm(grads))

  return jax.jit(step, donate_argnums=(0, 1))


def make_eval_loss(graphdef):
  """Jitted ``(params, batch) -> mean response NLL``."""
  return jax.jit(lambda params, batch: sft_loss(graphdef, params, batch)[0])


def tokenize_examples(examples: Sequence[text_data.SFTExample], tokenizer, *, max_prompt_len: int,
                      max_response_len: int) -> list[Example]:
  """Tokenizes SFT examples (chat template when available), truncating both sides."""
  out = []
  eos = tokenizer.eos_token_id
  for ex in examples:
    p = text_data.encode_prompt(tokenizer, ex.prompt, ex.messages)
    r = text_data.encode_response(tokenizer, ex.response, eos_id=eos)
    out.append(text_data.truncate(p, r, max_prompt_len=max_prompt_len,
                                  max_response_len=max_response_len))
  return out


def init_state(params, optimizer, seed: int) -> SFTState:
  return SFTState(params, optimizer.init(params), 0, text_data.init_data_position(seed))


def train_sft(
    model: nnx.Module,
    examples: Sequence[Example],
    config: SFTConfig,
    *,
    pad_id: int,
    writer=None,
    state: SFTState | None = None,
    prefix: str = "sft/",
) -> tuple[nnx.Module, SFTState, list[dict[str, float]]]:
  """Trains ``model`` on ``(prompt_ids, response_ids)`` examples; returns the updated model,
  the final state (to checkpoint or resume from) and the logged metrics.

  Args:
    model: a :class:`rljax.models.llm.DecoderLM` (its parameters are the starting point unless
      ``state`` is given).
    examples: tokenized examples.
    config: hyperparameters.
    pad_id: padding id.
    writer: optional :class:`rljax.metrics.MetricsWriter`.
    state: resume from this state (params, optimizer, step, data position).
    prefix: metric-name prefix.

  Raises:
    ValueError: no examples, or an example longer than the largest bucket.
  """
  if not examples:
    raise ValueError("train_sft: empty dataset")
  graphdef, params = nnx.split(model, nnx.Param)
  optimizer = make_optimizer(config.learning_rate, warmup_steps=config.warmup_steps,
                             weight_decay=config.weight_decay,
                             max_grad_norm=config.max_grad_norm)
  step_fn = make_sft_step(graphdef, optimizer)
  if state is None:
    state = init_state(params, optimizer, config.seed)
  lengths = np.asarray([len(p) + len(r) for p, r in examples])
  if lengths.max() > config.length_buckets[-1]:
    raise ValueError(f"an example has {lengths.max()} tokens > largest length bucket "
                     f"{config.length_buckets[-1]}")
  params, opt_state, step, pos = state
  history = []
  t0 = time.perf_counter()
  acc = dict(loss=0.0, n=0, pad=0.0)
  while step < config.num_steps:
    idx, pos = text_data.next_batch_indices(pos, len(examples), config.batch_size,
                                            lengths=lengths, group_size=config.group_size)
    length = bucket_size(int(lengths[idx].max()), config.length_buckets)
    batch = make_batch([examples[i] for i in idx], length, pad_id)
    params, opt_state, metrics = step_fn(params, opt_state, batch)
    step += 1
    acc["loss"] += float(metrics["loss"])
    acc["n"] += 1
    acc["pad"] += 1.0 - batch["mask"].mean()
    if step % config.log_every == 0 or step == config.num_steps:
      rec = {f"{prefix}loss": acc["loss"] / acc["n"],
             f"{prefix}grad_norm": float(metrics["grad_norm"]),
             f"{prefix}padding_fraction": acc["pad"] / acc["n"],
             f"{prefix}wall_s": time.perf_counter() - t0}
      history.append(dict(rec, step=step))
      if writer is not None:
        writer.write(step, rec)
      acc = dict(loss=0.0, n=0, pad=0.0)
  nnx.update(model, params)
  return model, SFTState(params, opt_state, step, pos), history
