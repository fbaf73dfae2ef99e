"""Supervised fine-tuning: next-token NLL on response tokens only, bucketed or packed.

Each example is ``(prompt_ids, response_ids)``. Two batch layouts:

* **bucketing** (default): a batch is the concatenation right-padded to a length bucket
  (``SFTConfig.length_buckets``), so a run compiles once per bucket. Batches are drawn in
  length-grouped order (:func:`rljax.envs.text.data.epoch_order`).
* **packing** (``SFTConfig.packing``): the dataset is packed once, first-fit decreasing, into
  rows of ``pack_length`` tokens that hold several examples each (:func:`pack_examples`), with
  segment ids, per-segment positions and a block-diagonal causal mask
  (:meth:`rljax.models.llm.DecoderLM.hidden_states`), so no token sees another example. Rows
  are shuffled per epoch; a step has one fixed shape, so one compilation.

The fraction of padding tokens is reported as ``padding_fraction``. The loss is
``sum(-log p(response tokens)) / #response tokens`` (numerator and denominator kept apart).
Pre-training is the same step with ``prompt_ids = [BOS]``: every text token is a target.

The step is one plain ``jax.jit`` over ``nnx.split`` parameters with the parameters and the
optimizer state donated. The data position is part of :class:`SFTState`.
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
from rljax.models import llm
from rljax.sampling import bucket_size
from rljax.sharding import mesh as mesh_lib

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
    packing: pack several examples per row (:func:`pack_examples`) instead of bucketing. A step
      then takes ``round(batch_size * num_rows / num_examples)`` (>= 1) packed rows, i.e. about
      ``batch_size`` examples, as without packing; on a mesh, rounded to a multiple of the
      data axes' size (at least one row per data shard).
    pack_length: row length when packing (0: the largest length bucket).
    seed: data shuffle seed.
    log_every: steps between metric records.

  Raises:
    ValueError: a field out of the range above, named with its value
      (:func:`check_training_fields`; ``group_size`` negative; ``pack_length`` 1 or negative).
  """

  num_steps: int = 200
  batch_size: int = 32
  learning_rate: float = 1e-3
  warmup_steps: int = 10
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  length_buckets: tuple[int, ...] = DEFAULT_LENGTH_BUCKETS
  group_size: int = 512
  packing: bool = False
  pack_length: int = 0
  seed: int = 0
  log_every: int = 10

  def __post_init__(self):
    object.__setattr__(self, "length_buckets", check_training_fields(self))
    if self.group_size < 0:
      raise ValueError(f"group_size must be >= 0 (0 or 1: no grouping), got {self.group_size}.")
    if self.pack_length < 0 or 0 < self.pack_length < 2:
      raise ValueError(f"pack_length must be 0 (largest bucket) or >= 2, got {self.pack_length}.")


class SFTState(NamedTuple):
  """Train state: parameters (``nnx.State``), optimizer state, step, data position, and
  ``window``: the sums behind the next metrics record (the steps since the last one; None:
  none yet), so that a resumed stage logs what an uninterrupted one does."""

  params: Any
  opt_state: Any
  step: int
  data_position: text_data.DataPosition
  window: dict[str, float] | None = None


