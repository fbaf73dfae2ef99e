"""PPO for MJX control: one jitted train step (rollout + GAE + ``ppo_update``), host loop.

Data flow of one training iteration (all inside one compiled function)::

    lax.scan over unroll_length:  normalise(obs) -> policy -> u ~ N, a = tanh(u)
                                  -> vmapped env.step (the libraries' auto-reset wrappers)
    -> transitions [B, T] -> values V(s_t), V(s'_t) -> compute_gae -> ppo_update
    -> observation statistics updated with this rollout's observations

Several iterations run in one ``lax.scan`` between evaluations, so a whole run compiles
four functions: the networks' initialisation, the reset, the training chunk, and the
evaluation. On CPU, where XLA runs one program's physics on one core, the chunk is by default
a host loop instead (`ThreadedChunk`, ``ControlConfig.env_threads``): each iteration's rollout
runs as one program per group of the environments, each called from its own thread, then
one program runs the update. (With ``ControlConfig.overlap_value_update`` and one environment
thread the chunk is a host loop of three programs per iteration, `OverlappedChunk`, which
updates the value network beside the next rollout.)

The observation statistics used to act are the same ones used in the update, and they
are refreshed only after it, so at the first minibatch of the first epoch the PPO
ratio is exactly 1.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rljax import checkpoint as ckpt
from rljax import envs
from rljax import metrics as metrics_lib
from rljax import ppo
from rljax import running_stats
from rljax import runtime
from rljax.control.config import ConfigError, ControlConfig, resolve_env_threads
from rljax.models import mlp

Array = jax.Array


class TrainState(NamedTuple):
  """The whole learner state carried between compiled steps.

  Attributes:
    params: ``nnx.State`` of the `ActorCritic`.
    opt_state: optax state.
    obs_stats: observation normaliser statistics.
    key: ``[2]`` uint32 PRNG key.
    iteration: ``[]`` int32 number of training iterations done.
    skipped_updates: ``[]`` int32 number of iterations whose update was skipped by the
      non-finite guard (a non-finite reward, observation, loss or gradient).
  """

  params: Any
  opt_state: Any
  obs_stats: running_stats.RunningStats
  key: Array
  iteration: Array
  skipped_updates: Array


class Networks(NamedTuple):
  """Static pieces: the NNX graph definition and the network config."""

  graphdef: Any
  config: mlp.ActorCriticConfig


def _obs_size(env) -> int:
  # From the abstract shape of a reset: Brax's ``PipelineEnv.observation_size`` runs ``reset``
  # eagerly, op by op (about 30 s for brax/ant on CPU, against under 1 s here).
  obs = jax.eval_shape(env.reset, jax.random.PRNGKey(0)).obs
  size = obs.shape if hasattr(obs, "shape") else jax.tree.map(lambda x: x.shape, obs)
  if isinstance(size, tuple) and len(size) == 1:
    return int(size[0])
  raise ValueError(
      f"rljax's MLP policy needs a flat observation vector; this environment's "
      f"observation_size is {size!r}."
  )


def make_networks(config: ControlConfig, env, key: Array | None) -> tuple[Networks, Any]:
  """Builds the actor-critic for ``env``; returns ``(networks, params)``, or ``(networks,
  None)`` for ``key=None`` (the graph definition only: nothing compiles or runs)."""
  net_config = mlp.ActorCriticConfig(
      observation_size=_obs_size(env),
      action_size=int(env.action_size),
      policy_hidden=config.policy_hidden,
      value_hidden=config.value_hidden,
      activation=config.activation,
      init_std=config.init_std,
      policy_init_scale=config.policy_init_scale,
  )
  make = lambda key: mlp.ActorCritic(net_config, rngs=nnx.Rngs(params=key))
  graphdef, _ = nnx.split(nnx.eval_shape(make, jax.random.PRNGKey(0)), nnx.Param)
  networks = Networks(graphdef, net_config)
  if key is None:
    return networks, None
  # One program instead of NNX's eager initialisers, op by op (a dispatch each, and a compile
  # per new shape): 0.4 s instead of 1.1 s for Brax's default networks on 2 cores, with
  # parameters bitwise equal to the eager ones (tests/test_control.py). It runs once, so it
  # compiles without LLVM optimisation.
  init = jax.jit(lambda key: nnx.split(make(key), nnx.Param)[1],
                 compiler_options=runtime.run_once_compiler_options())
  return networks, init(key)


def make_optimizer(config: ControlConfig, total_iterations: int) -> optax.GradientTransformation:
  """Adam with global-norm clipping and the configured learning-rate schedule."""
  total_steps = max(total_iterations * config.num_epochs * config.num_minibatches, 1)
  lr = config.learning_rate
  if config.lr_schedule == "linear":
    lr = optax.linear_schedule(config.learning_rate, 0.0, total_steps)
  elif config.lr_schedule == "cosine":
    lr = optax.cosine_decay_schedule(config.learning_rate, total_steps)
  if config.max_grad_norm is None:
    return optax.adam(lr)
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr))


def policy_apply(networks: Networks, params, obs_norm: Array) -> tuple[Array, Array]:
  """``obs [..., D]`` (normalised, float32) -> ``(loc, scale)``, each ``[..., A]``: the mean
  and standard deviation of the pre-tanh Gaussian policy (actions are ``tanh`` of a sample)."""
  model = nnx.merge(networks.graphdef, params)
  return model.policy_params(obs_norm)


def value_apply(networks: Networks, params, obs_norm: Array) -> Array:
  """``obs [..., D]`` (normalised, float32) -> state values ``[...]`` of the value network."""
  model = nnx.merge(networks.graphdef, params)
  return model.value_fn(obs_norm)


def ppo_apply_fn(networks: Networks) -> ppo.ApplyFn:
  """The control side of ``ppo_update``: ``(params, minibatch) -> (log_probs, values, entropy)``.

  ``minibatch["obs"]`` is ``[M, D]`` (normalised) and ``minibatch["raw_actions"]`` ``[M, A]``
  (pre-tanh samples); the three outputs are ``[M]`` (log-probability of the squashed action,
  value, entropy of the pre-tanh Gaussian).
  """

  def apply(params, minibatch):
    model = nnx.merge(networks.graphdef, params)
    loc, scale = model.policy_params(minibatch["obs"])
    log_probs = mlp.squashed_log_prob(minibatch["raw_actions"], loc, scale)
    values = model.value_fn(minibatch["obs"])
    return log_probs, values, mlp.gaussian_entropy(scale)

  return apply


@dataclasses.dataclass(frozen=True)
class Trainer:
  """The compiled pieces of a control PPO run; build with `make_trainer`.

  Attributes:
    config: the run's config.
    networks: graph definition and sizes of the actor-critic.
    env: the batched training environment.
    eval_env: the batched evaluation environment (Brax's ``EvalWrapper``).
    optimizer: optax transformation.
    iterations_per_chunk: training iterations per compiled call.
    num_chunks: compiled calls per run (one evaluation after each).
    episode_length: steps per episode.
    mesh: the device mesh the environments are split over, if any.
    env_threads: threads the rollouts step the environments on (`ThreadedChunk` when > 1;
      ``ControlConfig.env_threads`` as `resolve_env_threads` resolves it).
  """

  config: ControlConfig
  networks: Networks
  env: Any
  eval_env: Any
  optimizer: optax.GradientTransformation
  iterations_per_chunk: int
  num_chunks: int
  episode_length: int
  mesh: jax.sharding.Mesh | None = None
  env_threads: int = 1

  # -- placement over a device mesh ---------------------------------------------------

  def _env_sharding(self, x):
    P = jax.sharding.PartitionSpec
    # The data axes of size > 1, in the normal form XLA gives its outputs (so a
    # chunk's outputs match its inputs and nothing recompiles).
    axes = tuple(a for a in ("data", "fsdp") if self.mesh.shape.get(a, 1) > 1)
    spec = P(axes[0] if len(axes) == 1 else axes) if axes else P()
    batched = getattr(x, "ndim", 0) > 0 and x.shape[0] == self.config.num_envs and x.size > 0
    return jax.sharding.NamedSharding(self.mesh, spec if batched else P())

  def place(self, ts: TrainState, env_state, *, inside_jit: bool = False):
    """Environments split over the mesh's data axes; learner state replicated.

    Outside jit this moves the arrays; inside jit it constrains their shardings so
    that every chunk's outputs are laid out like its inputs (no recompilation). With
    several processes, ``jax.device_put`` of a process-local array onto the global
    mesh keeps each process's own rows, so every process must pass the same values
    (they do: `init` and checkpoint restores are deterministic).
    """
    if self.mesh is None:
      return ts, env_state
    put = jax.lax.with_sharding_constraint if inside_jit else jax.device_put
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    ts = jax.tree.map(lambda x: put(x, replicated), ts)
    env_state = jax.tree.map(lambda x: put(x, self._env_sharding(x)), env_state)
    return ts, env_state

  @property
  def env_steps_per_chunk(self) -> int:
    """Environment steps one training chunk takes (``iterations_per_chunk`` iterations)."""
    return self.iterations_per_chunk * self.config.env_steps_per_iteration

  def init(self, params) -> tuple[TrainState, Any]:
    """Initial train state and environment state for ``params``."""
    return self.place(*self._init_unplaced(params, reset=self._compiled_reset))

  def abstract_state(self, params) -> tuple[TrainState, Any]:
    """``jax.ShapeDtypeStruct`` leaves of ``init(params)``, with the shardings `place` gives
    them on a mesh; nothing runs (to compile the train chunk before the environments reset)."""
    ts, env_state = jax.eval_shape(self._init_unplaced, params)
    if self.mesh is None:
      return ts, env_state
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return (jax.tree.map(lambda x: _with_sharding(x, replicated), ts),
            jax.tree.map(lambda x: _with_sharding(x, self._env_sharding(x)), env_state))

  def _init_unplaced(self, params, reset: Callable | None = None) -> tuple[TrainState, Any]:
    c = self.config
    key = jax.random.PRNGKey(c.seed)
    _, key_env, key_train = jax.random.split(key, 3)
    ts = TrainState(
        params=params,
        opt_state=self.optimizer.init(params),
        obs_stats=running_stats.init(self.networks.config.observation_size),
        key=key_train,
        iteration=jnp.zeros((), jnp.int32),
        skipped_updates=jnp.zeros((), jnp.int32),
    )
    env_state = (reset or self._reset)(jax.random.split(key_env, c.num_envs))
    return ts, env_state

  @functools.cached_property
  def _reset(self) -> Callable:
    """``jit(keys [num_envs, 2] -> env_state)``. One jitted function, so the trace that
    `abstract_state` makes is reused when `init` compiles and runs it."""
    return jax.jit(lambda keys: _strong_types(self.env.reset(keys)))

  @functools.cached_property
  def _compiled_reset(self) -> Callable:
    """`_reset` compiled with `runtime.run_once_compiler_options` (it runs once per run; the
    options cannot go on `_reset` itself, which is also traced inside ``eval_shape``)."""
    # The keys' shape and dtype as `_init_unplaced` makes them, not restated here.
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.PRNGKey(0), self.config.num_envs))
    return self._reset.lower(keys).compile(runtime.run_once_compiler_options())

  # -- the compiled training iteration --------------------------------------------------

  def _unroll(self, params, stats, env_state, key: Array, group: Array | None = None):
    """``unroll_length`` steps of the environments in ``env_state``; returns leaves
    ``[T, B, ...]``. With ``group`` (``[]`` int32, `ThreadedChunk`) ``env_state`` holds the
    ``group``-th of `env_threads` equal groups of the ``num_envs`` environments, whose rows of
    the all-environment action noise it draws."""
    networks = self.networks

    def step(state, step_key):
      obs_n = running_stats.normalize(stats, state.obs)
      loc, scale = policy_apply(networks, params, obs_n)
      if group is None:
        u = mlp.sample_pre_tanh(step_key, loc, scale)
      else:
        u = mlp.sample_pre_tanh(step_key, loc, scale, num_rows=self.config.num_envs,
                                first_row=group * loc.shape[0])
      next_state = self.env.step(state, jnp.tanh(u))
      transition = dict(
          obs=state.obs,
          raw_actions=u,
          log_probs=mlp.squashed_log_prob(u, loc, scale),
          rewards=next_state.reward,
          dones=next_state.done,
          truncation=next_state.info["truncation"],
          final_obs=next_state.info[envs.FINAL_OBS_KEY],
      )
      return next_state, transition

    keys = jax.random.split(key, self.config.unroll_length)
    return jax.lax.scan(step, env_state, keys)

  def _bootstrap_values(self, params, stats, final_obs: Array, truncation: Array,
                        values: Array) -> Array:
    """``[N, T]`` values of each step's successor state, ``V(s'_t)``.

    ``s'_t`` is the pre-reset state (``final_obs [N, T, D]``, normalised here with ``stats``,
    only where used). Where step
    ``t < T - 1`` did not end an episode it is ``s_{t+1}``, whose value is already in
    ``values[:, t + 1]``; where it ended by termination its discount is 0 and the value is
    unused. Only truncated steps before the last (``truncation [N, T]``) need
    ``V(final_obs)``. So the full second value pass runs only for batches that hold such a
    step (episodes truncate together, once every ``episode_length / unroll_length``
    iterations or so); otherwise only the last step's successors ``[N]`` are evaluated.
    Both branches give the same values.
    """
    networks = self.networks

    def full(_):
      return value_apply(networks, params, running_stats.normalize(stats, final_obs))

    def shifted(_):
      last = value_apply(networks, params, running_stats.normalize(stats, final_obs[:, -1]))
      return jnp.concatenate([values[:, 1:], last[:, None]], axis=1)

    needs_full = jnp.any(truncation[:, :-1])
    return jax.lax.cond(needs_full, full, shifted, None)

  def _gae(self, params, stats, steps: dict[str, Array], values: Array) -> tuple[Array, Array]:
    """``(advantages, returns)`` ``[N, T]`` by `rljax.ppo.compute_gae` for the segments in
    ``steps`` (``rewards``, ``dones``, ``truncation`` ``[N, T]``, raw ``final_obs``
    ``[N, T, D]``) with values ``[N, T]``; successor values from `_bootstrap_values`."""
    c = self.config
    truncation = steps["truncation"].astype(jnp.float32)
    bootstrap = self._bootstrap_values(params, stats, steps["final_obs"], truncation, values)
    discounts = 1.0 - steps["dones"].astype(jnp.float32) * (1.0 - truncation)
    return ppo.compute_gae(
        steps["rewards"] * c.reward_scaling,
        values,
        bootstrap,
        discounts,
        gamma=c.gamma,
        gae_lambda=c.gae_lambda,
        truncation=truncation,
    )

  def _advantage_fn(self, stats) -> ppo.AdvantageFn | None:
    """`rljax.ppo.ppo_update`'s ``advantage_fn`` where ``config.gae_per_minibatch``: GAE over
    the minibatch's segments with the values the loss computed (``stats``: the statistics
    the batch was normalised with)."""
    if not self.config.gae_per_minibatch:
      return None
    return lambda params, minibatch, values: self._gae(params, stats, minibatch, values)

  def _collect(self, params, stats, env_state, key_roll: Array):
    """``batch_size / num_envs`` unrolls with the policy in ``params``; leaves ``[N, T, ...]``."""
    env_state, data = self._unrolls(params, stats, env_state, key_roll)
    return env_state, self._segments(data)

  def _unrolls(self, params, stats, env_state, key_roll: Array, group: Array | None = None):
    """The iteration's ``batch_size / num_envs`` unrolls of the environments in
    ``env_state`` (all, or one ``group`` as in `_unroll`); leaves ``[U, T, B, ...]``."""
    def one_unroll(env_state, k):
      return self._unroll(params, stats, env_state, k, group)

    keys = jax.random.split(key_roll, self.config.unrolls_per_iteration)
    return jax.lax.scan(one_unroll, env_state, keys)

  def _segments(self, data):
    """``[U, T, B, ...] -> [U * B, T, ...]``: one row per trajectory segment."""
    t = self.config.unroll_length
    return jax.tree.map(lambda x: jnp.swapaxes(x, 1, 2).reshape((-1, t) + x.shape[3:]), data)

  def _batch(self, params, stats, data) -> tuple[dict[str, Array], Array, Array]:
    """The update's batch (``[N, T]`` leaves, observations normalised) with values
    ``V(s_t)`` under ``params`` and GAE; or, where ``config.gae_per_minibatch``, with the
    rewards, flags and raw ``final_obs`` that `_advantage_fn` computes them from in
    each minibatch. Also whether rewards and observations are all finite (two ``[]``
    bools)."""
    obs_n = running_stats.normalize(stats, data["obs"])
    steps = {k: data[k] for k in ("rewards", "dones", "truncation", "final_obs")}
    batch = dict(
        obs=obs_n,
        raw_actions=data["raw_actions"],
        log_probs=data["log_probs"],
        mask=jnp.ones_like(data["log_probs"]),
    )
    if self.config.gae_per_minibatch:  # ppo_update computes them in each minibatch
      batch.update(steps)
    else:
      values = value_apply(self.networks, params, obs_n)
      advantages, returns = self._gae(params, stats, steps, values)
      batch.update(values=values, advantages=advantages, returns=returns)
    finite_rewards = jnp.all(jnp.isfinite(data["rewards"]))
    finite_obs = jnp.all(jnp.isfinite(data["obs"])) & jnp.all(jnp.isfinite(data["final_obs"]))
    return batch, finite_rewards, finite_obs

  def _fold_obs(self, stats: running_stats.RunningStats, data
                ) -> tuple[running_stats.RunningStats, running_stats.RunningStats]:
    """``(batch_stats, new_stats)``: the statistics the update normalises its batch with, and
    the ones the iteration ends with (``stats`` with the rollout's ``data["obs"]``,
    ``[N, T, obs]``, folded in where observations are normalised). ``batch_stats`` is
    ``new_stats`` in Brax's order (``config.obs_stats_before_update``), else ``stats``."""
    c = self.config
    new_stats = running_stats.update(stats, data["obs"]) if c.normalize_observations else stats
    return (new_stats if c.obs_stats_before_update else stats), new_stats

  def _iteration(self, carry, _):
    ts, env_state = carry
    _, key_roll, _ = _iteration_keys(ts.key)
    env_state, data = self._collect(ts.params, ts.obs_stats, env_state, key_roll)
    ts, metrics = self._learn(ts, data)
    return (ts, env_state), metrics

  def _learn(self, ts: TrainState, data) -> tuple[TrainState, dict[str, Array]]:
    """The iteration's update from its rollout ``data`` (``[N, T, ...]`` segments, collected
    with ``ts``'s policy and the key `_iteration` splits from ``ts.key``): normaliser, GAE,
    ``ppo_update`` and the non-finite guard. Returns the new state and the iteration's
    metrics (``[]`` each)."""
    c = self.config
    key, _, key_update = _iteration_keys(ts.key)
    batch_stats, stats = self._fold_obs(ts.obs_stats, data)
    batch, finite_rewards, finite_obs = self._batch(ts.params, batch_stats, data)
    state, update_metrics = ppo.ppo_update(
        ppo.PPOState(ts.params, ts.opt_state),
        batch,
        key_update,
        apply_fn=ppo_apply_fn(self.networks),
        optimizer=self.optimizer,
        config=c.ppo,
        advantage_fn=self._advantage_fn(batch_stats),
    )
    # Non-finite guard (see ppo_update for loss and gradients): a rollout with a
    # non-finite reward or observation changes neither the parameters, the optimizer
    # state nor the normaliser.
    apply = finite_rewards & finite_obs & (update_metrics["nonfinite_steps"] == 0)
    keep = functools.partial(_keep_where, apply)
    new_ts = TrainState(
        params=keep(state.params, ts.params),
        opt_state=keep(state.opt_state, ts.opt_state),
        obs_stats=keep(stats, ts.obs_stats),
        key=key,
        iteration=ts.iteration + 1,
        skipped_updates=ts.skipped_updates + (1 - apply.astype(jnp.int32)),
    )
    _add_data_metrics(update_metrics, data, finite_rewards, finite_obs)
    update_metrics["nonfinite/loss_or_grad"] = (update_metrics["nonfinite_steps"] > 0).astype(jnp.float32)
    return new_ts, update_metrics

  @property
  def overlaps_value_update(self) -> bool:
    """Whether `train_chunk` runs the value update beside the next rollout (see
    ``ControlConfig.overlap_value_update``): asked for, one process, at most one device."""
    one_device = self.mesh is None or self.mesh.devices.size == 1
    return self.config.overlap_value_update and one_device and jax.process_count() == 1

  @functools.cached_property
  def train_chunk(self) -> Callable:
    """``(ts, env_state) -> (ts, env_state, metrics)`` over ``iterations_per_chunk``.

    ``env_state`` leaves are batched ``[num_envs, ...]``; ``metrics`` maps names (``loss``,
    ``pg_loss``, ``train/reward_per_step``, ...) to scalars ``[]`` f32: means over the chunk's
    iterations, maxima for the ``nonfinite/`` flags, and ``nonfinite/skipped_updates``.

    One jitted ``lax.scan``, which donates the train state and environment state; or, with
    ``env_threads > 1``, a `ThreadedChunk`, and where `overlaps_value_update`, an
    `OverlappedChunk`, both with the same interface.
    """
    if self.env_threads > 1:
      return ThreadedChunk(self)
    if self.overlaps_value_update:
      return OverlappedChunk(self)

    def chunk(ts, env_state):
      ts, env_state = self.place(ts, env_state, inside_jit=True)
      (ts, env_state), m = jax.lax.scan(
          self._iteration, (ts, env_state), None, length=self.iterations_per_chunk
      )
      ts, env_state = self.place(ts, _strong_types(env_state), inside_jit=True)
      return ts, env_state, _chunk_metrics(m, ts.skipped_updates)

    return jax.jit(chunk, donate_argnums=(0, 1),
                   compiler_options=runtime.control_compiler_options())

  # -- the overlapped value update: three programs per iteration ------------------------

  def _ov_rollout(self, params, stats, env_state, key):
    key, key_roll, key_update = _iteration_keys(key)
    env_state, data = self._collect(params, stats, env_state, key_roll)
    return _strong_types(env_state), data, key, key_update

  def _ov_policy_step(self, params_p, opt_p, params_v, stats, data, key_update):
    """GAE with the current value network, then the policy's epochs of SGD."""
    c = self.config
    is_policy = _policy_mask(params_p)
    params = _select(is_policy, params_p, params_v)
    batch_stats, new_stats = self._fold_obs(stats, data)
    batch, finite_rewards, finite_obs = self._batch(params, batch_stats, data)
    state, m = ppo.ppo_update(
        ppo.PPOState(params, opt_p), batch, key_update,
        apply_fn=_policy_only_apply_fn(self.networks), optimizer=self.optimizer, config=c.ppo,
    )
    apply = finite_rewards & finite_obs & (m["nonfinite_steps"] == 0)
    keep = functools.partial(_keep_where, apply)
    _add_data_metrics(m, data, finite_rewards, finite_obs)
    m["apply"] = apply
    value_batch = {k: batch[k] for k in ("obs", "log_probs", "values", "advantages", "returns", "mask")}
    return (keep(state.params, params), keep(state.opt_state, opt_p), keep(new_stats, stats),
            value_batch, m)

  def _ov_value_step(self, params_v, opt_v, batch, key_update, m_policy):
    """The value network's epochs of SGD on the same minibatches (same ``key_update``).

    Returns the value network's parameters and optimizer state, and this iteration's
    metrics as the one-program iteration reports them plus ``skipped`` (``[]`` int32, 1 if
    the iteration's update was skipped)."""
    c = self.config
    state, m = ppo.ppo_update(
        ppo.PPOState(params_v, opt_v), batch, key_update,
        apply_fn=_value_only_apply_fn(self.networks), optimizer=self.optimizer, config=c.ppo,
    )
    # Skipped where the policy's update was (as the one-program guard skips both), or where
    # this update itself met a non-finite loss or gradient.
    both = m_policy["apply"] & (m["nonfinite_steps"] == 0)
    keep = functools.partial(_keep_where, both)
    it = dict(m_policy)
    del it["apply"]
    it["vf_loss"] = m["vf_loss"]
    it["loss"] = m_policy["pg_loss"] + c.vf_coef * m["vf_loss"] - c.entropy_coef * m_policy["entropy"]
    # The root-sum-square of the two networks' mean gradient norms: a lower bound of the
    # one-program metric, the mean over steps of the joint norm (Minkowski).
    it["grad_norm"] = jnp.sqrt(jnp.square(m_policy["grad_norm"]) + jnp.square(m["grad_norm"]))
    it["nonfinite_steps"] = m_policy["nonfinite_steps"] + m["nonfinite_steps"]
    it["nonfinite/loss_or_grad"] = (it["nonfinite_steps"] > 0).astype(jnp.float32)
    it["skipped"] = 1 - both.astype(jnp.int32)
    return keep(state.params, params_v), keep(state.opt_state, opt_v), it

  def _ov_finish(self, params_p, opt_p, params_v, opt_v, stats, key, ts_before, env_state,
                 iterations: tuple[dict[str, Array], ...]):
    """Merges the two networks' parameters and optimizer states into one `TrainState`, and
    reduces the chunk's per-iteration metrics (from `_ov_value_step`) as the one-program
    chunk does."""
    is_policy = _policy_mask(params_p)
    opt_is_policy = optax.tree_map_params(
        self.optimizer, lambda _, m: m, opt_p, is_policy, transform_non_params=lambda _: True)
    m = jax.tree.map(lambda *xs: jnp.stack(xs), *iterations)
    skipped = jnp.sum(m.pop("skipped"))
    ts = TrainState(
        params=_select(is_policy, params_p, params_v),
        opt_state=_select(opt_is_policy, opt_p, opt_v),
        obs_stats=stats,
        key=key,
        iteration=ts_before.iteration + self.iterations_per_chunk,
        skipped_updates=ts_before.skipped_updates + skipped,
    )
    return ts, env_state, _chunk_metrics(m, ts.skipped_updates)

  @functools.cached_property
  def evaluate(self) -> Callable:
    """``jit((params, obs_stats, key) -> metrics)``: one full episode per eval env."""
    c, networks = self.config, self.networks
    n_steps = self.episode_length // c.action_repeat

    def run(params, obs_stats, key):
      key_reset, key_act = jax.random.split(key)

      def act(obs, k):
        loc, scale = policy_apply(networks, params, running_stats.normalize(obs_stats, obs))
        return jnp.tanh(loc if c.deterministic_eval else mlp.sample_pre_tanh(k, loc, scale))

      return run_eval_episodes(self.eval_env, jax.random.split(key_reset, c.num_eval_envs), act,
                               jax.random.split(key_act, n_steps))

    return jax.jit(run, compiler_options=runtime.control_compiler_options())


