r"""Train a policy on an MJX environment with PPO (default) or analytic policy gradients.

    python experiments/train_control.py                       # CartpoleBalance, bundled defaults
    python experiments/train_control.py --env=brax/ant --num_timesteps=5000000 --logdir=runs/ant
    python experiments/train_control.py --algo=apg --env=playground/CartpoleSwingup
    python experiments/train_control.py --eval_video=mp4,gif --wandb   # videos; W&B offline

Every ``ControlConfig`` field but ``env_kwargs`` is a flag; unset flags take the environment's bundled
default (``rljax.control.config.default_config``; ``--show_config`` prints the result and exits). With ``--algo=apg`` the flags are
``APGConfig``'s fields (``rljax.control.apg``; defaults ``apg.default_apg_config``), and
PPO-only flags are errors. Bad values fail before anything compiles, with exit status 2
and a one-line message (``--verbose`` for a traceback).

Every run writes ``<logdir>/run_info.json`` (config, package versions, command line).

Exit status: 0 done; 2 bad input; 3 halted on a non-finite value (``--nonfinite=halt``);
75 (``EXIT_PREEMPTED``) stopped by SIGTERM after writing a checkpoint: run the same
command again (SLURM's ``--requeue`` does) and it resumes from that checkpoint.
"""

from __future__ import annotations

from rljax import preemption

if __name__ == "__main__":  # first, before the imports (several seconds); the trainers
  preemption.exit_on_early_sigterm()  # replace it while they run

import dataclasses  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

from rljax import checkpoint as ckpt_lib  # noqa: E402
from rljax import cli  # noqa: E402
from rljax import run_info, runtime  # noqa: E402
from rljax.sharding import distributed  # noqa: E402

ALGOS = ("ppo", "apg")
_ALGO = flags.DEFINE_string("algo", "ppo", f"Training algorithm: {', '.join(ALGOS)}.")
_EVAL_VIDEO = flags.DEFINE_list(
    "eval_video", [], "Video formats (mp4, gif) written at each evaluation to "
    "<logdir>/videos/eval_<env_steps>.<format> (PPO only); empty = no videos.")
_VIDEO_SIZE = cli.define_video_size_flag()
_WANDB = run_info.define_wandb_flag()
_ENV = flags.DEFINE_string("env", "playground/CartpoleBalance", "Environment name (rljax.envs.list_envs()).")
_LOGDIR = flags.DEFINE_string("logdir", None, "Output directory (default runs/<env>-<time>).")
_MENAGERIE = flags.DEFINE_string(
    "menagerie_path", None, "Local MuJoCo Menagerie checkout, for Playground's locomotion and "
    "manipulation environments (default $MUJOCO_MENAGERIE_PATH; this flag sets it).")
