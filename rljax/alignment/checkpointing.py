"""Checkpoints, resume and preemption for the RLHF trainer (rljax.alignment.rlhf.RLHFTrainer).

Layout under ``<logdir>`` (the orbax parts through :mod:`rljax.checkpoint`)::

    checkpoints/config.json          the pipeline's config; a resume with another one is refused
    checkpoints/<step>/policy/       the actor's parameters (what inference needs)
    checkpoints/<step>/train_state/  the critic's parameters, both optimizer states (one
                                     ``optax.multi_transform`` over {actor, critic}), the KL
                                     controller state (its current ``beta``; fixed or adaptive),
                                     the step, the data position (epoch, index in the epoch's
                                     order, shuffle seed), the PRNG key and the
                                     count of skipped (non-finite) updates
    frozen/                          the frozen roles, written once (see below)
    stages/<stage>.json, <stage>-<step>/   the stages before RL (pretrain, sft, rm) while
                                     they run (see below); removed once frozen/ is written

The sampler has no seed stream of its own: each step splits its generation key (and the
update's minibatch key) from the state's PRNG key, so restoring that key restores the
sampler's stream. Every ``checkpoint_every`` steps, and at the last step, a checkpoint is
written through orbax's ``CheckpointManager`` (temporary folder, renamed when complete; the
last ``keep`` are kept). A checkpoint that does not load (truncated, corrupt) is reported and
skipped in favour of the previous one.

Frozen roles. The REFERENCE model (and, with a learned reward, the REWARD model) never change
during RL, so they are not part of each step's checkpoint. They are saved once, before the
first RL step, under ``<logdir>/frozen`` (an orbax checkpoint, atomic; with a small JSON of
what the earlier stages measured). A resume loads them from there instead of re-running
pre-training, SFT and reward-model training: that is cheaper than rebuilding them and is
exact by construction (the same bits), whatever the machine or library versions do to a
re-run of those stages.

Stages before RL (:func:`run_stage`). On a SIGTERM, pre-training, SFT and reward-model
training stop before their next step and save their train state (parameters, optimizer state,
step, data position, the sums behind the next metrics record) under ``<logdir>/stages``; a
stage that ends saves its parameters there too. The rerun skips the stages that ended and
continues the interrupted one from its step, with the same batches and records. Each save is
an orbax folder (atomic) that the stage's small JSON marker, written after it, points to; the
previous folder is removed only then. A stage also saves every ``save_every`` steps (the
scripts' ``--stage_checkpoint_every``), which a rerun after a SIGKILL continues from; a saved
folder that cannot be read is set aside as ``<folder>.unreadable`` and its stage starts again.

On SIGTERM (:class:`rljax.checkpoint.SigtermFlag`) the current step finishes, a checkpoint is
written and :class:`Preempted` is raised; the scripts then exit with
:data:`rljax.checkpoint.EXIT_PREEMPTED` (75), like the control trainer.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from rljax import checkpoint as ckpt
from rljax import kl as kl_lib
from rljax import ppo, runtime
from rljax.alignment import rlhf, sft
from rljax.envs.text import data as text_data

EXIT_PREEMPTED = ckpt.EXIT_PREEMPTED
FROZEN_DIR = "frozen"
FROZEN_META = "meta.json"
# Keys of the RL records in metrics.jsonl (which also holds pre-training/SFT records).
_RL_KEY = "reward/mean"


class Preempted(Exception):
  """Raised after SIGTERM: the current step finished and was checkpointed."""

  def __init__(self, step: int, logdir: str):
    super().__init__(f"preempted by SIGTERM; checkpointed step {step} in {logdir}")
    self.step = step


# A SIGTERM during the stages before RL (pre-training, SFT, reward model) stops them at the next
# step with this (the scripts exit 75 too), after `run_stage` saved the stage's state.
StageInterrupted = sft.Interrupted
STAGES_DIR = "stages"
_STAGE_ORDER = {"pretrain": 0, "sft": 1, "rm": 2}  # the pipeline's order, for listings

config_to_json = ckpt.config_to_json  # a (nested) config as JSON: enums by value, tuples lists


# ---- the train state as two orbax items --------------------------------------------------------


def state_items(state: rlhf.RLHFState) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(policy, train_state)`` items of ``state``: flat ``{key path: array}`` dicts.

  ``policy`` holds the actor's parameters; ``train_state`` everything else. The PRNG key is
  stored as its raw ``uint32`` data; ints as int64 scalars.
  """
  params = state.ppo_state.params
  policy = ckpt.to_saveable({"actor": params["actor"]})
  train = ckpt.to_saveable({
      "critic": params.get("critic", {}),
      "opt_state": state.ppo_state.opt_state,
      "kl_coef": state.kl_state.kl_coef,
  })
  train["step"] = np.asarray(state.step, np.int64)
  train["data_position"] = np.asarray(tuple(state.data_position), np.int64)
  train["key"] = jax.random.key_data(state.key)
  train["skipped_updates"] = np.asarray(state.skipped_updates, np.int64)
  return policy, train


