"""The RL stage both pipelines end with: the trainer's steps, checkpointed or not, and their
console lines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rljax.alignment import checkpointing, rlhf, summary


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
  """
  num_steps = trainer.config.num_steps

  def show(rec):
    if summary.shows_step(int(rec["step"]), show_every, num_steps):
      log(summary.rl_step_line(rec))

  if not use_ckpt:
    return trainer.train(writer=writer, callback=show), None
  history, resumed_from = checkpointing.train(
      trainer, logdir, checkpoint_every=checkpoint_every, keep=keep_checkpoints,
      resume=resume, writer=writer, callback=show, log=log, sigterm=sigterm)
  if resumed_from is not None:  # the whole RL history, from before the resume too
    history = checkpointing.rl_history(writer.jsonl_path, history)
  return history, resumed_from
