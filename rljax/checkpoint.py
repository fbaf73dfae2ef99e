"""Orbax checkpoints of a whole train state, with the config that rebuilds it beside them.

Layout under ``<logdir>/checkpoints``::

    config.json          the run's config (written once, atomically)
    <step>/policy/       what inference needs: network params, normaliser statistics
    <step>/train_state/  everything else: optimizer state, RNG key, counters

Orbax's ``CheckpointManager`` writes each step into a temporary folder and renames it
when complete, so a crash never leaves a half-written checkpoint as the latest one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import json
import logging
import os
import shutil
import sys
import signal
import tempfile
import threading
from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import flags
from jax.experimental import multihost_utils

from rljax import metrics as metrics_lib
from rljax import nonfinite, preemption
from rljax.runtime import is_primary, sync_processes

CONFIG_FILE = "config.json"

# Exit statuses and the non-finite halt, re-exported where the scripts have always found them.
EXIT_PREEMPTED = preemption.EXIT_PREEMPTED
EXIT_NONFINITE = nonfinite.EXIT_NONFINITE
NonFiniteHalt = nonfinite.NonFiniteHalt


def checkpoint_dir(logdir: str) -> str:
  """``<logdir>/checkpoints`` as an absolute path (orbax needs one)."""
  return os.path.join(os.path.abspath(logdir), "checkpoints")


def newest_step(logdir: str) -> int | None:
  """The highest step folder under ``<logdir>/checkpoints`` (readable or not), or None."""
  d = checkpoint_dir(logdir)
  steps = [int(n) for n in os.listdir(d) if n.isdigit()] if os.path.isdir(d) else []
  return max(steps, default=None)


def write_json_atomic(path: str, obj: Any) -> None:
  """Writes JSON to ``path`` through a temporary file and ``os.replace``, with the mode a plain
  ``open`` would give (``0o666`` less the umask, not ``mkstemp``'s ``0o600``). On any error the
  temporary file is removed and ``path`` is left as it was."""
  d = os.path.dirname(path)
  os.makedirs(d, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      os.fchmod(f.fileno(), 0o666 & ~current_umask())
      json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def current_umask() -> int:
  """The process's file-mode creation mask (read by setting it and restoring it at once)."""
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


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
      # Synchronous saves: every save is waited for anyway, and with several processes an
      # async save's background finalisation (orbax's cross-process broadcasts) could
      # interleave with the next step's collectives on another thread.
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=False),
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


def _all_devices_replicated():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("processes",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _process_local(x: Any) -> bool:
  """A jax.Array that lives on this process's devices only, in a multi-process run."""
  return (jax.process_count() > 1 and isinstance(x, jax.Array)
          and x.is_fully_addressable)


def globalize(tree: Any) -> Any:
  """Arrays held by one process only, as arrays replicated over all processes' devices.

  Orbax saves and restores global arrays in a multi-process run; a process-local array
  (e.g. an RNG count variable, or a model kept off the mesh) would be refused. Each process
  must hold the same value (true for state computed identically on every process). Global
  arrays, numpy arrays and scalars pass through, as does everything with one process.
  """
  if jax.process_count() == 1:
    return tree
  rep = _all_devices_replicated()

  def put(x):
    if not _process_local(x):
      return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, rep, lambda idx: host[idx])

  return jax.tree.map(put, tree)


def localize(restored: Any, template: Any) -> Any:
  """Inverse of `globalize` after a restore: leaves that are process-local in ``template``
  (same structure) are put back on the template's sharding, from this process's copy."""
  if jax.process_count() == 1:
    return restored

  def back(x, t):
    if not _process_local(t):
      return x
    return jax.device_put(np.asarray(x.addressable_data(0)), t.sharding)

  return jax.tree.map(back, restored, template)