def state_from_items(template: rlhf.RLHFState, policy: dict[str, Any],
                     train: dict[str, Any]) -> rlhf.RLHFState:
  """Inverse of :func:`state_items`, with ``template`` (the trainer's fresh state) giving the
  tree structure and the PRNG key's implementation."""
  params = dict(template.ppo_state.params)
  params["actor"] = ckpt.from_saveable({"actor": params["actor"]}, policy)["actor"]
  rest = ckpt.from_saveable({"critic": params.get("critic", {}),
                             "opt_state": template.ppo_state.opt_state,
                             "kl_coef": template.kl_state.kl_coef}, train)
  if "critic" in params:
    params["critic"] = rest["critic"]
  epoch, index, seed = (int(x) for x in np.asarray(train["data_position"]))
  key = jax.random.wrap_key_data(jax.numpy.asarray(train["key"]),
                                 impl=jax.random.key_impl(template.key))
  return rlhf.RLHFState(
      ppo.PPOState(params, rest["opt_state"]), kl_lib.KLControllerState(rest["kl_coef"]),
      int(train["step"]), text_data.DataPosition(epoch, index, seed), key,
      int(train["skipped_updates"]))


# ---- frozen roles -------------------------------------------------------------------------------


def frozen_dir(logdir: str) -> str:
  """``<logdir>/frozen`` (absolute): the frozen roles' checkpoint (reference, reward model)."""
  return os.path.join(os.path.abspath(logdir), FROZEN_DIR)


def has_frozen(logdir: str) -> bool:
  """Whether ``<logdir>/frozen`` holds a complete frozen-roles checkpoint."""
  return os.path.exists(os.path.join(frozen_dir(logdir), FROZEN_META))


def _write_item(path: str, item: dict[str, Any], barrier: str) -> None:
  """Writes the flat item ``item`` (:func:`rljax.checkpoint.to_saveable`) to the orbax folder
  ``path`` (temporary folder, then renamed), replacing an incomplete earlier attempt there.
  Every process calls it; arrays held by one process only are saved as replicated global
  arrays (:func:`rljax.checkpoint.globalize`)."""
  if runtime.is_primary() and os.path.exists(path):  # an incomplete earlier attempt: redo it
    shutil.rmtree(path)
  runtime.sync_processes(f"{barrier}-clear")
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:  # synchronous (see make_manager)
    c.save(path, args=ocp.args.StandardSave(ckpt.globalize(item)))


