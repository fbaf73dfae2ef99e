r"""Train a PPO policy on an MJX environment.

    python experiments/train_control.py                       # CartpoleBalance, bundled defaults
    python experiments/train_control.py --env=brax/ant --num_timesteps=5000000 --logdir=runs/ant

Every ``ControlConfig`` field is a flag; unset flags take the environment's bundled
default (``rljax.control.config.default_config``). Bad values fail before anything
compiles, with exit status 2 and a one-line message (``--verbose`` for a traceback).

Exit status: 0 done; 2 bad input; 3 halted on a non-finite value (``--nonfinite=halt``);
75 (``EXIT_PREEMPTED``) stopped by SIGTERM after writing a checkpoint: run the same
command again (SLURM's ``--requeue`` does) and it resumes from that checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from absl import app, flags

from rljax import runtime
from rljax.sharding import distributed

_ENV = flags.DEFINE_string("env", "playground/CartpoleBalance", "Environment name (rljax.envs.list_envs()).")
_LOGDIR = flags.DEFINE_string("logdir", None, "Output directory (default runs/<env>-<time>).")
_CACHE = flags.DEFINE_bool("compilation_cache", True, "Use JAX's persistent compilation cache.")
_CACHE_DIR = flags.DEFINE_string("compilation_cache_dir", None, "Cache directory (default ~/.cache/rljax).")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Print tracebacks for user errors.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
_MESH = flags.DEFINE_string(
    "mesh", None, "Device mesh D,F,T (data, fsdp, tensor sizes); default: all devices on data."
)
_RULES = flags.DEFINE_string(
    "sharding_rules", "dp", "Sharding preset (dp, fsdp, fsdp_tp). The control MLP is small and "
    "always replicated; environments and batches are split over the data and fsdp axes."
)
distributed.define_flags()
_RESUME = flags.DEFINE_bool(
    "resume", True, "Continue from the newest checkpoint in --logdir when there is one."
)

# One flag per ControlConfig field (except env), defaulting to "use the env's default".
_FIELD_FLAGS = {}
_HELP = {
    "num_timesteps": "Environment steps to train for.",
    "num_envs": "Parallel environments.",
    "seed": "PRNG seed.",
    "batch_size": "Trajectory segments per iteration (multiple of num_envs; 0 = num_envs).",
    "num_minibatches": "Minibatches per epoch.",
    "num_epochs": "Passes over each batch (Brax's num_updates_per_batch).",
    "learning_rate": "Adam learning rate.",
    "entropy_coef": "Entropy bonus weight.",
    "gamma": "Discount factor.",
    "gae_lambda": "GAE lambda.",
    "clip_eps": "PPO clip range.",
}


def _define_field_flags():
  from rljax.control.config import ControlConfig

  for f in dataclasses.fields(ControlConfig):
    if f.name in ("env", "env_kwargs"):
      continue
    help_text = _HELP.get(f.name, f"ControlConfig.{f.name}.")
    if f.type in ("int", int):
      _FIELD_FLAGS[f.name] = flags.DEFINE_integer(f.name, None, help_text)
    elif f.type in ("float", float):
      _FIELD_FLAGS[f.name] = flags.DEFINE_float(f.name, None, help_text)
    elif f.type in ("bool", bool):
      _FIELD_FLAGS[f.name] = flags.DEFINE_bool(f.name, None, help_text)
    elif f.type in ("str", str):
      _FIELD_FLAGS[f.name] = flags.DEFINE_string(f.name, None, help_text)
    else:  # tuple[int, ...]
      _FIELD_FLAGS[f.name] = flags.DEFINE_list(f.name, None, help_text + " Comma-separated ints.")


_define_field_flags()


def build_config():
  from rljax import envs
  from rljax.control.config import ConfigError, default_config

  envs.check_name(_ENV.value)
  overrides = {}
  for name, flag in _FIELD_FLAGS.items():
    if flag.value is None:
      continue
    value = flag.value
    if isinstance(value, list):
      try:
        value = tuple(int(v) for v in value)
      except ValueError:
        raise ConfigError(f"--{name} must be comma-separated integers, got {','.join(value)!r}.")
    overrides[name] = value
  return default_config(_ENV.value).replace(**overrides)


def build_mesh(config):
  """The ``--mesh`` device mesh, or ``None`` on one device. Checks divisibility first."""
  import jax

  from rljax.sharding import mesh as mesh_lib
  from rljax.sharding import rules

  rules.as_preset(_RULES.value)
  if _MESH.value is None and jax.device_count() == 1:
    return None
  mesh = mesh_lib.make_mesh(mesh_lib.parse_mesh_flag(_MESH.value))
  mesh_lib.check_batch_divisible(config.num_envs, mesh, what="num_envs")
  return mesh


def main(argv):
  del argv

  runtime.configure_logging(_VERBOSE.value)

  def run():
    distributed.initialize_from_flags()  # no-op for one process outside SLURM
    config = build_config()  # validates before anything compiles
    mesh = build_mesh(config)
    logdir = _LOGDIR.value or os.path.join(
        "runs", f"{config.env.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    from rljax.checkpoint import check_writable

    check_writable(logdir)
    if _CACHE.value:
      runtime.enable_compilation_cache(_CACHE_DIR.value)
    from rljax.control import trainer

    try:
      result = trainer.train(
          config, logdir, progress=_PROGRESS.value, resume=_RESUME.value, mesh=mesh
      )
    except trainer.Preempted as e:
      print(f"{e}; exiting with status {trainer.EXIT_PREEMPTED}", file=sys.stderr)
      return trainer.EXIT_PREEMPTED
    except trainer.NonFiniteHalt as e:
      print(f"error: {e}", file=sys.stderr)
      return 3
    final = result.history[-1]
    print(
        f"{config.env}: final eval episode reward {final['eval/episode_reward']:.1f} "
        f"after {final['env_steps']:,} env steps; wall {result.wall_s:.1f} s "
        f"(compile ~{result.compile_s:.1f} s); logdir {logdir}"
    )

  runtime.run_main(run, verbose=_VERBOSE.value)


if __name__ == "__main__":
  app.run(main)
