"""PPO for MJX control: the compiled training chunk and the run that drives it.

Data flow of one training iteration (all inside one compiled function)::

    lax.scan over unroll_length:  normalise(obs) -> policy -> u ~ N, a = tanh(u)    (rollout.py)
                                  -> vmapped env.step (the libraries' auto-reset wrappers)
    -> transitions [B, T] -> values V(s_t), V(s'_t) -> compute_gae -> ppo_update    (learner.py)
    -> observation statistics updated with this rollout's observations

Several iterations run in one ``lax.scan`` between evaluations (`Trainer.train_chunk`), so a
whole run compiles four functions: the networks' initialisation, the reset, the training
chunk and the evaluation (evaluation.py). On CPU the chunk is by default a host loop of
several programs instead, which steps the environments on several threads
(host_chunks.py). `train` runs the chunks in the host loop every trainer shares
(`rljax.loop`): evaluation, logging, checkpoints (checkpointing.py), preemption and the
non-finite policy. `load_policy` rebuilds a trained policy from its run's folder (policy.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rljax import checkpoint as ckpt
from rljax import envs, loop, nonfinite, running_stats, runtime
from rljax import metrics as metrics_lib
from rljax.control import checkpointing, chunks, evaluation, learner
from rljax.control import networks as networks_lib
from rljax.control.config import ConfigError, ControlConfig, resolve_env_threads
from rljax.control.host_chunks import OverlappedChunk, ThreadedChunk, with_sharding
from rljax.control.learner import TrainState
from rljax.control.networks import Networks, policy_apply, value_apply
from rljax.control.policy import load_params, load_policy
from rljax.control.rollout import Rollout, iteration_keys, strong_types
from rljax.nonfinite import NonFiniteHalt
from rljax.preemption import EXIT_PREEMPTED, Preempted

Array = jax.Array
run_eval_episodes = evaluation.run_eval_episodes
episode_metrics = evaluation.episode_metrics

__all__ = [
    "EXIT_PREEMPTED", "Networks", "NonFiniteHalt", "OverlappedChunk", "Preempted",
    "ThreadedChunk", "TrainResult", "TrainState", "Trainer", "episode_metrics", "load_params",
    "load_policy", "make_networks", "make_trainer", "policy_apply", "run_eval_episodes", "train",
    "value_apply",
]


def make_networks(config: ControlConfig, env, key: Array | None) -> tuple[Networks, Any]:
  """The actor-critic of ``config``'s sizes and initialisation for ``env``: ``(networks,
  params)``, or ``(networks, None)`` for ``key=None`` (`rljax.control.networks.make_networks`).

  Raises:
    ValueError: non-flat observations.
  """
  net_config = networks_lib.actor_critic_config(
      env, policy_hidden=config.policy_hidden, value_hidden=config.value_hidden,
      activation=config.activation, init_std=config.init_std,
      policy_init_scale=config.policy_init_scale)
  return networks_lib.make_networks(net_config, key)


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

  @property
  def rollout(self) -> Rollout:
    """The run's rollouts (`rljax.control.rollout.Rollout`)."""
    return Rollout(self.env, self.networks, self.config)

  @functools.cached_property
  def learn_step(self) -> Callable:
    """``(ts, data) -> (ts, metrics)``, `rljax.control.learner.make_learn_step`'s."""
    return learner.make_learn_step(self.config, self.networks, self.optimizer)

  @property
  def env_steps_per_chunk(self) -> int:
    """Environment steps one training chunk takes (``iterations_per_chunk`` iterations)."""
    return self.iterations_per_chunk * self.config.env_steps_per_iteration

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

  # -- the starting state ---------------------------------------------------------------

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
    return (jax.tree.map(lambda x: with_sharding(x, replicated), ts),
            jax.tree.map(lambda x: with_sharding(x, self._env_sharding(x)), env_state))

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
    return jax.jit(lambda keys: strong_types(self.env.reset(keys)))

  @functools.cached_property
  def _compiled_reset(self) -> Callable:
    """`_reset` compiled with `runtime.run_once_compiler_options` (it runs once per run; the
    options cannot go on `_reset` itself, which is also traced inside ``eval_shape``)."""
    # The keys' shape and dtype as `_init_unplaced` makes them, not restated here.
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.PRNGKey(0), self.config.num_envs))
    return self._reset.lower(keys).compile(runtime.run_once_compiler_options())

  # -- the compiled training chunk ------------------------------------------------------

  def iteration(self, carry, _):
    """One training iteration, ``((ts, env_state), None) -> ((ts, env_state), metrics)``:
    the rollout of ``ts``'s policy, then `learn_step` on it (a ``lax.scan`` body)."""
    ts, env_state = carry
    _, key_roll, _ = iteration_keys(ts.key)
    env_state, data = self.rollout.collect(ts.params, ts.obs_stats, env_state, key_roll)
    ts, metrics = self.learn_step(ts, data)
    return (ts, env_state), metrics

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
          self.iteration, (ts, env_state), None, length=self.iterations_per_chunk
      )
      ts, env_state = self.place(ts, strong_types(env_state), inside_jit=True)
      return ts, env_state, learner.chunk_metrics(m, ts.skipped_updates)

    return jax.jit(chunk, donate_argnums=(0, 1),
                   compiler_options=runtime.control_compiler_options())

  @functools.cached_property
  def evaluate(self) -> Callable:
    """``jit((params, obs_stats, key) -> metrics)``: one full episode per eval env
    (`rljax.control.evaluation.make_evaluate`)."""
    return evaluation.make_evaluate(self.config, self.networks, self.eval_env,
                                    self.episode_length)

  # -- checkpoints ----------------------------------------------------------------------

  def checkpoint_items(self, chunk: int, state) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two items (`rljax.control.checkpointing`) of ``state = (ts, env_state)`` after
    ``chunk`` chunks."""
    ts, env_state = state
    return checkpointing.policy_item(ts), checkpointing.train_item(
        env_state, chunk * self.env_steps_per_chunk, opt_state=ts.opt_state, key=ts.key,
        iteration=ts.iteration, skipped_updates=ts.skipped_updates)

  def from_checkpoint(self, state, policy: dict[str, Any], train: dict[str, Any]):
    """``(ts, env_state)`` from a checkpoint's items, laid out as `init` lays them out."""
    ts, env_state = state
    params, obs_stats = checkpointing.restored_params(ts.params, policy)
    ts = TrainState(params=params, opt_state=train["opt_state"], obs_stats=obs_stats,
                    key=train["key"], iteration=train["iteration"],
                    skipped_updates=train["skipped_updates"])
    env_state = ckpt.from_saveable(env_state, train["env_state"])
    return self.place(*_uncommitted((ts, env_state), self.mesh))


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
      arrays of which each process holds its rows.

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
  with _process_local_default_devices():  # MJX puts its model on jax.devices()[0]
    env = envs.traced(envs.make(config.env, **dict(config.env_kwargs)))
  episode_length = config.episode_length or envs.default_episode_length(config.env)
  train_env = envs.wrap_for_training(
      env, episode_length=episode_length, action_repeat=config.action_repeat
  )
  eval_env = envs.wrap_for_evaluation(env, episode_length=episode_length,
                                      action_repeat=config.action_repeat)
  num_chunks, iterations_per_chunk = config.chunk_schedule
  if params_key is None:
    params_key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
  networks, params = make_networks(config, env, params_key)
  optimizer = learner.make_optimizer(config, iterations_per_chunk * num_chunks)
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


