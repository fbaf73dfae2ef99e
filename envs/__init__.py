"""One registry for the control environments, imported as ``rljax.envs``.

Names are ``"<source>/<name>"``:

* ``brax/<name>``: Brax's environments (``ant``, ``humanoid``, ``hopper``...) on the
  MJX backend;
* ``playground/<Name>``: MuJoCo Playground's environments. Its DM Control Suite
  (``CartpoleBalance``, ``CheetahRun``...) ships inside the package. Its locomotion and
  manipulation environments need a MuJoCo Menagerie checkout: pass
  ``menagerie_path=...`` to `make` or set ``$MUJOCO_MENAGERIE_PATH``.

Brax and Playground are imported when an environment is made or wrapped, not with this module,
so a script can check its flags without them.

`make` returns the unwrapped single environment. `wrap_for_training` applies the
libraries' own wrappers (``VmapWrapper``, ``EpisodeWrapper`` for episode length and
action repeat, and the auto-reset wrapper of Brax or Playground) for a batch of
environments, plus `RecordFinalObs`, which keeps the pre-reset observation of each step
so that truncated episodes can bootstrap from the truncated state's value;
`wrap_for_evaluation` adds Brax's ``EvalWrapper`` over them.

Example::

    from rljax import envs
    env = envs.make("playground/CartpoleBalance")
    train_env = envs.wrap_for_training(env, episode_length=1000)
"""

from __future__ import annotations

import difflib
import functools
import os
import weakref
from typing import Any

import jax

MENAGERIE_ENV_VAR = "MUJOCO_MENAGERIE_PATH"

_BRAX_ENVS = (
    "ant",
    "halfcheetah",
    "hopper",
    "humanoid",
    "humanoidstandup",
    "inverted_double_pendulum",
    "inverted_pendulum",
    "pusher",
    "reacher",
    "swimmer",
    "walker2d",
)


def _playground_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(DM Control Suite names, Menagerie-backed names) from Playground's registry."""
  from mujoco_playground._src import dm_control_suite, locomotion, manipulation

  return tuple(dm_control_suite.ALL_ENVS), tuple(locomotion.ALL_ENVS + manipulation.ALL_ENVS)


def list_envs() -> list[str]:
  """All registered names, e.g. ``["brax/ant", ..., "playground/CartpoleBalance", ...]``.

  Playground's locomotion and manipulation names are listed too; they need a local
  MuJoCo Menagerie (see `make`).
  """
  dm, menagerie = _playground_names()
  return [f"brax/{n}" for n in _BRAX_ENVS] + [f"playground/{n}" for n in dm + menagerie]


class UnknownEnvError(ValueError):
  """Raised for a name that is not in `list_envs`; the message lists close matches."""


class MenagerieNotFoundError(FileNotFoundError):
  """Raised for a Playground environment whose MuJoCo Menagerie assets are absent (a missing
  file: the experiment scripts report it in one line, exit status 2)."""


def check_name(name: str) -> str:
  """Returns ``name`` if registered, else raises `UnknownEnvError` naming close matches."""
  names = list_envs()
  if name in names:
    return name
  lower = {n.lower(): n for n in names}
  candidates = difflib.get_close_matches(name.lower(), list(lower), n=5, cutoff=0.5)
  # Also match on the part after the source prefix ("CartpoleBalance" -> playground/...).
  tail = name.split("/")[-1].lower()
  candidates += [
      n for n in lower if n.split("/")[-1] == tail or tail and tail in n.split("/")[-1]
  ][:5]
  close = list(dict.fromkeys(lower[c] for c in candidates))[:5]
  hint = f" Did you mean: {', '.join(close)}?" if close else ""
  raise UnknownEnvError(
      f"Unknown environment {name!r}.{hint} Names look like 'brax/ant' or "
      f"'playground/CartpoleBalance'; rljax.envs.list_envs() lists all {len(names)}."
  )


def _default_impl() -> str:
  # MJX's JAX implementation is ~20x faster than the Warp one on CPU (measured on
  # CartpoleBalance at 256 envs: 767k vs 34k steps/s); Warp is meant for NVIDIA GPUs.
  return "warp" if jax.default_backend() == "gpu" else "jax"