def save(manager: ocp.CheckpointManager, step: int, policy: Any, train_state: Any) -> None:
  """Saves both items at ``step`` and waits until they are on disk.

  Every process of a multi-process run calls this; process-local arrays are saved as
  replicated global arrays (`globalize`).
  """
  manager.save(
      step,
      args=ocp.args.Composite(
          policy=ocp.args.StandardSave(globalize(policy)),
          train_state=ocp.args.StandardSave(globalize(train_state)),
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
  abstract = lambda t: jax.tree.map(ocp.utils.to_shape_dtype_struct, globalize(t))
  skipped = []
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
          f"{first_line(e)}")
      skipped.append(step)
      continue
    _set_aside(manager, skipped, log)
    return step, localize(out.policy, policy_target), localize(out.train_state, train_target)
  return None


def set_aside(path: str) -> str:
  """Renames the unreadable folder ``path`` to ``<path>.unreadable`` (``.unreadable1``, ... if
  taken), kept for inspection; returns the new path. Call on process 0 only."""
  target, n = path + ".unreadable", 1
  while os.path.exists(target):
    target, n = f"{path}.unreadable{n}", n + 1
  os.rename(path, target)
  return target


def first_line(e: BaseException, limit: int = 300) -> str:
  """``"Type: first line of the message"`` of ``e`` (orbax and TensorStore errors run to pages)."""
  text = str(e).splitlines()[0][:limit] if str(e) else ""
  return f"{type(e).__name__}: {text}"


def _set_aside(manager: ocp.CheckpointManager, steps: list[int], log: Callable[[str], None]
               ) -> None:
  """Renames unreadable step folders to ``<step>.unreadable`` (kept for inspection, ignored
  by orbax), so that the resumed run can write those steps again. Process 0 renames; every
  process then reloads the manager."""
  for step in steps if is_primary() else ():
    path = os.path.join(str(manager.directory), str(step))
    if os.path.isdir(path):
      log(f"moved unreadable checkpoint {step} to {set_aside(path)}")
  if steps:
    sync_processes("rljax-set-aside")
    manager.reload()


def check_step_kept(logdir: str, step: int, kept) -> None:
  """Raises FileNotFoundError naming the ``kept`` steps unless ``step`` is one of them."""
  kept = sorted(kept)
  if step not in kept:
    raise FileNotFoundError(
        f"No checkpoint of step {step!r} under {checkpoint_dir(logdir)}; it holds "
        f"{'steps ' + ', '.join(map(str, kept)) if kept else 'none'} (runs keep the newest "
        f"keep_checkpoints; step=None loads the newest).")


def restore_policy(logdir: str, target: Any, step: int | None = None) -> Any:
  """Restores only the ``policy`` item into the structure of ``target`` (abstract ok).

  Leaves of ``target`` that carry a sharding are restored with it; the others (e.g. from
  ``nnx.eval_shape``) onto this process's first device, whatever mesh or process count saved
  the checkpoint (a policy trained on 8 devices or 2 processes loads in a 1-device process).

  Raises:
    FileNotFoundError: if there is no checkpoint under ``logdir``, or none of ``step``.
  """
  with ocp.CheckpointManager(checkpoint_dir(logdir), item_names=("policy", "train_state")) as m:
    if step is not None:
      check_step_kept(logdir, step, m.all_steps())
    step = m.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint under {checkpoint_dir(logdir)}.")
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def abstract_leaf(x):
      s = ocp.utils.to_shape_dtype_struct(x)
      if getattr(s, "sharding", None) is None:
        s = jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=local)
      return s

    abstract = jax.tree.map(abstract_leaf, target)
    out = m.restore(step, args=ocp.args.Composite(policy=ocp.args.StandardRestore(abstract)))
  return out.policy


def read_items(logdir: str, step: int | None = None,
               items: tuple[str, ...] = ("policy", "train_state")) -> tuple[int, dict[str, Any]]:
  """Reads a checkpoint's items as ``{item: {key path: numpy array}}``, with no template.

  Any process count and mesh can read it (arrays come back as host numpy arrays, whatever
  topology wrote them). For inspection, export and tests.

  Raises:
    FileNotFoundError: no checkpoint under ``logdir`` (or none of ``step``: the message lists
      the kept steps).
  """
  with ocp.CheckpointManager(checkpoint_dir(logdir), item_names=items) as m:
    if step is None:
      step = m.latest_step()
    else:
      check_step_kept(logdir, step, m.all_steps())
  if step is None:
    raise FileNotFoundError(f"No checkpoint under {checkpoint_dir(logdir)}.")
  out = {}
  with ocp.PyTreeCheckpointer() as c:
    for item in items:
      path = os.path.join(checkpoint_dir(logdir), str(step), item)
      if not os.path.isdir(path):
        raise FileNotFoundError(f"No checkpoint item {path}.")
      tree = dict(c.metadata(path).item_metadata.tree)
      args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
      out[item] = {k: np.asarray(v) for k, v in
                   c.restore(path, args=ocp.args.PyTreeRestore(restore_args=args)).items()}
  return step, out


