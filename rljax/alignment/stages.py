"""The stages before RL (pre-training, SFT, reward model): saved while they run, resumed.

Layout under ``<logdir>/stages`` while the stages run (removed once ``frozen/`` holds what
they made, `rljax.alignment.checkpointing`)::

    <stage>.json          the marker: step, done, folder, data position, metrics window, record
    <stage>-<step>/       the stage's train state (orbax, atomic): parameters, optimizer state
    <stage>-<step>-done/  a stage that ended: its parameters

On a SIGTERM a stage stops before its next step and saves its train state; a stage that ends
saves its parameters. The rerun skips the stages that ended and continues the interrupted one
from its step, with the same batches and records. Each save is an orbax folder that the
stage's marker, written after it, points to; the previous folder is removed only then. A
stage also saves every ``save_every`` steps (the scripts' ``--stage_checkpoint_every``), which
a rerun after a SIGKILL continues from; a saved folder that cannot be read is set aside as
``<folder>.unreadable`` and its stage starts again.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from rljax import checkpoint as ckpt
from rljax import runtime
from rljax.alignment import sft
from rljax.envs.text import data as text_data

STAGES_DIR = "stages"
_STAGE_ORDER = {"pretrain": 0, "sft": 1, "rm": 2}  # the pipeline's order, for listings
# A SIGTERM during a stage stops it at the next step with this (the scripts exit 75 too),
# after `run_stage` saved the stage's state.
StageInterrupted = sft.Interrupted


def stages_dir(logdir: str) -> str:
  """``<logdir>/stages`` (absolute): the stages' saved states while they run."""
  return os.path.join(os.path.abspath(logdir), STAGES_DIR)


def saved_stages(logdir: str) -> dict[str, dict[str, Any]]:
  """``{stage: marker}`` of the stages saved under ``logdir``: each marker has ``step``,
  ``done``, ``folder`` (the orbax folder's name), ``data_position`` (``[epoch, index, seed]``),
  ``window`` (the sums behind the next metrics record) and ``record`` (the stage's last logged
  record when ``done``, else None)."""
  d = stages_dir(logdir)
  if not os.path.isdir(d):
    return {}
  out = {}
  names = [n[:-len(".json")] for n in os.listdir(d) if n.endswith(".json") and n[0] != "."]
  for name in sorted(names, key=lambda n: (_STAGE_ORDER.get(n, len(_STAGE_ORDER)), n)):
    with open(os.path.join(d, f"{name}.json"), encoding="utf-8") as f:
      out[name] = json.load(f)
  return out


def _jsonable(record: dict[str, Any] | None) -> dict[str, Any] | None:
  """``record`` with numpy scalars as Python ints and floats."""
  if record is None:
    return None
  return {k: int(v) if isinstance(v, (int, np.integer)) else
          float(v) if isinstance(v, (float, np.floating)) else v for k, v in record.items()}


def _stage_item(state, done: bool) -> dict[str, Any]:
  tree = {"params": state.params} if done else {"params": state.params,
                                                "opt_state": state.opt_state}
  return ckpt.to_saveable(tree)


def save_stage(logdir: str, stage: str, state, *, done: bool,
               record: dict[str, Any] | None = None) -> str:
  """Saves a stage's train state (an ``SFTState`` or ``RewardModelState``): its parameters,
  and unless ``done`` its optimizer state, to ``<logdir>/stages/<stage>-<step>`` (orbax,
  atomic), then the marker ``<stage>.json`` with the step, the data position, the metrics
  window and ``record``; then removes the stage's earlier folder. Every process calls it.
  Returns the folder."""
  d = stages_dir(logdir)
  folder = f"{stage}-{int(state.step)}{'-done' if done else ''}"
  path = os.path.join(d, folder)
  marker = saved_stages(logdir).get(stage)
  if marker is not None and marker["folder"] == folder:  # saved already: the same state (one
    return path                                           # more SIGTERM before its next step)
  ckpt.write_item(path, _stage_item(state, done), f"rljax-stage-{stage}")
  if runtime.is_primary():
    ckpt.write_json_atomic(os.path.join(d, f"{stage}.json"), dict(
        step=int(state.step), done=done, folder=folder,
        data_position=[int(x) for x in state.data_position], window=_jsonable(state.window),
        record=_jsonable(record)))
    for name in os.listdir(d):  # the stage's earlier folders (the marker points here now)
      if (name != folder and name.split("-")[0] == stage and not name.endswith(".json")
          and ".unreadable" not in name):  # set aside for inspection: kept
        shutil.rmtree(os.path.join(d, name), ignore_errors=True)
  runtime.sync_processes(f"rljax-stage-{stage}-saved")
  return path