def _use_menagerie(path: str | os.PathLike | None) -> str:
  """Points Playground at a local Menagerie (returned), or fails before Playground tries git
  clone."""
  from etils import epath
  from mujoco_playground._src import mjx_env

  path = path or os.environ.get(MENAGERIE_ENV_VAR)
  if path:
    p = epath.Path(os.fspath(path))
    if not (p / "README.md").exists() and not p.exists():
      raise MenagerieNotFoundError(f"menagerie_path {str(p)!r} does not exist.")
    # Playground reads this module attribute when it loads robot assets.
    mjx_env.MENAGERIE_PATH = p
    return str(p)
  if not mjx_env.MENAGERIE_PATH.exists():
    raise MenagerieNotFoundError(
        "This Playground environment loads robot assets from MuJoCo Menagerie, which "
        f"is not at {mjx_env.MENAGERIE_PATH} and cannot be downloaded without network "
        "access. Clone https://github.com/google-deepmind/mujoco_menagerie on a machine "
        f"with network access, copy it here, and set ${MENAGERIE_ENV_VAR}=PATH (or pass "
        f"--menagerie_path=PATH to experiments/train_control.py, make(..., "
        f"menagerie_path=PATH) in Python)."
    )
  return str(mjx_env.MENAGERIE_PATH)


def check_assets(name: str, *, menagerie_path: str | os.PathLike | None = None) -> str:
  """Returns ``name`` if `make` can build it here, without building it: a registered name
  (`check_name`) whose assets are present (a local MuJoCo Menagerie for Playground's
  locomotion and manipulation environments, ``menagerie_path`` or
  ``$MUJOCO_MENAGERIE_PATH``; Brax's and the DM Control Suite's ship in their packages).

  A Menagerie-backed environment is built once to check that its robot's files are there (a
  few seconds); the others are not built.

  Raises:
    UnknownEnvError: as `check_name`.
    MenagerieNotFoundError: a Menagerie-backed environment without a local Menagerie, or
      whose robot files that Menagerie lacks.
  """
  check_name(name)
  source, env_name = name.split("/", 1)
  if source == "playground" and env_name not in _playground_names()[0]:
    make(name, menagerie_path=menagerie_path)
  return name


def make(name: str, *, menagerie_path: str | None = None, **kwargs: Any):
  """The single (unbatched, unwrapped) environment ``name``.

  Environments are not changed once built, so the same arguments give the same object (the
  last `CACHE_SIZE` are kept; arguments that cannot be hashed build a new one); with `traced`
  a process that trains several runs of one environment (a notebook, a sweep, the tests)
  traces its physics once.

  Args:
    name: a name from `list_envs`, e.g. ``"brax/ant"`` or ``"playground/CheetahRun"``.
    menagerie_path: local MuJoCo Menagerie checkout for Playground's locomotion and
      manipulation environments (default: ``$MUJOCO_MENAGERIE_PATH``).
    **kwargs: for ``brax/*``, keyword arguments of ``brax.envs.get_environment``
      (``backend`` defaults to ``"mjx"``); for ``playground/*``, entries of the
      environment's config (``config_overrides``); ``impl`` defaults to ``"jax"`` on
      CPU and ``"warp"`` on GPU.

  Returns:
    A ``brax.envs.Env`` or a ``mujoco_playground.MjxEnv``: ``reset(key)``,
    ``step(state, action)``, ``observation_size``, ``action_size``.

  Raises:
    UnknownEnvError: the name is not registered (the message lists close matches).
    MenagerieNotFoundError: a Menagerie-backed environment without a local Menagerie.
  """
  check_name(name)
  try:
    # The device too: MJX puts the model on jax.devices()[0], which a multi-process trainer
    # makes its own process's device while it builds; and the float width, since a model
    # built under jax.enable_x64 holds float64 arrays.
    key = (name, menagerie_path or os.environ.get(MENAGERIE_ENV_VAR),
           tuple(sorted(kwargs.items())), jax.devices()[0], bool(jax.config.jax_enable_x64))
    hash(key)
  except TypeError:  # e.g. a dict-valued override: not cached
    return _build(name, menagerie_path, kwargs)
  return _cached_build(key)