def run_eval_episodes(eval_env, reset_keys: Array, act: Callable[[Array, Any], Array],
                      step_keys: Array | None = None, *, num_steps: int | None = None
                      ) -> dict[str, Array]:
  """One episode per environment of a Brax ``EvalWrapper``-wrapped env, traced in ``lax.scan``.

  Each of the ``T`` steps runs the environment only while some environment's first episode is
  still running (``lax.cond``); after that the state passes through unchanged. ``EvalWrapper``
  freezes each episode's return and length at its first ``done``, so the steps skipped (which
  Brax's evaluator runs, up to ``T``) cannot change the result, and the metrics are bitwise
  those of running every step. Environments that terminate (``brax/ant``, ``brax/hopper``,
  ``brax/humanoid``) skip their physics once every episode has ended; DM Control tasks, which
  only truncate, run all ``T``. (A ``lax.while_loop`` that exits there instead compiled 4-6 s
  longer on brax/ant, and its results differed in the last bits: MJX's rounding changed.)

  Args:
    eval_env: wrapped with ``brax.envs.wrappers.training.EvalWrapper`` (over the episode and
      action-repeat wrappers), so that ``state.info["eval_metrics"]`` holds each episode's
      return and length, frozen at its first ``done``.
    reset_keys: ``[E, 2]`` uint32 PRNG keys, one per environment.
    act: ``(obs [E, D] f32, key or None) -> action [E, A]`` f32 in ``[-1, 1]``.
    step_keys: ``[T, 2]`` keys; step ``t`` passes ``step_keys[t]`` to ``act``. None: ``act``
      gets None and ``num_steps`` gives ``T``.
    num_steps: ``T`` (steps after action repeat) when ``step_keys`` is None.

  Returns:
    f32 scalars ``eval/episode_reward`` (mean undiscounted return), ``eval/episode_reward_std``
    and ``eval/episode_length`` (mean steps).
  """
  def step(state, k):
    running = jnp.any(state.info["eval_metrics"].active_episodes > 0)
    state = jax.lax.cond(running, lambda s: eval_env.step(s, act(s.obs, k)), lambda s: s, state)
    return state, ()

  state, _ = jax.lax.scan(step, eval_env.reset(reset_keys), step_keys, length=num_steps)
  return episode_metrics(state.info["eval_metrics"])


