"""The RL stage both pipelines end with: the trainer's steps, checkpointed or not, and their
console lines."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rljax import runtime
from rljax.alignment import checkpointing, kl_plot, rlhf, summary, timeline


def run_rl(trainer: rlhf.RLHFTrainer, logdir: str | None, *, use_ckpt: bool, writer,
           log: Callable[[str], None], show_every: int, checkpoint_every: int = 10,
           keep_checkpoints: int = 3, resume: bool = True, sigterm=None
           ) -> tuple[list[dict[str, Any]], int | None]:
  """Runs ``trainer``'s RL steps; returns ``(history, resumed_from)``.

  With ``use_ckpt`` (a ``logdir``) they run through `rljax.alignment.checkpointing.train`
  (checkpoints every ``checkpoint_every`` steps, resume, SIGTERM), and a resumed run's history
  is the whole RL history read back from ``metrics.jsonl``; otherwise through
  `rljax.alignment.rlhf.RLHFTrainer.train` (``resumed_from`` is then None). The first step,
  every ``show_every``-th and the last go to ``log`` as `rljax.alignment.summary.rl_step_line`.
  With a ``logdir`` the steps run here are drawn to ``<logdir>/timeline.png``
  (`rljax.alignment.timeline`; also when the run stops early), and the whole run's KL and
  ``beta`` to ``<logdir>/kl.png`` (`rljax.alignment.kl_plot`; where a reference is used).
  """
  num_steps = trainer.config.num_steps

  def show(rec):
    if summary.shows_step(int(rec["step"]), show_every, num_steps):
      log(summary.rl_step_line(rec))

  if not use_ckpt:
    return trainer.train(writer=writer, callback=show), None
  try:
    history, resumed_from = checkpointing.train(
        trainer, logdir, checkpoint_every=checkpoint_every, keep=keep_checkpoints,
        resume=resume, writer=writer, callback=show, log=log, sigterm=sigterm)
  finally:
    if runtime.is_primary():
      timeline.write_timeline(trainer.timeline, os.path.join(logdir, "timeline.png"),
                              title=_title(trainer.config))
      if trainer.config.uses_reference and writer is not None:
        kl_plot.write_kl_plot(writer.jsonl_path, os.path.join(logdir, "kl.png"), trainer.config)
  if resumed_from is not None:  # the whole RL history, from before the resume too
    history = checkpointing.rl_history(writer.jsonl_path, history)
  return history, resumed_from


def _title(config: rlhf.RLHFConfig) -> str:
  mode = (f"asynchronous, max_staleness={config.max_staleness}" if config.max_staleness
          else "synchronous")
  return f"{config.algo.value} RL steps ({mode}): generation, scoring, training, weight sync"