_CACHE = cli.define_compilation_cache_flags()
_VERBOSE = flags.DEFINE_bool("verbose", False, "Print tracebacks for user errors.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
_MESH = flags.DEFINE_string(
    "mesh", None, "Device mesh D,F,T (data, fsdp, tensor sizes); default: all devices on data."
)
_RULES = flags.DEFINE_string(
    "sharding_rules", "dp", "Sharding preset (dp, fsdp, fsdp_tp, tp). The control MLP is small and "
    "always replicated; environments and batches are split over the data and fsdp axes."
)
distributed.define_flags()
_DEVICE_MEMORY = ckpt_lib.define_device_memory_flag()
_RESUME = flags.DEFINE_bool(
    "resume", True, "Continue from the newest checkpoint in --logdir when there is one."
)
_SHOW_CONFIG = flags.DEFINE_bool(
    "show_config", False, "Print the run's config (the environment's bundled defaults with "
    "these flags applied) as JSON and exit, before anything is written or compiled. Values are "
    "as given (batch_size and episode_length 0 mean num_envs and the environment's default); "
    "a line on stderr says how many env steps num_timesteps rounds up to.")

# One flag per ControlConfig field (except env), defaulting to "use the env's default",
# and one per APG-only APGConfig field.
_FIELD_FLAGS = {}
_APG_FLAGS = {}
_HELP = {
    "num_timesteps": "Environment steps to train for, rounded up so that each of the "
                     "num_evals - 1 training chunks runs the same whole number of iterations.",
    "num_envs": "Parallel environments.",
    "seed": "PRNG seed.",
    "batch_size": "Trajectory segments per iteration (multiple of num_envs; 0 = num_envs).",
    "unroll_length": "Steps per trajectory segment (T).",
    "num_minibatches": "Minibatches per epoch.",
    "num_epochs": "Passes over each batch (Brax's num_updates_per_batch).",
    "num_microbatches": "Gradient accumulation: parts each minibatch's gradient is computed "
                        "over, one at a time (default 1; must divide a minibatch's segments; "
                        "same update up to rounding).",
    "learning_rate": "Adam learning rate.",
    "lr_schedule": "Learning-rate schedule: constant, linear (to 0 at the end) or cosine; with "
                   "--algo=apg constant or exponential (with --lr_decay).",
    "max_grad_norm": "Global gradient-norm clip (default none, as in Brax).",
    "vf_coef": "Value loss weight.",
    "reward_scaling": "Rewards are multiplied by this for training.",
    "normalize_observations": "Keep running observation statistics and normalise with them.",
    "normalize_advantages": "Whiten advantages per minibatch.",
    "policy_hidden": "Policy network hidden layer sizes, e.g. 32,32,32,32.",
    "value_hidden": "Value network hidden layer sizes, e.g. 256,256,256,256,256.",
    "activation": "Hidden-layer activation: swish, relu, tanh or elu.",
    "episode_length": "Steps per episode (time limit; 0 = the environment's default).",
    "action_repeat": "Physics steps per action.",
    "num_evals": "Evaluations over the run, the first at step 0 (num_evals - 1 training "
                 "chunks, a checkpoint after each; 1 acts as 2, as in Brax).",
    "num_eval_envs": "Environments per evaluation, one full episode each.",
    "deterministic_eval": "Evaluate the mean action tanh(loc) instead of sampling.",
    "keep_checkpoints": "Checkpoints kept (the newest).",
    "nonfinite": "A non-finite reward, observation, loss or gradient: skip (skip that update, "
                 "warn) or halt (also stop after checkpointing the last finite state).",
    "entropy_coef": "Entropy bonus weight.",
    "gamma": "Discount factor.",
    "gae_lambda": "GAE lambda.",
    "clip_eps": "PPO clip range.",
    "clip_eps_high": "Upper clip range (DAPO's clip-higher; default clip_eps).",
    "value_clip_eps": "Clip the value prediction to its old value +- this (PPO2; default off).",
    "init_std": "Policy's pre-tanh std where its scale output is 0; an offset of the std for the "
                "whole run (default 1.0; Brax's networks, brax/ant and CheetahRun: 0.694).",
    "policy_init_scale": "Variance scale of the policy's output layer (default 0.01: every state "
                         "starts at loc 0, std init_std; Brax's networks, brax/ant and "
                         "CheetahRun: 1).",
    "obs_stats_before_update": "Fold each rollout's observations into the normaliser before "
                               "that iteration's update, as Brax does (default false: after).",
    "overlap_value_update": "Update the value network on a second thread beside the next "
                            "rollout (same PPO up to rounding; one process, one device, one "
                            "environment thread, no max_grad_norm).",
    "env_threads": "Threads the rollout steps the environments on, each its share in its own "
                   "program (same PPO up to rounding; must divide num_envs; 0 = as many as "
                   "usable cores on CPU with one device, at most one per 32 environments; "
                   "1 = one program).",
    "gae_per_minibatch": "Compute GAE inside each minibatch's loss with the current value "
                         "network, as Brax does (saves a value pass per iteration; default "
                         "false; not with overlap_value_update or num_microbatches > 1).",
    "horizon_length": "APG: steps per policy update (the differentiated rollout).",
    "truncation_length": "APG: gradients flow back at most this many steps (0 = horizon_length).",
    "num_updates": "APG: policy updates in the run.",
    "lr_decay": "APG: the exponential --lr_schedule's per-update factor (given alone, it "
                "implies --lr_schedule=exponential).",
    "solver_iterations": "APG: MJX opt.iterations for training (1 makes MJX differentiable).",
    "ls_iterations": "APG: MJX opt.ls_iterations for training.",
}


def _define_flag(f, help_text):
  kind = f.type if isinstance(f.type, str) else f.type.__name__
  kind = kind.removesuffix(" | None")
  if kind == "int":
    return flags.DEFINE_integer(f.name, None, help_text)
  if kind == "float":
    return flags.DEFINE_float(f.name, None, help_text)
  if kind == "bool":
    return flags.DEFINE_bool(f.name, None, help_text)
  if kind == "str":
    return flags.DEFINE_string(f.name, None, help_text)
  return flags.DEFINE_list(f.name, None, help_text + " Comma-separated ints.")  # tuple[int, ...]


def _define_field_flags():
  from rljax.control import apg
  from rljax.control.config import ControlConfig
  from rljax.ppo import PPOConfig

  for f in dataclasses.fields(ControlConfig):
    if f.name in ("env", "env_kwargs", "ppo"):
      continue
    _FIELD_FLAGS[f.name] = _define_flag(f, _HELP.get(f.name, f"ControlConfig.{f.name}."))
  for f in dataclasses.fields(PPOConfig):  # the nested ControlConfig.ppo, by field name
    if f.name == "loss_aggregation":  # control's loss is a token mean (one per env step)
      continue
    _FIELD_FLAGS[f.name] = _define_flag(f, _HELP.get(f.name, f"PPOConfig.{f.name}."))
  apg_only = apg.apg_only_fields()
  for f in dataclasses.fields(apg.APGConfig):
    if f.name in apg_only:
      _APG_FLAGS[f.name] = _define_flag(f, _HELP.get(f.name, f"APG: APGConfig.{f.name}."))


_define_field_flags()


def check_algo(algo: str) -> str:
  """Returns ``algo`` if it is one of `ALGOS`; else raises ValueError listing them."""
  if algo not in ALGOS:
    raise ValueError(f"--algo must be one of {', '.join(ALGOS)}; got {algo!r}.")
  return algo


def build_config():
  """``ControlConfig`` (``--algo=ppo``) or ``APGConfig`` (``--algo=apg``) from the flags.

  The environment's name is not checked here (`main` checks it after the other flags).
  """
  from rljax.control.config import ConfigError, default_config

  algo = check_algo(_ALGO.value)
  overrides = {}
  for name, flag in {**_FIELD_FLAGS, **_APG_FLAGS}.items():
    if flag.value is None:
      continue
    value = flag.value
    if isinstance(value, list):
      try:
        value = tuple(int(v) for v in value)
      except ValueError:
        raise ConfigError(f"--{name} must be comma-separated integers, got {','.join(value)!r}.")
    overrides[name] = value
  if algo == "apg":
    from rljax.control import apg

    return apg.build_apg_config(_ENV.value, overrides)
  apg_only = sorted(k for k in overrides if k in _APG_FLAGS)
  if apg_only:
    raise ConfigError(
        f"{', '.join('--' + k for k in apg_only)}: APG settings, valid only with --algo=apg.")
  try:
    return default_config(_ENV.value).replace(**overrides)
  except ConfigError as e:
    raise ConfigError(with_defaults_named(e, overrides, _ENV.value)) from None


def with_defaults_named(error, overrides, env: str) -> str:
  """``error``'s message plus the values of its ``fields`` (`ConfigError.fields`) that the command
  line did not set, e.g. ``... Not set by a flag: num_envs=256 (playground/CartpoleBalance's
  default).``"""
  from rljax.control.config import default_config

  defaults = default_config(env).flat()
  unset = [f"{n}={defaults[n]!r}" for n in error.fields if n not in overrides]
  if not unset:
    return str(error)
  return (f"{error} Not set by a flag: {', '.join(unset)} ({env}'s "
          f"default{'s' if len(unset) > 1 else ''}).")


def schedule_line(config) -> str:
  """One line: the chunks, iterations and environment steps a PPO ``config`` trains."""
  chunks, iterations = config.chunk_schedule
  per_iteration = config.env_steps_per_iteration
  repeat = f" x action_repeat {config.action_repeat}" if config.action_repeat > 1 else ""
  return (f"schedule: {chunks} chunks x {iterations} iterations x {per_iteration:,} env steps "
          f"({config.segments_per_iteration} segments of {config.unroll_length} steps{repeat}) = "
          f"{chunks * iterations * per_iteration:,} env steps (num_timesteps="
          f"{config.num_timesteps:,} rounded up to whole chunks), {config.num_evals} evaluations")


def video_options():
  """``(formats, height, width)`` from ``--eval_video`` and ``--video_size``, or ``None``
  without ``--eval_video``. Checked before the environment is looked up (no Playground import).

  Raises:
    ValueError: an unknown format, a bad ``--video_size``, or ``--algo=apg``.
  """
  formats = tuple(f.strip().lower() for f in _EVAL_VIDEO.value if f.strip())
  if not formats:
    return None
  if _ALGO.value != "ppo":
    raise ValueError(f"--eval_video works with --algo=ppo only, got --algo={_ALGO.value}.")
  height, width = cli.video_size(_VIDEO_SIZE)
  from rljax.control import render

  return render.check_video_options(formats, height, width), height, width


def build_eval_video(config, logdir: str, options):
  """The trainer's ``on_eval`` callback for `video_options`'s ``options``, or ``None``."""
  if options is None:
    return None
  from rljax.control import eval_video

  formats, height, width = options
  return eval_video.eval_video_callback(config, logdir, formats=formats, height=height,
                                        width=width)


def build_mesh(config):
  """The ``--mesh`` device mesh, or ``None`` on one device. Checks divisibility first, and that
  ``--env_threads`` fits it."""
  import jax

  from rljax.control.config import resolve_env_threads
  from rljax.sharding import mesh as mesh_lib
  from rljax.sharding import rules

  rules.as_preset(_RULES.value)
  if _MESH.value is None and jax.device_count() == 1:
    return None
  mesh = mesh_lib.make_mesh(mesh_lib.parse_mesh_flag(_MESH.value))
  mesh_lib.check_batch_divisible(config.num_envs, mesh, what="num_envs")
  resolve_env_threads(config, mesh)  # env_threads > 1 needs one device
  return mesh


def main(argv):
  del argv

  runtime.configure_logging(_VERBOSE.value)

  def run():
    distributed.initialize_from_flags()  # no-op for one process outside SLURM
    config = build_config()  # validates before anything compiles
    if _SHOW_CONFIG.value:
      from rljax import envs

      envs.check_name(config.env)  # a misspelled --env is an error here too
      print(config.to_json())
      if _ALGO.value == "ppo":  # how num_timesteps is run, on stderr: stdout stays JSON
        print(schedule_line(config), file=sys.stderr)
      return 0
    if config.num_evals == 1:
      runtime.primary_print("note: num_evals=1 acts as 2, as Brax's does: one evaluation before "
                            "training and one after it")
    if _ALGO.value == "apg" and _MESH.value is not None:
      raise ValueError("--mesh is not supported with --algo=apg (APG runs on one device).")
    mesh = build_mesh(config) if _ALGO.value == "ppo" else None
    video = video_options()
    # The name after the other flags: listing the environments imports MuJoCo Playground
    # (about 5 s of a bad-flag exit's 8-10 s), so their mistakes are reported without it.
    from rljax import envs

    if _MENAGERIE.value:  # read by rljax.envs.make wherever the run builds the environment
      os.environ[envs.MENAGERIE_ENV_VAR] = _MENAGERIE.value
    envs.check_assets(config.env)  # the name, then Menagerie's assets where it needs them
    logdir = _LOGDIR.value or os.path.join(
        "runs", f"{config.env.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    on_eval = build_eval_video(config, logdir, video)
    from rljax.checkpoint import check_writable

    check_writable(logdir)
    # A refused resume (another config, or --noresume on a run) leaves run_info.json as it was.
    from rljax.control import trainer

    if _ALGO.value == "apg":
      from rljax.control import apg

      saved_run = apg.saved_run(config)
    else:
      from rljax.control import checkpointing

      saved_run = checkpointing.saved_run(config)
    ckpt_lib.check_logdir(logdir, saved_run, resume=_RESUME.value)
    if _RESUME.value:  # a mesh that cannot hold the saved state fails here, before building
      ckpt_lib.check_fits(logdir, num_devices=mesh.size if mesh is not None else 1,
                          device_bytes=ckpt_lib.device_bytes_from_flag(_DEVICE_MEMORY.value))
    run_info.start_run(logdir, config, use_wandb=_WANDB.value, extra={"algo": _ALGO.value})
    _CACHE.apply()
    try:
      if _ALGO.value == "apg":
        from rljax.control import apg

        result = apg.train_apg(config, logdir, progress=_PROGRESS.value, resume=_RESUME.value,
                               log=runtime.primary_print)
      else:
        result = trainer.train(
            config, logdir, progress=_PROGRESS.value, resume=_RESUME.value, mesh=mesh,
            on_eval=on_eval, log=runtime.primary_print,
        )
    except trainer.Preempted as e:
      print(f"{e}; exiting with status {trainer.EXIT_PREEMPTED}", file=sys.stderr)
      return trainer.EXIT_PREEMPTED
    except trainer.NonFiniteHalt as e:
      print(f"error: {e}", file=sys.stderr)
      return 3
    if not result.history:  # a finished run whose metrics.jsonl is gone
      runtime.primary_print(f"{config.env}: no evaluation records in {logdir}/metrics.jsonl")
      return 0
    final = result.history[-1]
    runtime.primary_print(  # once, from process 0 of a multi-process run
        f"{config.env}: final eval episode reward {final['eval/episode_reward']:.1f} "
        f"after {final['env_steps']:,} env steps; wall {result.wall_s:.1f} s "
        f"(start-up ~{result.compile_s:.1f} s); logdir {logdir}"
    )

  runtime.run_main(run, verbose=_VERBOSE.value)


if __name__ == "__main__":
  app.run(main)
