"""What a run was: ``<logdir>/run_info.json`` (config, package versions, command line).

Every experiment script calls `start_run` once its flags are validated and its ``logdir``
is known::

    from rljax import run_info
    _WANDB = run_info.define_wandb_flag()          # --wandb (module level, beside the flags)
    ...
    run_info.start_run(logdir, config, use_wandb=_WANDB.value)

which writes ``run_info.json``::

    {"command": "experiments/train_control.py --algo=apg ...", "argv": [...],
     "executable": "/.../python", "cwd": "...", "started": "2026-01-01T12:00:00+00:00",
     "host": "...", "platform": "Linux-...", "config_type": "APGConfig",
     "config": {...}, "versions": {"python": "3.11.9", "jax": "0.10.0", ..., "rljax": "0.1.0"}}

and, with ``--wandb``, starts an offline Weights & Biases run (`rljax.metrics.init_wandb`)
that every `rljax.metrics.MetricsWriter` of the process mirrors its metrics to.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import enum
import importlib.metadata
import json
import os
import platform
import shlex
import sys
from typing import Any, Mapping, Sequence

from rljax import metrics
from rljax.runtime import is_primary

RUN_INFO_FILE = "run_info.json"

# Distributions whose versions decide a run's numbers (PyPI names, as importlib.metadata
# knows them).
PACKAGES: tuple[str, ...] = (
    "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "brax", "mujoco", "mujoco-mjx",
    "playground", "rljax",
)


def package_versions(packages: Sequence[str] = PACKAGES) -> dict[str, str | None]:
  """``{"python": "3.11.9", name: version or None (not installed), ...}``.

  Versions come from ``importlib.metadata.version`` (the installed distributions), so an
  editable install of rljax reports ``pyproject.toml``'s version.
  """
  out: dict[str, str | None] = {"python": platform.python_version()}
  for name in packages:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def _json_default(x: Any) -> Any:
  if isinstance(x, enum.Enum):
    return x.value
  if isinstance(x, (set, frozenset)):
    return sorted(x)
  if hasattr(x, "tolist"):  # numpy / jax scalars and arrays
    return x.tolist()
  return str(x)


def config_to_dict(config: Any) -> dict[str, Any]:
  """A JSON-ready dict of a config: a dataclass (nested ones included), a mapping or ``None``.

  Enums become their values, tuples lists, anything else not JSON-serialisable its ``str``.

  Raises:
    TypeError: ``config`` is neither a dataclass instance, a mapping nor ``None``.
  """
  if config is None:
    return {}
  if dataclasses.is_dataclass(config) and not isinstance(config, type):
    raw = dataclasses.asdict(config)
  elif isinstance(config, Mapping):
    raw = dict(config)
  else:
    raise TypeError(
        f"config must be a dataclass instance, a mapping or None, got {type(config).__name__}.")
  return json.loads(json.dumps(raw, default=_json_default))


def collect(config: Any = None, *, argv: Sequence[str] | None = None,
            extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The ``run_info.json`` dict (see the module docstring); ``argv`` defaults to ``sys.argv``."""
  argv = list(sys.argv if argv is None else argv)
  info: dict[str, Any] = {
      "command": shlex.join(argv),
      "argv": argv,
      "executable": sys.executable,
      "cwd": os.getcwd(),
      "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "host": platform.node(),
      "platform": platform.platform(),
      "config_type": None if config is None else type(config).__name__,
      "config": config_to_dict(config),
      "versions": package_versions(),
  }
  if extra:
    info.update(json.loads(json.dumps(dict(extra), default=_json_default)))
  return info


def _previous_starts(path: str) -> list[dict[str, Any]]:
  """The starts recorded in an existing ``run_info.json`` (its own and its ``"previous"``);
  [] when there is none or it is unreadable."""
  try:
    with open(path, encoding="utf-8") as f:
      old = json.load(f)
  except (OSError, ValueError):
    return []
  if not isinstance(old, dict):
    return []
  keep = ("command", "started", "host", "versions")
  return list(old.get("previous", [])) + [{k: old[k] for k in keep if k in old}]


def write_run_info(logdir: str, config: Any = None, *, argv: Sequence[str] | None = None,
                   extra: Mapping[str, Any] | None = None) -> str:
  """Writes `collect`'s dict to ``<logdir>/run_info.json`` (atomically); returns the path.

  A resumed run writes its own command line and versions, and keeps the earlier starts'
  ``command``, ``started``, ``host`` and ``versions`` under ``"previous"`` (oldest first; e.g.
  the 2-process command a 1-process resume continued). In a multi-process run only process 0
  writes it (``rljax.runtime.is_primary``).

  Raises:
    OSError: ``logdir`` cannot be created or written.
    TypeError: see `config_to_dict`.
  """
  path = os.path.join(logdir, RUN_INFO_FILE)
  if not is_primary():
    return path
  info = collect(config, argv=argv, extra=extra)
  previous = _previous_starts(path)
  if previous:
    info["previous"] = previous
  os.makedirs(logdir, exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(info, f, indent=2, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)
  return path


def define_wandb_flag():
  """Defines the absl flag ``--wandb`` (default off) and returns its holder."""
  from absl import flags

  # The flag belongs to the calling script (absl then lists it in the script's --help).
  flags.disclaim_key_flags()

  return flags.DEFINE_bool(
      "wandb", False,
      "Also log metrics to Weights & Biases, offline, under <logdir>/wandb "
      "(needs pip install 'rljax[wandb]'; upload later with `wandb sync`).")


def start_run(logdir: str, config: Any = None, *, use_wandb: bool = False,
              argv: Sequence[str] | None = None, extra: Mapping[str, Any] | None = None):
  """Writes ``<logdir>/run_info.json``; with ``use_wandb`` also starts an offline W&B run.

  The W&B run (``rljax.metrics.init_wandb``, config = the run's config plus the
  versions) is finished when the process exits; metric writers created after this call
  mirror to it.

  Returns:
    The ``wandb`` run, or ``None`` without ``use_wandb``.

  Raises:
    ValueError: ``use_wandb`` but the ``wandb`` package is not installed.
    OSError: ``logdir`` cannot be written.
  """
  path = write_run_info(logdir, config, argv=argv, extra=extra)
  if not use_wandb or not is_primary():
    return None
  with open(path, encoding="utf-8") as f:
    info = json.load(f)
  wb_config = dict(info["config"], _versions=info["versions"], _command=info["command"])
  run = metrics.init_wandb(logdir, wb_config)
  atexit.register(run.finish)
  return run


__all__ = [
    "PACKAGES",
    "RUN_INFO_FILE",
    "collect",
    "config_to_dict",
    "define_wandb_flag",
    "package_versions",
    "start_run",
    "write_run_info",
]
