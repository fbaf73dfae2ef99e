"""A pipeline run's folder: what it records, what it accepts, and its stages before RL.

`saved_run` says what a run of a config records in ``checkpoints/config.json``, and what a
logdir holds for it; `rljax.checkpoint.check_logdir` then decides whether a command may start
there (the scripts ask before they write anything), and `prepare` records the run. `sft_stage`
runs pre-training or SFT as a resumable stage (`rljax.alignment.stages.run_stage`).
"""

from __future__ import annotations

import os
from typing import Any

from rljax import checkpoint as ckpt
from rljax.alignment import checkpointing, sft, stages
from rljax.alignment.hf_models import HF_MODEL_DIR
from rljax.alignment.pipeline_config import (EmbeddedConfig, PreferenceConfig,
                                             upgrade_saved_config)
from rljax.metrics import MetricsWriter


def make_writer(logdir: str | None, total: int | None = None) -> MetricsWriter | None:
  """The pipelines' metrics writer (JSONL, TensorBoard, console), or None without a logdir."""
  if logdir is None:
    return None
  return MetricsWriter(logdir, total=total, unit="steps",
                       console_keys=("reward/mean", "kl", "accuracy"), tensorboard=True)


def stop_on(sigterm):
  """The stages' ``should_stop``: whether the installed ``SigtermFlag`` (or None) was raised
  in any process (a collective with several, asked by all before each step)."""
  return None if sigterm is None else sigterm.any_process


def sft_stage(logdir: str | None, stage: str, model, examples, config: sft.SFTConfig, *,
              pad_id: int, writer, layout, sigterm, log, save_every: int
              ) -> tuple[Any, dict[str, Any]]:
  """`sft.train_sft` as stage ``stage`` (``"pretrain"`` or ``"sft"``) through
  `rljax.alignment.stages.run_stage`: saved under ``<logdir>/stages`` (None: not saved) every
  ``save_every`` steps, resumed from there; each logged record goes to ``log`` as a line.
  Returns the model and the stage's last record."""
  def train(m, state, checkpoint):
    return sft.train_sft(m, examples, config, pad_id=pad_id, writer=writer, state=state,
                         prefix=f"{stage}/", layout=layout, should_stop=stop_on(sigterm),
                         checkpoint=checkpoint, log=log)

  model, record, _ = stages.run_stage(
      logdir, stage, train, model, lambda: sft.fresh_state(model, config),
      save_every=save_every, log=log)
  return model, record


def saved_run(config: EmbeddedConfig | PreferenceConfig, data: str | None = None,
              stop_after: str = "rl") -> ckpt.SavedRun:
  """A pipeline run of ``config`` as ``<logdir>/checkpoints/config.json`` records it, for
  `rljax.checkpoint.check_logdir` and `prepare`. ``data``: the preference data path
  (``PreferenceConfig`` only; saved as an absolute path). The section names the run's kind:
  ``rlhf_embedded`` / ``rlhf_preference`` for RL runs, ``sft_...`` and ``rm_...`` for runs
  that stop after SFT or the reward model (``stop_after``; the stage scripts), so a logdir of
  one kind does not resume as another. What a logdir holds is its RL checkpoints, frozen
  roles or saved stages (`rljax.alignment.checkpointing.saved_state`); one with an exported
  model but no saved state is refused (`_refuse_export_without_state`)."""
  config_json = checkpointing.config_to_json(config)
  kind = "rlhf" if stop_after == "rl" else stop_after
  if isinstance(config, EmbeddedConfig):
    section, defaults = f"{kind}_embedded", ckpt.dataclass_defaults(EmbeddedConfig)
  else:
    section, defaults = f"{kind}_preference", ckpt.dataclass_defaults(PreferenceConfig)
    config_json = dict(config_json, data=os.path.abspath(data))
  return ckpt.SavedRun(section=section, config_json=config_json, defaults=defaults,
                       held=_held, upgrade=upgrade_saved_config)


def _held(logdir: str) -> str | None:
  """What pipeline state ``logdir`` holds, in words (None: nothing to resume)."""
  _refuse_export_without_state(logdir)
  return checkpointing.saved_state(logdir)


def prepare(logdir: str | None, config: EmbeddedConfig | PreferenceConfig, data: str | None,
            stop_after: str, resume: bool, log) -> bool:
  """`rljax.alignment.checkpointing.prepare` for the run of ``config`` (`saved_run`): the
  logdir checked and the config recorded; whether the frozen roles are saved to resume RL
  from (False without a ``logdir``)."""
  if logdir is None:
    return False
  return checkpointing.prepare(logdir, saved_run(config, data, stop_after), resume=resume,
                               log=log)


def say_if_finished(logdir: str | None, names: list[str], log) -> None:
  """Logs that a stage script's run in ``logdir`` has nothing left to train when each of its
  stages ``names`` is saved as ended (a rerun of a finished run)."""
  saved = stages.saved_stages(logdir) if logdir is not None else {}
  if names and all(saved.get(n, {}).get("done") for n in names):
    log(f"{logdir} has finished its stages ({', '.join(names)}): nothing left to train")


def _refuse_export_without_state(logdir: str) -> None:
  """A ``logdir`` with an exported model (``hf_model``) but no saved state to resume from (a
  finished run of an rljax version whose stage scripts did not save their stages) is refused:
  a new run there would drop its records and replace its model.

  Raises:
    ValueError: naming ``logdir`` and what it holds.
  """
  if (os.path.isdir(os.path.join(logdir, HF_MODEL_DIR))
      and checkpointing.saved_state(logdir) is None):
    raise ValueError(f"--logdir {logdir!r} holds a finished run's {HF_MODEL_DIR} but no saved "
                     f"state to resume it from; use a new --logdir (nothing in it was changed)")