CACHE_SIZE = 16


@functools.lru_cache(maxsize=CACHE_SIZE)
def _cached_build(key):
  name, menagerie_path, items, _, _ = key
  return _build(name, menagerie_path, dict(items))


def _build(name: str, menagerie_path: str | None, kwargs: dict[str, Any]):
  """`make`'s environment, built anew."""
  source, env_name = name.split("/", 1)
  if source == "brax":
    from brax import envs as brax_envs

    kwargs.setdefault("backend", "mjx")
    return brax_envs.get_environment(env_name, **kwargs)
  from mujoco_playground import registry

  dm, _ = _playground_names()
  overrides = dict(kwargs)
  overrides.setdefault("impl", _default_impl())
  if env_name in dm:
    return registry.load(env_name, config_overrides=overrides)
  path = _use_menagerie(menagerie_path)
  try:
    return registry.load(env_name, config_overrides=overrides)
  except ValueError as e:  # MuJoCo's XML compiler: a file it includes is missing
    if "Error opening file" not in str(e):
      raise
    raise MenagerieNotFoundError(
        f"{path} lacks the MuJoCo Menagerie files {name} needs ({str(e).splitlines()[0]}): "
        f"point {MENAGERIE_ENV_VAR} (or --menagerie_path, menagerie_path=) at a full clone of "
        f"https://github.com/google-deepmind/mujoco_menagerie.") from e


def default_episode_length(name: str) -> int:
  """The episode length the environment's authors train with (1000 for most)."""
  if name.startswith("playground/"):
    from mujoco_playground import registry

    return int(registry.get_default_config(name.split("/", 1)[1]).episode_length)
  return 1000


FINAL_OBS_KEY = "final_obs"


class RecordFinalObs:
  """Keeps each step's observation before auto-reset in ``state.info['final_obs']``.

  Sits between ``EpisodeWrapper`` and the auto-reset wrapper. Auto-reset replaces
  ``state.obs`` with the first observation of the next episode; this copy is what a
  truncated episode bootstraps from. It is not an auto-reset of its own.
  """

  def __init__(self, env):
    self.env = env

  def reset(self, rng):
    state = self.env.reset(rng)
    state.info[FINAL_OBS_KEY] = state.obs
    return state

  def step(self, state, action):
    state = self.env.step(state, action)
    state.info[FINAL_OBS_KEY] = state.obs
    return state

  def __getattr__(self, name):
    return getattr(self.env, name)


def _split_keys(d: dict, own: frozenset) -> tuple[dict, dict]:
  """``(the entries of d whose keys are in own, the others)``."""
  return {k: v for k, v in d.items() if k in own}, {k: v for k, v in d.items() if k not in own}


_TRACED: "weakref.WeakKeyDictionary[Any, TraceOnce]" = weakref.WeakKeyDictionary()


def traced(env) -> "TraceOnce":
  """``env`` under `TraceOnce`, one wrapper per environment object: the trainers build their
  environments with ``traced(make(name))``, so every run of one environment in a process
  shares its traces of ``reset`` and ``step``."""
  wrapper = _TRACED.get(env)
  if wrapper is None:
    wrapper = _TRACED[env] = TraceOnce(env)
  return wrapper