# ---- single orbax items (RLHF's frozen roles and stages) ---------------------------------------


def write_item(path: str, item: dict[str, Any], barrier: str) -> None:
  """Writes the flat item ``item`` (:func:`to_saveable`) to the orbax folder
  ``path`` (temporary folder, then renamed), replacing an incomplete earlier attempt there.
  Every process calls it; arrays held by one process only are saved as replicated global
  arrays (:func:`globalize`)."""
  if is_primary() and os.path.exists(path):  # an incomplete earlier attempt: redo it
    shutil.rmtree(path)
  sync_processes(f"{barrier}-clear")
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:  # synchronous (see make_manager)
    c.save(path, args=ocp.args.StandardSave(globalize(item)))


def restore_item(path: str, local: dict[str, Any]) -> dict[str, Any]:
  """The item `write_item` wrote to ``path``, restored onto ``local``'s shapes and shardings;
  raises what orbax raises."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, globalize(local))
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:
    return localize(c.restore(path, args=ocp.args.StandardRestore(abstract)), local)


@contextlib.contextmanager
def quiet_failed_restore():
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


def read_item(path: str, local: dict[str, Any], what: str) -> dict[str, Any]:
  """The item `write_item` wrote to ``path``, restored onto ``local``'s shapes and shardings.

  Raises:
    ValueError: it does not fit ``local`` (names or shapes differ) or cannot be read; the
      message names ``what`` and ``path``.
  """
  try:
    return restore_item(path, local)
  except Exception as e:  # orbax raises many types for unreadable or mismatched data
    raise ValueError(f"{what} in {path} cannot be loaded into this run's models "
                     f"({first_line(e)})") from None


GIB = 1024**3


def device_memory_bytes(device: jax.Device | None = None) -> int | None:
  """A device's memory limit as JAX reports it (``memory_stats()['bytes_limit']`` on GPU and
  TPU); ``None`` where the backend reports none (CPU)."""
  device = device or jax.local_devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # pragma: no cover - backends without memory stats
    return None
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def define_device_memory_flag():
  """Defines the absl flag ``--device_memory_gb`` (used by :func:`check_fits` on resume)."""
  # The flag belongs to the calling script (absl then lists it in the script's --help).
  flags.disclaim_key_flags()

  return flags.DEFINE_float(
      "device_memory_gb", None, "Memory of one device in GiB, checked before a resume restores "
      "a checkpoint (default: the limit the device reports; CPU reports none, so no check).")


def device_bytes_from_flag(gb: float | None) -> int | None:
  """``--device_memory_gb`` in bytes, or the device's own limit when the flag is unset."""
  if gb is None:
    return device_memory_bytes()
  if gb <= 0:
    raise ValueError(f"--device_memory_gb must be > 0, got {gb}")
  return int(gb * GIB)


def saved_bytes(path: str) -> int:
  """Bytes of the arrays in one orbax item folder (from its metadata; nothing is read)."""
  total = 0
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)  # orbax warns that a step-level metadata file is absent
  try:
    with ocp.PyTreeCheckpointer() as c:
      tree = dict(c.metadata(path).item_metadata.tree)
  finally:
    absl_logger.setLevel(level)
  for meta in jax.tree.leaves(tree):
    shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
    if shape is not None and dtype is not None:
      total += int(np.prod(shape)) * np.dtype(dtype).itemsize
  return total


