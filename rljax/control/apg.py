r"""Analytic policy gradients (APG): training by differentiating through the physics.

MJX and Brax's ``generalized`` pipeline are written in JAX, so a rollout's return is a
differentiable function of the policy parameters. APG (Freeman et al., 2021, "Brax -- A
Differentiable Physics Engine for Large Scale Rigid Body Simulation", sec. 5; Brax's
``brax/training/agents/apg``) follows the exact gradient of the return of a short
rollout of a *deterministic* policy :math:`a_t = \tanh(\mu_\theta(\bar s_t))`, where
:math:`\bar s_t` is the normalised observation:

.. math::

    L(\theta) = -\frac{1}{N\,\sum_t \gamma^t} \sum_{n=1}^{N} \sum_{t=0}^{H-1}
                \gamma^t\, r(s^n_t, a^n_t), \qquad
    s^n_{t+1} = f(s^n_t, a^n_t), \qquad
    \nabla_\theta L \text{ by reverse-mode AD through } f \text{ (lax.scan over env.step)}.

* **Truncation.** Gradients through long horizons explode or vanish in chaotic or
  contact-rich dynamics (Suh et al., 2022, "Do Differentiable Simulators Give Better
  Policy Gradients?"; Xu et al., 2022, "Accelerated Policy Learning with Parallel
  Differentiable Simulation", SHAC). The horizon ``H`` is split into segments of
  ``truncation_length`` steps and the state is ``stop_gradient``-ed at each segment start:
  the return still covers ``H`` steps, but each reward is differentiated only back to
  the start of its segment.
* **Clipping.** The gradient's global norm is clipped to ``max_grad_norm`` before Adam.
  Gradients are taken per environment and non-finite ones are left out of the mean
  (`masked_env_gradients`: MJX's line search yields NaN gradients at states where the
  solver has nothing to do; counted in ``nonfinite/envs_dropped``); if all are
  non-finite the update is skipped (``optax.apply_if_finite``).
* **Continuing rollouts.** The batched environments carry on between updates (the
  libraries' auto-reset wrappers), with episode clocks scrambled at the start, as in
  Brax's APG, so that resets are spread over time.

Differentiating MJX needs a solver without ``while_loop`` (`rljax.control.differentiable`):
training uses that modified model, while evaluation runs on the *unmodified* environment, so
the reported rewards are those of the real task (docs/control.md gives the accuracy cost).

Example::

    from rljax.control import apg
    config = apg.default_apg_config("playground/CartpoleSwingup")
    result = apg.train_apg(config, "runs/apg_cartpole")
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax


from rljax import checkpoint as ckpt
from rljax import envs, loop, running_stats, runtime
from rljax import metrics as metrics_lib
from rljax.control import checkpointing, chunks
from rljax.control import networks as networks_lib
from rljax.control.config import ConfigError, ControlConfig
from rljax.control.differentiable import has_mjx_model, make_differentiable, solver_options
from rljax.control.evaluation import run_eval_episodes
from rljax.control.networks import Networks, policy_apply
from rljax.models import mlp

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class APGConfig:
  """Everything that defines an APG run. Frozen; validated in ``__post_init__``.

  Each policy update differentiates ``horizon_length`` steps of all ``num_envs``
  environments, so a run takes ``num_updates * num_envs * horizon_length`` environment
  steps (times ``action_repeat`` physics steps).

  Attributes:
    env: registry name, e.g. ``"playground/CartpoleSwingup"`` or ``"brax/reacher"``
      (pass ``env_kwargs=(("backend", "generalized"),)`` for Brax's generalized pipeline).
    num_envs: parallel environments ``N``.
    horizon_length: steps ``H`` per policy update (the differentiated rollout).
    truncation_length: gradients flow back at most this many steps (``stop_gradient``
      on the state every ``truncation_length`` steps); must divide ``horizon_length``.
      ``0`` means no truncation (``= horizon_length``).
    num_updates: policy updates in the run.
    learning_rate: Adam step size at the first update.
    lr_schedule: ``"constant"`` or ``"exponential"`` (the rate times ``lr_decay`` after every
      update, as Brax's APG).
    lr_decay: the exponential schedule's per-update factor (Brax: 0.997); 1 with
      ``"constant"``.
    adam_b1, adam_b2: Adam's moment decays (Brax's APG uses 0.7, 0.95).
    max_grad_norm: global gradient-norm clip; ``None`` for none.
    gamma: discount inside the horizon (1 = the mean reward, as Brax's APG).
    normalize_observations: keep running observation statistics (not differentiated).
    policy_hidden / activation: the policy MLP (``rljax.models.mlp``).
    episode_length: steps per episode; 0 means the environment's default.
    action_repeat: physics steps per action.
    scramble_episodes: start the environments at random points of their episodes.
    num_evals: evaluations over the run (the first before training).
    num_eval_envs: environments per evaluation (one full episode each, unmodified
      solver settings, deterministic policy).
    solver_iterations: MJX ``opt.iterations`` for training (1 makes MJX
      differentiable); ``None`` keeps the model's.
    ls_iterations: MJX ``opt.ls_iterations`` for training; ``None`` keeps the model's.
    seed: PRNG seed.
    env_kwargs: extra keyword arguments for ``rljax.envs.make``.
    keep_checkpoints: number of checkpoints orbax keeps.
  """

  env: str = "playground/CartpoleSwingup"
  num_envs: int = 64
  horizon_length: int = 32
  truncation_length: int = 0
  num_updates: int = 300
  learning_rate: float = 1e-3
  lr_schedule: str = "constant"
  lr_decay: float = 1.0
  adam_b1: float = 0.7
  adam_b2: float = 0.95
  max_grad_norm: float | None = 1.0
  gamma: float = 1.0
  normalize_observations: bool = True
  policy_hidden: tuple[int, ...] = (64, 64)
  activation: str = "tanh"
  episode_length: int = 0
  action_repeat: int = 1
  scramble_episodes: bool = True
  num_evals: int = 10
  num_eval_envs: int = 16
  solver_iterations: int | None = 1
  ls_iterations: int | None = None
  seed: int = 0
  env_kwargs: tuple[tuple[str, Any], ...] = ()
  keep_checkpoints: int = 3

  def __post_init__(self):
    for name in ("num_envs", "horizon_length", "num_updates", "action_repeat", "num_evals",
                 "num_eval_envs", "keep_checkpoints"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}.")
    for name in ("truncation_length", "episode_length"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}.")
    if self.truncation_length and self.horizon_length % self.truncation_length:
      raise ConfigError(
          f"truncation_length={self.truncation_length} must divide "
          f"horizon_length={self.horizon_length}."
      )
    if not self.learning_rate > 0:
      raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate!r}.")
    if not 0 < self.lr_decay <= 1:
      raise ConfigError(f"lr_decay must be in (0, 1], got {self.lr_decay!r}.")
    if self.lr_schedule not in ("constant", "exponential"):
      raise ConfigError(f"lr_schedule must be 'constant' or 'exponential' for APG, got "
                        f"{self.lr_schedule!r}.")
    if (self.lr_schedule == "exponential") != (self.lr_decay < 1):
      raise ConfigError(
          f"lr_schedule={self.lr_schedule!r} with lr_decay={self.lr_decay!r}: the exponential "
          f"schedule needs lr_decay < 1, and lr_decay applies to it only.")
    for name in ("adam_b1", "adam_b2"):
      if not 0 <= getattr(self, name) < 1:
        raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)!r}.")
    if self.max_grad_norm is not None and not self.max_grad_norm > 0:
      raise ConfigError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}.")
    if not 0 < self.gamma <= 1:
      raise ConfigError(f"gamma must be in (0, 1], got {self.gamma!r}.")
    for name in ("solver_iterations", "ls_iterations"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ConfigError(f"{name} must be a positive integer or None, got {value!r}.")
    object.__setattr__(self, "policy_hidden", tuple(self.policy_hidden))
    object.__setattr__(self, "env_kwargs", tuple(tuple(kv) for kv in self.env_kwargs))
    # Fails early, with the network's own message, on bad sizes or activation.
    try:
      mlp.ActorCriticConfig(observation_size=1, action_size=1, policy_hidden=self.policy_hidden,
                            value_hidden=(), activation=self.activation)
    except ValueError as e:
      raise ConfigError(str(e)) from None

  @property
  def env_steps_per_update(self) -> int:
    return self.num_envs * self.horizon_length * self.action_repeat

  @property
  def segment_length(self) -> int:
    """Steps between ``stop_gradient`` s (``truncation_length``, or ``horizon_length``)."""
    return self.truncation_length or self.horizon_length

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

  def replace(self, **changes) -> "APGConfig":
    return dataclasses.replace(self, **changes)


# Per-environment defaults, tuned on a 2-core CPU (expected results: docs/control.md).
# Swing-up needs the long horizon: with horizon_length=32 APG stalls near 370.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "playground/CartpoleSwingup": dict(
        num_envs=64, horizon_length=128, num_updates=800, learning_rate=3e-3, lr_schedule="exponential",
        lr_decay=0.998,
        policy_hidden=(64, 64), num_evals=11,
    ),
    "brax/reacher": dict(
        env_kwargs=(("backend", "generalized"),), num_envs=64, horizon_length=32,
        num_updates=300, learning_rate=3e-3,
        lr_schedule="exponential", lr_decay=0.995, policy_hidden=(64, 64),
        num_evals=11,
    ),
}


def default_apg_config(env: str) -> APGConfig:
  """Bundled APG defaults for ``env`` (generic defaults for environments not listed)."""
  return APGConfig(env=env, **_DEFAULTS.get(env, {}))


def apg_only_fields() -> tuple[str, ...]:
  """`APGConfig` fields that PPO's ``ControlConfig`` does not have (for script flags)."""
  ppo = set(ControlConfig().flat())
  return tuple(f.name for f in dataclasses.fields(APGConfig) if f.name not in ppo)


def build_apg_config(env: str, overrides: dict[str, Any]) -> APGConfig:
  """``default_apg_config(env)`` with ``overrides`` (e.g. from script flags) applied.

  Raises:
    ConfigError: an override that is not an `APGConfig` field (naming it, e.g. a
      PPO-only flag such as ``num_minibatches``), or an invalid value.
  """
  names = {f.name for f in dataclasses.fields(APGConfig)}
  unknown = sorted(k for k in overrides if k not in names)
  if unknown:
    verb = "does" if len(unknown) == 1 else "do"
    # env_kwargs is an APGConfig field but no flag of train_control.py (a dict, set in Python).
    flag_names = sorted(names - {"env_kwargs"})
    raise ConfigError(
        f"{', '.join('--' + k for k in unknown)} {verb} not apply to --algo=apg; APG's "
        f"settings (rljax.control.apg.APGConfig) are "
        f"{', '.join('--' + n for n in flag_names)} (and env_kwargs, in Python only)."
    )
  if overrides.get("lr_decay", 1.0) < 1 and "lr_schedule" not in overrides:
    overrides = dict(overrides, lr_schedule="exponential")  # as --lr_decay alone always meant
  elif overrides.get("lr_schedule") == "constant" and "lr_decay" not in overrides:
    overrides = dict(overrides, lr_decay=1.0)  # an environment's default decay, turned off
  return default_apg_config(env).replace(**overrides)


# -- the loss --------------------------------------------------------------------------------


def deterministic_action(networks: Networks, params, obs_stats, obs: Array) -> Array:
  """``obs [..., D] -> tanh(loc) [..., A]``: the policy MLP's mean, squashed.

  The same function as ``trainer.load_policy(..., deterministic=True)``.
  """
  loc, _ = policy_apply(networks, params, running_stats.normalize(obs_stats, obs))
  return jnp.tanh(loc)


def discount_weights(horizon_length: int, gamma: float) -> Array:
  """``[H]`` float32 weights ``gamma^t / sum_t gamma^t`` (uniform ``1/H`` for ``gamma = 1``)."""
  w = jnp.asarray(gamma, jnp.float32) ** jnp.arange(horizon_length, dtype=jnp.float32)
  return w / jnp.sum(w)


def apg_loss(params, obs_stats: running_stats.RunningStats, env_state, *, env,
             networks: Networks, horizon_length: int, segment_length: int,
             gamma: float = 1.0):
  """Negative discounted mean reward of an ``H``-step rollout, differentiable in ``params``.

  Args:
    params: the policy's parameters (differentiated).
    obs_stats: observation statistics (constants).
    env_state: batched state of ``env`` (leading axis ``N``).
    env: a batched, differentiable environment (`make_differentiable`, wrapped by
      ``rljax.envs.wrap_for_training``).
    networks: graph definition and sizes.
    horizon_length: ``H``.
    segment_length: steps between ``stop_gradient`` s of the state; divides ``H``.
    gamma: discount.

  Returns:
    ``(loss [], (final_state, obs [H, N, D], rewards [H, N]))``; ``loss`` is float32.
  """
  num_segments = horizon_length // segment_length

  def step(state, _):
    action = deterministic_action(networks, params, obs_stats, state.obs)
    next_state = env.step(state, action)
    return next_state, (state.obs, next_state.reward)

  def segment(state, _):
    state = jax.lax.stop_gradient(state)
    return jax.lax.scan(step, state, None, length=segment_length)

  final, (obs, rewards) = jax.lax.scan(segment, env_state, None, length=num_segments)
  obs = obs.reshape((horizon_length,) + obs.shape[2:])
  rewards = rewards.reshape((horizon_length,) + rewards.shape[2:])
  weights = discount_weights(horizon_length, gamma)
  loss = -jnp.mean(jnp.tensordot(weights, rewards, axes=1))
  return loss, (jax.lax.stop_gradient(final), obs, rewards)


def masked_env_gradients(loss_fn: Callable, params, obs_stats, env_state):
  """Per-environment APG gradients, averaged over the environments whose gradient is finite.

  MJX's line search divides by the curvature along its search direction, guarded by
  ``jnp.where``; when that direction is exactly zero (the warm start already solves
  the constraint problem) the forward pass is fine but reverse mode yields ``0 * inf =
  NaN``. One such environment would poison the batch's gradient, so gradients are
  taken per environment (``jax.vmap`` of ``jax.grad`` over a batch of one) and
  non-finite ones are dropped from the mean.

  Args:
    loss_fn: ``(params, obs_stats, env_state) -> (loss, (final_state, obs [H, B, D],
      rewards [H, B]))``, e.g. `apg_loss` with its keywords bound.
    params: differentiated parameters.
    obs_stats: observation statistics.
    env_state: batched environment state, leading axis ``N``.

  Returns:
    ``(loss [], grads, final_state, obs [N * H, D], rewards [N, H], finite [N] bool)``;
    ``loss`` and ``grads`` are means over finite environments (zero if none is).
  """
  split = jax.tree.map(lambda x: x[:, None], env_state)  # [N, 1, ...]: batches of one

  def one(s):
    return jax.value_and_grad(loss_fn, has_aux=True)(params, obs_stats, s)

  (loss_n, (final_n, obs_n, rewards_n)), grads_n = jax.vmap(one)(split)
  finite = jnp.isfinite(loss_n)
  for g in jax.tree.leaves(grads_n):
    finite &= jnp.all(jnp.isfinite(g.reshape(g.shape[0], -1)), axis=1)
  weights = finite.astype(jnp.float32) / jnp.maximum(jnp.sum(finite), 1)

  def mean(x):
    w = weights.reshape(weights.shape + (1,) * (x.ndim - 1)).astype(x.dtype)
    return jnp.sum(jnp.where(w > 0, x, 0.0) * w, axis=0)

  final = jax.tree.map(lambda x: x[:, 0], final_n)
  obs = obs_n.reshape((-1, obs_n.shape[-1]))
  rewards = rewards_n.reshape(rewards_n.shape[0], -1)
  return mean(loss_n), jax.tree.map(mean, grads_n), final, obs, rewards, finite


def make_optimizer(config: APGConfig) -> optax.GradientTransformation:
  """Clip by global norm, then Adam with exponential decay; skips non-finite updates."""
  lr = config.learning_rate
  if config.lr_schedule == "exponential":
    lr = optax.exponential_decay(config.learning_rate, transition_steps=1,
                                 decay_rate=config.lr_decay)
  parts = [] if config.max_grad_norm is None else [optax.clip_by_global_norm(config.max_grad_norm)]
  parts.append(optax.adam(lr, b1=config.adam_b1, b2=config.adam_b2))
  return optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=2**30)


# -- the trainer -------------------------------------------------------------------------------


class APGState(NamedTuple):
  """Learner state between compiled chunks.

  Attributes:
    params: ``nnx.State`` of the actor-critic (only the policy is trained).
    opt_state: optax state.
    obs_stats: observation normaliser statistics.
    key: ``[2]`` uint32 PRNG key.
    update: ``[]`` int32 policy updates done.
  """

  params: Any
  opt_state: Any
  obs_stats: running_stats.RunningStats
  key: Array
  update: Array


@dataclasses.dataclass(frozen=True)
class APGTrainer:
  """The compiled pieces of an APG run; build with `make_apg_trainer`."""

  config: APGConfig
  networks: Networks
  env: Any
  eval_env: Any
  optimizer: optax.GradientTransformation
  updates_per_chunk: int
  num_chunks: int
  episode_length: int
  train_solver: dict[str, int] | None = None

  @property
  def env_steps_per_chunk(self) -> int:
    return self.updates_per_chunk * self.config.env_steps_per_update

  def checkpoint_items(self, chunk: int, state) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's items (`rljax.control.checkpointing`, the PPO trainer's layout) of
    ``state = (APGState, env_state)`` after ``chunk`` chunks."""
    apg_state, env_state = state
    return checkpointing.policy_item(apg_state), checkpointing.train_item(
        env_state, chunk * self.env_steps_per_chunk, opt_state=apg_state.opt_state,
        key=apg_state.key, update=apg_state.update)

  def init(self, params) -> tuple[APGState, Any]:
    """The state at step 0 from policy ``params``: ``(APGState, env_state)`` with the
    environments reset (and scrambled over their episodes when ``scramble_episodes``)."""
    c = self.config
    key_env, key_scramble, key_train = jax.random.split(jax.random.PRNGKey(c.seed), 3)
    state = APGState(
        params=params,
        opt_state=self.optimizer.init(params),
        obs_stats=running_stats.init(self.networks.config.observation_size),
        key=key_train,
        update=jnp.zeros((), jnp.int32),
    )

    def reset(key_env, key_scramble):
      env_state = self.env.reset(jax.random.split(key_env, c.num_envs))
      if c.scramble_episodes and "steps" in env_state.info:
        steps = env_state.info["steps"]
        start = jnp.floor(jax.random.uniform(key_scramble, steps.shape) * self.episode_length)
        env_state.info["steps"] = start.astype(steps.dtype)
      return env_state

    return state, jax.jit(reset)(key_env, key_scramble)

  def _update(self, carry, _):
    state, env_state = carry
    c = self.config
    loss_fn = functools.partial(
        apg_loss, env=self.env, networks=self.networks, horizon_length=c.horizon_length,
        segment_length=c.segment_length, gamma=c.gamma,
    )
    loss, grads, env_state, obs, rewards, finite = masked_env_gradients(
        loss_fn, state.params, state.obs_stats, env_state)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    stats = state.obs_stats
    if c.normalize_observations:
      stats = running_stats.update(stats, obs)
    metrics = {
        "loss": loss,
        "grad_norm": optax.global_norm(grads),
        "train/reward_per_step": jnp.mean(rewards),
        "nonfinite/envs_dropped": jnp.sum(~finite).astype(jnp.float32),
    }
    new = APGState(params, opt_state, stats, state.key, state.update + 1)
    return (new, env_state), metrics

  @functools.cached_property
  def train_chunk(self) -> Callable:
    """``jit((state, env_state) -> (state, env_state, metrics))`` over ``updates_per_chunk``.

    Both states are donated. ``metrics`` are means over the chunk, plus
    ``nonfinite/skipped_updates`` (total so far).
    """

    def chunk(state, env_state):
      (state, env_state), m = jax.lax.scan(
          self._update, (state, env_state), None, length=self.updates_per_chunk)
      out = jax.tree.map(jnp.mean, m)
      out["nonfinite/skipped_updates"] = state.opt_state.total_notfinite
      return state, env_state, out

    return jax.jit(chunk, donate_argnums=(0, 1),
                   compiler_options=runtime.control_compiler_options())

  @functools.cached_property
  def evaluate(self) -> Callable:
    """``jit((params, obs_stats, key) -> metrics)``: one full episode per eval env."""
    c, networks = self.config, self.networks
    n_steps = self.episode_length // c.action_repeat

    def run(params, obs_stats, key):
      return run_eval_episodes(
          self.eval_env, jax.random.split(key, c.num_eval_envs),
          lambda obs, _: deterministic_action(networks, params, obs_stats, obs),
          num_steps=n_steps)

    return jax.jit(run, compiler_options=runtime.control_compiler_options())


def make_apg_trainer(config: APGConfig, params_key: Array | None = None):
  """Builds environments (training: differentiable; evaluation: unmodified), networks
  and optimizer; returns ``(trainer, params)``.

  Raises:
    rljax.envs.UnknownEnvError: unknown ``config.env``.
    ValueError: non-flat observations.
  """
  env = envs.make(config.env, **dict(config.env_kwargs))
  episode_length = config.episode_length or envs.default_episode_length(config.env)
  diff_env = make_differentiable(env, solver_iterations=config.solver_iterations,
                                 ls_iterations=config.ls_iterations)
  train_env = envs.wrap_for_training(diff_env, episode_length=episode_length,
                                     action_repeat=config.action_repeat)
  eval_env = envs.wrap_for_evaluation(env, episode_length=episode_length,
                                      action_repeat=config.action_repeat)
  # No value network (APG has none); the actor-critic keeps load_policy and export reading
  # APG checkpoints as PPO's.
  net_config = networks_lib.actor_critic_config(
      env, policy_hidden=config.policy_hidden, value_hidden=(), activation=config.activation)
  if params_key is None:
    params_key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
  networks, params = networks_lib.make_networks(net_config, params_key)
  num_chunks = max(config.num_evals - 1, 1)
  updates_per_chunk = max(math.ceil(config.num_updates / num_chunks), 1)
  trainer = APGTrainer(
      config=config,
      networks=networks,
      env=train_env,
      eval_env=eval_env,
      optimizer=make_optimizer(config),
      updates_per_chunk=updates_per_chunk,
      num_chunks=num_chunks,
      episode_length=episode_length,
      train_solver=solver_options(diff_env) if has_mjx_model(diff_env) else None,
  )
  return trainer, params


class APGResult(NamedTuple):
  """What `train_apg` returns.

  Attributes:
    state: the final `APGState`.
    networks: the policy's graph definition and sizes (for ``export.export_policy``).
    history: one dict per evaluation: ``step``, ``env_steps``, ``eval/episode_reward``,
      ``timing/wall_s``, training means...
    wall_s: seconds for the whole run.
    compile_s: estimated compilation seconds included in ``wall_s``.
    resumed_from: the chunk a resumed run restarted after; None for a fresh run.
  """

  state: APGState
  networks: Networks
  history: list[dict[str, float]]
  wall_s: float
  compile_s: float
  resumed_from: int | None = None  # the chunk a resumed run restarted after, else None


def saved_run(config: APGConfig) -> ckpt.SavedRun:
  """An APG run of ``config`` as ``config.json`` records it (`rljax.checkpoint.check_logdir`)."""
  return ckpt.SavedRun(section="apg", config_json=json.loads(config.to_json()),
                       defaults=ckpt.dataclass_defaults(APGConfig), upgrade=_with_lr_schedule)


def _with_lr_schedule(saved: dict[str, Any]) -> dict[str, Any]:
  """A saved APG config of a version without ``lr_schedule``: exponential where it decayed."""
  if "lr_schedule" in saved:
    return saved
  return dict(saved, lr_schedule="exponential" if saved.get("lr_decay", 1.0) < 1 else "constant")


def train_apg(config: APGConfig, logdir: str | None = None, *, progress: bool = True,
              checkpoints: bool = True, resume: bool = True,
              log: Callable[[str], None] = print) -> APGResult:
  """Trains ``config`` with APG in the shared host loop (`rljax.loop.run`).

  Writes to ``logdir`` (if given): ``metrics.jsonl`` (``step``, ``env_steps``,
  ``eval/episode_reward``, ``loss``, ``grad_norm``, ``sps``, ``timing/*``),
  TensorBoard events, ``learning_curve.png``, and ``checkpoints/`` in the PPO trainer's
  layout (``config.json`` with ``"algo": "apg"``), so ``trainer.load_policy``,
  ``export.export_from_logdir`` and ``render.render_policy`` work on APG runs.

  Restarts as the PPO trainer's `rljax.control.trainer.train` does: every evaluation writes
  a checkpoint of the full state (policy, optimizer, normaliser, key, update count and the
  environment state); with ``resume`` (default) the run continues from the newest readable
  one and ends bitwise equal to an uninterrupted run. On SIGTERM the current chunk finishes,
  is checkpointed, and `rljax.preemption.Preempted` is raised (during start-up: before the
  first evaluation, with nothing new to save).

  Returns:
    `APGResult`.

  Raises:
    rljax.envs.UnknownEnvError: unknown environment, before anything compiles.
    ValueError: ``logdir`` holds checkpoints of another config, or holds checkpoints and
      ``resume`` is False.
    rljax.preemption.Preempted: SIGTERM was received; the state is checkpointed.
  """
  t_start = time.perf_counter()
  with ckpt.SigtermFlag() as sigterm:
    use_ckpt = logdir is not None and checkpoints
    newest = ckpt.check_logdir(logdir, saved_run(config), resume=resume) if use_ckpt else None
    if progress:
      runtime.primary_print(f"{config.env}: building the environments; the evaluation and the "
                            f"first chunk compile at their first call (a new configuration "
                            f"takes up to a minute on CPU)", file=sys.stderr, flush=True)
    trainer, params = make_apg_trainer(config)
    state = trainer.init(params)
    saver, start, resumed_from, history = None, 0, None, []
    if use_ckpt:
      checkpointing.write_config(logdir, "apg", config, trainer.networks.config, algo="apg",
                                 train_solver=trainer.train_solver)
      saver = loop.Checkpoints(
          logdir, keep=config.keep_checkpoints,
          items=trainer.checkpoint_items, from_items=_from_items)
      restored = saver.restore(state, log=log) if newest is not None else None
      if restored is not None:
        start, state = restored
        resumed_from = start
      history = checkpointing.resume_history(logdir, resumed_from, num_chunks=trainer.num_chunks,
                                             env_steps=start * trainer.env_steps_per_chunk,
                                             log=log)
    writer = None
    if logdir is not None and start < trainer.num_chunks:
      writer = metrics_lib.MetricsWriter(
          logdir, total=trainer.num_chunks * trainer.env_steps_per_chunk if progress else None,
          console_keys=("eval/episode_reward", "sps"))
    eval_key = jax.random.PRNGKey(config.seed + 10_000)
    train_s: list[float] = []  # the first two chunks' times estimate the compile time

    spec = loop.LoopSpec(num_steps=trainer.num_chunks, unit="chunk", evaluate_first=True)
    step_fn = chunks.chunk_step(trainer.train_chunk, trainer.env_steps_per_chunk, train_s)
    try:
      state, history = loop.run(
          spec, state, step_fn,
          sigterm=sigterm, start=start, logdir=logdir, checkpoints=saver,
          evaluate=chunks.chunk_evaluation(trainer.evaluate, eval_key), writer=writer,
          progress=lambda step, record: record["env_steps"], history=history,
          first_record={"sps": 0.0, "env_steps": 0}, wall_clock_start=t_start)
    finally:
      if writer is not None:
        writer.close()
      if saver is not None:
        saver.close()
  wall_s = time.perf_counter() - t_start
  # The evaluation before training compiles the evaluation; the first chunk's excess over the
  # second is its compile.
  compile_s = history[0]["timing/eval_s"] if start == 0 and history else 0.0
  if len(train_s) > 1:
    compile_s += max(train_s[0] - train_s[1], 0.0)
  if writer is not None:
    metrics_lib.plot_learning_curve(writer.jsonl_path, os.path.join(logdir, "learning_curve.png"),
                                    title=f"{config.env} (APG, rljax)")
  return APGResult(state[0], trainer.networks, history, wall_s, compile_s, resumed_from)


def _from_items(state, policy: dict, train: dict):
  """The state a checkpoint's items hold, in the structure of ``(state, env_state)``."""
  apg_state, env_state = state
  params, obs_stats = checkpointing.restored_params(apg_state.params, policy)
  return (APGState(params=params, opt_state=train["opt_state"], obs_stats=obs_stats,
                   key=train["key"], update=train["update"]),
          ckpt.from_saveable(env_state, train["env_state"]))


__all__ = [
    "APGConfig",
    "APGResult",
    "APGState",
    "APGTrainer",
    "apg_loss",
    "apg_only_fields",
    "build_apg_config",
    "default_apg_config",
    "deterministic_action",
    "discount_weights",
    "make_apg_trainer",
    "make_differentiable",
    "make_optimizer",
    "masked_env_gradients",
    "solver_options",
    "train_apg",
]