class TraceOnce:
  """``env`` with its ``reset`` and ``step`` under ``jax.jit``, so each is traced once.

  JAX caches a jitted function's trace per input shape and structure, and ``vmap`` traces a
  jitted function at the unbatched shapes. Every computation built on this wrapper (the
  observation-size probe, the batched reset, the train chunk and the evaluation, at any
  number of environments) therefore reuses one trace of ``reset`` instead of re-running
  MJX's Python for each.

  ``step`` is traced once too. The wrappers above this one add their own keys to
  ``state.info`` and ``state.metrics`` (Brax's ``EvalWrapper`` adds ``eval_metrics`` and a
  ``reward`` metric), which would give the training and the evaluation states different
  structures and each its own trace of MJX's Python. The jitted step sees only the keys
  the environment's own ``reset`` returns; the wrappers' keys pass around it unchanged,
  as every Brax wrapper requires of the environment it wraps. XLA inlines the nested
  calls, so the compiled programs compute the same values. Other attributes are the
  wrapped environment's.
  """

  def __init__(self, env):
    self.env = env
    self._reset = jax.jit(env.reset)
    self._step = jax.jit(env.step)
    self._own_keys: tuple[frozenset, frozenset] | None = None  # (info, metrics) of reset

  def reset(self, rng):
    state = self._reset(rng)
    self._own_keys = (frozenset(state.info), frozenset(state.metrics))
    return state

  def step(self, state, action):
    if self._own_keys is None:  # a step before any reset: the whole state goes in
      return self._step(state, action)
    info, info_extra = _split_keys(state.info, self._own_keys[0])
    metrics, metrics_extra = _split_keys(state.metrics, self._own_keys[1])
    out = self._step(state.replace(info=info, metrics=metrics), action)
    return out.replace(info={**info_extra, **out.info}, metrics={**metrics_extra, **out.metrics})

  def __getattr__(self, name):
    if name in ("env", "_reset", "_step", "_own_keys"):  # not set yet (e.g. while unpickling)
      raise AttributeError(name)
    return getattr(self.env, name)


def wrap_for_training(env, *, episode_length: int, action_repeat: int = 1):
  """Batches ``env`` with the libraries' own training wrappers.

  The chain is ``VmapWrapper -> EpisodeWrapper(episode_length, action_repeat) ->
  RecordFinalObs -> AutoReset``, using Playground's ``BraxAutoResetWrapper`` for
  Playground environments and Brax's ``AutoResetWrapper`` for Brax ones.

  Args:
    env: from `make`.
    episode_length: steps (after action repeat) before ``info['truncation']`` is set.
    action_repeat: physics steps per action.

  Returns:
    An environment whose ``reset`` takes ``[B, 2]`` keys and whose ``step`` takes
    ``[B, action_size]`` actions. ``state.info`` has ``truncation`` and ``final_obs``.

  Raises:
    ValueError: non-positive ``episode_length`` or ``action_repeat``.
  """
  if episode_length < 1 or action_repeat < 1:
    raise ValueError(
        f"episode_length and action_repeat must be >= 1, got {episode_length}, {action_repeat}."
    )
  from brax.envs.wrappers import training as brax_training

  wrapped = brax_training.EpisodeWrapper(
      brax_training.VmapWrapper(env), episode_length, action_repeat
  )
  wrapped = RecordFinalObs(wrapped)
  if _is_playground(env.unwrapped):
    from mujoco_playground._src import wrapper as pg_wrapper

    return pg_wrapper.BraxAutoResetWrapper(wrapped)
  return brax_training.AutoResetWrapper(wrapped)


def wrap_for_evaluation(env, *, episode_length: int, action_repeat: int = 1):
  """`wrap_for_training` inside Brax's ``EvalWrapper``, which records each environment's
  first episode (return and length, frozen at its first ``done``) in
  ``state.info["eval_metrics"]``; what the trainers evaluate on.

  Raises:
    ValueError: non-positive ``episode_length`` or ``action_repeat``.
  """
  from brax.envs.wrappers import training as brax_training

  return brax_training.EvalWrapper(
      wrap_for_training(env, episode_length=episode_length, action_repeat=action_repeat))


def _is_playground(env) -> bool:
  from mujoco_playground._src import mjx_env

  return isinstance(env, mjx_env.MjxEnv)


__all__ = [
    "FINAL_OBS_KEY",
    "MenagerieNotFoundError",
    "RecordFinalObs",
    "TraceOnce",
    "UnknownEnvError",
    "check_assets",
    "check_name",
    "default_episode_length",
    "list_envs",
    "make",
    "wrap_for_training",
]
