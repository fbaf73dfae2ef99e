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

On SIGTERM (:class:`rljax.checkpoint.SigtermFlag`) the current step finishes, a checkpoint is
written and :class:`Preempted` is raised; the scripts then exit with
:data:`rljax.checkpoint.EXIT_PREEMPTED` (75), like the control trainer.
"""

from __future__ import annotations

import json
import os
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
# step with this (the scripts exit 75 too); nothing of those stages is saved.
StageInterrupted = sft.Interrupted

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


def save_frozen(logdir: str, models: dict[str, nnx.Module], meta: dict[str, Any]) -> None:
  """Saves the full state of each model in ``models`` (e.g. ``{"reference": m}``) once.

  The orbax checkpoint is written to ``<logdir>/frozen/roles`` (temporary folder, then
  renamed); ``meta`` (JSON-able) is written last, atomically, and marks it complete. Every
  process calls this; arrays held by one process only are saved as replicated global
  arrays (:func:`rljax.checkpoint.globalize`), and process 0 writes ``meta``.
  """
  path = frozen_dir(logdir)
  item = ckpt.globalize(ckpt.to_saveable({name: nnx.state(m) for name, m in models.items()}))
  roles = os.path.join(path, "roles")
  if runtime.is_primary() and os.path.exists(roles):  # an incomplete earlier attempt: redo it
    import shutil

    shutil.rmtree(roles)
  runtime.sync_processes("rljax-frozen-clear")
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:  # synchronous (see make_manager)
    c.save(roles, args=ocp.args.StandardSave(item))
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
  template = ckpt.to_saveable({name: nnx.state(m) for name, m in models.items()})
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, ckpt.globalize(template))
  try:
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:
      saved = ckpt.localize(c.restore(os.path.join(path, "roles"),
                                      args=ocp.args.StandardRestore(abstract)), template)
  except Exception as e:  # orbax raises many types for unreadable or mismatched data
    raise ValueError(f"the frozen roles in {path} cannot be loaded into this run's models "
                     f"({type(e).__name__}: {str(e)[:300]})") from None
  for name, m in models.items():
    nnx.update(m, ckpt.from_saveable({name: nnx.state(m)}, saved)[name])
  with open(os.path.join(path, FROZEN_META), encoding="utf-8") as f:
    return json.load(f)


# ---- resume checks and the host loop ------------------------------------------------------------


def check_logdir(logdir: str, section: str, config_json: dict[str, Any], *, resume: bool,
                 defaults: dict[str, Any] | None = None) -> None:
  """`prepare`'s checks alone, writing nothing (the scripts run them before ``run_info.json``
  is written, so that a refused command leaves the run's folder as it was).

  Raises:
    ValueError: ``logdir`` holds RLHF state (frozen roles or RL checkpoints) and ``resume`` is
      False, or its saved config differs from ``config_json`` (see `prepare`).
  """
  exists = has_frozen(logdir) or ckpt.newest_step(logdir) is not None
  if exists and not resume:
    raise ValueError(f"--logdir {logdir!r} already holds an RLHF run; pass --resume to continue "
                     f"it or use a new --logdir (its checkpoints are left untouched).")
  if resume and exists:
    ckpt.check_same_config(logdir, section, config_json, defaults)


def prepare(logdir: str, section: str, config_json: dict[str, Any], *, resume: bool,
            defaults: dict[str, Any] | None = None) -> bool:
  """Checks ``logdir`` before anything is built or compiled; returns whether to resume.

  With ``resume``, a run whose saved config differs is refused when the ``logdir`` holds its
  state (frozen roles or RL checkpoints); a field the saved config lacks (added after the run
  started) counts as its entry in ``defaults`` (flat dotted keys,
  :func:`rljax.checkpoint.dataclass_defaults` of the config class). A config saved by a run
  that stopped before saving any state (e.g. on bad input) does not bind the next one. Without
  ``resume``, a ``logdir`` that already holds RLHF state is refused (its checkpoints are left
  untouched). Then the config is written to ``<logdir>/checkpoints/config.json``; on a fresh
  start the records of an earlier start that saved no state are dropped from ``metrics.jsonl``.

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
    ckpt.write_json_atomic(os.path.join(ckpt.checkpoint_dir(logdir), ckpt.CONFIG_FILE),
                           {section: config_json})
    if not frozen:  # a fresh start: an earlier one that saved no state (e.g. stopped in SFT)
      ckpt.truncate_jsonl(os.path.join(logdir, "metrics.jsonl"), -1)  # is redone: its records go
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