def episode_metrics(eval_metrics) -> dict[str, Array]:
  """`run_eval_episodes`'s f32 scalars from a Brax ``EvalMetrics`` (``[E]`` episode returns and
  lengths): ``eval/episode_reward`` (mean), ``eval/episode_reward_std``, ``eval/episode_length``."""
  rewards = eval_metrics.episode_metrics["reward"]
  return {
      "eval/episode_reward": jnp.mean(rewards),
      "eval/episode_reward_std": jnp.std(rewards),
      "eval/episode_length": jnp.mean(eval_metrics.episode_steps),
  }


@contextlib.contextmanager
def _process_local_default_devices():
  """Within the block, ``jax.devices()`` lists this process's devices first.

  MJX (``mjx.put_model``) places the environment's model on ``jax.devices()[0]``, which with
  several processes is process 0's device: every other process would then hold constants it
  cannot read ("Closing over jax.Array that spans non-addressable devices"). Each process builds
  its own copy on its own device instead. A no-op with one process.
  """
  if jax.process_count() == 1:
    yield
    return
  original = jax.devices

  def local_first(backend=None):
    local = jax.local_devices(backend=backend)
    return local + [d for d in original(backend) if d not in local]

  jax.devices = local_first
  try:
    yield
  finally:
    jax.devices = original