def _uncommitted(tree, mesh: jax.sharding.Mesh | None):
  """``tree``'s restored arrays as `Trainer.init` makes them. Without a mesh those are
  uncommitted (jax places them), which the train chunk and the evaluation were compiled for;
  orbax restores arrays committed to a device, a call with which would compile both again
  (once per resumed run). On a mesh `Trainer.place` lays them out as compiled."""
  if mesh is not None:
    return tree
  return jax.device_put(jax.device_get(tree))  # host arrays, put back uncommitted


def _compile_ahead(trainer: Trainer, params, eval_key):
  """Starts compiling the train chunk and then the evaluation on one more thread, from the
  state's abstract shapes, while the caller resets the environments; returns their futures.

  Tracing and lowering are Python and hold the GIL, so they run here one after another, the
  train chunk's (the longest compile) first; XLA's compiles release it and run beside the
  reset. The jitted functions then reuse the executables (a call with other shapes or
  shardings would compile again).
  """
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rljax-compile")
  abstract_ts, abstract_env = trainer.abstract_state(params)  # the reset's one trace
  chunk = pool.submit(trainer.train_chunk.lower(abstract_ts, abstract_env).compile)
  evaluate = pool.submit(trainer.evaluate.lower(abstract_ts.params, abstract_ts.obs_stats,
                                                jax.eval_shape(lambda: eval_key)).compile)
  pool.shutdown(wait=False)
  return chunk, evaluate