def check_training_fields(config) -> tuple[int, ...]:
  """Validates the fields :class:`SFTConfig` and ``RewardModelConfig`` share.

  Args:
    config: has ``num_steps``, ``batch_size``, ``log_every`` (ints), ``learning_rate``,
      ``warmup_steps``, ``weight_decay``, ``max_grad_norm`` and ``length_buckets`` (ints).

  Returns:
    ``length_buckets`` as a tuple of Python ints, for the config to store.

  Raises:
    ValueError: naming the first bad field and its value: ``num_steps``, ``batch_size`` or
      ``log_every`` < 1; ``learning_rate`` not > 0 (NaN included); ``warmup_steps`` < 0,
      ``weight_decay`` not >= 0 or ``max_grad_norm`` not > 0; ``length_buckets`` empty, not
      strictly increasing, or starting under 2.
  """
  for name in ("num_steps", "batch_size", "log_every"):
    if getattr(config, name) < 1:
      raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}.")
  if not config.learning_rate > 0:
    raise ValueError(f"learning_rate must be > 0, got {config.learning_rate}.")
  if config.warmup_steps < 0 or not config.weight_decay >= 0 or not config.max_grad_norm > 0:
    raise ValueError(
        f"need warmup_steps >= 0, weight_decay >= 0, max_grad_norm > 0; got "
        f"{config.warmup_steps}, {config.weight_decay}, {config.max_grad_norm}.")
  b = tuple(int(x) for x in config.length_buckets)
  if not b or list(b) != sorted(set(b)) or b[0] < 2:
    raise ValueError(f"length_buckets must be increasing ints >= 2, got {config.length_buckets}.")
  return b


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


def pack_examples(examples: Sequence[Example], length: int, pad_id: int, *,
                  num_rows: int | None = None) -> dict[str, np.ndarray]:
  """Packs examples into rows of ``length`` tokens, first-fit decreasing.

  Returns ``tokens, mask, loss_mask, segment_ids, positions [N_rows, length]`` int32:
  ``segment_ids`` is ``1, 2, ..`` per example within its row and 0 on padding; ``positions``
  restart at 0 for each example; ``loss_mask`` is 1 on response tokens. With
  ``DecoderLM(tokens, mask, segment_ids=...)`` each example is scored exactly as in its own
  unpadded row (block-diagonal causal attention), so :func:`sft_loss` on the packed batch
  equals it on :func:`make_batch` of the same examples. ``num_rows`` pads the row count with
  all-padding rows (fixed shapes).

  Raises:
    ValueError: an example longer than ``length`` or with an empty response, or more rows
      needed than ``num_rows``.
  """
  lens = np.asarray([len(p) + len(r) for p, r in examples], np.int64)
  for i, ((p, r), n) in enumerate(zip(examples, lens)):
    if not len(r):
      raise ValueError(f"example {i} has an empty response")
    if n > length:
      raise ValueError(f"example {i} has {n} tokens > pack length {length}")
  free = np.zeros(0, np.int64)  # remaining room per row
  row_of = np.zeros(len(examples), np.int64)
  for i in np.argsort(-lens, kind="stable"):
    fits = np.flatnonzero(free >= lens[i])
    if fits.size:
      row_of[i] = fits[0]
    else:
      free = np.append(free, length)
      row_of[i] = free.size - 1
    free[row_of[i]] -= lens[i]
  rows = free.size if num_rows is None else num_rows
  if free.size > rows:
    raise ValueError(f"{free.size} packed rows needed > num_rows {rows}")
  out = {k: np.zeros((rows, length), np.int32)
         for k in ("tokens", "mask", "loss_mask", "segment_ids", "positions")}
  out["tokens"][:] = pad_id
  fill = np.zeros(rows, np.int64)
  for i, (p, r) in enumerate(examples):  # original order within a row
    row, s, n = row_of[i], fill[row_of[i]], lens[i]
    out["tokens"][row, s:s + n] = list(p) + list(r)
    out["mask"][row, s:s + n] = 1
    out["loss_mask"][row, s + len(p):s + n] = 1
    out["segment_ids"][row, s:s + n] = out["segment_ids"][row, :s].max(initial=0) + 1
    out["positions"][row, s:s + n] = np.arange(n)
    fill[row] += n
  return out


def _log_probs(graphdef, params, batch) -> jax.Array:
  """``[B, L]`` f32 log-prob of each token given its prefix within its example (packed rows:
  within its segment; 0 at each example's first token and on padding)."""
  if "segment_ids" not in batch:
    return modeling.lm_log_probs(graphdef, params, batch["tokens"], batch["mask"])
  model = nnx.merge(graphdef, params)
  tokens, seg = batch["tokens"], batch["segment_ids"]
  logits = model(tokens, batch["mask"], positions=batch["positions"], segment_ids=seg)
  lp = llm.token_log_probs(logits[:, :-1], tokens[:, 1:])
  same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
  return jnp.pad(jnp.where(same, lp, 0.0), ((0, 0), (1, 0)))