def make_trainer(
    config: ControlConfig,
    params_key: Array | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
):
  """Builds the environments, networks and optimizer; returns ``(trainer, params)``.

  Args:
    config: the run's config.
    params_key: PRNG key for the initial parameters (default: from ``config.seed``).
    mesh: optional device mesh. The ``num_envs`` environments (and so every batch)
      are split over its ``data`` and ``fsdp`` axes and the learner state is
      replicated; jit's partitioner then computes the gradient of the global batch,
      equal to the 1-device gradient. The mesh may span several processes
      (``jax.distributed``): every process builds the same environments and initial
      state (same seeds) on its own devices, and `Trainer.init` turns them into global
      arrays of which each process holds its rows (the 2-process chunk equals the
      1-process one, ``tests/test_distributed_training.py``).

  Raises:
    rljax.envs.UnknownEnvError: unknown ``config.env``.
    ConfigError: ``num_envs`` not divisible by the mesh's data axes; ``env_threads > 1`` on
      several devices (`resolve_env_threads`).
  """
  env_threads = resolve_env_threads(config, mesh)
  if mesh is not None:
    n_data = math.prod(mesh.shape[a] for a in ("data", "fsdp") if a in mesh.axis_names)
    if config.num_envs % n_data or config.num_eval_envs % n_data:
      raise ConfigError(
          f"num_envs={config.num_envs} and num_eval_envs={config.num_eval_envs} must be "
          f"divisible by the mesh's data axes ({n_data} devices: {dict(mesh.shape)})."
      )
  from brax.envs.wrappers import training as brax_training

  with _process_local_default_devices():  # MJX puts its model on jax.devices()[0]
    env = envs.TraceOnce(envs.make(config.env, **dict(config.env_kwargs)))
  episode_length = config.episode_length or envs.default_episode_length(config.env)
  train_env = envs.wrap_for_training(
      env, episode_length=episode_length, action_repeat=config.action_repeat
  )
  eval_env = brax_training.EvalWrapper(
      envs.wrap_for_training(env, episode_length=episode_length, action_repeat=config.action_repeat)
  )
  num_chunks, iterations_per_chunk = config.chunk_schedule
  if params_key is None:
    params_key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
  networks, params = make_networks(config, env, params_key)
  optimizer = make_optimizer(config, iterations_per_chunk * num_chunks)
  trainer = Trainer(
      config=config,
      networks=networks,
      env=train_env,
      eval_env=eval_env,
      optimizer=optimizer,
      iterations_per_chunk=iterations_per_chunk,
      num_chunks=num_chunks,
      episode_length=episode_length,
      mesh=mesh,
      env_threads=env_threads,
  )
  return trainer, params


class TrainResult(NamedTuple):
  """What `train` returns: final state, the evaluation history and wall times.

  ``history`` holds one record per evaluation (``step``, ``env_steps``, ``eval/...``, losses,
  timings) of the whole run: after a resume, the records logged before it come first (read
  back from ``metrics.jsonl``; none if that file is gone).
  """

  train_state: TrainState
  history: list[dict[str, float]]
  wall_s: float
  compile_s: float
  num_compiled: int  # distinct compiled versions of the train chunk and the evaluation
  resumed_from: int | None  # the chunk a resumed run restarted after, else None


# Exit status of a run stopped by SIGTERM (SLURM preemption) after checkpointing:
# EX_TEMPFAIL from sysexits.h, "try again later" (shared with the RLHF scripts).
EXIT_PREEMPTED = ckpt.EXIT_PREEMPTED


class Preempted(Exception):
  """Raised by `train` after SIGTERM: the current chunk finished and was checkpointed, or
  (``during_start_up``) the signal came before the first chunk and ``chunk`` is the
  newest checkpoint (0: none), from which the same command resumes."""

  def __init__(self, chunk: int, logdir: str, *, during_start_up: bool = False):
    if during_start_up:
      where = f"checkpoint {chunk}" if chunk else "the start"
      msg = (f"preempted by SIGTERM during start-up, before training; nothing new to "
             f"checkpoint: the run resumes from {where} in {logdir}")
    else:
      msg = f"preempted by SIGTERM; checkpointed chunk {chunk} in {logdir}"
    super().__init__(msg)
    self.chunk = chunk