def check_fits(logdir: str, *, num_devices: int, device_bytes: int | None,
               extra_items: tuple[str, ...] = ()) -> None:
  """Refuses to restore a checkpoint that the devices cannot hold, before anything is built.

  The newest step's items under ``<logdir>/checkpoints`` (plus ``extra_items``, other orbax
  item folders that will be loaded, e.g. RLHF's frozen roles) hold ``total`` bytes; spread
  perfectly over ``num_devices`` that is ``total / num_devices`` per device at the least (the
  real layout replicates some arrays, so this is a lower bound: it catches a mesh that is
  too small, not every layout that is). A no-op without a checkpoint or without
  ``device_bytes`` (CPU reports no device memory limit; scripts take ``--device_memory_gb``).

  Raises:
    ValueError: naming the checkpoint, the bytes it needs per device and the bytes a device
      holds.
  """
  step = newest_step(logdir)
  if device_bytes is None or step is None:
    return
  step_dir = os.path.join(checkpoint_dir(logdir), str(step))
  items = [os.path.join(step_dir, d) for d in sorted(os.listdir(step_dir))
           if os.path.isdir(os.path.join(step_dir, d))] + [p for p in extra_items if os.path.isdir(p)]
  try:
    total = sum(saved_bytes(p) for p in items)
  except Exception:  # unreadable metadata: restore() reports and skips that checkpoint
    return
  need = total / max(num_devices, 1)
  if need > device_bytes:
    raise ValueError(
        f"cannot restore {logdir!r} onto this mesh: the state of checkpoint {step} is "
        f"{total / GIB:.3g} GiB, at least {need / GIB:.3g} GiB per device on {num_devices} "
        f"device(s), but a device holds {device_bytes / GIB:.3g} GiB; use more devices "
        f"(--mesh) or devices with more memory (its checkpoints are left untouched).")


def check_writable(logdir: str) -> None:
  """Creates ``logdir`` if needed and checks that files can be written in it.

  Raises:
    ValueError: naming the directory, if it cannot be created or written.
  """
  if os.path.exists(logdir) and not os.path.isdir(logdir):
    raise ValueError(f"--logdir {logdir!r} is a file; expected a directory (new or existing).")
  try:
    os.makedirs(logdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=logdir, prefix=".write-test-"):
      pass
  except OSError as e:
    raise ValueError(f"--logdir {logdir!r} is not writable: {e.strerror or e}.") from None


def _enum_value(o: Any) -> Any:
  """``json.dumps`` ``default`` for configs: enums by value; anything else unserialisable."""
  if isinstance(o, enum.Enum):
    return o.value
  raise TypeError(f"cannot serialise {type(o).__name__} in a config")


def config_to_json(config: Any) -> dict[str, Any]:
  """A (nested) config dataclass as JSON-able dict: enums by value, tuples as lists."""
  return json.loads(json.dumps(dataclasses.asdict(config), default=_enum_value, sort_keys=True))


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """A nested JSON config as one level of dotted keys: ``{"rl": {"ppo": {"clip_eps": 0.2}}}``
  becomes ``{"rl.ppo.clip_eps": 0.2}``. Non-dict values (lists, None) are leaves."""
  flat: dict[str, Any] = {}
  for k, v in config.items():
    if isinstance(v, Mapping) and v:
      flat.update(flatten_config(v, f"{prefix}{k}."))
    else:
      flat[f"{prefix}{k}"] = v
  return flat


def dataclass_defaults(cls: type) -> dict[str, Any]:
  """The declared defaults of config dataclass ``cls`` as flat dotted JSON keys.

  A field whose default is a nested config contributes the defaults its own class declares,
  recursively (``rl.kl_coef`` is ``RLHFConfig``'s default even where the outer class's factory
  sets another value), so a field added to any class later is implied at the value that class
  gives it. Fields without a default are left out. Enums become their values and tuples lists,
  as in a saved ``config.json``. For :func:`check_same_config`.
  """
  out: dict[str, Any] = {}
  for f in dataclasses.fields(cls):
    if f.default is not dataclasses.MISSING:
      value = f.default
    elif f.default_factory is not dataclasses.MISSING:
      value = f.default_factory()
    else:
      continue
    if dataclasses.is_dataclass(value):
      out.update({f"{f.name}.{k}": v for k, v in dataclass_defaults(type(value)).items()})
    else:
      out[f.name] = json.loads(json.dumps(value, default=_enum_value))
  return out


# The kinds of run a logdir's config.json names (its section), in the words of the commands.
RUN_KINDS = {
    "control": "a train_control.py run",
    "apg": "a train_control.py --algo=apg run",
    "rlhf_embedded": "a train_rlhf.py run on the embedded task",
    "rlhf_preference": "a train_rlhf.py --preference_data run",
    "sft_embedded": "a train_sft.py run on the embedded task",
    "sft_preference": "a train_sft.py --preference_data run",
    "rm_preference": "a train_reward_model.py run",
}