def sft_loss(graphdef, params, batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean NLL over response tokens of ``batch`` (:func:`make_batch` or :func:`pack_examples`)."""
  lp = _log_probs(graphdef, params, batch)
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
  """Step 0: ``optimizer.init(params)`` and the data position of epoch 0 shuffled by ``seed``."""
  return SFTState(params, optimizer.init(params), 0, text_data.init_data_position(seed))


def optimizer_for(config) -> optax.GradientTransformation:
  """`make_optimizer` from a `SFTConfig`'s or ``RewardModelConfig``'s fields."""
  return make_optimizer(config.learning_rate, warmup_steps=config.warmup_steps,
                        weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm)


def fresh_state(model: nnx.Module, config: SFTConfig) -> SFTState:
  """The state `train_sft` starts ``model`` from: its ``nnx.Param`` state, the optimizer's
  initial state, step 0 (the template a saved state is restored into)."""
  return init_state(nnx.state(model, nnx.Param), optimizer_for(config), config.seed)


class Interrupted(Exception):
  """A training stage (SFT, pre-training, reward model) stopped before ``step + 1`` of
  ``num_steps`` because its ``should_stop`` said so (a SIGTERM).

  Attributes:
    stage, step, num_steps: where it stopped.
    state: the stage's train state at that point (an `SFTState` or
      ``reward_model.RewardModelState``), set by the training loop; None if it is not known.
    saved_in: the folder the state was saved to
      (:func:`rljax.alignment.stages.run_stage`), else None; the message says which.
  """

  def __init__(self, stage: str, step: int, num_steps: int, state=None):
    super().__init__(stage, step, num_steps)
    self.stage, self.step, self.num_steps = stage, step, num_steps
    self.state, self.saved_in = state, None

  def __str__(self) -> str:
    where = f"preempted by SIGTERM during {self.stage} (after step {self.step} of {self.num_steps})"
    if self.saved_in is None:
      return f"{where}: the stage's state was not saved, so it starts again"
    return f"{where}: its state is saved in {self.saved_in}, and the same command resumes it"


def check_stop(should_stop, prefix: str, step: int, num_steps: int) -> None:
  """Raises `Interrupted` if ``should_stop`` (a ``() -> bool`` or None) returns True."""
  if should_stop is not None and should_stop():
    raise Interrupted(prefix.strip("/") or "training", step, num_steps)


def stop_point(should_stop, prefix: str, num_steps: int, state, checkpoint=None) -> None:
  """Before the step after ``state.step``: ``checkpoint(state)`` (None: nothing; it decides
  whether to save), then `check_stop`; the `Interrupted` it raises carries ``state`` (what a
  checkpoint of the stage saves)."""
  if checkpoint is not None:
    checkpoint(state)
  try:
    check_stop(should_stop, prefix, state.step, num_steps)
  except Interrupted as e:
    e.state = state
    raise


# The values of a stage's records that `record_line` shows (SFT and pre-training, reward model).
_SHOWN = ("loss", "padding_fraction", "train_accuracy", "eval_accuracy")


def record_line(prefix: str, step: int, num_steps: int, record: dict[str, Any]) -> str:
  """A logged record of a stage as one console line, e.g.
  ``"pretrain step 50/800: loss 2.345, padding_fraction 0.120 (12.3 s)"``: its `_SHOWN`
  values, named without ``prefix``, then ``wall_s``."""
  shown = ", ".join(f"{name} {record[prefix + name]:.3f}" for name in _SHOWN
                    if prefix + name in record)
  return (f"{prefix.strip('/') or 'training'} step {step}/{num_steps}: {shown} "
          f"({record.get(prefix + 'wall_s', 0.0):.1f} s)")


def train_sft(
    model: nnx.Module,
    examples: Sequence[Example],
    config: SFTConfig,
    *,
    pad_id: int,
    writer=None,
    state: SFTState | None = None,
    prefix: str = "sft/",
    layout=None,
    should_stop=None,
    checkpoint=None,
    log=None,
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
    layout: an :class:`rljax.alignment.layout.TrainLayout` (mesh + rules preset) to train on:
      params and optimizer state sharded by its rules, each batch split over its data axes.
    should_stop: ``() -> bool``, asked before every step (e.g. whether SIGTERM came).
    checkpoint: ``(state) -> None``, called with the state before every step, before
      ``should_stop`` (e.g. `rljax.alignment.stages.run_stage`'s periodic save).
    log: ``(str) -> None``, receives each logged record as one line (`record_line`).

  Raises:
    ValueError: no examples, or an example longer than the largest bucket (the pack length
      when packing).
    Interrupted: ``should_stop()`` returned True; it carries the state to resume from.
  """
  if not examples:
    raise ValueError("train_sft: empty dataset")
  graphdef, params = nnx.split(model, nnx.Param)
  optimizer = optimizer_for(config)
  step_fn = make_sft_step(graphdef, optimizer)
  if state is None:
    state = init_state(params, optimizer, config.seed)
  lengths = np.asarray([len(p) + len(r) for p, r in examples])
  if not config.packing and lengths.max() > config.length_buckets[-1]:
    raise ValueError(f"an example has {lengths.max()} tokens > largest length bucket "
                     f"{config.length_buckets[-1]}")
  params, opt_state, step, pos, window = state
  if config.packing:
    # Packed once; the data position then walks over rows (shuffled per epoch).
    packed = pack_examples(examples, config.pack_length or config.length_buckets[-1], pad_id)
    num_rows = packed["tokens"].shape[0]
    rows_per_step = max(1, round(config.batch_size * num_rows / len(examples)))
    if layout is not None:  # packed rows per step: a multiple of the data axes' size
      n = mesh_lib.data_parallel_size(layout.mesh)
      rows_per_step = max(n, round(rows_per_step / n) * n)
  if layout is not None:  # checked before anything compiles
    layout.check_batch(rows_per_step if config.packing else config.batch_size, what="batch_size")
    params, opt_state = layout.shard(params), layout.shard(opt_state)
  history = []
  t0 = time.perf_counter()
  acc = dict(window or dict(loss=0.0, n=0, pad=0.0))
  while step < config.num_steps:
    stop_point(should_stop, prefix, config.num_steps,
               SFTState(params, opt_state, step, pos, dict(acc)), checkpoint)
    if config.packing:
      idx, pos = text_data.next_batch_indices(pos, num_rows, rows_per_step)
      batch = {k: v[idx] for k, v in packed.items()}
    else:
      idx, pos = text_data.next_batch_indices(pos, len(examples), config.batch_size,
                                              lengths=lengths, group_size=config.group_size)
      length = bucket_size(int(lengths[idx].max()), config.length_buckets)
      batch = make_batch([examples[i] for i in idx], length, pad_id)
    params, opt_state, metrics = step_fn(
        params, opt_state, batch if layout is None else layout.put_batch(batch))
    step += 1
    acc["loss"] += float(metrics["loss"])
    acc["n"] += 1
    acc["pad"] += float(1.0 - batch["mask"].mean())
    if step % config.log_every == 0 or step == config.num_steps:
      rec = {f"{prefix}loss": acc["loss"] / acc["n"],
             f"{prefix}grad_norm": float(metrics["grad_norm"]),
             f"{prefix}padding_fraction": acc["pad"] / acc["n"],
             f"{prefix}wall_s": time.perf_counter() - t0}
      history.append(dict(rec, step=step))
      if writer is not None:
        writer.write(step, rec, stage=prefix.strip("/") or None)
      if log is not None:
        log(record_line(prefix, step, config.num_steps, rec))
      acc = dict(loss=0.0, n=0, pad=0.0)
  nnx.update(model, params)
  return model, SFTState(params, opt_state, step, pos, acc), history