NonFiniteHalt = ckpt.NonFiniteHalt  # raised with nonfinite="halt" after checkpointing


_MAX_METRICS = ("nonfinite/reward", "nonfinite/observation", "nonfinite/loss_or_grad")


def _chunk_metrics(m: dict[str, Array], skipped_updates: Array) -> dict[str, Array]:
  """Per-iteration metrics ``[I]`` -> the chunk's: means, and maxima of the non-finite flags
  (1.0 if it happened in any iteration)."""
  out = {k: jnp.max(v) if k in _MAX_METRICS else jnp.mean(v) for k, v in m.items()}
  out["nonfinite/skipped_updates"] = skipped_updates.astype(jnp.float32)
  return out


def _add_data_metrics(m: dict[str, Array], data, finite_rewards: Array, finite_obs: Array) -> None:
  m["train/reward_per_step"] = jnp.mean(data["rewards"])
  m["train/episodes_done"] = jnp.sum(data["dones"])
  m["nonfinite/reward"] = 1.0 - finite_rewards
  m["nonfinite/observation"] = 1.0 - finite_obs


def _keep_where(apply: Array, new, old):
  """``new`` where the ``[]`` bool ``apply`` holds, else ``old`` (the non-finite guard)."""
  return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)


def _policy_mask(params):
  """``params``' structure with ``True`` at the policy network's leaves."""
  return jax.tree_util.tree_map_with_path(lambda path, _: path[0].key == "policy", params)


def _select(mask, a, b):
  """Leaves of ``a`` where ``mask`` (a Python-bool tree of the same structure), else of ``b``."""
  return jax.tree.map(lambda m, x, y: x if m else y, mask, a, b)


def _policy_only_apply_fn(networks: Networks) -> ppo.ApplyFn:
  """`ppo_apply_fn` with the value predictions taken from the batch: the loss's gradient
  then reaches only the policy network."""

  def apply(params, minibatch):
    loc, scale = policy_apply(networks, params, minibatch["obs"])
    log_probs = mlp.squashed_log_prob(minibatch["raw_actions"], loc, scale)
    return log_probs, minibatch["values"], mlp.gaussian_entropy(scale)

  return apply


def _value_only_apply_fn(networks: Networks) -> ppo.ApplyFn:
  """`ppo_apply_fn` with the rollout's log-probs (ratio 1) and no entropy: the loss's
  gradient then reaches only the value network."""

  def apply(params, minibatch):
    values = value_apply(networks, params, minibatch["obs"])
    return minibatch["log_probs"], values, jnp.zeros_like(values)

  return apply


class _HostChunk:
  """A training chunk driven from the host: several compiled programs per iteration, called
  from Python (`OverlappedChunk`, `ThreadedChunk`).

  Same interface as the jitted one-program chunk: call it with ``(ts, env_state)`` for
  ``(ts, env_state, metrics)``, ``lower(ts, env_state).compile()`` ahead of time (compiles
  every program), ``_cache_size()``. The environment state is donated, as the one-program
  chunk donates it; its inputs are not to be reused either way. Subclasses set ``_programs``
  (the jitted functions) and define ``_traces`` (each program traced for the chunk's abstract
  inputs, from the outputs of the ones before it) and ``__call__``.
  """

  _programs: tuple = ()

  def __init__(self, trainer: "Trainer"):
    self.trainer = trainer
    self._jit = functools.partial(jax.jit, compiler_options=runtime.control_compiler_options())

  @property
  def _device_sharding(self):
    """Inside the chunk arrays live on one device: committed to it where the trainer has a
    (one-device) mesh, whose placed arrays come in; uncommitted otherwise, as they come."""
    if self.trainer.mesh is None:
      return None
    return jax.sharding.SingleDeviceSharding(self.trainer.mesh.devices.flat[0])

  def _abstract(self, tree):
    """``tree``'s abstract values, placed as inside the chunk (`_device_sharding`)."""
    return jax.tree.map(lambda x: _with_sharding(x, self._device_sharding), tree)

  def _traces(self, ts, env_state) -> list:
    raise NotImplementedError

  def lower(self, ts, env_state):
    """Traces and lowers the programs now (Python, on the calling thread); the returned
    object's ``compile()`` compiles them (XLA, without the GIL) and returns the chunk."""
    lowered = [traced.lower() for traced in self._traces(ts, env_state)]
    chunk = self

    class _Lowered:
      def compile(self):
        for low in lowered:
          low.compile()
        return chunk

    return _Lowered()

  def _cache_size(self) -> int:
    return sum(f._cache_size() for f in self._programs)

  def _on_device(self, ts, env_state):
    """The chunk's inputs in the one layout inside it, the one `lower` compiles for, so each
    program compiles once."""
    sharding = self._device_sharding
    if sharding is None:
      return ts, env_state
    return jax.device_put((ts, env_state), sharding)


class OverlappedChunk(_HostChunk):
  """A training chunk that updates the value network while the next rollout runs.

  MJX physics keeps one core busy, and the next rollout needs only the new *policy*:
  the value network's update (the same epochs over the same minibatches, from the same
  key) can run on a second thread, where XLA's CPU client executes it beside the
  rollout. Each iteration is three compiled programs::

      main thread:   rollout(pi_k) -> [wait V_k] -> GAE(V_k) + policy update -> rollout(pi_k+1) ...
      second thread:                               value update V_k -> V_k+1  (beside the rollout)

  GAE is computed once per iteration, before the update, with the value network the
  one-program iteration uses; the two networks share no parameter and Adam without a
  global-norm clip treats every leaf alone, so the result is the one-program chunk's
  up to floating-point reassociation (``tests/test_control.py`` checks it). Where a
  reward, observation, loss or gradient is not finite the guard differs: the policy's
  update (and the normaliser's) is skipped for the rollout and its own loss and gradient
  only, since the next rollout has used it before the value update ends; the value
  update is skipped with the policy's or for its own. The iteration counts once in
  ``nonfinite/skipped_updates``, ``nonfinite_steps`` sums both networks' skipped steps,
  and after a skip of the value update alone the merged Adam step count is the
  policy's. The ``grad_norm`` metric is the root-sum-square of the two networks' mean
  norms, a lower bound of the joint one. Each update's Adam also steps the other
  network's leaves with zero gradients (elementwise work, discarded at the merge).

  Same interface as the jitted chunk (`_HostChunk`).
  """

  def __init__(self, trainer: "Trainer"):
    super().__init__(trainer)
    jit = self._jit
    self._rollout = jit(trainer._ov_rollout, donate_argnums=(2,))
    self._policy_step = jit(trainer._ov_policy_step)
    self._value_step = jit(trainer._ov_value_step)
    self._finish = jit(trainer._ov_finish)
    self._programs = (self._rollout, self._policy_step, self._value_step, self._finish)

  def _traces(self, ts, env_state):
    """The four programs traced for the chunk's (abstract) inputs, each from the outputs of
    the ones before it."""
    sd = self._abstract
    ts, env_state = sd(ts), sd(env_state)
    rollout = self._rollout.trace(ts.params, ts.obs_stats, env_state, ts.key)
    env2, data, key, key_update = sd(rollout.out_info)
    policy = self._policy_step.trace(ts.params, ts.opt_state, ts.params, ts.obs_stats, data,
                                     key_update)
    params_p, opt_p, stats, batch, m_policy = sd(policy.out_info)
    value = self._value_step.trace(ts.params, ts.opt_state, batch, key_update, m_policy)
    it_metrics = sd(value.out_info[2])
    finish = self._finish.trace(params_p, opt_p, ts.params, ts.opt_state, stats, key, ts, env2,
                                (it_metrics,) * self.trainer.iterations_per_chunk)
    return [rollout, policy, value, finish]

  def __call__(self, ts: TrainState, env_state):
    """``(ts, env_state) -> (ts, env_state, metrics)``, as `Trainer.train_chunk`: the new
    state after ``iterations_per_chunk`` iterations and the chunk's scalar metrics ``[]``."""
    ts, env_state = self._on_device(ts, env_state)
    params_p, opt_p = ts.params, ts.opt_state
    params_v, opt_v = ts.params, ts.opt_state
    stats, key = ts.obs_stats, ts.key
    iterations = []  # each iteration's metrics, from the value step
    value_done = None
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rljax-value") as pool:
      for _ in range(self.trainer.iterations_per_chunk):
        env_state, data, key, key_update = self._rollout(params_p, stats, env_state, key)
        if value_done is not None:
          params_v, opt_v, it = value_done.result()
          iterations.append(it)
        params_p, opt_p, stats, batch, m_policy = self._policy_step(
            params_p, opt_p, params_v, stats, data, key_update)
        value_done = pool.submit(
            lambda *a: jax.block_until_ready(self._value_step(*a)),
            params_v, opt_v, batch, key_update, m_policy)
      params_v, opt_v, it = value_done.result()
      iterations.append(it)
    ts, env_state, metrics = self._finish(params_p, opt_p, params_v, opt_v, stats, key, ts,
                                          env_state, tuple(iterations))
    # Laid out as the one-program chunk leaves them (what the evaluation was compiled for).
    return (*self.trainer.place(ts, env_state), metrics)