def run_kind(section: str) -> str:
  """The kind of run a config.json ``section`` holds, in words (`RUN_KINDS`)."""
  return RUN_KINDS.get(section, f"a {section} run")


class SavedRun(NamedTuple):
  """A kind of run as its ``<logdir>/checkpoints/config.json`` records it, for `check_logdir`.

  Attributes:
    section: the run's kind, the key of its config in ``config.json`` (`RUN_KINDS`).
    config_json: the run's config as JSON (`config_to_json`).
    defaults: flat dotted defaults of the config's fields (`dataclass_defaults`): a field a
      saved config lacks (added since the run started) counts as its default.
    held: ``logdir -> str | None``, the state ``logdir`` holds in words (None: nothing to
      resume); it may raise ValueError for a logdir no run of this kind may use. Default:
      its checkpoints (`checkpoints_held`).
    upgrade: ``saved section -> saved section``, the config of an older version in today's
      layout (e.g. fields since nested), applied before the comparison; None: as saved.
  """

  section: str
  config_json: dict[str, Any]
  defaults: Mapping[str, Any] | None = None
  held: Callable[[str], str | None] | None = None
  upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None


def checkpoints_held(logdir: str) -> str | None:
  """``"checkpoints up to step N"`` for a ``logdir`` with checkpoints, else None."""
  newest = newest_step(logdir)
  return None if newest is None else f"checkpoints up to step {newest}"


def check_logdir(logdir: str, run: SavedRun, *, resume: bool,
                 flag_names: Mapping[str, str] | None = None) -> int | None:
  """Whether a run of kind ``run.section`` may start in ``logdir``, writing nothing; every
  trainer's check, which the scripts call before they write anything (so a refused command
  leaves the run's folder as it was). Returns the newest checkpoint's step (None: none).

  A ``logdir`` holding another kind of run is refused; without ``resume`` one that holds state
  (``run.held``) is refused, its checkpoints left untouched; a resume needs the saved config
  (:func:`check_same_config`). A saved config binds only a run that saved state (one stopped
  before its first save, e.g. while compiling, does not refuse the next command).

  Raises:
    ValueError: naming ``logdir`` and what it holds (another kind; state without
      ``resume``), or the fields whose saved values differ.
  """
  held = (run.held or checkpoints_held)(logdir)
  if held is not None:
    if resume:  # the kind is checked there too
      check_same_config(logdir, run.section, run.config_json, run.defaults, flag_names,
                        upgrade=run.upgrade)
    else:
      check_same_kind(logdir, run.section)  # before the refusal, which would advise resuming
      raise ValueError(
          f"--logdir {logdir!r} already holds {run_kind(run.section)} ({held}); run the "
          f"command without --noresume to resume it (the default; a finished run then trains "
          f"nothing), or use a new --logdir (its checkpoints are left untouched).")
  return newest_step(logdir)


def check_same_kind(logdir: str, section: str) -> None:
  """Refuses a ``logdir`` whose saved config (if any) is of another kind of run.

  Raises:
    ValueError: naming the kind ``logdir`` holds and the kind asked for.
  """
  try:
    saved = read_config(logdir)
  except FileNotFoundError:
    return
  _refuse_other_kind(logdir, section, saved)


def _refuse_other_kind(logdir: str, section: str, saved: dict[str, Any]) -> None:
  """`check_same_kind` on ``logdir``'s saved config ``saved`` (already read)."""
  if section not in saved:
    held = " and ".join(RUN_KINDS[k] for k in saved if k in RUN_KINDS) or "another kind of run"
    raise ValueError(f"--logdir {logdir!r} holds {held}, not {run_kind(section)} (its "
                     f"{os.path.join(checkpoint_dir(logdir), CONFIG_FILE)} says so); use a new "
                     f"--logdir.")


