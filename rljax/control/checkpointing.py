"""Control checkpoints: what a run saves, and how a run in a logdir is resumed.

Each checkpoint (orbax, through `rljax.loop.Checkpoints`) holds two items::

    <step>/policy/       {"params", "obs_stats"}: what `rljax.control.policy.load_policy` reads
    <step>/train_state/  optimizer state, PRNG key, counters, env steps and the environment state

and ``checkpoints/config.json`` records the run's config and network sizes, so a policy can be
rebuilt from the folder alone. The PPO trainer and APG share this layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from rljax import checkpoint as ckpt
from rljax import metrics as metrics_lib
from rljax import running_stats
from rljax.control.config import ControlConfig, nest_ppo_fields


def saved_run(config: ControlConfig) -> ckpt.SavedRun:
  """A PPO run of ``config`` as ``config.json`` records it (`rljax.checkpoint.check_logdir`);
  configs saved before ``ppo`` was nested are read in today's layout."""
  return ckpt.SavedRun(section="control", config_json=json.loads(config.to_json()),
                       defaults=ckpt.dataclass_defaults(ControlConfig), upgrade=nest_ppo_fields)


def write_config(logdir: str, section: str, config, network_config, **extra) -> None:
  """Writes ``checkpoints/config.json``: ``{section: config, "network": sizes, **extra}``."""
  ckpt.write_json_atomic(
      os.path.join(ckpt.checkpoint_dir(logdir), ckpt.CONFIG_FILE),
      {section: json.loads(config.to_json()), "network": dataclasses.asdict(network_config),
       **extra})


def policy_item(state) -> dict[str, Any]:
  """The ``policy`` item of a state with ``params`` and ``obs_stats`` (PPO's and APG's)."""
  return {"params": nnx.to_pure_dict(state.params), "obs_stats": state.obs_stats._asdict()}


def train_item(env_state, env_steps: int, **arrays) -> dict[str, Any]:
  """The ``train_state`` item: ``arrays`` (optimizer state, key, counters), ``env_steps`` and
  the environment state (zero-size leaves dropped, `rljax.checkpoint.to_saveable`)."""
  return dict(arrays, env_steps=np.asarray(env_steps, np.int64),
              env_state=ckpt.to_saveable(env_state))


def restored_params(params, policy: dict[str, Any]):
  """``(params, obs_stats)`` from a restored ``policy`` item, in ``params``' structure."""
  nnx.replace_by_pure_dict(params, policy["params"])
  return params, running_stats.RunningStats(**policy["obs_stats"])


def resume_history(logdir: str, chunk: int | None, *, num_chunks: int, env_steps: int,
                   log: Callable[[str], None]) -> list[dict[str, float]]:
  """The records a run starting in ``logdir`` keeps (PPO's and APG's).

  After restoring chunk ``chunk`` it says so through ``log`` (resuming, or nothing left to
  train), drops the records logged after that chunk from ``metrics.jsonl`` (they are redone)
  and returns the ones before. With ``chunk=None`` (nothing restored) it drops every record,
  an earlier start's that saved no checkpoint, and returns [].
  """
  path = os.path.join(logdir, "metrics.jsonl")
  if chunk is None:
    if os.path.exists(path):
      ckpt.truncate_jsonl(path, -1)
    return []
  if chunk < num_chunks:
    log(f"resuming {logdir} after chunk {chunk} ({env_steps:,} env steps)")
  else:
    log(f"{logdir} has finished all {chunk} chunks ({env_steps:,} env steps): "
        f"nothing left to train")
  ckpt.truncate_jsonl(path, chunk)
  if not os.path.exists(path):
    return []
  as_value = lambda k, v: int(v) if k in ("step", "env_steps") else float(v)  # noqa: E731
  return [{k: as_value(k, v) for k, v in r.items()} for r in metrics_lib.read_jsonl(path)
          if r["step"] <= chunk]