class ThreadedChunk(_HostChunk):
  """A training chunk whose rollouts step the environments on `Trainer.env_threads` threads.

  XLA:CPU runs one program's MJX physics on one core, even with several free: a loop body's
  independent operations run one after another, and the physics' own loops are not split
  across threads. Each iteration here runs as::

      threads 1..K:  rollout of environments [g m, (g + 1) m)   (one compiled program, K calls
                     at once, each on its group; m = num_envs / K)
      then:          update (normaliser, GAE, ppo_update, guard) on the K groups' segments

  so the physics of K groups runs on K cores at once. The groups are split off the
  environment state at the chunk's start and joined at its end, so the state between chunks
  (checkpoints, evaluation) is the one-program chunk's. The rollout program draws the
  all-environment action noise and takes its group's rows, and the update orders the
  segments as the one-program iteration does, so the run is the one-program run up to
  floating-point rounding: the physics' at another batch size, and the update's, compiled as
  a program of its own (``tests/test_control.py``: on CartpoleBalance the rollouts' data are
  the one-program rollout's bit for bit, and two chunks end within 1e-5). Same interface
  (`_HostChunk`).
  """

  def __init__(self, trainer: "Trainer"):
    super().__init__(trainer)
    self.threads = trainer.env_threads
    jit = self._jit
    self._split = jit(self._split_groups)
    self._rollout = jit(self._group_rollout, donate_argnums=(2,))
    self._learn = jit(self._learn_groups, donate_argnums=(0,))
    self._finish = jit(self._join)
    self._programs = (self._split, self._rollout, self._learn, self._finish)

  def _split_groups(self, env_state):
    m = self.trainer.config.num_envs // self.threads
    return tuple(jax.tree.map(lambda x: x[g * m:(g + 1) * m], env_state)
                 for g in range(self.threads))

  def _group_rollout(self, params, stats, env_group, key, group):
    _, key_roll, _ = _iteration_keys(key)
    env_group, data = self.trainer._unrolls(params, stats, env_group, key_roll, group)
    return _strong_types(env_group), data

  def _learn_groups(self, ts, groups_data):
    data = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=2), *groups_data)  # [U, T, B, ...]
    return self.trainer._learn(ts, self.trainer._segments(data))

  def _join(self, ts, env_groups, iterations):
    env_state = jax.tree.map(lambda *xs: jnp.concatenate(xs), *env_groups)
    m = jax.tree.map(lambda *xs: jnp.stack(xs), *iterations)
    return ts, _strong_types(env_state), _chunk_metrics(m, ts.skipped_updates)

  def _traces(self, ts, env_state):
    """The four programs traced for the chunk's (abstract) inputs, each from the outputs of
    the ones before it."""
    ts, env_state = self._abstract(ts), self._abstract(env_state)
    split = self._split.trace(env_state)
    groups = self._abstract(split.out_info)
    group = jax.ShapeDtypeStruct((), jnp.int32)
    rollout = self._rollout.trace(ts.params, ts.obs_stats, groups[0], ts.key, group)
    env_group, data = self._abstract(rollout.out_info)
    learn = self._learn.trace(ts, (data,) * self.threads)
    ts2, metrics = self._abstract(learn.out_info)
    finish = self._finish.trace(ts2, (env_group,) * self.threads,
                                (metrics,) * self.trainer.iterations_per_chunk)
    return [split, rollout, learn, finish]

  def __call__(self, ts: TrainState, env_state):
    """``(ts, env_state) -> (ts, env_state, metrics)``, as `Trainer.train_chunk`."""
    ts, env_state = self._on_device(ts, env_state)
    groups = self._split(env_state)
    indices = [np.int32(g) for g in range(self.threads)]
    iterations = []
    with concurrent.futures.ThreadPoolExecutor(
        self.threads - 1, thread_name_prefix="rljax-env") as pool:
      for _ in range(self.trainer.iterations_per_chunk):
        run = lambda g: jax.block_until_ready(  # noqa: E731
            self._rollout(ts.params, ts.obs_stats, groups[g], ts.key, indices[g]))
        results = runtime.map_on_threads(run, range(self.threads), pool)
        groups = tuple(env_group for env_group, _ in results)
        ts, metrics = self._learn(ts, tuple(data for _, data in results))
        iterations.append(metrics)
    ts, env_state, metrics = self._finish(ts, groups, tuple(iterations))
    return (*self.trainer.place(ts, env_state), metrics)


def _iteration_keys(key: Array) -> tuple[Array, Array, Array]:
  """One training iteration's keys from the train state's: ``(next key, rollout key, update
  key)``. Every chunk (one program, `OverlappedChunk`, `ThreadedChunk`) splits them here, so
  they draw the same rollouts and minibatches."""
  return tuple(jax.random.split(key, 3))


def _with_sharding(x, sharding) -> jax.ShapeDtypeStruct:
  """The abstract value of ``x`` (shape, dtype, weak type) placed with ``sharding``."""
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)


def _uncommitted(tree, mesh: jax.sharding.Mesh | None):
  """``tree``'s restored arrays as `Trainer.init` makes them. Without a mesh those are
  uncommitted (jax places them), which the train chunk and the evaluation were compiled
  for; orbax restores arrays committed to a device, a call with which compiles both again
  (13 s on CartpoleBalance, 46 s on CheetahRun, once per resumed run). On a mesh `Trainer.place`
  lays them out as compiled."""
  if mesh is not None:
    return tree
  return jax.device_put(jax.device_get(tree))  # host arrays, put back uncommitted


def _strong_types(tree):
  """``tree`` with no weakly typed leaves.

  Environment states can hold weakly typed leaves: Playground's CheetahRun resets
  ``data.time`` to a Python float, and Brax's ant steps some metrics to weak types. The reset
  and the train chunk both return strong types, so the chunk's outputs match its inputs:
  a jitted function called with another weak type compiles again (18-30 s, once per run).
  """
  return jax.tree.map(lambda x: jnp.asarray(x, dtype=x.dtype), tree)


class _ChunkDone(NamedTuple):
  """A trained chunk whose evaluation, record and checkpoint are still to come."""

  chunk: int
  record: dict[str, Any]
  ts: TrainState
  env_state: Any
  env_steps: int


def _policy_item(ts: TrainState) -> dict[str, Any]:
  return {"params": nnx.to_pure_dict(ts.params), "obs_stats": ts.obs_stats._asdict()}


def _train_item(ts: TrainState, env_state, env_steps: int) -> dict[str, Any]:
  return {
      "opt_state": ts.opt_state,
      "key": ts.key,
      "iteration": ts.iteration,
      "skipped_updates": ts.skipped_updates,
      "env_steps": np.asarray(env_steps, np.int64),
      "env_state": ckpt.to_saveable(env_state),
  }


def _from_items(ts: TrainState, policy: dict, train_item: dict) -> TrainState:
  params = ts.params
  nnx.replace_by_pure_dict(params, policy["params"])
  return TrainState(
      params=params,
      opt_state=train_item["opt_state"],
      obs_stats=running_stats.RunningStats(**policy["obs_stats"]),
      key=train_item["key"],
      iteration=train_item["iteration"],
      skipped_updates=train_item["skipped_updates"],
  )


def check_logdir(logdir: str | None, config, *, resume: bool, section: str = "control"
                 ) -> int | None:
  """Whether a run of ``config`` may start in ``logdir``, writing nothing; returns the newest
  saved chunk (None: no checkpoint, a fresh start). `train` and APG's ``train_apg`` call it
  first; ``train_control.py`` before it writes ``run_info.json`` too, so a refused command
  leaves the run's folder as it was.

  A saved config binds only a run that saved state (one stopped before its first checkpoint,
  e.g. while compiling, does not refuse the next command in its ``logdir``).

  Args:
    config: a `ControlConfig` (``section="control"``) or an APG config (``"apg"``); fields
      added since a run started count as their defaults.

  Raises:
    ValueError: ``logdir`` holds checkpoints and ``resume`` is False (they are left
      untouched), or they were saved with another config (a resume would not be exact).
  """
  newest = ckpt.newest_step(logdir) if logdir is not None else None
  if newest is not None:
    ckpt.check_resume(logdir, f"checkpoints up to step {newest}", resume=resume,
                      section=section, config_json=json.loads(config.to_json()),
                      defaults=ckpt.dataclass_defaults(type(config)))
  return newest


