"""Training chunks driven from the host: several compiled programs per iteration.

The default chunk is one jitted ``lax.scan`` over its iterations (`rljax.control.trainer`).
On CPU, where XLA runs one program's MJX physics on one core, two chunks with the same
interface fill the machine instead:

* `ThreadedChunk` (``ControlConfig.env_threads > 1``): each iteration's rollout runs as one
  program per group of the environments, each called from its own thread, then one program
  runs the update;
* `OverlappedChunk` (``ControlConfig.overlap_value_update``): the value network's update runs
  on a second thread beside the next rollout.

Both are the one-program chunk up to floating-point rounding (the same keys, noise, segment
order and minibatches).
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rljax import nonfinite, ppo, runtime
from rljax.control import learner
from rljax.control.learner import TrainState
from rljax.control.networks import policy_mask, policy_only_apply_fn, value_only_apply_fn
from rljax.control.rollout import iteration_keys, strong_types

if TYPE_CHECKING:  # the trainer builds its chunks; only its type is named here
  from rljax.control.trainer import Trainer

Array = jax.Array


def with_sharding(x, sharding) -> jax.ShapeDtypeStruct:
  """The abstract value of ``x`` (shape, dtype, weak type) placed with ``sharding``."""
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)


def _select(mask, a, b):
  """Leaves of ``a`` where ``mask`` (a Python-bool tree of the same structure), else of ``b``."""
  return jax.tree.map(lambda m, x, y: x if m else y, mask, a, b)


class HostChunk:
  """A training chunk driven from the host (`OverlappedChunk`, `ThreadedChunk`).

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
    return jax.tree.map(lambda x: with_sharding(x, self._device_sharding), tree)

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


