"""Reward-model training: Bradley-Terry loss on preference pairs, held-out accuracy with a CI.

The reward model is a :class:`rljax.models.llm.DecoderLM` whose reward head reads the final
hidden state at each sequence's last non-padding token (the EOS of ``prompt + response + EOS``).
Chosen and rejected sequences of a batch go through the model as one ``[2N, L]`` batch.
Loss: ``-log sigmoid(r_chosen - r_rejected - margin)`` (Ouyang et al. 2022, eq. 1).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

from rljax.alignment import losses, modeling
from rljax.alignment.sft import (DEFAULT_LENGTH_BUCKETS, check_training_fields, optimizer_for,
                                 record_line, stop_point)
from rljax.envs.text import data as text_data
from rljax.sampling import bucket_size

Pair = tuple[Sequence[int], Sequence[int], Sequence[int]]  # prompt, chosen, rejected ids


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
  """Reward-model hyperparameters.

  Attributes:
    num_steps: optimizer steps (> 0).
    batch_size: pairs per step (> 0).
    learning_rate: AdamW peak learning rate (> 0).
    warmup_steps: linear warm-up steps (>= 0).
    weight_decay: AdamW decay (>= 0).
    max_grad_norm: gradient clip (> 0).
    margin: Bradley-Terry margin ``m`` (>= 0).
    eval_fraction: held-out fraction of the pairs, in ``[0, 1)``.
    length_buckets: padded lengths, increasing, >= 2.
    seed: split and shuffle seed.
    log_every: steps between records (> 0).

  Raises:
    ValueError: a field out of the range above, named with its value
      (:func:`rljax.alignment.sft.check_training_fields`, ``margin``, ``eval_fraction``).
  """

  num_steps: int = 200
  batch_size: int = 16
  learning_rate: float = 5e-4
  warmup_steps: int = 10
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  margin: float = 0.0
  eval_fraction: float = 0.1
  length_buckets: tuple[int, ...] = DEFAULT_LENGTH_BUCKETS
  seed: int = 0
  log_every: int = 10

  def __post_init__(self):
    object.__setattr__(self, "length_buckets", check_training_fields(self))
    if not self.margin >= 0:
      raise ValueError(f"margin must be >= 0, got {self.margin}.")
    if not 0 <= self.eval_fraction < 1:
      raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}.")


class RewardModelState(NamedTuple):
  """Train state: parameters (``nnx.State``), optimizer state, step, data position, and
  ``window``: the sums behind the next metrics record (as ``sft.SFTState``'s)."""

  params: Any
  opt_state: Any
  step: int
  data_position: text_data.DataPosition
  window: dict[str, float] | None = None


class EvalResult(NamedTuple):
  """Held-out accuracy with its 95% Wilson interval, and the mean BT loss."""

  accuracy: float
  ci_low: float
  ci_high: float
  loss: float
  num_pairs: int

  def record(self, prefix: str = "rm/") -> dict[str, float]:
    """The metrics record: ``{prefix}eval_accuracy``, ``..._ci_low``, ``..._ci_high``,
    ``{prefix}eval_loss``."""
    return {f"{prefix}eval_accuracy": self.accuracy, f"{prefix}eval_accuracy_ci_low": self.ci_low,
            f"{prefix}eval_accuracy_ci_high": self.ci_high, f"{prefix}eval_loss": self.loss}


def tokenize_pairs(pairs: Sequence[text_data.PreferencePair], tokenizer, *, max_prompt_len: int,
                   max_response_len: int) -> list[Pair]:
  """Tokenizes preference pairs: prompt (chat template when available), responses + EOS."""
  eos = tokenizer.eos_token_id
  out = []
  for pr in pairs:
    p = text_data.encode_prompt(tokenizer, pr.prompt, pr.messages)[-max_prompt_len:]
    c = text_data.encode_response(tokenizer, pr.chosen, eos_id=eos)[:max_response_len]
    r = text_data.encode_response(tokenizer, pr.rejected, eos_id=eos)[:max_response_len]
    out.append((p, c, r))
  return out


def split_pairs(pairs: Sequence[Any], eval_fraction: float, seed: int
                ) -> tuple[list[Any], list[Any]]:
  """Deterministic ``(train, held_out)`` split; at least one held-out pair when the fraction
  is > 0."""
  order = np.random.default_rng(seed).permutation(len(pairs))
  n_eval = int(round(eval_fraction * len(pairs)))
  if eval_fraction > 0:
    n_eval = max(n_eval, 1)
  held = [pairs[i] for i in order[:n_eval]]
  train = [pairs[i] for i in order[n_eval:]]
  return train, held


def make_batch(pairs: Sequence[Pair], length: int, pad_id: int) -> dict[str, np.ndarray]:
  """``tokens, mask [2N, length]``: rows ``0..N-1`` chosen, ``N..2N-1`` rejected, right-padded."""
  rows = [list(p) + list(c) for p, c, _ in pairs] + [list(p) + list(r) for p, _, r in pairs]
  tokens, mask = modeling.pad_right(rows, length, pad_id)
  return dict(tokens=tokens, mask=mask)


def rm_loss(graphdef, params, batch, margin: float):
  """Bradley-Terry loss of a `make_batch` batch (Ouyang et al. 2022, eq. 1; Llama 2's margin).

  Args:
    graphdef, params: the reward model (``nnx.split``).
    batch: ``tokens, mask [2N, L]``, rows ``0..N-1`` chosen and ``N..2N-1`` rejected.
    margin: ``m >= 0`` in ``-log sigmoid(r_chosen - r_rejected - m)``.

  Returns:
    ``(loss, metrics)`` from `rljax.alignment.losses.bradley_terry_loss`: the scalar f32 mean
    loss over the ``N`` pairs and its pairwise accuracy.
  """
  scores = modeling.sequence_scores(graphdef, params, batch["tokens"], batch["mask"])
  n = scores.shape[0] // 2
  return losses.bradley_terry_loss(scores[:n], scores[n:], margin=margin)


def make_rm_step(graphdef, optimizer, margin: float):
  """Jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` (donated)."""

  def step(params, opt_state, batch):
    (loss, metrics), grads = jax.value_and_grad(
        lambda p: rm_loss(graphdef, p, batch, margin), has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))

  return jax.jit(step, donate_argnums=(0, 1))