def _truncate_jsonl(path: str, last_step: int) -> None:
  """Drops records logged after ``last_step`` (they are redone after a resume)."""
  ckpt.truncate_jsonl(path, last_step)


def resume_history(logdir: str, chunk: int | None, *, num_chunks: int, env_steps: int,
                   log: Callable[[str], None]) -> list[dict[str, float]]:
  """The records a run starting in ``logdir`` keeps (PPO's `train` and APG's ``train_apg``).

  After restoring chunk ``chunk`` it says so through ``log`` (resuming, or nothing left to
  train), drops the records logged after that chunk from ``metrics.jsonl`` (they are redone)
  and returns the ones before, as `train` returns them. With ``chunk=None`` (nothing restored)
  it drops every record, an earlier start's that saved no checkpoint, and returns [].
  """
  path = os.path.join(logdir, "metrics.jsonl")
  if chunk is None:
    if os.path.exists(path):
      _truncate_jsonl(path, -1)
    return []
  if chunk < num_chunks:
    log(f"resuming {logdir} after chunk {chunk} ({env_steps:,} env steps)")
  else:
    log(f"{logdir} has finished all {chunk} chunks ({env_steps:,} env steps): "
        f"nothing left to train")
  _truncate_jsonl(path, chunk)
  return _logged_history(logdir, chunk)


def _logged_history(logdir: str, last_step: int) -> list[dict[str, float]]:
  """``metrics.jsonl``'s records up to ``last_step``, as `train` returns them (floats;
  ``"nan"``/``"inf"`` strings back to floats); [] without the file."""
  path = os.path.join(logdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  as_value = lambda k, v: int(v) if k in ("step", "env_steps") else float(v)
  return [{k: as_value(k, v) for k, v in r.items()} for r in metrics_lib.read_jsonl(path)
          if r["step"] <= last_step]


_SigtermFlag = ckpt.SigtermFlag


def train(
    config: ControlConfig,
    logdir: str | None = None,
    *,
    progress: bool = True,
    checkpoints: bool = True,
    resume: bool = True,
    log: Callable[[str], None] = print,
    mesh: jax.sharding.Mesh | None = None,
    on_eval: Callable[[int, TrainState, dict[str, Any]], Any] | None = None,
    overlap_eval: bool = False,
) -> TrainResult:
  """Trains ``config`` end to end: evaluation, logging and checkpoints in the host loop.

  Writes to ``logdir`` (if given): ``metrics.jsonl``, TensorBoard events,
  ``learning_curve.png``, ``checkpoints/`` (orbax, the full train state including the
  environment state, every evaluation) with ``checkpoints/config.json``.

  With ``resume`` (default) and a checkpoint in ``logdir``, the run continues from the
  newest readable checkpoint and ends bitwise equal to an uninterrupted run. On
  SIGTERM the current chunk finishes, a checkpoint is written and `Preempted` is
  raised (scripts exit with `EXIT_PREEMPTED`); a SIGTERM during start-up raises it once
  the compiles end, before the first evaluation, with nothing new to save.

  ``on_eval(chunk, train_state, record)``, if given, is called on the host after each
  evaluation is logged and checkpointed (chunk 0 before training included), with the record as logged
  (``env_steps``, ``eval/episode_reward``, ...); e.g.
  ``rljax.control.eval_video.eval_video_callback`` writes a video there.

  ``overlap_eval=True`` evaluates chunk ``k`` on a second thread while chunk ``k + 1`` trains;
  results are identical either way. It pays with spare cores: on 2 cores it cut the wall time
  by 5% (ant) to 19% (CheetahRun) but slowed each chunk by about the evaluation's time (the
  evaluation and the chunk share XLA's thread pool), so it is off by default. It is ignored
  with several processes, which must launch their computations in one order.

  Returns:
    `TrainResult`.

  Raises:
    rljax.control.config.ConfigError, rljax.envs.UnknownEnvError, ValueError: bad
      settings (or a ``logdir`` whose checkpoints are of another config), before anything
      compiles.
    Preempted: SIGTERM was received; the state is checkpointed (or was, during start-up).
    NonFiniteHalt: ``config.nonfinite == "halt"`` and an update was skipped.
  """
  t_start = time.perf_counter()
  # From the start, so a SIGTERM during start-up (environments, compiles: up to a minute)
  # stops the run with `Preempted` too, once the compiles (which cannot be cancelled) end.
  with _SigtermFlag() as sigterm:
    return _train(config, logdir, progress=progress, checkpoints=checkpoints, resume=resume,
                  log=log, mesh=mesh, on_eval=on_eval, overlap_eval=overlap_eval,
                  t_start=t_start, sigterm=sigterm)


def _train(config: ControlConfig, logdir: str | None, *, progress: bool, checkpoints: bool,
           resume: bool, log: Callable[[str], None], mesh: jax.sharding.Mesh | None,
           on_eval: Callable | None, overlap_eval: bool, t_start: float,
           sigterm: ckpt.SigtermFlag) -> TrainResult:
  """`train`'s body, with its SIGTERM flag installed."""
  use_ckpt = logdir is not None and checkpoints
  newest = check_logdir(logdir, config, resume=resume) if use_ckpt else None
  trainer, params = make_trainer(config, mesh=mesh)
  # The train chunk and then the evaluation compile on one more thread, from the state's
  # abstract shapes, while the environments reset here. Tracing and lowering are Python and
  # hold the GIL, so they run here one after another, the train chunk's (the longest
  # compile) first; XLA's compiles release it and run beside them. (The two compiling side
  # by side on two threads, beside the reset's, took 8-11% more CPU and started training
  # 1.1-1.5 s later on CartpoleBalance at Brax's settings, 1.7 s on CheetahRun and 3.5 s on
  # brax/ant: XLA's compiles already use both cores. Lowered on three threads
  # at once, the chunk started compiling 4.3 s after the abstract state instead of 1.2 s:
  # CartpoleBalance at Brax's settings, 2 cores.) The jitted functions then reuse the
  # executables (a call with other shapes or shardings would compile again;
  # tests/test_control.py counts compilations).
  # A run whose newest checkpoint is its last chunk has nothing left to train, so nothing is
  # compiled ahead (if that checkpoint turns out unreadable, the chunk restored instead
  # compiles on its first call).
  finished = newest == trainer.num_chunks
  eval_key = jax.random.PRNGKey(config.seed + 10_000)
  chunk_compiled = eval_compiled = None
  if not finished:
    compile_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rljax-compile")
    abstract_ts, abstract_env = trainer.abstract_state(params)  # the reset's one trace
    chunk_compiled = compile_pool.submit(
        trainer.train_chunk.lower(abstract_ts, abstract_env).compile)
    eval_compiled = compile_pool.submit(
        trainer.evaluate.lower(abstract_ts.params, abstract_ts.obs_stats,
                               jax.eval_shape(lambda: eval_key)).compile)
    compile_pool.shutdown(wait=False)
  ts, env_state = trainer.init(params)
  history: list[dict[str, float]] = []
  env_steps, start_chunk, resumed_from = 0, 0, None
  manager = None
  if use_ckpt:
    ckpt.write_json_atomic(
        os.path.join(ckpt.checkpoint_dir(logdir), ckpt.CONFIG_FILE),
        {"control": json.loads(config.to_json()), "network": dataclasses.asdict(trainer.networks.config)},
    )
    manager = ckpt.make_manager(logdir, max_to_keep=config.keep_checkpoints)
    restored = (
        ckpt.restore(manager, _policy_item(ts), _train_item(ts, env_state, 0), log=log)
        if resume else None
    )
    if restored is not None:
      start_chunk, policy_item, train_item = restored
      ts = _from_items(ts, policy_item, train_item)
      env_state = ckpt.from_saveable(env_state, train_item["env_state"])
      ts, env_state = trainer.place(*_uncommitted((ts, env_state), trainer.mesh))
      env_steps = int(train_item["env_steps"])
      resumed_from = start_chunk
    history = resume_history(logdir, resumed_from, num_chunks=trainer.num_chunks,
                             env_steps=env_steps, log=log)

  writer = None  # made once start-up ends, so that the progress bar times training only

  def log_record(chunk: int, m: dict[str, Any], env_steps: int):
    record = {k: float(v) for k, v in m.items()}
    record["env_steps"] = env_steps
    history.append(dict(record, step=chunk))
    if writer is not None:
      writer.write(chunk, record, progress=env_steps)

  def save(chunk: int, ts: TrainState, env_state, env_steps: int):
    if manager is not None:
      ckpt.save(manager, chunk, _policy_item(ts), _train_item(ts, env_state, env_steps))

  # Both compiles finish before anything runs. (Starting chunk 1 while the evaluation still
  # compiled made a 300k-step CartpoleBalance run 2 s slower on 2 cores: the compile takes a
  # core from the chunk's parallel matmuls.)
  if eval_compiled is not None:
    eval_compiled.result()
  if chunk_compiled is not None and start_chunk < trainer.num_chunks:
    chunk_compiled.result()
  # Seconds from the start until both are compiled (environment build and reset overlap).
  compile_s = time.perf_counter() - t_start
  if start_chunk < trainer.num_chunks and sigterm.any_process():  # in start-up: nothing to save
    if manager is not None:
      manager.close()
    raise Preempted(start_chunk, str(logdir), during_start_up=True)
  if logdir is not None and start_chunk < trainer.num_chunks:
    writer = metrics_lib.MetricsWriter(
        logdir,
        total=trainer.num_chunks * trainer.env_steps_per_chunk if progress else None,
        console_keys=("eval/episode_reward", "sps"),
    )

  skipped_before = int(ts.skipped_updates)
  overlap = bool(overlap_eval) and jax.process_count() == 1
  eval_pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rljax-eval")
               if overlap else None)

  def timed_eval(params, obs_stats, chunk: int) -> dict[str, Any]:
    t = time.perf_counter()
    ev = jax.device_get(trainer.evaluate(params, obs_stats, jax.random.fold_in(eval_key, chunk)))
    return dict(ev, **{"timing/eval_s": time.perf_counter() - t})

  def finish(done: _ChunkDone, ev: dict[str, Any]) -> None:
    """Logs, checkpoints and reports one trained chunk, in chunk order."""
    nonlocal skipped_before
    record = dict(done.record, **ev)
    record["timing/wall_s"] = time.perf_counter() - t_start
    log_record(done.chunk, record, done.env_steps)
    if done.chunk > 0:  # chunk 0 is the evaluation before training
      save(done.chunk, done.ts, done.env_state, done.env_steps)
    if on_eval is not None:
      on_eval(done.chunk, done.ts, history[-1])
    skipped = int(done.ts.skipped_updates)
    if skipped > skipped_before:
      which = [k.split("/")[1] for k in ("nonfinite/reward", "nonfinite/observation",
                                         "nonfinite/loss_or_grad") if record[k] > 0]
      msg = (f"non-finite {', '.join(which)} in chunk {done.chunk} (iterations up to "
             f"{int(done.ts.iteration)}): {skipped - skipped_before} update(s) skipped, "
             f"{skipped} in total")
      skipped_before = skipped
      if config.nonfinite == "halt":
        raise NonFiniteHalt(msg + f"; halted with the last good state checkpointed in {logdir}.")
      log("warning: " + msg)

  # With ``overlap``, chunk k's evaluation, logging and checkpoint run while chunk k + 1
  # trains: the evaluation on a second thread (XLA's CPU client runs computations launched
  # from two threads at once, and MJX physics keeps only one core busy), on copies of the
  # state since the chunk consumes (donates) its inputs. Records and checkpoints are
  # still written in chunk order, each record before its checkpoint, and every value is
  # the same as without overlap.
  # A copy that compiles nothing (``jnp.copy`` would compile one program per leaf shape).
  snapshot = lambda tree: jax.block_until_ready(jax.device_put(tree, may_alias=False))
  pending: _ChunkDone | None = None
  try:
    if start_chunk == 0:
      before = _ChunkDone(0, {"sps": 0.0}, ts, None, env_steps)
      if overlap and start_chunk < trainer.num_chunks:
        pending = before._replace(ts=snapshot(ts))
      else:
        finish(before, timed_eval(ts.params, ts.obs_stats, 0))
    for chunk in range(start_chunk + 1, trainer.num_chunks + 1):
      eval_future = None
      if pending is not None:
        eval_future = eval_pool.submit(timed_eval, pending.ts.params, pending.ts.obs_stats,
                                       pending.chunk)
      t0 = time.perf_counter()
      ts, env_state, train_metrics = trainer.train_chunk(ts, env_state)
      if pending is not None:
        finish(pending, eval_future.result())
        pending = None
      train_metrics = jax.device_get(train_metrics)
      train_s = time.perf_counter() - t0
      env_steps += trainer.env_steps_per_chunk
      record = dict(train_metrics)
      record.update({"sps": trainer.env_steps_per_chunk / train_s, "timing/train_s": train_s})
      done = _ChunkDone(chunk, record, ts, env_state, env_steps)
      last = chunk == trainer.num_chunks
      if overlap and not last and not sigterm.received:
        # Copies, made before the next chunk donates the originals.
        pending = done._replace(
            ts=snapshot(ts), env_state=snapshot(env_state) if manager is not None else None)
        continue
      finish(done, timed_eval(ts.params, ts.obs_stats, chunk))
      if not last and sigterm.any_process():  # every process stops after the same chunk
        if writer is not None:
          writer.close()
        raise Preempted(chunk, str(logdir))
  finally:
    if eval_pool is not None:
      eval_pool.shutdown(wait=True)

  wall_s = time.perf_counter() - t_start
  if writer is not None:
    writer.close()
    metrics_lib.plot_learning_curve(
        writer.jsonl_path,
        os.path.join(logdir, "learning_curve.png"),
        title=f"{config.env} (PPO, rljax)",
    )
  if manager is not None:
    manager.close()
  num_compiled = trainer.train_chunk._cache_size() + trainer.evaluate._cache_size()
  return TrainResult(ts, history, wall_s, compile_s, num_compiled, resumed_from)


