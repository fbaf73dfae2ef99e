"""Configuration of the control PPO trainer, with bundled per-environment defaults.

`ControlConfig` nests the shared `rljax.ppo.PPOConfig` (clip range, coefficients, epochs and
minibatches) as ``ppo``, as `rljax.alignment.rlhf.RLHFConfig` does, and adds what the control
side needs: environments, sizes, networks, optimizer, discounting and evaluation.
`ControlConfig.replace` also takes the nested PPO fields by name
(``config.replace(num_minibatches=4)``), which is how the bundled defaults and the
script's flags are applied.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax

from rljax import nonfinite, runtime
from rljax.models.mlp import BRAX_INIT_STD as _BRAX_INIT_STD
from rljax.models.mlp import ActorCriticConfig as _ActorCriticConfig
from rljax.ppo import LossAggregation, PPOConfig

# `ControlConfig.env_threads=0` gives each environment thread at least this many environments:
# fewer per program leaves the physics' vectorised loops short.
MIN_ENVS_PER_THREAD = 32


class ConfigError(ValueError):
  """A configuration value is out of range; the message names the field and value.

  Attributes:
    fields: the config fields whose values the message quotes as ``name=value``, in the
      message's order (``experiments/train_control.py`` names the ones no flag set as the
      environment's defaults); empty where the message says where its values come from.
  """

  def __init__(self, message: str, *, fields: tuple[str, ...] = ()):
    super().__init__(message)
    self.fields = tuple(fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControlConfig:
  """Everything that defines a control PPO run. Frozen; validated in ``__post_init__``.

  Sizes: each training iteration collects ``batch_size`` trajectory segments of
  ``unroll_length`` steps (``batch_size / num_envs`` sequential unrolls of all
  ``num_envs`` environments), then runs ``num_epochs x num_minibatches`` SGD steps on
  minibatches of ``batch_size / num_minibatches`` segments. In Brax's terms our
  ``batch_size`` is Brax's ``batch_size * num_minibatches`` and ``num_epochs`` is its
  ``num_updates_per_batch``.

  Attributes:
    env: registry name, e.g. ``"playground/CartpoleBalance"``.
    num_timesteps: environment steps to train for (after action repeat), rounded up so that
      each of the ``num_evals - 1`` training chunks runs the same whole number of iterations
      of ``env_steps_per_iteration`` steps.
    num_envs: parallel environments.
    unroll_length: steps per trajectory segment (``T``).
    batch_size: segments per iteration; a multiple of ``num_envs``, divisible by
      ``num_minibatches``. ``0`` means ``num_envs``.
    ppo: the shared PPO settings (`rljax.ppo.PPOConfig`): ``clip_eps``, ``vf_coef``,
      ``entropy_coef`` (Brax's ``entropy_cost``), ``normalize_advantages`` (per minibatch),
      ``num_epochs`` (Brax's ``num_updates_per_batch``), ``num_minibatches`` (per epoch),
      ``num_microbatches`` (parts each minibatch's gradient is accumulated over; the same
      update up to floating-point reassociation) and the rest; the loss is a token mean (one
      token per environment step).
    learning_rate: Adam step size.
    lr_schedule: ``"constant"``, ``"linear"`` (to 0 at the end) or ``"cosine"``.
    max_grad_norm: global gradient-norm clip (``None``: no clipping, as in Brax).
    gamma: discount (``discounting`` in Brax).
    gae_lambda: GAE lambda.
    reward_scaling: rewards are multiplied by this for training.
    normalize_observations: keep running observation statistics.
    obs_stats_before_update: fold each rollout's observations into the statistics before
      that iteration's update (Brax's order), so the update normalises its batch with
      statistics that include it; the first minibatch's probability ratios then differ
      from 1 by the normaliser's change. ``False`` (default) folds them in after the update,
      so the update normalises with the statistics the rollout was sampled under and the
      first minibatch's ratios are exactly 1.
    policy_hidden / value_hidden / activation: network sizes.
    init_std: the policy's pre-tanh standard deviation where its scale output is 0
      (at initialisation). Brax's networks correspond to ``mlp.BRAX_INIT_STD`` (0.694).
    policy_init_scale: variance scale of the policy's output layer; ``0.01`` starts
      near ``loc = 0, std = init_std`` in every state (Andrychowicz et al. 2021),
      Brax uses ``1.0``.
    episode_length: steps per episode (time limit); 0 means the environment's default.
    action_repeat: physics steps per action.
    num_evals: evaluations over the run (the first at step 0); ``max(num_evals - 1, 1)``
      training chunks, so 1 acts as 2, as in Brax's ``num_evals``.
    num_eval_envs: environments per evaluation, each running one full episode.
    deterministic_eval: evaluate the mean action ``tanh(loc)``.
    seed: PRNG seed; the same seed gives bitwise-equal runs on the same machine.
    env_kwargs: extra keyword arguments for ``rljax.envs.make``.
    keep_checkpoints: number of checkpoints orbax keeps.
    nonfinite: what a non-finite reward, observation, loss or gradient does:
      ``"skip"`` skips that update (parameters, optimizer and normaliser unchanged)
      with a warning naming the chunk and the quantity; ``"halt"`` also stops the
      run after checkpointing the (still finite) state. Skips are counted in the
      ``nonfinite/skipped_updates`` metric.
    overlap_value_update: update the value network on a second thread while the next
      rollout runs (`rljax.control.host_chunks.OverlappedChunk`); the same PPO up to
      floating-point rounding, faster where the physics leaves a core idle (MJX on CPU).
      Needs ``max_grad_norm=None`` (a global clip couples the two networks' steps). Used with
      one process on one device; elsewhere the chunk is one program.
    env_threads: host threads that step the environments: each iteration's rollout runs as
      ``env_threads`` calls of one compiled program, each stepping ``num_envs /
      env_threads`` of the environments from its own thread, followed by one program for the
      update (`rljax.control.host_chunks.ThreadedChunk`). XLA:CPU runs one program's MJX
      physics on one core, so on CPU the threads step several times as many environments per
      second. Each thread draws the action noise the one-program rollout gives its rows, so
      the run is the one-program run up to floating-point rounding. ``0`` (default) chooses
      (`resolve_env_threads`): on CPU with one device and one process, the most threads up to
      the usable cores that divide ``num_envs`` with at least `MIN_ENVS_PER_THREAD`
      environments each (unless ``overlap_value_update``); elsewhere 1. ``1``: one program
      per chunk. Must divide ``num_envs``; more than 1 needs one device, one process and
      ``overlap_value_update=False``.
    gae_per_minibatch: compute GAE inside each minibatch's loss, from the value forward the
      loss makes anyway and the value network as that SGD step finds it (as Brax's PPO
      does), instead of once per iteration before the update from the rollout's value
      network. It saves one value-network pass over the batch per iteration and changes the
      algorithm: later minibatches see advantages from a partly trained value network.
      Truncated steps still bootstrap from the truncated state's value. Off by default. Not
      with ``overlap_value_update`` or ``num_microbatches > 1``.
  """

  env: str = "playground/CartpoleBalance"
  num_timesteps: int = 5_000_000
  num_envs: int = 256
  unroll_length: int = 32
  batch_size: int = 0
  ppo: PPOConfig = dataclasses.field(
      default_factory=lambda: PPOConfig(entropy_coef=1e-2, num_minibatches=8))
  learning_rate: float = 3e-4
  lr_schedule: str = "constant"
  max_grad_norm: float | None = None
  gamma: float = 0.99
  gae_lambda: float = 0.95
  reward_scaling: float = 1.0
  normalize_observations: bool = True
  obs_stats_before_update: bool = False
  policy_hidden: tuple[int, ...] = (32, 32, 32, 32)
  value_hidden: tuple[int, ...] = (256, 256, 256, 256, 256)
  activation: str = "swish"
  init_std: float = 1.0
  policy_init_scale: float = 0.01
  episode_length: int = 0
  action_repeat: int = 1
  num_evals: int = 10
  num_eval_envs: int = 128
  deterministic_eval: bool = True
  seed: int = 0
  env_kwargs: tuple[tuple[str, Any], ...] = ()
  keep_checkpoints: int = 3
  nonfinite: str = "skip"
  overlap_value_update: bool = False
  env_threads: int = 0
  gae_per_minibatch: bool = False

  def __post_init__(self):
    if not isinstance(self.ppo, PPOConfig):
      raise ConfigError(f"ppo must be an rljax.ppo.PPOConfig, got {self.ppo!r}.")
    if self.ppo.loss_aggregation != LossAggregation.TOKEN_MEAN:
      raise ConfigError(f"ppo.loss_aggregation must be token_mean for control (one token per "
                        f"environment step), got {self.ppo.loss_aggregation.value!r}.")
    positive_ints = (
        "num_timesteps", "num_envs", "unroll_length", "action_repeat", "num_evals",
        "num_eval_envs",
    )  # fmt: skip
    for name in positive_ints:
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}.")
    for name in ("batch_size", "episode_length", "env_threads"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}.")
    if not self.learning_rate > 0:
      raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate!r}.")
    nonfinite.check_policy(self.nonfinite, ConfigError)
    if self.lr_schedule not in ("constant", "linear", "cosine"):
      raise ConfigError(
          f"lr_schedule must be 'constant', 'linear' or 'cosine', got {self.lr_schedule!r}."
      )
    if not 0 < self.gamma <= 1 or not 0 <= self.gae_lambda <= 1:
      raise ConfigError(
          f"need 0 < gamma <= 1 and 0 <= gae_lambda <= 1, got {self.gamma}, {self.gae_lambda}."
      )
    if self.max_grad_norm is not None and not self.max_grad_norm > 0:
      raise ConfigError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}.")
    if self.overlap_value_update and self.max_grad_norm is not None:
      raise ConfigError(
          f"overlap_value_update needs max_grad_norm=None (a global-norm clip couples the policy "
          f"and value steps), got max_grad_norm={self.max_grad_norm!r}.",
          fields=("max_grad_norm",))
    if self.env_threads and self.num_envs % self.env_threads:
      raise ConfigError(
          f"env_threads={self.env_threads} must divide num_envs={self.num_envs} (each thread "
          f"steps num_envs / env_threads environments).", fields=("env_threads", "num_envs"))
    if self.env_threads > 1 and self.overlap_value_update:
      raise ConfigError(
          f"env_threads={self.env_threads} needs overlap_value_update=False (the threads' "
          f"physics leaves no core for the value update), got overlap_value_update=True.",
          fields=("env_threads", "overlap_value_update"))
    if self.gae_per_minibatch and self.overlap_value_update:
      raise ConfigError(
          "gae_per_minibatch needs overlap_value_update=False (the overlapped value update "
          "trains on advantages computed before it), got overlap_value_update=True.",
          fields=("overlap_value_update",))
    if self.gae_per_minibatch and self.ppo.num_microbatches != 1:
      raise ConfigError(
          f"gae_per_minibatch needs num_microbatches=1 (advantages are whitened over the whole "
          f"minibatch), got num_microbatches={self.ppo.num_microbatches}.",
          fields=("num_microbatches",))
    min_std = _ActorCriticConfig.min_std  # the network's floor; checked here before compiling
    if not self.init_std > min_std:
      raise ConfigError(
          f"init_std must be > {min_std!r} (the policy's min_std), got {self.init_std!r}.")
    if not self.policy_init_scale > 0:
      raise ConfigError(f"policy_init_scale must be > 0, got {self.policy_init_scale!r}.")
    if not self.reward_scaling > 0:
      raise ConfigError(f"reward_scaling must be > 0, got {self.reward_scaling!r}.")
    object.__setattr__(self, "policy_hidden", tuple(self.policy_hidden))
    object.__setattr__(self, "value_hidden", tuple(self.value_hidden))
    object.__setattr__(self, "env_kwargs", tuple(tuple(kv) for kv in self.env_kwargs))
    batch = self.segments_per_iteration
    # batch_size=0 means one segment per environment: name num_envs as the batch's source.
    batch_src = (f"batch_size={batch}" if self.batch_size else
                 f"num_envs={self.num_envs}, as batch_size=0")
    batch_fields = ("batch_size",) if self.batch_size else ("num_envs", "batch_size")
    if batch % self.num_envs:
      raise ConfigError(
          f"batch_size={batch} must be a multiple of num_envs={self.num_envs} "
          f"(each unroll steps all environments once).",
          fields=("batch_size", "num_envs"))
    minibatches, microbatches = self.ppo.num_minibatches, self.ppo.num_microbatches
    if batch % minibatches:
      raise ConfigError(
          f"the batch of {batch} segments ({batch_src}) is not divisible by "
          f"num_minibatches={minibatches}.",
          fields=(*batch_fields, "num_minibatches"))
    if (batch // minibatches) % microbatches:
      raise ConfigError(
          f"a minibatch of {batch // minibatches} segments is not divisible by "
          f"num_microbatches={microbatches}: {batch} segments a batch ({batch_src}) "
          f"over num_minibatches={minibatches}.",
          fields=("num_microbatches", *batch_fields, "num_minibatches"))

  @property
  def segments_per_iteration(self) -> int:
    """Rollout segments of ``unroll_length`` steps per iteration: ``batch_size`` or
    ``num_envs``."""
    return self.batch_size or self.num_envs

  @property
  def unrolls_per_iteration(self) -> int:
    """Unrolls of all ``num_envs`` environments per iteration."""
    return self.segments_per_iteration // self.num_envs

  @property
  def env_steps_per_iteration(self) -> int:
    """Environment steps per iteration, action repeats counted (Brax's convention)."""
    return self.segments_per_iteration * self.unroll_length * self.action_repeat

  @property
  def chunk_schedule(self) -> tuple[int, int]:
    """``(num_chunks, iterations_per_chunk)``: ``max(num_evals - 1, 1)`` training chunks of
    one whole number of iterations, enough for ``num_timesteps`` (rounded up); the run trains
    ``num_chunks * iterations_per_chunk * env_steps_per_iteration`` environment steps."""
    num_chunks = max(self.num_evals - 1, 1)
    total_iterations = max(math.ceil(self.num_timesteps / self.env_steps_per_iteration), 1)
    return num_chunks, max(math.ceil(total_iterations / num_chunks), 1)

  def to_json(self) -> str:
    """Every field as indented, key-sorted JSON (``checkpoints/config.json``; enums by value)."""
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True,
                      default=lambda value: value.value)  # enums by value

  @classmethod
  def from_json(cls, text: str) -> "ControlConfig":
    """The config `to_json` wrote (tuples restored; a config saved before ``ppo`` was nested
    is read too, `nest_ppo_fields`); checked as at construction."""
    d = nest_ppo_fields(json.loads(text))
    for k in ("policy_hidden", "value_hidden"):
      d[k] = tuple(d[k])
    d["env_kwargs"] = tuple(tuple(kv) for kv in d.get("env_kwargs", ()))
    d["ppo"] = PPOConfig(**d.get("ppo", {}))
    return cls(**d)

  def replace(self, **changes) -> "ControlConfig":
    """A copy with ``changes`` (``dataclasses.replace``), checked as at construction. The nested
    `PPOConfig`'s fields may be given by name (``num_minibatches=4``) beside the others.

    Raises:
      ConfigError: a name that is neither a field of this config nor of `PPOConfig`, or a
        value either refuses.
    """
    ppo_changes = {k: changes.pop(k) for k in list(changes) if k in PPO_FIELDS}
    unknown = sorted(set(changes) - set(CONTROL_FIELDS))
    if unknown:
      raise ConfigError(f"ControlConfig has no field {', '.join(unknown)} (nor has its ppo, "
                        f"rljax.ppo.PPOConfig).")
    if ppo_changes:
      try:
        changes["ppo"] = dataclasses.replace(changes.get("ppo", self.ppo), **ppo_changes)
      except ValueError as e:
        raise ConfigError(str(e)) from None
    return dataclasses.replace(self, **changes)

  def flat(self) -> dict[str, Any]:
    """Every field by its own name, the nested PPO fields beside the others (as the script's
    flags name them)."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "ppo"}
    d.update({name: getattr(self.ppo, name) for name in PPO_FIELDS})
    return d


PPO_FIELDS = tuple(f.name for f in dataclasses.fields(PPOConfig))
CONTROL_FIELDS = tuple(f.name for f in dataclasses.fields(ControlConfig))


def nest_ppo_fields(saved: dict[str, Any]) -> dict[str, Any]:
  """A saved ``ControlConfig`` dict in today's layout: the PPO fields that configs saved
  before ``ppo`` was nested hold at the top level move into ``ppo`` (a dict as saved today
  is returned as it is)."""
  if "ppo" in saved:
    return saved
  out = {k: v for k, v in saved.items() if k not in PPO_FIELDS}
  out["ppo"] = {k: v for k, v in saved.items() if k in PPO_FIELDS}
  return out


def resolve_env_threads(config: ControlConfig, mesh=None, *, cores: int | None = None) -> int:
  """The threads a run's rollouts step its environments on (`ThreadedChunk` when > 1).

  ``mesh`` is the run's device mesh (a ``jax.sharding.Mesh``; None: one device).
  ``config.env_threads`` if set. ``0`` chooses: 1 on a non-CPU backend, on a mesh of several
  devices or in several processes (each device already steps its own environments), or with
  ``overlap_value_update``; else the largest divisor of ``num_envs`` that is at most
  ``cores`` (default: the CPUs this process may run on) and leaves each thread at least
  `MIN_ENVS_PER_THREAD` environments (1 if none). E.g. 256 environments on 2 cores: 2;
  on 12 cores: 8 (32 each); 100 environments on 8 cores: 2 (50 each).

  Raises:
    ConfigError: ``env_threads > 1`` on a mesh of several devices or in several processes.
  """
  devices = mesh.devices.size if mesh is not None else 1
  processes = jax.process_count()
  if config.env_threads:
    if config.env_threads > 1 and (devices > 1 or processes > 1):
      where = f"a mesh of {devices} devices" if devices > 1 else f"{processes} processes"
      raise ConfigError(
          f"env_threads={config.env_threads} needs one device in one process; this run has "
          f"{where}, which step their own environments side by side (use env_threads=0 or 1).",
          fields=("env_threads",))
    return config.env_threads
  if (jax.default_backend() != "cpu" or devices > 1 or processes > 1
      or config.overlap_value_update):
    return 1
  return runtime.host_threads(config.num_envs, MIN_ENVS_PER_THREAD, cores)


# Per-environment defaults: what `experiments/train_control.py --env=NAME` starts from before
# its flags apply; only the fields that differ from `ControlConfig`'s own defaults. Tuned on a
# 2-core CPU; the measurements behind them are in docs/control.md and docs/performance.md.
_SMALL_NETWORKS = dict(num_minibatches=4, policy_hidden=(64, 64), value_hidden=(128, 128))
# Brax's policy initialisation (see ControlConfig.init_std).
_BRAX_INIT = dict(init_std=_BRAX_INIT_STD, policy_init_scale=1.0)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "playground/CartpoleBalance": dict(_SMALL_NETWORKS, num_timesteps=4_000_000,
                                       learning_rate=1e-3),
    "playground/CheetahRun": dict(_SMALL_NETWORKS, **_BRAX_INIT, num_timesteps=8_000_000,
                                  learning_rate=1e-3, gamma=0.995),
    "brax/ant": dict(_SMALL_NETWORKS, **_BRAX_INIT, num_timesteps=6_000_000, unroll_length=16,
                     lr_schedule="linear", gamma=0.97),
}


def default_config(env: str) -> ControlConfig:
  """The bundled defaults for ``env`` (generic defaults for environments not listed)."""
  return ControlConfig(env=env).replace(**_DEFAULTS.get(env, {}))