class OverlappedChunk(HostChunk):
  """A training chunk that updates the value network while the next rollout runs.

  MJX physics keeps one core busy, and the next rollout needs only the new *policy*: the
  value network's update (the same epochs over the same minibatches, from the same key) can
  run on a second thread, where XLA's CPU client executes it beside the rollout. Each
  iteration is three compiled programs::

      main thread:   rollout(pi_k) -> [wait V_k] -> GAE(V_k) + policy update -> rollout(pi_k+1) ...
      second thread:                               value update V_k -> V_k+1  (beside the rollout)

  GAE is computed once per iteration, before the update, with the value network the
  one-program iteration uses; the two networks share no parameter and Adam without a
  global-norm clip treats every leaf alone, so the result is the one-program chunk's up to
  floating-point reassociation. Where a reward, observation, loss or gradient is not finite
  the guard differs: the policy's update (and the normaliser's) is skipped for the rollout and
  its own loss and gradient only, since the next rollout has used it before the value update
  ends; the value update is skipped with the policy's or for its own. The iteration counts
  once in ``nonfinite/skipped_updates``, ``nonfinite_steps`` sums both networks' skipped
  steps, and after a skip of the value update alone the merged Adam step count is the
  policy's. The ``grad_norm`` metric is the root-sum-square of the two networks' mean norms,
  a lower bound of the joint one. Each update's Adam also steps the other network's leaves
  with zero gradients (elementwise work, discarded at the merge).
  """

  def __init__(self, trainer: "Trainer"):
    super().__init__(trainer)
    jit = self._jit
    self._rollout = jit(self._ov_rollout, donate_argnums=(2,))
    self._policy_step = jit(self._ov_policy_step)
    self._value_step = jit(self._ov_value_step)
    self._finish = jit(self._ov_finish)
    self._programs = (self._rollout, self._policy_step, self._value_step, self._finish)

  def _ov_rollout(self, params, stats, env_state, key):
    key, key_roll, key_update = iteration_keys(key)
    env_state, data = self.trainer.rollout.collect(params, stats, env_state, key_roll)
    return strong_types(env_state), data, key, key_update

  def _ov_policy_step(self, params_p, opt_p, params_v, stats, data, key_update):
    """GAE with the current value network, then the policy's epochs of SGD."""
    tr = self.trainer
    c, networks = tr.config, tr.networks
    params = _select(policy_mask(params_p), params_p, params_v)
    batch_stats, new_stats = learner.fold_obs(c, stats, data)
    batch, finite_rewards, finite_obs = learner.make_batch(c, networks, params, batch_stats, data)
    state, m = ppo.ppo_update(
        ppo.PPOState(params, opt_p), batch, key_update,
        apply_fn=policy_only_apply_fn(networks), optimizer=tr.optimizer, config=c.ppo,
    )
    apply = finite_rewards & finite_obs & (m["nonfinite_steps"] == 0)
    keep = functools.partial(nonfinite.keep_where, apply)
    m.update(learner.data_metrics(data, finite_rewards, finite_obs))
    m["apply"] = apply
    value_batch = {k: batch[k] for k in ("obs", "log_probs", "values", "advantages", "returns",
                                         "mask")}
    return (keep(state.params, params), keep(state.opt_state, opt_p), keep(new_stats, stats),
            value_batch, m)

  def _ov_value_step(self, params_v, opt_v, batch, key_update, m_policy):
    """The value network's epochs of SGD on the same minibatches (same ``key_update``).

    Returns the value network's parameters and optimizer state, and this iteration's
    metrics as the one-program iteration reports them plus ``skipped`` (``[]`` int32, 1 if
    the iteration's update was skipped)."""
    tr = self.trainer
    c = tr.config
    state, m = ppo.ppo_update(
        ppo.PPOState(params_v, opt_v), batch, key_update,
        apply_fn=value_only_apply_fn(tr.networks), optimizer=tr.optimizer, config=c.ppo,
    )
    # Skipped where the policy's update was (as the one-program guard skips both), or where
    # this update itself met a non-finite loss or gradient.
    both = m_policy["apply"] & (m["nonfinite_steps"] == 0)
    keep = functools.partial(nonfinite.keep_where, both)
    it = dict(m_policy)
    del it["apply"]
    it["vf_loss"] = m["vf_loss"]
    it["loss"] = (m_policy["pg_loss"] + c.ppo.vf_coef * m["vf_loss"]
                  - c.ppo.entropy_coef * m_policy["entropy"])
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
    tr = self.trainer
    is_policy = policy_mask(params_p)
    opt_is_policy = optax.tree_map_params(
        tr.optimizer, lambda _, m: m, opt_p, is_policy, transform_non_params=lambda _: True)
    m = jax.tree.map(lambda *xs: jnp.stack(xs), *iterations)
    skipped = jnp.sum(m.pop("skipped"))
    ts = TrainState(
        params=_select(is_policy, params_p, params_v),
        opt_state=_select(opt_is_policy, opt_p, opt_v),
        obs_stats=stats,
        key=key,
        iteration=ts_before.iteration + tr.iterations_per_chunk,
        skipped_updates=ts_before.skipped_updates + skipped,
    )
    return ts, env_state, learner.chunk_metrics(m, ts.skipped_updates)

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
    """``(ts, env_state) -> (ts, env_state, metrics)``, as the one-program chunk: the new
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


class ThreadedChunk(HostChunk):
  """A training chunk whose rollouts step the environments on ``Trainer.env_threads`` threads.

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
  a program of its own.
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
    _, key_roll, _ = iteration_keys(key)
    env_group, data = self.trainer.rollout.unrolls(params, stats, env_group, key_roll, group)
    return strong_types(env_group), data

  def _learn_groups(self, ts, groups_data):
    data = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=2), *groups_data)  # [U, T, B, ...]
    return self.trainer.learn_step(ts, self.trainer.rollout.segments(data))

  def _join(self, ts, env_groups, iterations):
    env_state = jax.tree.map(lambda *xs: jnp.concatenate(xs), *env_groups)
    m = jax.tree.map(lambda *xs: jnp.stack(xs), *iterations)
    return ts, strong_types(env_state), learner.chunk_metrics(m, ts.skipped_updates)

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
    """``(ts, env_state) -> (ts, env_state, metrics)``, as the one-program chunk."""
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