def load_params(logdir: str, *, step: int | None = None):
  """Restores ``(networks, params, obs_stats)`` of a run from ``<logdir>/checkpoints``.

  Raises:
    FileNotFoundError: no checkpoint or config under ``logdir``.
    ValueError: ``logdir`` holds another kind of run (e.g. an RLHF run).
  """
  saved = ckpt.read_config(logdir)
  if "network" not in saved:
    raise ValueError(
        f"{logdir!r} is not a control run: its checkpoints/config.json has "
        f"{sorted(saved) or 'no sections'}, not the policy network that train_control.py "
        f"saves (load_policy, export and render read control runs)")
  net_config = mlp.ActorCriticConfig(
      **{k: tuple(v) if isinstance(v, list) else v for k, v in saved["network"].items()}
  )
  abstract = nnx.eval_shape(lambda: mlp.ActorCritic(net_config, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract, nnx.Param)
  target = {
      "params": nnx.to_pure_dict(params),
      "obs_stats": running_stats.init(net_config.observation_size)._asdict(),
  }
  restored = ckpt.restore_policy(logdir, target, step)
  nnx.replace_by_pure_dict(params, restored["params"])
  stats = running_stats.RunningStats(**restored["obs_stats"])
  return Networks(graphdef, net_config), params, stats


def load_policy(logdir: str, *, step: int | None = None, deterministic: bool = True):
  """Rebuilds the trained policy from ``<logdir>/checkpoints`` alone.

  Returns:
    ``policy(obs [..., D] float32, key=None) -> actions [..., A]`` in ``[-1, 1]``, jitted;
    the observation normaliser is applied inside. With ``deterministic=True`` the action is
    ``tanh(loc)`` and a key is ignored; with ``deterministic=False`` it is sampled with
    ``key``, which is then required.

  Raises:
    FileNotFoundError: no checkpoint or config under ``logdir``.
    ValueError: (when ``policy`` is called) ``obs``'s last axis is not the run's
      observation size ``D`` (a width of 1 would otherwise broadcast silently against the
      normaliser's ``[D]`` statistics); ``deterministic=False`` and no ``key``.
  """
  networks, params, stats = load_params(logdir, step=step)
  obs_size = networks.config.observation_size

  @jax.jit
  def policy(obs: Array, key: Array | None = None) -> Array:
    if obs.ndim == 0 or obs.shape[-1] != obs_size:
      raise ValueError(
          f"load_policy({logdir!r}): observations of shape {tuple(obs.shape)}; expected "
          f"[..., {obs_size}] (this run's observation size).")
    if not deterministic and key is None:
      raise ValueError(f"load_policy({logdir!r}, deterministic=False): the policy samples, so "
                       f"call it with a PRNG key: policy(obs, key).")
    loc, scale = policy_apply(networks, params, running_stats.normalize(stats, obs))
    if deterministic:
      return jnp.tanh(loc)
    return jnp.tanh(mlp.sample_pre_tanh(key, loc, scale))

  return policy