def _length(pair: Pair) -> int:
  p, c, r = pair
  return len(p) + max(len(c), len(r))


def evaluate(graphdef, params, pairs: Sequence[Pair], *, pad_id: int, batch_size: int = 32,
             length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS, margin: float = 0.0
             ) -> EvalResult:
  """Pairwise accuracy (``r_chosen > r_rejected``) on ``pairs`` with a 95% Wilson interval.

  Raises:
    ValueError: no pairs.
  """
  if not pairs:
    raise ValueError("evaluate: no held-out pairs")
  score_fn = jax.jit(lambda p, t, m: modeling.sequence_scores(graphdef, p, t, m))
  correct, loss_sum = 0, 0.0
  for s in range(0, len(pairs), batch_size):
    chunk = list(pairs[s:s + batch_size])
    n = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch_size - n)  # fixed batch shape: no recompiles
    length = bucket_size(max(_length(x) for x in chunk), length_buckets)
    b = make_batch(chunk, length, pad_id)
    scores = np.asarray(score_fn(params, b["tokens"], b["mask"]))
    diff = scores[:batch_size][:n] - scores[batch_size:][:n]
    correct += int(np.sum(diff > 0))
    loss_sum += float(np.sum(np.logaddexp(0.0, -(diff - margin))))
  lo, hi = losses.binomial_confidence_interval(correct, len(pairs))
  return EvalResult(correct / len(pairs), lo, hi, loss_sum / len(pairs), len(pairs))


def fresh_state(model: nnx.Module, config: RewardModelConfig) -> RewardModelState:
  """The state `train_reward_model` starts ``model`` from (step 0), the template a saved
  state is restored into."""
  params = nnx.state(model, nnx.Param)
  return RewardModelState(params, optimizer_for(config).init(params), 0,
                          text_data.init_data_position(config.seed))