def check_same_config(logdir: str, section: str, now: dict[str, Any],
                      defaults: Mapping[str, Any] | None = None,
                      flag_names: Mapping[str, str] | None = None, *,
                      upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                      ) -> None:
  """A run resumes only with the config it was started with (else it is not exact).

  Compares ``now`` (JSON-able, possibly nested) with ``config.json[section]`` under
  ``<logdir>/checkpoints``, field by field (nested fields by dotted name, e.g.
  ``rl.kl_coef``); a run without a saved config passes. A field missing from the saved config
  (one added to the config classes after the run started) counts as ``defaults[field]`` (flat
  dotted keys, e.g. from :func:`dataclass_defaults`, or nested), the value the run was trained
  with; without a default it reads as ``None``. ``flag_names`` maps fields to the flags that
  set them where the names differ (``{"sft_steps": "--num_steps"}``), for the message.
  ``upgrade`` maps a saved section of an older version to today's layout first.

  Raises:
    ValueError: another kind of run (:func:`check_same_kind`), or naming every differing field
      with its saved and current value (fields of the same name that differ alike, e.g.
      ``seed`` and ``rl.seed``, named together; separated by semicolons).
  """
  try:
    saved = read_config(logdir)
  except FileNotFoundError:
    return
  _refuse_other_kind(logdir, section, saved)
  saved = saved[section] if upgrade is None else upgrade(saved[section])
  saved, now = flatten_config(saved), flatten_config(now)
  implied = {k: v for k, v in flatten_config(defaults or {}).items()
             if k in now and k not in saved}
  saved = {**implied, **saved}
  keys = sorted(set(saved) | set(now))
  diff = {k: (saved.get(k), now.get(k)) for k in keys if saved.get(k) != now.get(k)}
  if diff:
    flag_names = flag_names or {}
    # Fields one flag sets together (``seed`` and ``rl.seed``) differ alike: named together.
    groups: dict[tuple, list[str]] = {}
    for k, (a, b) in diff.items():
      groups.setdefault((k.rsplit(".", 1)[-1], repr(a), repr(b), k in implied), []).append(k)
    named = lambda n: f"{n} ({flag_names[n]})" if n in flag_names else n  # noqa: E731
    shown = "; ".join(
        f"{' and '.join(named(n) for n in sorted(names, key=lambda n: (n.count('.'), n)))}: "
        f"{'not saved, so the default ' if implied_ else 'saved '}{a}, now {b}"
        for (_, a, b, implied_), names in groups.items())
    raise ValueError(
        f"--logdir {logdir!r} holds a run with a different config ({shown}); use a new --logdir "
        f"or the same settings to resume."
    )


def truncate_jsonl(path: str, last_step: int,
                   applies: Callable[[dict[str, Any]], bool] = lambda r: True, *,
                   in_place: bool = False) -> int:
  """Drops records with ``step > last_step`` (they are redone after a resume); returns how
  many (0 on processes other than 0, which write no logs).

  Only records for which ``applies(record)`` is true are considered (e.g. RL records in a
  file that also holds pre-training ones). The file is replaced atomically, or with
  ``in_place`` rewritten in place, so that a writer already holding it open in append mode
  keeps appending to the same file. Only process 0 writes logs, so only it truncates.
  """
  if not is_primary() or not os.path.exists(path):
    return 0
  records = metrics_lib.read_jsonl(path)
  keep = [r for r in records if not (applies(r) and r["step"] > last_step)]
  dropped = len(records) - len(keep)
  if not dropped:  # the file is left as it is
    return 0
  text = "".join(json.dumps(r) + "\n" for r in keep)
  if in_place:
    with open(path, "r+", encoding="utf-8") as f:
      f.write(text)
      f.truncate()
  else:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)
  return dropped


class SigtermFlag:
  """Records SIGTERM; a host loop checks `any_process` between compiled steps.

  The handler only sets a flag, so it can never interrupt a checkpoint write. Installed
  only from the main thread (``signal`` allows no other); elsewhere it never fires.
  Use as a context manager; the previous handler is restored on exit (in the scripts, after a
  SIGTERM was taken, one that exits 75 at once on another: `rljax.preemption.handler_after`).
  """

  def __init__(self):
    self.received = False
    self._previous = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.received = True

  def any_process(self) -> bool:
    """Whether SIGTERM reached this process or, in a multi-process run, any other.

    With several processes this is a collective (an all-gather of one flag per process), so
    every process must call it at the same point of its loop (after the same step or chunk);
    then all of them stop after that step even when the signal reached them at different
    steps, and none is left waiting in the next step's collectives. With one process it only
    reads ``received``.
    """
    if jax.process_count() == 1:
      return self.received
    flags = multihost_utils.process_allgather(np.int32(self.received))
    return bool(np.max(flags))

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, preemption.handler_after(self._previous, self.received))
      self._previous = None