def _skip_message(step: int, state, record: dict[str, Any], before: int, now: int) -> str:
  """The non-finite policy's message for the updates skipped in chunk ``step``."""
  which = [k.split("/")[1] for k in ("nonfinite/reward", "nonfinite/observation",
                                     "nonfinite/loss_or_grad") if record[k] > 0]
  return (f"non-finite {', '.join(which)} in chunk {step} (iterations up to "
          f"{int(state[0].iteration)}): {now - before} update(s) skipped, {now} in total")


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
  """Trains ``config`` end to end in the shared host loop (`rljax.loop.run`).

  Writes to ``logdir`` (if given): ``metrics.jsonl``, TensorBoard events,
  ``learning_curve.png``, ``checkpoints/`` (orbax, the full train state including the
  environment state, every evaluation) with ``checkpoints/config.json``.

  With ``resume`` (default) and a checkpoint in ``logdir``, the run continues from the
  newest readable checkpoint and ends bitwise equal to an uninterrupted run. On
  SIGTERM the current chunk finishes, a checkpoint is written and `Preempted` is
  raised (scripts exit with `EXIT_PREEMPTED`); a SIGTERM during start-up raises it once
  the compiles end, before the first evaluation, with nothing new to save.

  ``on_eval(chunk, train_state, record)``, if given, is called on the host after each
  evaluation is logged and checkpointed (chunk 0 before training included), with the record
  as logged (``env_steps``, ``eval/episode_reward``, ...); e.g.
  ``rljax.control.eval_video.eval_video_callback`` writes a video there.

  ``overlap_eval=True`` evaluates chunk ``k`` on a second thread while chunk ``k + 1``
  trains; results are identical either way. It pays only with spare cores (the evaluation
  and the chunk share XLA's thread pool), so it is off by default. It is ignored with
  several processes, which must launch their computations in one order.

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
  with ckpt.SigtermFlag() as sigterm:
    use_ckpt = logdir is not None and checkpoints
    newest = (ckpt.check_logdir(logdir, checkpointing.saved_run(config), resume=resume)
              if use_ckpt else None)
    if progress:
      runtime.primary_print(f"{config.env}: building the environments and compiling (a new "
                            f"configuration takes tens of seconds on CPU; the compilation "
                            f"cache shortens a rerun)", file=sys.stderr, flush=True)
    trainer, params = make_trainer(config, mesh=mesh)
    eval_key = jax.random.PRNGKey(config.seed + 10_000)
    # A run whose newest checkpoint is its last chunk has nothing left to train, so nothing
    # is compiled ahead (if that checkpoint is unreadable, the chunk restored instead
    # compiles on its first call).
    compiling = (_compile_ahead(trainer, params, eval_key) if newest != trainer.num_chunks
                 else (None, None))
    state = trainer.init(params)
    saver, start, resumed_from, history = None, 0, None, []
    if use_ckpt:
      checkpointing.write_config(logdir, "control", config, trainer.networks.config)
      saver = loop.Checkpoints(logdir, keep=config.keep_checkpoints,
                               items=trainer.checkpoint_items, from_items=trainer.from_checkpoint)
      restored = saver.restore(state, log=log) if resume else None
      if restored is not None:
        start, state = restored
        resumed_from = start
      history = checkpointing.resume_history(
          logdir, resumed_from, num_chunks=trainer.num_chunks,
          env_steps=start * trainer.env_steps_per_chunk, log=log)
    chunk_compiled, eval_compiled = compiling
    # Both compiles finish before anything runs (a compile would take a core from the
    # chunk's parallel matmuls).
    if eval_compiled is not None:
      eval_compiled.result()
    if chunk_compiled is not None and start < trainer.num_chunks:
      chunk_compiled.result()
    # Seconds from the start until both are compiled (environment build and reset overlap).
    compile_s = time.perf_counter() - t_start
    if progress:
      runtime.primary_print(f"start-up {compile_s:.1f} s", file=sys.stderr, flush=True)
    writer = None
    if logdir is not None and start < trainer.num_chunks:
      writer = metrics_lib.MetricsWriter(
          logdir, total=trainer.num_chunks * trainer.env_steps_per_chunk if progress else None,
          console_keys=("eval/episode_reward", "sps"))

    spec = loop.LoopSpec(num_steps=trainer.num_chunks, unit="chunk", evaluate_first=True,
                         overlap_eval=bool(overlap_eval) and jax.process_count() == 1)
    watch = nonfinite.Watch(config.nonfinite, lambda state: int(state[0].skipped_updates),
                                 _skip_message, warn=lambda m: log("warning: " + m))
    try:
      state, history = loop.run(
          spec, state, chunks.chunk_step(trainer.train_chunk, trainer.env_steps_per_chunk),
          sigterm=sigterm, start=start, logdir=logdir, checkpoints=saver,
          evaluate=chunks.chunk_evaluation(trainer.evaluate, eval_key), writer=writer,
          progress=lambda step, record: record["env_steps"], history=history,
          first_record={"sps": 0.0, "env_steps": 0},
          on_record=None if on_eval is None else lambda k, s, r: on_eval(k, s[0], r),
          watch=watch, wall_clock_start=t_start)
    finally:
      if writer is not None:
        writer.close()
      if saver is not None:
        saver.close()
  wall_s = time.perf_counter() - t_start
  if writer is not None:
    metrics_lib.plot_learning_curve(writer.jsonl_path, os.path.join(logdir, "learning_curve.png"),
                                    title=f"{config.env} (PPO, rljax)")
  num_compiled = trainer.train_chunk._cache_size() + trainer.evaluate._cache_size()
  return TrainResult(state[0], history, wall_s, compile_s, num_compiled, resumed_from)