def train_reward_model(
    model: nnx.Module,
    train_pairs: Sequence[Pair],
    config: RewardModelConfig,
    *,
    pad_id: int,
    eval_pairs: Sequence[Pair] = (),
    writer=None,
    prefix: str = "rm/",
    layout=None,
    should_stop=None,
    state: RewardModelState | None = None,
    checkpoint=None,
    log=None,
) -> tuple[nnx.Module, RewardModelState, list[dict[str, float]]]:
  """Trains the reward head and body of ``model`` with the Bradley-Terry loss.

  Held-out accuracy (with its CI) is logged at the end when ``eval_pairs`` are given.
  ``layout``: an optional :class:`rljax.alignment.layout.TrainLayout` (mesh + rules preset):
  params and optimizer state sharded by its rules, each batch's rows split over its data axes.
  ``should_stop``: ``() -> bool``, asked before every step (e.g. whether SIGTERM came).
  ``state``: resume from this state (`fresh_state`'s structure), e.g. the one an `Interrupted`
  carries: the run then continues as an uninterrupted one would, records included.
  ``checkpoint`` and ``log``: as in `rljax.alignment.sft.train_sft`.

  Raises:
    ValueError: no training pairs, or a pair longer than the largest bucket.
    rljax.alignment.sft.Interrupted: ``should_stop()`` returned True; it carries the state to
      resume from.
    rljax.sharding.mesh.MeshError: ``2 * batch_size`` rows not divisible by the data axes.
  """
  if not train_pairs:
    raise ValueError("train_reward_model: empty dataset")
  graphdef, _ = nnx.split(model, nnx.Param)
  optimizer = optimizer_for(config)
  step_fn = make_rm_step(graphdef, optimizer, config.margin)
  lengths = np.asarray([_length(x) for x in train_pairs])
  if lengths.max() > config.length_buckets[-1]:
    raise ValueError(f"a pair has {lengths.max()} tokens > largest bucket {config.length_buckets[-1]}")
  params, opt_state, start, pos, window = state or fresh_state(model, config)
  if layout is not None:  # rljax.alignment.layout.TrainLayout; checked before compiling
    layout.check_batch(2 * config.batch_size, what="2 * batch_size (chosen + rejected rows)")
    params, opt_state = layout.shard(params), layout.shard(opt_state)
  history = []
  t0 = time.perf_counter()
  acc = dict(window or dict(loss=0.0, accuracy=0.0, n=0))
  for step in range(start + 1, config.num_steps + 1):
    stop_point(should_stop, prefix, config.num_steps,
               RewardModelState(params, opt_state, step - 1, pos, dict(acc)), checkpoint)
    idx, pos = text_data.next_batch_indices(pos, len(train_pairs), config.batch_size,
                                            lengths=lengths, group_size=config.batch_size * 16)
    length = bucket_size(int(lengths[idx].max()), config.length_buckets)
    batch = make_batch([train_pairs[i] for i in idx], length, pad_id)
    params, opt_state, metrics = step_fn(
        params, opt_state, batch if layout is None else layout.put_batch(batch))
    acc["loss"] += float(metrics["loss"])
    acc["accuracy"] += float(metrics["accuracy"])
    acc["n"] += 1
    if step % config.log_every == 0 or step == config.num_steps:
      rec = {f"{prefix}loss": acc["loss"] / acc["n"],
             f"{prefix}train_accuracy": acc["accuracy"] / acc["n"],
             f"{prefix}grad_norm": float(metrics["grad_norm"]),
             f"{prefix}wall_s": time.perf_counter() - t0}
      if step == config.num_steps and eval_pairs:
        ev = evaluate(graphdef, params, eval_pairs, pad_id=pad_id,
                      length_buckets=config.length_buckets, margin=config.margin)
        rec.update(ev.record(prefix))
      history.append(dict(rec, step=step))
      if writer is not None:
        writer.write(step, rec, stage=prefix.strip("/") or None)
      if log is not None:
        log(record_line(prefix, step, config.num_steps, rec))
      acc = dict(loss=0.0, accuracy=0.0, n=0)
  nnx.update(model, params)
  return model, RewardModelState(params, opt_state, config.num_steps, pos, acc), history
