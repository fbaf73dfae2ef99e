"""The host loop every trainer runs: control PPO and APG, and RLHF.

A trainer brings one compiled step (a control chunk of iterations, one RL step) as
``step_fn(state, k) -> (state, record)``; `run` calls it ``num_steps`` times and does everything
between steps on the host, in this order, the same for every trainer::

    for k in start + 1 .. num_steps:
        state, record = step_fn(state, k)           the trainer's compiled work
        record |= evaluate(state, k)                optional, timed as timing/eval_s
        log the record                              history and the metrics writer
        checkpoint                                  every checkpoint_every steps and at the last
        on_record(k, state, record)                 e.g. an evaluation video
        non-finite policy                           warn, or checkpoint and raise NonFiniteHalt
        SIGTERM in any process                      checkpoint and raise Preempted

A SIGTERM that arrives before the first step (during start-up: building environments,
compiling) raises `Preempted` there. With ``LoopSpec.evaluate_first`` an evaluation of the
starting state is logged as step 0. With ``LoopSpec.overlap_eval`` the evaluation of step ``k``
runs on a second thread while step ``k + 1`` trains, on a copy of the state (the step donates
its inputs); records and checkpoints are still written in step order with the same values.

`Checkpoints` pairs an orbax ``CheckpointManager`` (`rljax.checkpoint`) with a trainer's
mapping between its state and the two saved items (``policy``, ``train_state``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from rljax import checkpoint as ckpt
from rljax import nonfinite
from rljax.preemption import Preempted

Record = dict[str, Any]
ItemsFn = Callable[[int, Any], tuple[dict[str, Any], dict[str, Any]]]
FromItemsFn = Callable[[Any, dict[str, Any], dict[str, Any]], Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSpec:
  """How `run` drives a trainer's steps.

  Attributes:
    num_steps: steps in the whole run (>= 1).
    unit: what one step is called in messages (``"chunk"``, ``"step"``).
    checkpoint_every: steps between checkpoints (>= 1); the last step is always saved.
    log_every: steps between records sent to the metrics writer (>= 1; the last is always
      sent); the history keeps every step's record.
    evaluate_first: log an evaluation of the starting state as step 0 (a fresh run only).
    save_if_stopped_first: a SIGTERM before the first step checkpoints the starting state
      (RLHF: step 0, whose frozen roles are saved) instead of saving nothing.
    overlap_eval: evaluate step ``k`` on a second thread while step ``k + 1`` trains.
  """

  num_steps: int
  unit: str = "step"
  checkpoint_every: int = 1
  log_every: int = 1
  evaluate_first: bool = False
  save_if_stopped_first: bool = False
  overlap_eval: bool = False

  def __post_init__(self):
    for name in ("num_steps", "checkpoint_every", "log_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Checkpoints:
  """A run's checkpoints: orbax's manager over ``<logdir>/checkpoints`` and the trainer's
  ``items(step, state) -> (policy, train_state)`` and ``from_items(state, policy,
  train_state) -> state`` (``state`` gives the structure to restore into).

  Saving a step twice is a no-op (the loop saves a step when it is due, when it halts and
  when it is preempted).

  Raises:
    ValueError: ``keep`` < 1.
  """

  def __init__(self, logdir: str, *, keep: int, items: ItemsFn, from_items: FromItemsFn):
    if keep < 1:
      raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
    self.logdir = logdir
    self.manager = ckpt.make_manager(logdir, max_to_keep=keep)
    self._items, self._from_items = items, from_items
    self.saved_step: int | None = None

  def restore(self, state: Any, *, log: Callable[[str], None] = print
              ) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest checkpoint that loads (an unreadable one is reported
    through ``log`` and set aside), or None when there is none."""
    restored = ckpt.restore(self.manager, *self._items(0, state), log=log)
    if restored is None:
      return None
    step, policy, train = restored
    self.saved_step = step
    return step, self._from_items(state, policy, train)

  def save(self, step: int, state: Any) -> None:
    """Writes ``state`` as checkpoint ``step`` and waits for it (unless saved already)."""
    if self.saved_step != step:
      ckpt.save(self.manager, step, *self._items(step, state))
      self.saved_step = step

  def close(self) -> None:
    self.manager.close()


class _Done(NamedTuple):
  """A trained step whose evaluation, record and checkpoint are still to come."""

  step: int
  record: Record
  state: Any


def snapshot(tree):
  """A device copy of ``tree``'s arrays (same shardings) that compiles nothing (``jnp.copy``
  would compile one program per leaf shape), made before the next step donates the
  originals; it waits for the copy."""
  return jax.block_until_ready(jax.device_put(tree, may_alias=False))


