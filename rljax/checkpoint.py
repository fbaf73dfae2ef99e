"""Orbax checkpoints of a whole train state, with the config that rebuilds it beside them.

Layout under ``<logdir>/checkpoints``::

    config.json          the run's config (written once, atomically)
    <step>/policy/       what inference needs: network params, normaliser statistics
    <step>/train_state/  everything else: optimizer state, RNG key, counters

Orbax's ``CheckpointManager`` writes each step into a temporary folder and renames it
when complete, so a crash never leaves a half-written checkpoint as the latest one.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

CONFIG_FILE = "config.json"


def checkpoint_dir(logdir: str) -> str:
  return os.path.join(os.path.abspath(logdir), "checkpoints")


def write_json_atomic(path: str, obj: Any) -> None:
  """Writes JSON to ``path`` through a temporary file and ``os.replace``."""
  d = os.path.dirname(path)
  os.makedirs(d, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def read_config(logdir: str) -> dict[str, Any]:
  """Reads ``<logdir>/checkpoints/config.json``.

  Raises:
    FileNotFoundError: with the path, if the run has no saved config.
  """
  path = os.path.join(checkpoint_dir(logdir), CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"No checkpoint config at {path}; is {logdir!r} an rljax run?")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def make_manager(logdir: str, *, max_to_keep: int = 3) -> ocp.CheckpointManager:
  """A ``CheckpointManager`` over ``<logdir>/checkpoints`` with items policy/train_state."""
  return ocp.CheckpointManager(
      checkpoint_dir(logdir),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
      item_names=("policy", "train_state"),
  )


def to_saveable(tree: Any) -> dict[str, Any]:
  """Flattens a pytree to ``{key path: leaf}``, dropping zero-size leaves.

  Orbax cannot store zero-size arrays (MJX states have some, e.g. ``data.act`` of a
  model without actuator activations); `from_saveable` takes them from a template.
  """
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): x for p, x in flat if np.size(x) > 0}


def from_saveable(template: Any, saved: dict[str, Any]) -> Any:
  """Inverse of `to_saveable`: leaves of ``template`` replaced by ``saved`` ones."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(template)
  leaves = [saved.get(jax.tree_util.keystr(p), x) for p, x in flat]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def save(manager: ocp.CheckpointManager, step: int, policy: Any, train_state: Any) -> None:
  """Saves both items at ``step`` and waits until they are on disk."""
  manager.save(
      step,
      args=ocp.args.Composite(
          policy=ocp.args.StandardSave(policy), train_state=ocp.args.StandardSave(train_state)
      ),
  )
  manager.wait_until_finished()


def restore(
    manager: ocp.CheckpointManager,
    policy_target: Any,
    train_target: Any,
    *,
    log: Callable[[str], None] = print,
) -> tuple[int, Any, Any] | None:
  """Restores the newest checkpoint that loads, newest first; ``None`` if there is none.

  A checkpoint that fails to load (for example a truncated file after a crash or a
  disk problem) is reported through ``log`` and skipped in favour of the previous
  one. It is never loaded silently.

  Args:
    manager: from `make_manager`.
    policy_target, train_target: pytrees (concrete or abstract) giving the structure,
      shapes, dtypes and shardings to restore into.
    log: receives one line per skipped checkpoint.

  Returns:
    ``(step, policy, train_state)`` or ``None``.
  """
  abstract = lambda t: jax.tree.map(ocp.utils.to_shape_dtype_struct, t)
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      out = manager.restore(
          step,
          args=ocp.args.Composite(
              policy=ocp.args.StandardRestore(abstract(policy_target)),
              train_state=ocp.args.StandardRestore(abstract(train_target)),
          ),
      )
    except Exception as e:  # orbax raises many types for unreadable data
      log(f"checkpoint {step} in {manager.directory} is unreadable, skipping it: "
          f"{type(e).__name__}: {str(e)[:300]}")
      continue
    return step, out.policy, out.train_state
  return None


def restore_policy(logdir: str, target: Any, step: int | None = None) -> Any:
  """Restores only the ``policy`` item into the structure of ``target`` (abstract ok).

  Raises:
    FileNotFoundError: if there is no checkpoint under ``logdir``.
  """
  with ocp.CheckpointManager(checkpoint_dir(logdir), item_names=("policy", "train_state")) as m:
    step = m.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint under {checkpoint_dir(logdir)}.")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    out = m.restore(step, args=ocp.args.Composite(policy=ocp.args.StandardRestore(abstract)))
  return out.policy


def check_writable(logdir: str) -> None:
  """Creates ``logdir`` if needed and checks that files can be written in it.

  Raises:
    ValueError: naming the directory, if it cannot be created or written.
  """
  try:
    os.makedirs(logdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=logdir, prefix=".write-test-"):
      pass
  except OSError as e:
    raise ValueError(f"--logdir {logdir!r} is not writable: {e.strerror or e}.") from None
