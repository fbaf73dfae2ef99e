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

The stages before RL save their states under ``<logdir>/stages`` while they run
(`rljax.alignment.stages`).

`train` runs the RL steps in the host loop every trainer shares (`rljax.loop.run`): on SIGTERM
(:class:`rljax.checkpoint.SigtermFlag`) the current step finishes, a checkpoint is written and
`rljax.preemption.Preempted` is raised; the scripts then exit with
:data:`rljax.checkpoint.EXIT_PREEMPTED` (75), like the control trainer.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from rljax import checkpoint as ckpt
from rljax import kl as kl_lib
from rljax import loop, ppo, runtime
from rljax import metrics as metrics_lib
from rljax.alignment import rlhf, stages
from rljax.envs.text import data as text_data
from rljax.preemption import Preempted

EXIT_PREEMPTED = ckpt.EXIT_PREEMPTED
FROZEN_DIR = "frozen"
FROZEN_META = "meta.json"
# Keys of the RL records in metrics.jsonl (which also holds pre-training/SFT records).
_RL_KEY = "reward/mean"
StageInterrupted = stages.StageInterrupted
config_to_json = ckpt.config_to_json  # a (nested) config as JSON: enums by value, tuples lists


# ---- the train state as two orbax items --------------------------------------------------------


def state_items(state: rlhf.RLHFState) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(policy, train_state)`` items of ``state``: flat ``{key path: array}`` dicts.

  ``policy`` holds the actor's parameters; ``train_state`` everything else (with
  ``max_staleness > 0`` also ``lagged_actor``: the weights that generate the in-flight
  batches). The PRNG key is stored as its raw ``uint32`` data; ints as int64 scalars.
  """
  params = state.ppo_state.params
  policy = ckpt.to_saveable({"actor": params["actor"]})
  rest = {"critic": params.get("critic", {}), "opt_state": state.ppo_state.opt_state,
          "kl_coef": state.kl_state.kl_coef}
  if state.lagged_actor:
    rest["lagged_actor"] = {str(i): p for i, p in enumerate(state.lagged_actor)}
  train = ckpt.to_saveable(rest)
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
  like = {"critic": params.get("critic", {}), "opt_state": template.ppo_state.opt_state,
          "kl_coef": template.kl_state.kl_coef}
  if template.lagged_actor:
    like["lagged_actor"] = {str(i): p for i, p in enumerate(template.lagged_actor)}
  rest = ckpt.from_saveable(like, train)
  lagged = tuple(rest["lagged_actor"][str(i)] for i in range(len(template.lagged_actor)))
  if "critic" in params:
    params["critic"] = rest["critic"]
  epoch, index, seed = (int(x) for x in np.asarray(train["data_position"]))
  key = jax.random.wrap_key_data(jax.numpy.asarray(train["key"]),
                                 impl=jax.random.key_impl(template.key))
  return rlhf.RLHFState(
      ppo.PPOState(params, rest["opt_state"]), kl_lib.KLControllerState(rest["kl_coef"]),
      int(train["step"]), text_data.DataPosition(epoch, index, seed), key,
      int(train["skipped_updates"]), lagged)


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
  ckpt.write_item(os.path.join(path, "roles"),
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
  saved = ckpt.read_item(os.path.join(path, "roles"),
                     ckpt.to_saveable({name: nnx.state(m) for name, m in models.items()}),
                     "the frozen roles")
  for name, m in models.items():
    nnx.update(m, ckpt.from_saveable({name: nnx.state(m)}, saved)[name])
  with open(os.path.join(path, FROZEN_META), encoding="utf-8") as f:
    return json.load(f)


# ---- the scripts' SIGTERM handling -------------------------------------------------------------


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


# ---- resume checks and the RL loop --------------------------------------------------------------


def saved_state(logdir: str) -> str | None:
  """What RLHF state ``logdir`` holds, in words (e.g. ``"RL checkpoints up to step 4"``,
  ``"saved stages: pretrain ended at step 40, sft stopped after step 19"``), or None."""
  newest = ckpt.newest_step(logdir)
  if newest is not None:
    return f"RL checkpoints up to step {newest}"
  if has_frozen(logdir):
    return f"the models of the stages before RL, in {frozen_dir(logdir)}"
  saved = stages.saved_stages(logdir)
  if not saved:
    return None
  return "saved stages: " + ", ".join(
      f"{name} {'ended at' if m['done'] else 'stopped after'} step {m['step']}"
      for name, m in saved.items())




def _keep_stage_records(path: str, saved: dict[str, dict[str, Any]]) -> int:
  """Drops the records of ``metrics.jsonl`` at ``path`` that no saved stage covers: those of
  other stages (RL included) and those after a saved stage's step; returns how many."""
  def covered(r):
    return r.get("stage") in saved and r["step"] <= saved[r["stage"]]["step"]

  return ckpt.truncate_jsonl(path, -1, lambda r: not covered(r))  # steps count from 0 or 1


