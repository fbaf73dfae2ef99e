"""Rollouts of the RLHF trainer and the generator that makes them ahead of the update.

A rollout is one step's batch after the stages that need no trained weights other than the
generating actor's: generation (the sampler), the REFERENCE log-probs and the REWARD scores.
The update then trains on it (`rljax.alignment.rlhf.RLHFTrainer`).

With ``RLHFConfig.max_staleness = s > 0`` a `Generator` makes the rollouts on its own host
thread, ``s`` batches ahead of the update (asynchronous RLHF, one-step off-policy for
``s = 1``; as verl's one-step off-policy mode, AReaL, Fu et al. 2025, arXiv:2505.24298)::

    step v (policy version v = updates applied so far):
      trainer:   copy the actor (version v) -> submit batch v + s      (timing/sync)
                 wait for batch v -> critic -> update -> version v + 1  (timing/update)
      generator: ... batch v + 1, generated with version max(0, v + 1 - s), while v trains

Batch ``j`` is always generated with version ``max(0, j - s)`` and trained at step ``j``, so
no sample is trained more than ``s`` updates after the version that generated it
(``rollout/policy_lag_max <= s``). What a batch holds depends only on its index (prompts, PRNG
keys: the synchronous trainer's chain) and its version's weights, never on thread timing, so
a run is deterministic and a resumed run regenerates its in-flight batches exactly from the
versions saved in the checkpoint (``RLHFState.lagged_actor``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from rljax.alignment import reward_functions
from rljax.envs.text import data as text_data
from rljax.sampling import SampleOutput


class BatchPlan(NamedTuple):
  """What batch ``index`` draws: its prompt rows and PRNG keys, from the data position and key
  the synchronous trainer would have before that step (``next_*``: after it)."""

  index: int
  rows: list[int]
  gen_key: jax.Array
  update_key: jax.Array
  next_key: jax.Array
  next_position: text_data.DataPosition


class Rollout(NamedTuple):
  """One batch, generated, referenced and scored.

  Attributes:
    plan: the `BatchPlan` it was drawn by.
    version: the policy version (updates applied) of the weights that generated it.
    out: the sampler's `rljax.sampling.SampleOutput` (``tokens [B, R]``, ``log_probs_t1``:
      the behaviour policy's full-vocabulary log-probs of the sampled tokens, ...).
    ref_log_probs: ``[B, R]`` float32 REFERENCE log-probs (the sampler's own without a
      reference pass).
    raw_scores: ``[B]`` float32 scores of the reward model or function.
    scores: ``[B]`` ``raw_scores`` with the missing-EOS and overlong penalties.
    timing: seconds of ``timing/reshard``, ``timing/generation``, ``timing/reference`` and
      ``timing/reward``.
    spans: ``(stage, start, end)`` of ``sync``, ``generate`` and ``score``, in
      ``time.perf_counter`` seconds (for the timeline).
  """

  plan: BatchPlan
  version: int
  out: SampleOutput
  ref_log_probs: Any
  raw_scores: np.ndarray
  scores: np.ndarray
  timing: dict[str, float]
  spans: tuple[tuple[str, float, float], ...]


def plan_batch(index: int, key: jax.Array, position: text_data.DataPosition, *,
               num_prompts: int, prompts_per_step: int, group_size: int) -> BatchPlan:
  """Batch ``index``'s prompt rows (each prompt ``group_size`` times) and keys, drawn from
  ``key`` and ``position`` as the synchronous trainer draws them."""
  idx, pos = text_data.next_batch_indices(position, num_prompts, prompts_per_step)
  rows = [int(i) for i in idx for _ in range(group_size)]
  next_key, gen_key, update_key = jax.random.split(key, 3)
  return BatchPlan(index, rows, gen_key, update_key, next_key, pos)


class GeneratorError(RuntimeError):
  """The generator failed: names the batch (the RL step that was to train it) and the cause."""


class Generator:
  """Makes rollouts on one host thread, in batch order, ``max_staleness`` ahead of the update.

  Args:
    make_rollout: ``(plan, params, version) -> Rollout``: generation, reference and reward
      for one batch with the actor weights ``params`` (training layout; the function moves
      them to the generation layout itself).
    plan_next: ``(index, key, position) -> BatchPlan``.
    num_steps: the run's last step (no batch is made beyond it).
  """

  def __init__(self, make_rollout: Callable[[BatchPlan, Any, int], Rollout],
               plan_next: Callable[[int, jax.Array, text_data.DataPosition], BatchPlan], *,
               num_steps: int):
    self._make = make_rollout
    self._plan = plan_next
    self._num_steps = num_steps
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rljax-generator")
    self._pending: collections.deque[tuple[int, concurrent.futures.Future]] = collections.deque()
    self._lock = threading.Lock()
    self.busy_spans: list[tuple[str, float, float]] = []  # the generator's stages, in order
    self._cursor: tuple[int, jax.Array, text_data.DataPosition] | None = None

  def start(self, step: int, key: jax.Array, position: text_data.DataPosition,
            lagged: tuple[Any, ...]) -> None:
    """Submits batches ``step .. step + s - 1`` (``s = len(lagged)``, the max_staleness),
    batch ``step + i`` with ``lagged[i]``, the weights of version ``max(0, step + i - s)``;
    ``key`` and ``position`` are the train state's at ``step``."""
    self._cursor = (step, key, position)
    for i, params in enumerate(lagged):
      self.submit(params, max(0, step + i - len(lagged)))

  def submit(self, params, version: int) -> None:
    """Queues the next batch, to be generated with ``params`` (policy ``version``)."""
    index, key, position = self._cursor
    if index >= self._num_steps:
      return
    plan = self._plan(index, key, position)
    self._cursor = (index + 1, plan.next_key, plan.next_position)
    self._pending.append((index, self._pool.submit(self._run, plan, params, version)))

  def _run(self, plan: BatchPlan, params, version: int) -> Rollout:
    rollout = self._make(plan, params, version)
    with self._lock:
      self.busy_spans.extend(s for s in rollout.spans if s[0] != "sync")
    return rollout

  def next(self, index: int) -> tuple[Rollout, float]:
    """The rollout of batch ``index`` (the oldest queued) and the seconds waited for it.

    Raises:
      GeneratorError: the generator raised while making it (the cause is chained), or batch
        ``index`` was never submitted.
      rljax.alignment.reward_functions.RewardFunctionError: a reward function named on the
        command line failed while scoring it (a user error, reported as in a synchronous run).
    """
    if not self._pending or self._pending[0][0] != index:
      queued = [i for i, _ in self._pending]
      raise GeneratorError(f"the generator has no batch for RL step {index + 1} "
                           f"(queued batches: {queued})")
    _, future = self._pending.popleft()
    t = time.perf_counter()
    try:
      rollout = future.result()
    except (GeneratorError, reward_functions.RewardFunctionError):
      raise  # already named with the step: a remote generator, or a user's reward function
    except Exception as e:
      raise GeneratorError(f"the generator failed on the batch of RL step {index + 1}: "
                           f"{type(e).__name__}: {e}") from e
    return rollout, time.perf_counter() - t

  def busy_within(self, start: float, end: float) -> float:
    """Seconds in ``[start, end]`` during which the generator was generating or scoring."""
    with self._lock:
      spans = list(self.busy_spans)
    return float(sum(max(0.0, min(e, end) - max(s, start)) for _, s, e in spans))

  def close(self) -> None:
    """Drops the queued batches (waiting for the one being made) and stops the thread."""
    for _, future in self._pending:
      future.cancel()
    self._pending.clear()
    self._pool.shutdown(wait=True, cancel_futures=True)
