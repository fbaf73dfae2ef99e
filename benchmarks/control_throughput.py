r"""Control throughput: rljax's PPO trainer vs Brax's, side by side in one process.

    python benchmarks/control_throughput.py --env=playground/CartpoleBalance --out=cartpole.json

For one environment it runs, back to back:

1. rljax's trainer with the *same settings* as step 2 (environment, ``num_envs``,
   ``unroll_length``, batch, minibatches, updates per batch, network sizes and the policy's
   initialisation, evaluations and how they act, timesteps), with Brax's normaliser order
   (each rollout folded in before its update); ``--gae_per_minibatch`` also computes GAE
   inside each minibatch's loss, as Brax does (rljax's default: once per iteration);
2. Brax's own trainer, ``brax.training.agents.ppo.train``, as its users run it
   (Playground environments wrapped with Playground's ``wrap_for_brax_training``);
3. rljax again with its own default config for the environment;
4. the physics limit: ``jit(lax.scan(vmap(env.step)))`` with zero actions, compiled both with
   XLA's default options and with the ones rljax compiles its physics with
   (``rljax.runtime.control_compiler_options``), measured in this process after the trainers
   and again in a fresh child process (``--physics_limit_only``); the fastest of the four is
   the limit (a process that has run the trainers can read it lower: on ant 11.3k against
   13.1-17.8k steps/s in fresh processes on one machine, benchmarks/HISTORY.md).
   Where rljax's rollouts step the environments on several threads (``ControlConfig.env_threads``
   as this machine resolves it, ``rljax_env_threads``), the same program is also timed on that
   many threads at once, each on its group of the environments: ``physics_limit_threaded_sps``,
   the limit of a rollout that uses those cores, and ``fraction_of_threaded_limit``.

Both of rljax's runs use its ``env_threads`` (the identical-settings run too: it is how rljax
runs those settings; Brax's trainer steps all environments in one program per device).

With ``--repeats=N`` steps 1 and 2 run N times each, alternating their order (rljax, Brax, Brax,
rljax, ...), and the reported figures are medians over the runs.

Steady-state steps/s exclude compilation: they are the median over the training
epochs after the first (both trainers time each epoch the same way, evaluation
excluded). Wall times are whole runs, compilation and evaluations included; Python
module imports, a one-time cost of the process, happen before either run is timed.

Brax 0.14.2 calls ``jax.device_put_replicated``, which JAX 0.10 removed; the small shim
below restores it for Brax only. Nothing of Brax's algorithm or settings is changed.

Flags (``--helpfull`` lists them with their defaults): ``--env``, ``--num_envs``,
``--num_timesteps`` (the identical-settings runs), ``--default_num_timesteps`` (rljax's default
run), ``--seed``, ``--repeats``, ``--skip_default``, ``--gae_per_minibatch`` and ``--out`` (the
JSON file). ``--physics_limit_only`` and ``--physics_limit_threads`` are what the benchmark runs
in its child process.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

_ENV = flags.DEFINE_string("env", "playground/CartpoleBalance", "Environment name.")
_NUM_ENVS = flags.DEFINE_integer("num_envs", 256, "Parallel environments.")
_TIMESTEPS = flags.DEFINE_integer("num_timesteps", 1_500_000, "Timesteps of the identical-settings runs.")
_OUT = flags.DEFINE_string("out", None, "Write the JSON result here.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the identical-settings runs (both trainers).")
_SKIP_DEFAULT = flags.DEFINE_bool("skip_default", False, "Skip the rljax-default run.")
_GAE_PER_MINIBATCH = flags.DEFINE_bool(
    "gae_per_minibatch", False,
    "The identical-settings rljax run computes GAE inside each minibatch's loss, as Brax does "
    "(ControlConfig.gae_per_minibatch), instead of once per iteration before the update "
    "(rljax's default). Off: it was 2-3% faster and learnt less (benchmarks/HISTORY.md, "
    "2026-12-02).")
_LIMIT_ONLY = flags.DEFINE_bool(
    "physics_limit_only", False,
    "Measure the physics limit alone (both compiler options), write it to --out as JSON and "
    "exit: what the benchmark runs in a fresh child process.")
_LIMIT_THREADS = flags.DEFINE_integer(
    "physics_limit_threads", 1,
    "With --physics_limit_only: also measure the limit with the environments split over this "
    "many threads (what the parent passes: rljax's env_threads on this machine).", lower_bound=1)
_REPEATS = flags.DEFINE_integer(
    "repeats", 1,
    "Run the identical-settings pair this many times, alternating the order (rljax, Brax, "
    "Brax, rljax, rljax, Brax, ...), so that a drift of the machine's speed during the process "
    "weighs on both alike. rljax_sps, brax_sps and the wall times are then medians over the "
    "repeats, and the ratios are theirs; each run's figures are in the JSON (*_runs). rljax's "
    "default run is repeated as often (after the pairs), and rljax_default_sps, whose ratio to "
    "the limit is fraction_of_limit, is its median. On the 2-core machines the same code's "
    "steady rates moved by up to 20% between runs (benchmarks/HISTORY.md, 2026-12-04).",
    lower_bound=1)
_DEFAULT_TIMESTEPS = flags.DEFINE_integer(
    "default_num_timesteps", None,
    "Timesteps of the rljax-default run (default: --num_timesteps); only its steady "
    "steps/s is reported, which does not depend on the run's length.")


def install_device_put_replicated_shim() -> None:
  """Restores ``jax.device_put_replicated`` (removed in JAX 0.10) for Brax 0.14.2.

  It puts ``len(devices)`` stacked copies of each leaf on ``devices``, sharded along
  the new leading axis: what the removed function returned, and what Brax's
  ``pmap``-based trainers expect.
  """
  if hasattr(jax, "device_put_replicated"):
    return

  def device_put_replicated(x, devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("i",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i"))
    return jax.tree.map(
        lambda a: jax.device_put(jnp.stack([jnp.asarray(a)] * len(devices)), sharding), x
    )

  jax.device_put_replicated = device_put_replicated


# Identical settings, in Brax's terms. unroll_length follows the environment families'
# published configs (Playground's DM Control: 30; Brax's ant: short unrolls).
def identical_settings(env: str, num_envs: int, num_timesteps: int, seed: int = 0) -> dict:
  unroll = 10 if env.startswith("brax/") else 30
  return dict(
      num_timesteps=num_timesteps,
      num_envs=num_envs,
      unroll_length=unroll,
      batch_size=num_envs,  # Brax: trajectory segments per minibatch
      num_minibatches=4,
      num_updates_per_batch=4,
      learning_rate=1e-3,
      entropy_cost=1e-2,
      discounting=0.99,
      gae_lambda=0.95,
      clipping_epsilon=0.2,
      reward_scaling=1.0,
      normalize_observations=True,
      num_evals=5,
      num_eval_envs=128,
      policy_hidden_layer_sizes=(32, 32, 32, 32),  # Brax's default networks
      value_hidden_layer_sizes=(256, 256, 256, 256, 256),
      seed=seed,
  )


def rljax_config_from(env: str, s: dict, episode_length: int, gae_per_minibatch: bool = False):
  from rljax.control.config import ControlConfig
  from rljax.models import mlp

  return ControlConfig().replace(
      env=env,
      num_timesteps=s["num_timesteps"],
      num_envs=s["num_envs"],
      unroll_length=s["unroll_length"],
      batch_size=s["batch_size"] * s["num_minibatches"],  # rljax: segments per iteration
      num_minibatches=s["num_minibatches"],
      num_epochs=s["num_updates_per_batch"],
      learning_rate=s["learning_rate"],
      entropy_coef=s["entropy_cost"],
      gamma=s["discounting"],
      gae_lambda=s["gae_lambda"],
      clip_eps=s["clipping_epsilon"],
      reward_scaling=s["reward_scaling"],
      normalize_observations=s["normalize_observations"],
      # Brax folds each rollout into its normaliser before the update that uses it.
      obs_stats_before_update=True,
      # Brax computes GAE inside each minibatch's loss from the value forward the loss
      # makes, with the value network as that step finds it (no separate value pass);
      # rljax's own order unless asked (2-3% faster, learnt less: benchmarks/HISTORY.md,
      # 2026-12-02).
      gae_per_minibatch=gae_per_minibatch,
      num_evals=s["num_evals"],
      num_eval_envs=s["num_eval_envs"],
      policy_hidden=s["policy_hidden_layer_sizes"],
      value_hidden=s["value_hidden_layer_sizes"],
      # Brax's policy network: a full-scale LeCun output layer and std = softplus(raw) +
      # 0.001. rljax's own default starts near loc = 0, std = 1 in every state instead,
      # which on brax/ant learnt about 3x slower at these settings.
      init_std=mlp.BRAX_INIT_STD,
      policy_init_scale=1.0,
      # Brax evaluates by sampling actions (its deterministic_eval=False default).
      deterministic_eval=False,
      episode_length=episode_length,
      seed=s["seed"],
  )


def run_rljax(config) -> dict:
  from rljax.control import trainer

  result = trainer.train(config, None, progress=False)
  sps = [h["sps"] for h in result.history[2:]] or [result.history[-1]["sps"]]
  return dict(
      sps=statistics.median(sps),
      wall_s=result.wall_s,
      compile_s=result.compile_s,
      final_reward=result.history[-1]["eval/episode_reward"],
      env_steps=result.history[-1]["env_steps"],
  )


def median_run(runs: list[dict]) -> dict:
  """One run's figures from several runs of the same trainer and settings: the median of each
  number (``sps``, ``wall_s``, ...); the final reward is the first run's (a seed's runs give the
  same one)."""
  merged = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
  merged["final_reward"] = runs[0]["final_reward"]
  return merged


def run_brax(env_name: str, s: dict, episode_length: int) -> dict:
  install_device_put_replicated_shim()
  import functools

  from brax.training.agents.ppo import networks as ppo_networks
  from brax.training.agents.ppo import train as ppo_train

  from rljax import envs

  # Both wall times start before the environment is built (rljax's train() builds it).
  t0 = time.perf_counter()
  env = envs.make(env_name)
  wrap_env_fn = None
  if env_name.startswith("playground/"):
    from mujoco_playground import wrapper

    wrap_env_fn = wrapper.wrap_for_brax_training
  sps, rewards, steps = [], [], []

  def progress(num_steps, metrics):
    steps.append(num_steps)
    rewards.append(float(metrics.get("eval/episode_reward", np.nan)))
    if "training/sps" in metrics:
      sps.append(float(metrics["training/sps"]))

  network_factory = functools.partial(
      ppo_networks.make_ppo_networks,
      policy_hidden_layer_sizes=s["policy_hidden_layer_sizes"],
      value_hidden_layer_sizes=s["value_hidden_layer_sizes"],
  )
  kwargs = {k: v for k, v in s.items() if not k.endswith("hidden_layer_sizes")}
  ppo_train.train(
      environment=env,
      episode_length=episode_length,
      network_factory=network_factory,
      wrap_env_fn=wrap_env_fn,
      progress_fn=progress,
      **kwargs,
  )
  wall = time.perf_counter() - t0
  steady = sps[1:] or sps
  return dict(
      sps=statistics.median(steady), wall_s=wall, final_reward=rewards[-1], env_steps=steps[-1]
  )


def physics_limits(env_name: str, num_envs: int, options: dict[str, dict | None],
                   steps: int = 200, threads: int = 1) -> dict[str, float]:
  """Steps/s of ``jit(lax.scan(vmap(env.step)))`` with zero actions, compiled once per entry of
  ``options`` (name -> XLA compiler options, ``None`` for XLA's defaults); each the best of 3
  timed calls from the same reset state.

  With ``threads > 1`` the program is compiled for ``num_envs / threads`` environments and
  called on ``threads`` threads at once, each on its group of the same reset state, as
  rljax's `ThreadedChunk` steps its environments (keys ``<option>_threads``): the physics
  limit of a rollout that uses that many cores.
  """
  from rljax import envs

  env = envs.make(env_name)
  state = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.PRNGKey(0), num_envs))
  m = num_envs // threads
  groups = [jax.tree.map(lambda x: x[g * m:(g + 1) * m], state) for g in range(threads)]
  zeros = jnp.zeros((m, env.action_size))

  def run(state):
    return jax.lax.scan(lambda s, _: (jax.vmap(env.step)(s, zeros), ()), state, None, length=steps)[0]

  limits = {}
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for name, compiler_options in options.items():
      compiled = jax.jit(run, compiler_options=compiler_options)
      call = lambda g: jax.block_until_ready(compiled(g))  # noqa: E731
      for g in groups:
        call(g)
      best = float("inf")
      for _ in range(3):
        t0 = time.perf_counter()
        list(pool.map(call, groups))
        best = min(best, time.perf_counter() - t0)
      limits[name if threads == 1 else f"{name}_threads"] = num_envs * steps / best
  return limits


def limit_options() -> dict[str, dict | None]:
  """The compiler options the limit is measured with: XLA's defaults and rljax's."""
  from rljax import runtime

  return {"default": None, "rljax": runtime.control_compiler_options()}


def all_physics_limits(env_name: str, num_envs: int, threads: int) -> dict[str, float]:
  """:func:`physics_limits` with both `limit_options`, on one thread and (if ``threads > 1``)
  on ``threads`` threads."""
  limits = physics_limits(env_name, num_envs, limit_options())
  if threads > 1:
    limits.update(physics_limits(env_name, num_envs, limit_options(), threads=threads))
  return limits


def physics_limits_in_child(env_name: str, num_envs: int, threads: int) -> dict[str, float]:
  """:func:`all_physics_limits` measured by this script in a fresh process
  (``--physics_limit_only``), which has run nothing else.

  Raises:
    RuntimeError: the child failed (its stderr's tail is in the message).
  """
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "limit.json")
    child = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f"--env={env_name}",
         f"--num_envs={num_envs}", "--physics_limit_only", f"--physics_limit_threads={threads}",
         f"--out={out}"],
        capture_output=True, text=True)
    if child.returncode != 0:
      raise RuntimeError(f"the physics-limit child process failed:\n{child.stderr[-2000:]}")
    with open(out, encoding="utf-8") as f:
      return json.load(f)


def import_both_stacks() -> None:
  """Imports every module either trainer imports lazily, before either is timed.

  Module imports are a one-time cost of the process, not of a run. Without this the
  first run timed (rljax's) would pay the imports of Brax's and Playground's modules
  that the second (Brax's) then finds imported: about 5 s of wall time.
  """
  import brax.envs.wrappers.training  # noqa: F401
  import brax.training.agents.ppo.train  # noqa: F401
  from mujoco_playground import wrapper  # noqa: F401

  import rljax.control.trainer  # noqa: F401


def main(argv):
  del argv
  if _LIMIT_ONLY.value:
    limits = all_physics_limits(_ENV.value, _NUM_ENVS.value, _LIMIT_THREADS.value)
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(limits, f)
    return
  import_both_stacks()
  from rljax import envs
  from rljax.control.config import default_config, resolve_env_threads

  env_name = _ENV.value
  episode_length = envs.default_episode_length(env_name)
  s = identical_settings(env_name, _NUM_ENVS.value, _TIMESTEPS.value, _SEED.value)
  print(f"[{env_name}] identical settings: {s}", flush=True)
  runs = {"rljax": [], "brax": []}
  for repeat in range(_REPEATS.value):
    for name in ("rljax", "brax") if repeat % 2 == 0 else ("brax", "rljax"):
      if name == "rljax":
        r = run_rljax(rljax_config_from(env_name, s, episode_length, _GAE_PER_MINIBATCH.value))
      else:
        r = run_brax(env_name, s, episode_length)
      runs[name].append(r)
      print(f"  {name:<5} (identical, run {repeat + 1} of {_REPEATS.value}): {r}", flush=True)
  ours, brax = median_run(runs["rljax"]), median_run(runs["brax"])
  default, default_runs = None, []
  if not _SKIP_DEFAULT.value:
    dc = default_config(env_name)
    dc = dc.replace(num_timesteps=_DEFAULT_TIMESTEPS.value or _TIMESTEPS.value, num_evals=5)
    for repeat in range(_REPEATS.value):
      default_runs.append(run_rljax(dc))
      print(f"  rljax (default {dc.num_envs} envs, {dc.policy_hidden}/{dc.value_hidden}, run "
            f"{repeat + 1} of {_REPEATS.value}): {default_runs[-1]}", flush=True)
    default = median_run(default_runs)
  # The limit is the fastest of XLA's default compiler options and the ones rljax compiles its
  # physics with (rljax.runtime.control_compiler_options), so fraction_of_limit cannot exceed 1
  # by a compiler setting alone; and of this process (after the trainers) and a fresh one.
  # It is one program, as fraction_of_limit's target defines it. rljax's rollouts step the
  # environments on `threads` threads (ControlConfig.env_threads, as this machine resolves it),
  # whose physics limit is measured too: the same program on each thread's group, all at once.
  threads = resolve_env_threads(default_config(env_name).replace(
      num_envs=_NUM_ENVS.value))
  here = all_physics_limits(env_name, _NUM_ENVS.value, threads)
  fresh = physics_limits_in_child(env_name, _NUM_ENVS.value, threads)
  best = lambda *keys: max(d[k] for d in (here, fresh) for k in keys)  # noqa: E731
  limit_default, limit_rljax = best("default"), best("rljax")
  limit = max(limit_default, limit_rljax)
  limit_threaded = best("default_threads", "rljax_threads") if threads > 1 else limit
  single = lambda d: max(d["default"], d["rljax"])  # noqa: E731
  print(f"  physics limit: {limit:,.0f} steps/s (XLA defaults {limit_default:,.0f}, "
        f"rljax's options {limit_rljax:,.0f}; this process {single(here):,.0f}, "
        f"a fresh one {single(fresh):,.0f}); on {threads} threads: {limit_threaded:,.0f}",
        flush=True)
  result = dict(
      env=env_name,
      num_envs=_NUM_ENVS.value,
      rljax_sps=ours["sps"],
      brax_sps=brax["sps"],
      rljax_default_sps=default["sps"] if default else None,
      physics_limit_sps=limit,
      physics_limit_default_xla_sps=limit_default,
      physics_limit_rljax_options_sps=limit_rljax,
      physics_limit_this_process_sps=single(here),
      physics_limit_fresh_process_sps=single(fresh),
      rljax_env_threads=threads,
      physics_limit_threaded_sps=limit_threaded,
      rljax_wall_s=ours["wall_s"],
      rljax_compile_s=ours["compile_s"],
      brax_wall_s=brax["wall_s"],
      ratio_vs_brax=ours["sps"] / brax["sps"],
      wall_ratio_vs_brax=brax["wall_s"] / ours["wall_s"],
      fraction_of_limit=default["sps"] / limit if default else None,
      fraction_of_threaded_limit=default["sps"] / limit_threaded if default else None,
      rljax_gae_per_minibatch=_GAE_PER_MINIBATCH.value,
      rljax_final_reward=ours["final_reward"],
      brax_final_reward=brax["final_reward"],
      rljax_default_final_reward=default["final_reward"] if default else None,
      rljax_default_wall_s=default["wall_s"] if default else None,
      repeats=_REPEATS.value,
      rljax_sps_runs=[r["sps"] for r in runs["rljax"]],
      brax_sps_runs=[r["sps"] for r in runs["brax"]],
      rljax_wall_s_runs=[r["wall_s"] for r in runs["rljax"]],
      brax_wall_s_runs=[r["wall_s"] for r in runs["brax"]],
      rljax_default_sps_runs=[r["sps"] for r in default_runs],
  )
  print("\n| metric | value |\n|---|---|")
  for k, v in result.items():
    if isinstance(v, list):
      v = ", ".join(f"{x:,.1f}" for x in v)
    print(f"| {k} | {v:,.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  app.run(main)
