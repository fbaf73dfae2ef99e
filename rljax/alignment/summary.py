"""What an RLHF run reports: its summary (``summary.json``) and console lines."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rljax import checkpoint as ckpt
from rljax import runtime
from rljax.alignment.timeline import overlap_summary


def history_summary(history: Sequence[Mapping[str, float]], k: int) -> dict[str, float]:
  """``reward_first``/``reward_last`` (mean ``reward/mean`` of the first and last ``k`` steps),
  ``score_first``/``score_last`` (the same of ``score/mean``, the reward model's or reward
  function's score before the penalties; NaN for records without it) and ``kl_max`` over
  finite values only, so a step whose reward was not finite (its update
  skipped by the non-finite guard) does not turn them into NaN; an empty selection gives NaN.
  ``kl_last`` is the last step's ``kl`` as logged (NaN when it was not finite or not measured);
  ``summary_steps``: the window actually used, ``min(k, len(history) // 2)`` so that the first
  and last windows do not overlap (1 for a 1-step run, whose two windows are its one step).
  Also the per-step phase times and the overlap of generation with the update
  (`rljax.alignment.timeline.overlap_summary`: ``step_generation_s``, ``step_update_s``,
  ``step_sync_s``, ``step_overlap_s``, ``step_s``, ``overlap_fraction``)."""

  def finite(values):
    a = np.asarray(list(values), np.float64)
    return a[np.isfinite(a)]

  def mean(values):
    a = finite(values)
    return float(a.mean()) if a.size else float("nan")

  k = max(1, min(k, len(history) // 2))
  rewards = [h["reward/mean"] for h in history]
  scores = [h.get("score/mean", np.nan) for h in history]
  kls = finite(h.get("kl", np.nan) for h in history)
  return dict(reward_first=mean(rewards[:k]), reward_last=mean(rewards[-k:]),
              score_first=mean(scores[:k]), score_last=mean(scores[-k:]),
              kl_max=float(kls.max()) if kls.size else float("nan"),
              kl_last=float(history[-1].get("kl", np.nan)) if history else float("nan"),
              summary_steps=min(k, len(history)), **overlap_summary(history))


def nats(x: float) -> str:
  """A KL value (nats) for the console: 3 decimals, with no ``-0.000``. The k1 estimate of a
  policy still at the reference is a few 1e-5 either side of 0, and a minus sign there reads
  as a bug (``-0.0006`` still shows as ``-0.001``)."""
  text = f"{x:.3f}"
  return "0.000" if text == "-0.000" else text


def rl_step_line(record: Mapping[str, float]) -> str:
  """The console line of one RL step, the same for every pipeline and algorithm, e.g.
  ``rl step   20: reward 0.512  kl 0.031  entropy 1.204  len 3.10  step 0.412s`` (``kl`` is NaN
  when not measured, see :func:`nats`; ``entropy`` is left out of records without it)."""
  entropy = f"  entropy {record['entropy']:.3f}" if "entropy" in record else ""
  return (f"rl step {int(record['step']):4d}: reward {record['reward/mean']:.3f}  "
          f"kl {nats(record.get('kl', float('nan')))}{entropy}  "
          f"len {record['response_length/mean']:.2f}  step {record['timing/step']:.3f}s")


def shows_step(step: int, every: int, num_steps: int) -> bool:
  """Whether the console shows RL step ``step``: the first, every ``every``-th and the last."""
  return step == 1 or step % every == 0 or step == num_steps


def write_summary(logdir: str | None, summary: Mapping[str, Any]) -> None:
  """Writes ``summary`` without its ``history`` to ``<logdir>/summary.json`` (process 0 only,
  atomically: a crash leaves the previous file or none). Nothing without a ``logdir``."""
  if logdir is not None and runtime.is_primary():
    ckpt.write_json_atomic(os.path.join(logdir, "summary.json"),
                           {k: v for k, v in summary.items() if k != "history"})


def finished_summary(logdir: str | None, resumed_from: int | None, num_steps: int,
                     history: Sequence[Mapping[str, float]]) -> dict[str, Any] | None:
  """The saved ``<logdir>/summary.json`` when this call resumed a run that had already finished
  (``resumed_from == num_steps``: nothing was trained), with this call's ``history`` and
  ``resumed_from``, and ``from_summary_json=True``; None otherwise (or when the file is
  missing). The file is left as the run wrote it, so its stage and wall times stay the
  training run's, not the re-run's."""
  if logdir is None or resumed_from != num_steps:
    return None
  path = os.path.join(logdir, "summary.json")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  return dict(saved, history=list(history), resumed_from=resumed_from, from_summary_json=True)