def prepare(logdir: str, run: ckpt.SavedRun, *, resume: bool,
            log: Callable[[str], None] | None = None) -> bool:
  """Checks ``logdir`` before anything is built or compiled; returns whether to resume.

  ``run`` describes the run (`rljax.checkpoint.SavedRun`; its ``held`` says what state the
  logdir holds; default `saved_state`: a stage's saved state, frozen roles or RL
  checkpoints). With
  ``resume``, a run whose saved config differs is refused when the ``logdir`` holds its state
  (`rljax.checkpoint.check_logdir`; a field the saved config lacks, added after the run
  started, counts as its default). A config saved by a run
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
  run = run if run.held is not None else run._replace(held=saved_state)
  ckpt.check_logdir(logdir, run, resume=resume)
  frozen = resume and has_frozen(logdir)
  # Every process has looked before process 0 writes (else a peer would find the new file).
  runtime.sync_processes("rljax-prepare-checked")
  if runtime.is_primary():
    config_path = os.path.join(ckpt.checkpoint_dir(logdir), ckpt.CONFIG_FILE)
    started_before = os.path.exists(config_path) and saved_state(logdir) is None
    ckpt.write_json_atomic(config_path, {run.section: run.config_json})
    dropped = 0
    if not frozen:  # what an earlier start logged past its saved stages is redone: those go
      dropped = _keep_stage_records(os.path.join(logdir, "metrics.jsonl"),
                                    stages.saved_stages(logdir))
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
  """Runs ``trainer`` to ``config.num_steps`` in the host loop (`rljax.loop.run`) with
  checkpoints, resume and SIGTERM handling.

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
    rljax.preemption.Preempted: SIGTERM was received; the state is checkpointed (a SIGTERM
      before the first step checkpoints that step's state: RL step 0 of a fresh run).
    rljax.nonfinite.NonFiniteHalt: ``nonfinite="halt"`` and a step's update was skipped;
      that step's state (parameters as before it, all finite) is checkpointed.
  """
  spec = loop.LoopSpec(num_steps=trainer.config.num_steps, checkpoint_every=checkpoint_every,
                       save_if_stopped_first=True)
  saver = loop.Checkpoints(logdir, keep=keep, items=lambda step, state: state_items(state),
                           from_items=state_from_items)
  resumed_from = None
  with contextlib.ExitStack() as stack:
    stack.callback(saver.close)
    stack.callback(trainer.close)  # an asynchronous run's generator thread
    if sigterm is None:
      sigterm = stack.enter_context(ckpt.SigtermFlag())
    if resume:
      restored = saver.restore(trainer.state, log=log)
      if restored is not None:
        resumed_from, trainer.state = restored
        if resumed_from < spec.num_steps:
          log(f"resuming {logdir} after RL step {resumed_from}")
        else:  # as the control trainer says it
          log(f"{logdir} has finished all {resumed_from} RL steps: nothing left to train")
        if writer is not None:
          ckpt.truncate_jsonl(writer.jsonl_path, resumed_from, lambda r: _RL_KEY in r,
                              in_place=True)
    trainer.state, history = loop.run(
        spec, trainer.state, trainer.loop_step, sigterm=sigterm, start=trainer.state.step,
        logdir=logdir, checkpoints=saver, writer=writer, stage="rl",
        on_record=None if callback is None else lambda step, state, rec: callback(rec),
        watch=trainer.nonfinite_watch())
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
  if not runtime.is_primary():
    return list(fallback or [])
  return [{k: v for k, v in r.items() if k != "stage"}
          for r in metrics_lib.read_jsonl(jsonl_path) if _RL_KEY in r]