def load_stage(logdir: str, stage: str, template: Callable[[], Any]):
  """The state saved for ``stage`` under ``logdir``, or None.

  Args:
    template: ``() ->`` the stage's fresh state (``sft.fresh_state`` /
      ``reward_model.fresh_state``), which gives the tree structure; called only when a state
      is saved.

  Returns:
    ``(state, marker)``: ``state`` is ``template`` with the saved parameters, step, data
    position and metrics window, and the optimizer state unless the stage ended
    (``marker["done"]``).

  Raises:
    UnreadableStage: the saved folder is missing, cannot be read, or does not fit
      ``template`` (names or shapes differ).
  """
  marker = saved_stages(logdir).get(stage)
  if marker is None:
    return None
  template = template()
  path = os.path.join(stages_dir(logdir), marker["folder"])
  if not os.path.isdir(path):
    raise UnreadableStage(stage, path, "FileNotFoundError: the folder is missing")
  try:
    with ckpt.quiet_failed_restore():
      saved = ckpt.restore_item(path, _stage_item(template, marker["done"]))
  except Exception as e:  # orbax raises many types for unreadable or mismatched data
    raise UnreadableStage(stage, path, ckpt.first_line(e, limit=160)) from None
  tree = ckpt.from_saveable({"params": template.params, "opt_state": template.opt_state}, saved)
  state = template._replace(params=tree["params"], opt_state=tree["opt_state"],
                            step=int(marker["step"]),
                            data_position=text_data.DataPosition(*marker["data_position"]),
                            window=marker["window"])
  return state, marker


class UnreadableStage(ValueError):
  """A stage's saved state (``path``) is missing, corrupt or does not fit the run's models."""

  def __init__(self, stage: str, path: str, reason: str):
    super().__init__(f"the saved {stage} state in {path} cannot be read ({reason})")
    self.stage, self.path = stage, path


def _set_stage_aside(logdir: str, e: UnreadableStage, log: Callable[[str], None]) -> None:
  """After `UnreadableStage` ``e``: its folder (if any) is renamed ``<folder>.unreadable``, its
  marker removed, and its records dropped from ``metrics.jsonl`` (the stage starts again)."""
  if runtime.is_primary():
    moved = ckpt.set_aside(e.path) if os.path.isdir(e.path) else None
    os.remove(os.path.join(stages_dir(logdir), f"{e.stage}.json"))
    ckpt.truncate_jsonl(os.path.join(logdir, "metrics.jsonl"), -1,
                        lambda r: r.get("stage") == e.stage, in_place=True)
    log(f"{e.stage}: {e}; " + (f"moved to {moved}, " if moved else "") +
        "the stage starts again")
  runtime.sync_processes(f"rljax-stage-{e.stage}-set-aside")


def drop_stages(logdir: str) -> None:
  """Removes ``<logdir>/stages`` (once ``frozen/`` holds what the stages made)."""
  if runtime.is_primary():
    shutil.rmtree(stages_dir(logdir), ignore_errors=True)
  runtime.sync_processes("rljax-stages-dropped")


def run_stage(logdir: str | None, stage: str, train: Callable, model: nnx.Module,
              template: Callable[[], Any], *, save_every: int = 0,
              log: Callable[[str], None] = print) -> tuple[nnx.Module, dict[str, Any], bool]:
  """Runs a stage before RL with its state saved under ``<logdir>/stages`` (no saving when
  ``logdir`` is None).

  A stage saved as ended is not run: its parameters go into ``model``. A stage saved part-way
  continues from its saved step. Its state is saved every ``save_every`` steps (0: never; the
  last saved state is what a SIGKILL or a lost node resumes from), at its end, and on an
  `sft.Interrupted` (SIGTERM), which is re-raised after the save (its ``saved_in`` names the
  folder). A saved state that cannot be read (`UnreadableStage`: corrupt, missing, or not
  fitting ``template``) is reported through ``log`` and set aside as ``<folder>.unreadable``
  with its records dropped from ``metrics.jsonl``; the stage then starts again.

  Args:
    stage: ``"pretrain"``, ``"sft"`` or ``"rm"``.
    train: ``(model, state or None, checkpoint) -> (model, state, history)``, e.g.
      ``sft.train_sft`` with its other arguments bound; ``checkpoint`` is its argument of
      that name (called with the state before each step) or None.
    template: ``() -> fresh state`` of the stage (the structure a saved one is restored into).
    save_every: steps between saves of the stage's state (>= 0).

  Returns:
    ``(model, record, ran)``: the trained model, the stage's last logged record (the saved
    one when the stage had ended) and whether the stage ran in this call.

  Raises:
    ValueError: ``save_every`` < 0.
  """
  if save_every < 0:
    raise ValueError(f"stage_checkpoint_every must be >= 0 (0: only on SIGTERM and at a "
                     f"stage's end), got {save_every}")
  if logdir is None:
    model, _, history = train(model, None, None)
    return model, history[-1], True
  state = None
  try:
    saved = load_stage(logdir, stage, template)
  except UnreadableStage as e:  # kept for inspection; the stage starts again
    _set_stage_aside(logdir, e, log)
    saved = None
  if saved is not None:
    state, marker = saved
    where = os.path.join(stages_dir(logdir), marker["folder"])
    if marker["done"]:
      nnx.update(model, state.params)
      log(f"{stage}: loaded the finished stage ({state.step} steps) from {where}")
      return model, marker["record"], False
    log(f"{stage}: resuming after step {state.step} from {where}")

  def checkpoint(s) -> None:  # before step s.step + 1; save_stage skips a step saved already
    if s.step and s.step % save_every == 0:
      save_stage(logdir, stage, s, done=False)

  try:
    model, state, history = train(model, state, checkpoint if save_every else None)
  except sft.Interrupted as e:
    if e.state is not None:
      e.saved_in = save_stage(logdir, stage, e.state, done=False)
    raise
  save_stage(logdir, stage, state, done=True, record=history[-1])
  return model, history[-1], True