def _restore_item(path: str, local: dict[str, Any]) -> dict[str, Any]:
  """The item `_write_item` wrote to ``path``, restored onto ``local``'s shapes and shardings;
  raises what orbax raises."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, ckpt.globalize(local))
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:
    return ckpt.localize(c.restore(path, args=ocp.args.StandardRestore(abstract)), local)


@contextlib.contextmanager
def _quiet_failed_restore():
  """Within, and after a failure in it: the reports of a failed orbax restore's leftover work
  are not printed. It leaves one asyncio task per array whose exception was never retrieved
  (each with TensorStore's page-long spec), and TensorStore callbacks that then find the event
  loop closed (`sys.unraisablehook`, from other threads, after the restore has returned). The
  caller's one-line error covers them; other reports pass."""
  logger = logging.getLogger("asyncio")
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  try:
    yield
  except Exception:
    hook = sys.unraisablehook
    if not getattr(hook, "_rljax_quiet", False):  # installed once; passes everything else on

      def quiet(unraisable):
        if not (unraisable.exc_type is RuntimeError
                and str(unraisable.exc_value) == "Event loop is closed"):
          hook(unraisable)

      quiet._rljax_quiet = True
      sys.unraisablehook = quiet
    raise
  finally:
    gc.collect()
    logger.setLevel(level)


def _read_item(path: str, local: dict[str, Any], what: str) -> dict[str, Any]:
  """The item `_write_item` wrote to ``path``, restored onto ``local``'s shapes and shardings.

  Raises:
    ValueError: it does not fit ``local`` (names or shapes differ) or cannot be read; the
      message names ``what`` and ``path``.
  """
  try:
    return _restore_item(path, local)
  except Exception as e:  # orbax raises many types for unreadable or mismatched data
    raise ValueError(f"{what} in {path} cannot be loaded into this run's models "
                     f"({ckpt.first_line(e)})") from None


def save_frozen(logdir: str, models: dict[str, nnx.Module], meta: dict[str, Any]) -> None:
  """Saves the full state of each model in ``models`` (e.g. ``{"reference": m}``) once.

  The orbax checkpoint is written to ``<logdir>/frozen/roles`` (temporary folder, then
  renamed); ``meta`` (JSON-able) is written last, atomically, and marks it complete. Every
  process calls this; arrays held by one process only are saved as replicated global
  arrays (:func:`rljax.checkpoint.globalize`), and process 0 writes ``meta``.
  """
  path = frozen_dir(logdir)
  _write_item(os.path.join(path, "roles"),
              ckpt.to_saveable({name: nnx.state(m) for name, m in models.items()}),
              "rljax-frozen")
  if runtime.is_primary():
    ckpt.write_json_atomic(os.path.join(path, FROZEN_META), meta)
  runtime.sync_processes("rljax-frozen-saved")


def load_frozen(logdir: str, models: dict[str, nnx.Module]) -> dict[str, Any]:
  """Loads the frozen roles into ``models`` (same names and architectures as saved).

  Returns:
    the ``meta`` dict saved with them.

  Raises:
    FileNotFoundError: no complete frozen checkpoint under ``logdir``.
    ValueError: the saved roles do not fit ``models`` (names or shapes differ).
  """
  path = frozen_dir(logdir)
  if not has_frozen(logdir):
    raise FileNotFoundError(f"no frozen roles under {path}")
  saved = _read_item(os.path.join(path, "roles"),
                     ckpt.to_saveable({name: nnx.state(m) for name, m in models.items()}),
                     "the frozen roles")
  for name, m in models.items():
    nnx.update(m, ckpt.from_saveable({name: nnx.state(m)}, saved)[name])
  with open(os.path.join(path, FROZEN_META), encoding="utf-8") as f:
    return json.load(f)


# ---- the stages before RL ----------------------------------------------------------------------


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
  _write_item(path, _stage_item(state, done), f"rljax-stage-{stage}")
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
    with _quiet_failed_restore():
      saved = _restore_item(path, _stage_item(template, marker["done"]))
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


def run_preemptible(main: Callable[[ckpt.SigtermFlag], int | None]) -> int | None:
  """The alignment scripts' SIGTERM handling: ``main(sigterm)`` under an installed
  :class:`rljax.checkpoint.SigtermFlag`; a `Preempted` or `StageInterrupted` (its state saved)
  is printed to stderr and returns :data:`EXIT_PREEMPTED` (75), else ``main``'s result."""

  with ckpt.SigtermFlag() as sigterm:
    try:
      return main(sigterm)
    except (Preempted, StageInterrupted) as e:
      print(f"{e}; exiting with status {EXIT_PREEMPTED}", file=sys.stderr)
      return EXIT_PREEMPTED


# ---- resume checks and the host loop ------------------------------------------------------------


def saved_state(logdir: str) -> str | None:
  """What RLHF state ``logdir`` holds, in words (e.g. ``"RL checkpoints up to step 4"``,
  ``"saved stages: pretrain ended at step 40, sft stopped after step 19"``), or None."""
  newest = ckpt.newest_step(logdir)
  if newest is not None:
    return f"RL checkpoints up to step {newest}"
  if has_frozen(logdir):
    return f"the models of the stages before RL, in {frozen_dir(logdir)}"
  stages = saved_stages(logdir)
  if not stages:
    return None
  return "saved stages: " + ", ".join(
      f"{name} {'ended at' if m['done'] else 'stopped after'} step {m['step']}"
      for name, m in stages.items())


def check_logdir(logdir: str, section: str, config_json: dict[str, Any], *, resume: bool,
                 defaults: dict[str, Any] | None = None,
                 flag_names: dict[str, str] | None = None) -> None:
  """`prepare`'s checks alone, writing nothing (the scripts run them before ``run_info.json``
  is written, so that a refused command leaves the run's folder as it was).

  ``flag_names``: fields named by other flags (`rljax.checkpoint.check_same_config`).

  Raises:
    ValueError: ``logdir`` holds RLHF state (a stage's saved state, frozen roles or RL
      checkpoints) and ``resume`` is False, or of another kind of run, or its saved config
      differs from ``config_json`` (see `prepare`).
  """
  ckpt.check_resume(logdir, saved_state(logdir), resume=resume, section=section,
                    config_json=config_json, defaults=defaults, flag_names=flag_names)


def _keep_stage_records(path: str, stages: dict[str, dict[str, Any]]) -> int:
  """Drops the records of ``metrics.jsonl`` at ``path`` that no saved stage covers: those of
  other stages (RL included) and those after a saved stage's step; returns how many."""
  def covered(r):
    return r.get("stage") in stages and r["step"] <= stages[r["stage"]]["step"]

  return ckpt.truncate_jsonl(path, -1, lambda r: not covered(r))  # steps count from 0 or 1


def prepare(logdir: str, section: str, config_json: dict[str, Any], *, resume: bool,
            defaults: dict[str, Any] | None = None,
            log: Callable[[str], None] | None = None) -> bool:
  """Checks ``logdir`` before anything is built or compiled; returns whether to resume.

  With ``resume``, a run whose saved config differs is refused when the ``logdir`` holds its
  state (a stage's saved state, frozen roles or RL checkpoints); a field the saved config
  lacks (added after the run started) counts as its entry in ``defaults`` (flat dotted keys,
  :func:`rljax.checkpoint.dataclass_defaults` of the config class). A config saved by a run
  that stopped before saving any state (e.g. on bad input) does not bind the next one. Without
  ``resume``, a ``logdir`` that already holds RLHF state is refused (its checkpoints are left
  untouched). Then the config is written to ``<logdir>/checkpoints/config.json``. Before RL
  (no frozen roles yet), ``metrics.jsonl`` keeps only the records of the stages saved under
  ``<logdir>/stages``, up to their saved steps: an earlier start's later records are redone.
  ``log`` (process 0) is told when an earlier start (its config is saved) saved no state, so
  that this one starts from the beginning, and how many of its records are dropped.

  Returns:
    True when ``resume`` and the frozen roles are saved (the RL stage can start from them).

  Raises:
    ValueError: config mismatch, or existing state without ``resume``.
  """
  check_logdir(logdir, section, config_json, resume=resume, defaults=defaults)
  frozen = resume and has_frozen(logdir)
  # Every process has looked before process 0 writes (else a peer would find the new file).
  runtime.sync_processes("rljax-prepare-checked")
  if runtime.is_primary():
    config_path = os.path.join(ckpt.checkpoint_dir(logdir), ckpt.CONFIG_FILE)
    started_before = os.path.exists(config_path) and saved_state(logdir) is None
    ckpt.write_json_atomic(config_path, {section: config_json})
    dropped = 0
    if not frozen:  # what an earlier start logged past its saved stages is redone: those go
      dropped = _keep_stage_records(os.path.join(logdir, "metrics.jsonl"), saved_stages(logdir))
    if started_before and log is not None:
      log(f"{logdir}: an earlier start of this run saved no state (it stopped before its "
          f"first save), so it starts from the beginning"
          + (f"; its {dropped} record(s) in metrics.jsonl are dropped" if dropped else ""))
  runtime.sync_processes("rljax-prepare-written")
  return frozen


def train(trainer: rlhf.RLHFTrainer, logdir: str, *, checkpoint_every: int = 10,
          keep: int = 3, resume: bool = True, writer=None, callback=None,
          log: Callable[[str], None] = print, sigterm: ckpt.SigtermFlag | None = None,
          ) -> tuple[list[dict[str, float]], int | None]:
  """Runs ``trainer`` to ``config.num_steps`` with checkpoints, resume and SIGTERM handling.

  Args:
    trainer: a freshly built trainer (its state at step 0).
    logdir: run directory; checkpoints go to ``<logdir>/checkpoints``.
    checkpoint_every: steps between checkpoints (>= 1); the last step is always saved.
    keep: checkpoints kept (>= 1), newest first.
    resume: restore the newest readable checkpoint first (RL records after it are removed
      from ``metrics.jsonl``, since they are redone).
    writer: a :class:`rljax.metrics.MetricsWriter` or None.
    callback: called with each step's record.
    log: receives resume and skipped-checkpoint messages.
    sigterm: a :class:`rljax.checkpoint.SigtermFlag` already installed by the caller (so a
      SIGTERM during earlier stages counts); None installs one for the loop.

  Returns:
    ``(history, resumed_from)``: the records of the steps run here, and the step restored
    (None if started fresh).

  Raises:
    ValueError: ``checkpoint_every`` or ``keep`` < 1.
    Preempted: SIGTERM was received; the state is checkpointed.
    rljax.checkpoint.NonFiniteHalt: ``nonfinite="halt"`` and a step's update was skipped;
      that step's state (parameters as before it, all finite) is checkpointed.
  """
  if checkpoint_every < 1:
    raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
  if keep < 1:
    raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
  num_steps = trainer.config.num_steps
  manager = ckpt.make_manager(logdir, max_to_keep=keep)
  resumed_from = None
  saved_step = None
  if resume:
    restored = ckpt.restore(manager, *state_items(trainer.state), log=log)
    if restored is not None:
      step, policy, train_item = restored
      trainer.state = state_from_items(trainer.state, policy, train_item)
      resumed_from = saved_step = step
      if step < num_steps:
        log(f"resuming {logdir} after RL step {step}")
      else:  # as the control trainer says it
        log(f"{logdir} has finished all {step} RL steps: nothing left to train")
      if writer is not None:
        ckpt.truncate_jsonl(writer.jsonl_path, step, lambda r: _RL_KEY in r, in_place=True)

  def save():
    nonlocal saved_step
    step = trainer.state.step
    if saved_step != step:
      ckpt.save(manager, step, *state_items(trainer.state))
      saved_step = step

  own_flag = sigterm is None
  flag = ckpt.SigtermFlag().__enter__() if own_flag else sigterm
  history: list[dict[str, float]] = []
  try:
    while trainer.state.step < num_steps:
      if flag.any_process():  # every process stops after the same step
        save()
        raise Preempted(trainer.state.step, str(logdir))
      try:
        rec = trainer.step()
      except rlhf.NonFiniteHalt as e:  # the skipped step's state is finite: the last good one
        save()
        raise rlhf.NonFiniteHalt(f"{e}; halted with the last good state checkpointed in "
                                 f"{logdir} (step {trainer.state.step})") from None
      step = trainer.state.step
      rec["step"] = step
      history.append(rec)
      if writer is not None:
        writer.write(step, {k: v for k, v in rec.items() if k != "step"}, progress=step,
                     stage="rl")
      if step % checkpoint_every == 0 or step == num_steps:
        save()
      if callback is not None:
        callback(rec)
    save()
  finally:
    if own_flag:
      flag.__exit__(None, None, None)
    manager.close()
  return history, resumed_from


def load_state_items(logdir: str, step: int | None = None) -> tuple[int, dict, dict]:
  """Reads a checkpoint's raw items (no template; saved by any process count or mesh):
  ``(step, policy, train_state)`` as flat ``{key path: numpy array}`` dicts. For inspection
  and tests.

  Raises:
    FileNotFoundError: no checkpoint under ``logdir``.
  """
  step, items = ckpt.read_items(logdir, step)
  return step, items["policy"], items["train_state"]


def rl_history(jsonl_path: str, fallback: list[dict[str, Any]] | None = None
               ) -> list[dict[str, Any]]:
  """The RL records of a run's ``metrics.jsonl`` (those with ``reward/mean``), in order, as
  the trainer returns them (without the file's ``stage`` field).

  Only process 0 writes the file; on other processes (which may not share the file system)
  ``fallback`` (e.g. the records of the steps run here) is returned instead.
  """
  from rljax import metrics as metrics_lib

  if not runtime.is_primary():
    return list(fallback or [])
  return [{k: v for k, v in r.items() if k != "stage"}
          for r in metrics_lib.read_jsonl(jsonl_path) if _RL_KEY in r]