def run(spec: LoopSpec, state: Any, step_fn: Callable[[Any, int], tuple[Any, Record]], *,
        sigterm: ckpt.SigtermFlag, start: int = 0, logdir: str | None = None,
        checkpoints: Checkpoints | None = None,
        evaluate: Callable[[Any, int], Record] | None = None, writer=None,
        progress: Callable[[int, Record], int] | None = None, stage: str | None = None,
        history: Sequence[Record] = (), first_record: Record | None = None,
        on_record: Callable[[int, Any, Record], Any] | None = None,
        watch: nonfinite.Watch | None = None,
        wall_clock_start: float | None = None) -> tuple[Any, list[Record]]:
  """Runs steps ``start + 1 .. spec.num_steps`` of ``step_fn`` from ``state``.

  Args:
    spec: the loop's settings.
    state: the state after step ``start`` (fresh, or restored by ``checkpoints``).
    step_fn: ``(state, step) -> (state, record)``: step number ``step`` and its metrics.
    sigterm: the installed `rljax.checkpoint.SigtermFlag`; asked in every process after each
      step but the last (a collective with several processes) and before the first.
    start: the step ``state`` is at.
    logdir: named in messages.
    checkpoints: where states are saved (None: nowhere).
    evaluate: ``(state, step) -> record`` merged into each step's record.
    writer: a `rljax.metrics.MetricsWriter` (or None); each record is written at its step.
    progress: ``(step, record) -> int``, the writer's progress (default: the step).
    stage: the writer's ``stage`` field.
    history: records logged before ``start`` (a resumed run); the returned history adds
      this run's, each with its ``step``.
    first_record: the step-0 record's own entries beside its evaluation (``evaluate_first``).
    on_record: ``(step, state, record)``, called after each record is logged and saved.
    watch: the trainer's non-finite policy (`rljax.nonfinite.Watch`).
    wall_clock_start: ``time.perf_counter()`` at the run's start; records then get
      ``timing/wall_s``, the seconds since then.

  Returns:
    ``(state, history)``.

  Raises:
    Preempted: SIGTERM in some process; the state after the last finished step is
      checkpointed (before the first step: see ``spec.save_if_stopped_first``).
    rljax.nonfinite.NonFiniteHalt: ``watch.policy == "halt"`` and an update was skipped;
      that step's state, whose parameters are the last finite ones, is checkpointed.
  """
  history = list(history)
  n = spec.num_steps
  if start >= n:
    return state, history
  if sigterm.any_process():  # in start-up
    if spec.save_if_stopped_first and checkpoints is not None:
      checkpoints.save(start, state)
      raise Preempted(start, str(logdir), unit=spec.unit)
    raise Preempted(start, str(logdir), unit=spec.unit, during_start_up=True)
  skipped_before = watch.skipped(state) if watch is not None else 0

  def timed_eval(state, step: int) -> Record:
    t = time.perf_counter()
    record = dict(evaluate(state, step))
    record["timing/eval_s"] = time.perf_counter() - t
    return record

  def finish(done: _Done, evaluated: Record) -> None:
    """Logs, checkpoints and reports one step, in step order."""
    nonlocal skipped_before
    step, state = done.step, done.state
    record = dict(done.record, **evaluated)
    if wall_clock_start is not None:
      record["timing/wall_s"] = time.perf_counter() - wall_clock_start
    history.append(dict(record, step=step))
    if writer is not None and (step % spec.log_every == 0 or step == n):
      writer.write(step, record, progress=step if progress is None else progress(step, record),
                   stage=stage)
    if step > 0 and checkpoints is not None and (step % spec.checkpoint_every == 0 or step == n):
      checkpoints.save(step, state)
    if on_record is not None:
      on_record(step, state, history[-1])
    if watch is not None:
      skipped = watch.skipped(state)
      if skipped > skipped_before:
        message = watch.describe(step, state, history[-1], skipped_before, skipped)
        skipped_before = skipped
        if watch.policy == "halt":
          if checkpoints is None:
            raise nonfinite.NonFiniteHalt(f"{message}; halted (the run has no logdir, so "
                                          f"nothing was checkpointed)")
          checkpoints.save(step, state)
          raise nonfinite.NonFiniteHalt(f"{message}; halted with the last good state "
                                        f"checkpointed in {logdir} ({spec.unit} {step})")
        if watch.warn is not None:
          watch.warn(message)

  no_eval: Callable[[Any, int], Record] = lambda state, step: {}  # noqa: E731
  evaluate_now = timed_eval if evaluate is not None else no_eval
  overlap = spec.overlap_eval and evaluate is not None
  pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rljax-eval")
          if overlap else None)
  pending: _Done | None = None
  try:
    if start == 0 and spec.evaluate_first and evaluate is not None:
      before = _Done(0, dict(first_record or {}), state)
      if overlap:
        pending = before._replace(state=snapshot(state))
      else:
        finish(before, evaluate_now(state, 0))
    for step in range(start + 1, n + 1):
      evaluating = (pool.submit(evaluate_now, pending.state, pending.step)
                    if pending is not None else None)
      state, record = step_fn(state, step)
      if pending is not None:
        finish(pending, evaluating.result())
        pending = None
      done = _Done(step, record, state)
      last = step == n
      if overlap and not last and not sigterm.received:
        pending = done._replace(state=snapshot(state))
        continue
      finish(done, evaluate_now(state, step))
      if not last and sigterm.any_process():  # every process stops after the same step
        if checkpoints is not None:
          checkpoints.save(step, state)
        raise Preempted(step, str(logdir), unit=spec.unit)
  finally:
    if pool is not None:
      pool.shutdown(wait=True)
  if checkpoints is not None:
    checkpoints.save(n, state)
  return state, history
