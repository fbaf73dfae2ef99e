"""The control trainers' steps as the host loop (`rljax.loop.run`) calls them: one compiled
training chunk, timed into its record, and one evaluation. PPO and APG both use them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax


def chunk_step(train_chunk: Callable, env_steps_per_chunk: int,
               train_times: list[float] | None = None) -> Callable:
  """``step_fn((train_state, env_state), chunk) -> ((train_state, env_state), record)`` for
  `rljax.loop.run`: one call of ``train_chunk`` (``(ts, env_state) -> (ts, env_state,
  metrics)``); the record holds its metrics as floats, ``sps`` (environment steps per second
  of the chunk), ``timing/train_s`` and ``env_steps`` (cumulative, ``chunk *
  env_steps_per_chunk``). Each chunk's seconds are also appended to ``train_times``."""

  def step(state, chunk: int) -> tuple[Any, dict[str, float]]:
    t0 = time.perf_counter()
    ts, env_state, metrics = train_chunk(*state)
    record = {k: float(v) for k, v in jax.device_get(metrics).items()}
    train_s = time.perf_counter() - t0
    if train_times is not None:
      train_times.append(train_s)
    record.update({"sps": env_steps_per_chunk / train_s, "timing/train_s": train_s,
                   "env_steps": chunk * env_steps_per_chunk})
    return (ts, env_state), record

  return step


def chunk_evaluation(evaluate: Callable, eval_key: jax.Array) -> Callable:
  """``evaluate_fn((train_state, env_state), chunk) -> record`` for `rljax.loop.run`:
  ``evaluate(params, obs_stats, key)`` of the train state with ``fold_in(eval_key, chunk)``,
  its metrics as floats."""

  def run(state, chunk: int) -> dict[str, float]:
    ts = state[0]
    metrics = evaluate(ts.params, ts.obs_stats, jax.random.fold_in(eval_key, chunk))
    return {k: float(v) for k, v in jax.device_get(metrics).items()}

  return run
