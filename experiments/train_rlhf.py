r"""RLHF: SFT -> (reward model) -> RL with PPO, GRPO, RLOO or REINFORCE++.

    python experiments/train_rlhf.py                      # embedded default, 1-2.5 min on 2 CPUs
    python experiments/train_rlhf.py --algo=grpo
    python experiments/train_rlhf.py --preference_data=PATH/hh-rlhf-harmless-base-test.jsonl.gz
    python experiments/train_rlhf.py --preference_data=PATH --model=HF_FOLDER  # pretrained start
    python experiments/train_rlhf.py --preference_data=PATH --model=SFT_FOLDER --sft_steps=0 \
        --reward_model=RM_FOLDER        # the other scripts' hf_model folders (OpenRLHF-style)

With no flags: a tiny Llama-style LM is pre-trained briefly on code-generated additions
("a+b=c"), fine-tuned on "a+b=" -> "c", then trained with RL against a programmatic reward
(1 for the exact sum, partial credit for digits in place, minus 0.5 for a response without
EOS, so short runs can show negative means). It prints reward and KL over the RL
steps and greedy exact-match accuracy on held-out problems before and after RL.

With --preference_data: a BPE tokenizer trained on the data, pre-training on the dialogues,
SFT on the chosen responses, a Bradley-Terry reward model on a 90/10 split (held-out accuracy
with a 95% CI), then PPO against that reward model. With --model (a Hugging Face Llama/Qwen2
folder, as OpenRLHF's --pretrain) the tokenizer and the initial weights of the actor, the
reference and the reward model's and critic's trunks come from it; no pre-training. With
--reward_model (a trained reward model's Hugging Face folder, e.g. train_reward_model.py's
hf_model or TRL's RewardTrainer output; OpenRLHF's --reward_pretrain) no reward model is trained.

Everything lives in rljax.alignment.pipeline; this script parses flags. User errors exit with
status 2 and one line (--verbose for a traceback).

Checkpoints (rljax.alignment.checkpointing): every --checkpoint_every RL steps, and the stages
before RL every --stage_checkpoint_every of their steps, when they end and on a SIGTERM
(<logdir>/stages); running the same command with the same --logdir resumes exactly. Exit status: 0 done; 2 bad input; 3 halted on a
non-finite reward, loss or gradient (--nonfinite=halt; the last good state is checkpointed); 75
(EXIT_PREEMPTED) stopped by SIGTERM after writing a checkpoint (or, from the first line until the
trainer's handler is installed, with nothing new to save): run the same command again.
"""

from __future__ import annotations

from rljax import preemption

if __name__ == "__main__":  # first, before the imports (several seconds); the trainer's own
  preemption.exit_on_early_sigterm()  # handler replaces it while it runs

import dataclasses  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

from rljax import checkpoint as ckpt_lib  # noqa: E402
from rljax import cli, run_info, runtime  # noqa: E402
from rljax.alignment import flags as alignment_flags  # noqa: E402

_ALGOS = ("ppo", "grpo", "rloo", "reinforce_pp")
# --preference_data, --logdir, --num_steps, --pretrain_steps, --limit, --seed, --verbose, --mesh,
# --sharding_rules, process flags, --wandb, and the data flags (rljax.alignment.flags), as in
# train_sft.py and train_reward_model.py.
_F = alignment_flags.define_stage_flags(
    logdir_prefix="rlhf-<algo>",
    steps_help=f"RL steps ({alignment_flags.default_steps('rl.num_steps')}).",
    data_help="HH-RLHF or {prompt,chosen,rejected} JSONL(.gz); default: embedded task.",
    mesh_help="Device mesh D,F,T (data, fsdp, tensor sizes). colocated: over all devices "
    "(default: all on data); disaggregated: the training mesh, the other devices generate.",
    rules_help="Training sharding preset: fsdp, fsdp_tp, dp or tp (rljax.sharding.rules).")
_ALGO = flags.DEFINE_string("algo", "ppo", f"RL algorithm: one of {', '.join(_ALGOS)}.")
_KL = flags.DEFINE_float("kl_coef", None, "Initial KL coefficient beta.")
_KL_EST = flags.DEFINE_enum("kl_estimator", None, ["k1", "k2", "k3"], "Per-token KL estimator.")
_KL_IN = flags.DEFINE_enum("kl_placement", None, ["reward", "loss"], "KL in the reward or the loss.")
_KL_CONTROLLER = flags.DEFINE_enum(
    "kl_controller", None, ["fixed", "adaptive", "pi"], "What sets beta after each step: fixed, "
    "adaptive (Ziegler et al.) or pi (a proportional-integral controller that holds "
    "--kl_target). Default: pi when --kl_target is given, else the pipeline's (embedded: "
    "fixed; --preference_data: adaptive).")
_ADAPTIVE = flags.DEFINE_bool("adaptive_kl", None, "Old spelling of --kl_controller=adaptive "
                              "(--noadaptive_kl: --kl_controller=fixed).")
_KL_TARGET = flags.DEFINE_float(
    "kl_target", None, "Target KL in nats per response of the adaptive and pi controllers "
    "(given alone, it selects --kl_controller=pi).")
_KL_HORIZON = flags.DEFINE_integer("kl_horizon", None,
                                   "Adaptive controller's horizon (samples; Ziegler et al.: 10000).")
_ACTOR_LR = flags.DEFINE_float("actor_lr", None, "Actor (policy) Adam learning rate.")
_CRITIC_LR = flags.DEFINE_float("critic_lr", None, "Critic (value model) Adam learning rate (PPO).")
_CLIP_HIGH = flags.DEFINE_float("clip_eps_high", None, "DAPO clip-higher upper clip range.")
_MICROBATCHES = flags.DEFINE_integer(
    "num_microbatches", None, "Gradient accumulation: parts each PPO minibatch's gradient is "
    "computed over, one at a time (must divide the minibatch's sequences; default 1).")
_OVERLONG = flags.DEFINE_integer("overlong_buffer", None, "DAPO overlong buffer (tokens; 0 = off).")
_NONFINITE = flags.DEFINE_enum(
    "nonfinite", None, ["skip", "halt"], "A non-finite reward, loss or gradient: skip that "
    "update with a warning, or halt (exit 3) after checkpointing the last good state.")
_COMPUTE_DTYPE = flags.DEFINE_enum(
    "compute_dtype", None, ["float32", "bfloat16"], "Mixed precision: the dtype of every forward "
    "and backward matmul (bfloat16: as TRL's --bf16 autocast); weights and optimizer stay f32.")
# Role placement (rljax.alignment.pipeline.make_placement) beside --mesh and --sharding_rules.
_PLACEMENT = flags.DEFINE_string(
    "placement", "colocated", "colocated (all roles on one mesh; the actor is resharded from the "
    "training layout to tp for generation) or disaggregated (generation on separate devices).")
_OFFLOAD = flags.DEFINE_bool(
    "offload_frozen", False, "Keep the frozen roles (reference, reward model) in host memory "
    "(pinned_host) between uses, freeing device memory on GPU/TPU; on CPU it is the same RAM.")
# Checkpoints, resume and preemption (names as in train_control.py).
_DEVICE_MEMORY = ckpt_lib.define_device_memory_flag()
_CKPT_EVERY = flags.DEFINE_integer("checkpoint_every", 10, "RL steps between checkpoints.")
_KEEP = flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept (the newest).")
# Stage sizes (tests and quick runs use small ones).
_SFT_STEPS = alignment_flags.define_sft_steps_flag(
    f"SFT steps ({alignment_flags.default_steps('sft_steps')}; 0 skips SFT, e.g. for a "
    "--model that is already fine-tuned).")
_RM_STEPS = flags.DEFINE_integer(
    "rm_steps", None,
    f"--preference_data: reward-model steps ({alignment_flags.default_steps('rm_steps')}).")
_REWARD_MODEL = flags.DEFINE_string(
    "reward_model", None, "--preference_data with --model: a trained reward model's Hugging "
    "Face folder (train_reward_model.py's <logdir>/hf_model, or a one-label "
    "*ForSequenceClassification folder as TRL's RewardTrainer saves; OpenRLHF's "
    "--reward_pretrain) used instead of training one; it must share --model's tokenizer.")
_EVAL_PROMPTS = flags.DEFINE_integer(
    "num_eval_prompts", None, "Embedded: held-out problems for greedy accuracy (0 = none).")
_PPS = flags.DEFINE_integer("prompts_per_step", None, "Prompts per RL step.")
# Asynchronous RLHF (rljax.alignment.rollouts).
_STALENESS = flags.DEFINE_integer(
    "max_staleness", None, "Asynchronous RLHF: 0 (default) generates and trains in turn; s > 0 "
    "generates the next batches on a generator thread with weights at most s updates old while "
    "the update runs (1: one-step off-policy), corrected by the decoupled PPO objective.")
# A reward program and its prompts (rljax.alignment.reward_functions), on the embedded model.
_REWARD_FN = flags.DEFINE_string(
    "reward_fn", None, "package.module:function (or file.py:function) scoring the responses: "
    "fn(responses: list[str], **columns) -> list[float], given the --prompts file's other "
    "columns one list each (e.g. rewards.math_answers:exact_match). Embedded model only.")
_PROMPTS = flags.DEFINE_string(
    "prompts", None, "JSONL(.gz) prompt file for RL: a 'prompt' field per line plus any columns "
    "--reward_fn reads (e.g. 'answer'). Embedded model only: characters '0123456789+= '.")
_IS_CAP = flags.DEFINE_float(
    "behaviour_weight_cap", None, "Asynchronous RLHF: truncation of the importance weight "
    "pi_prox / pi_behav (>= 1; default 5).")


def rl_overrides() -> dict:
  """RLConfig fields set by flags (``--num_steps`` checked >= 1)."""
  out = {"seed": _F.seed.value}
  steps = _F.checked_num_steps()
  if steps is not None:
    out["num_steps"] = steps
  controller = kl_controller_override()
  if controller is not None:
    out["kl_controller"] = controller
  for key, flag in (("kl_coef", _KL), ("kl_estimator", _KL_EST),
                    ("kl_placement", _KL_IN), ("kl_target", _KL_TARGET),
                    ("overlong_buffer", _OVERLONG), ("kl_horizon", _KL_HORIZON),
                    ("actor_lr", _ACTOR_LR), ("critic_lr", _CRITIC_LR), ("nonfinite", _NONFINITE),
                    ("compute_dtype", _COMPUTE_DTYPE), ("max_staleness", _STALENESS),
                    ("behaviour_weight_cap", _IS_CAP)):
    if flag.value is not None:
      out[key] = flag.value
  return out


def kl_controller_override() -> str | None:
  """``--kl_controller`` (or its old spelling ``--[no]adaptive_kl``); ``pi`` where only
  ``--kl_target`` is given; None: the pipeline's default.

  Raises:
    ValueError: ``--kl_controller`` and ``--[no]adaptive_kl`` together.
  """
  if _ADAPTIVE.value is not None:
    old = "adaptive" if _ADAPTIVE.value else "fixed"
    if _KL_CONTROLLER.value is not None:
      raise ValueError(f"--{'' if _ADAPTIVE.value else 'no'}adaptive_kl is the old spelling of "
                       f"--kl_controller={old}; give only --kl_controller={_KL_CONTROLLER.value}")
    return old
  if _KL_CONTROLLER.value is not None:
    return _KL_CONTROLLER.value
  return "pi" if _KL_TARGET.value is not None else None


def check_algo(name: str) -> str:
  """``name`` if it is a known algorithm, else a ValueError suggesting close matches."""
  if name in _ALGOS:
    return name
  import difflib

  close = difflib.get_close_matches(name, _ALGOS, n=2, cutoff=0.5)
  hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
  raise ValueError(f"--algo {name!r} is not one of {', '.join(_ALGOS)}{hint}")


def check_checkpoint_flags() -> None:
  for flag in (_CKPT_EVERY, _KEEP):
    alignment_flags.checked(flag, at_least=1)
  _F.checkpoint_kwargs()  # --stage_checkpoint_every


def stage_overrides(preference_data: str | None) -> dict:
  """Stage sizes set by flags: ``EmbeddedConfig`` fields (``--sft_steps`` >= 0, 0 skipping SFT;
  ``--num_eval_prompts`` >= 0) or, with ``preference_data``, ``PreferenceConfig`` fields
  (``--sft_steps`` >= 0, ``--rm_steps`` >= 1, ``--reward_model``, which excludes
  ``--rm_steps`` and ``--rm_lr``).

  Raises:
    ValueError: a value out of range, or a flag the selected pipeline has no use for.
  """
  if preference_data is None:
    for flag in (_RM_STEPS, _REWARD_MODEL):
      if flag.value is not None:
        raise ValueError(f"--{flag.name} applies to --preference_data runs only (the embedded "
                         f"addition task's reward is exact match, with no reward model)")
    bounds = {"sft_steps": (_SFT_STEPS, 0), "num_eval_prompts": (_EVAL_PROMPTS, 0)}
  else:
    if _EVAL_PROMPTS.value is not None:
      raise ValueError("--num_eval_prompts applies to the embedded addition task only")
    if _REWARD_MODEL.value is not None:
      for name in ("rm_steps", "rm_lr"):
        if flags.FLAGS[name].value is not None:
          raise ValueError(f"--{name} trains a reward model; --reward_model "
                           f"{_REWARD_MODEL.value!r} loads a trained one instead")
    bounds = {"sft_steps": (_SFT_STEPS, 0), "rm_steps": (_RM_STEPS, 1)}
  out = {k: alignment_flags.checked(flag, at_least=low) for k, (flag, low) in bounds.items()}
  if preference_data is not None:
    out["reward_model"] = _REWARD_MODEL.value
  return {k: v for k, v in out.items() if v is not None}


def reward_program_overrides() -> dict:
  """``EmbeddedConfig`` fields of ``--reward_fn`` and ``--prompts`` (the file made absolute,
  so that a resumed run from another folder reads the same one)."""
  out = {}
  if _REWARD_FN.value is not None:
    out["reward_fn"] = _REWARD_FN.value
  if _PROMPTS.value is not None:
    if not os.path.isfile(_PROMPTS.value):
      raise FileNotFoundError(f"--prompts {_PROMPTS.value!r} does not exist")
    out["prompts"] = os.path.abspath(_PROMPTS.value)
  return out


def with_ppo_flags(rl):
  """``rl`` with ``--clip_eps_high`` and ``--num_microbatches`` applied to its ``PPOConfig``."""
  changes = {}
  if _CLIP_HIGH.value is not None:
    changes["clip_eps_high"] = _CLIP_HIGH.value
  if _MICROBATCHES.value is not None:
    changes["num_microbatches"] = _MICROBATCHES.value
  if not changes:
    return rl
  return dataclasses.replace(rl, ppo=dataclasses.replace(rl.ppo, **changes))


def serve_generator(link) -> int:
  """Process 1 of a two-process disaggregated run: samples for the trainer until it is done
  (status 0); a trainer that stops or fails ends it with one line and status 1."""
  from rljax.alignment import remote_generation
  from rljax.sharding.link import LinkError

  try:
    remote_generation.serve(link)
  except LinkError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  finally:
    link.close()
  return 0


def main(argv):
  del argv
  runtime.configure_logging(_F.verbose.value)

  def run():
    # Processes joined (a no-op for one process outside SLURM), --mesh and --placement checked,
    # before anything compiles. Disaggregated over 2 processes: process 1 only generates.
    pair = (_F.start_disaggregated(offload_frozen=_OFFLOAD.value)
            if _PLACEMENT.value == "disaggregated" else None)
    if pair is not None:
      link, placement = pair
      if placement is None:
        return serve_generator(link)
      try:
        return train(placement)
      finally:
        placement.remote_generator.close()
        link.close()
    return train(_F.start(_PLACEMENT.value, offload_frozen=_OFFLOAD.value))

  def train(placement):
    from rljax.alignment import pipeline
    from rljax.checkpoint import check_writable

    check_algo(_ALGO.value)
    if _CRITIC_LR.value is not None and _ALGO.value != "ppo":
      raise ValueError(f"--critic_lr applies to --algo=ppo only ({_ALGO.value} has no critic)")
    check_checkpoint_flags()
    logdir = _F.resolved_logdir(time.strftime("%Y%m%d-%H%M%S"), prefix=f"rlhf-{_ALGO.value}")
    overrides = rl_overrides()
    if _PPS.value is not None:
      overrides["prompts_per_step"] = alignment_flags.checked(_PPS, at_least=1)
    data = _F.preference_data.value
    _F.check_data(data)
    if data is None:
      rl = pipeline.default_rl_config(_ALGO.value, **overrides)
      rl = with_ppo_flags(rl)
      config = _F.with_pretrain_steps(
          pipeline.EmbeddedConfig(rl=rl, seed=_F.seed.value, **stage_overrides(data),
                                  **reward_program_overrides()))
      pipeline.check_rl_task(config)  # the prompt file and the function, before compiling
    else:
      for flag in (_REWARD_FN, _PROMPTS):
        if flag.value is not None:
          raise ValueError(f"--{flag.name} applies to the embedded model only (without "
                           f"--preference_data, whose RL stage is scored by its reward model)")
      if not os.path.exists(data):
        raise FileNotFoundError(f"--preference_data {data!r} does not exist")
      base = _F.data.base_config()  # with --model: its pretrained learning rates
      group = 4 if _ALGO.value in ("grpo", "rloo") else 1
      overrides.setdefault("prompts_per_step", base.rl.prompts_per_step // group)
      rl = dataclasses.replace(base.rl, algo=_ALGO.value, group_size=group, **overrides)
      rl = with_ppo_flags(rl)
      config = _F.preference_config(rl=rl, **stage_overrides(data))
      pipeline.check_inputs(config, data)  # before the logdir exists
    pipeline.check_placement(placement, rl=config.rl,
                             batch_sizes={"batch_size": config.batch_size})  # before compiling
    check_writable(logdir)
    # A refused resume (another config, or --noresume on a run) leaves run_info.json as it was.
    ckpt_lib.check_logdir(logdir, pipeline.saved_run(config, data), resume=_F.resume.value,
                          flag_names={"rl.num_steps": "--num_steps"})
    if _F.resume.value:  # a mesh that cannot hold the saved state fails here, before building
      import jax

      from rljax.alignment import checkpointing as ckpting

      ckpt_lib.check_fits(
          logdir, num_devices=1 if placement is None else jax.device_count(),
          device_bytes=ckpt_lib.device_bytes_from_flag(_DEVICE_MEMORY.value),
          extra_items=(os.path.join(ckpting.frozen_dir(logdir), "roles"),))
    run_info.start_run(logdir, config, use_wandb=_F.wandb.value)
    _F.compilation_cache.apply()
    from rljax.alignment import checkpointing
    from rljax.nonfinite import NonFiniteHalt

    ckpt_kw = dict(checkpoint_every=_CKPT_EVERY.value, keep_checkpoints=_KEEP.value,
                   placement=placement, **_F.checkpoint_kwargs())

    def go(sigterm):
      try:
        return report(pipeline, config, logdir, sigterm=sigterm, **ckpt_kw)
      except NonFiniteHalt as e:  # exit status 3, as train_control.py
        print(f"error: {e}", file=sys.stderr)
        return 3

    return checkpointing.run_preemptible(go)  # 75 after a SIGTERM, the state saved

  runtime.run_main(run, verbose=_F.verbose.value)


def _steps(n: int) -> str:
  return f"{n} step" if n == 1 else f"{n} steps"


def _accuracy(before: float, after: float) -> str:
  if math.isnan(before):  # no held-out prompts
    return "greedy accuracy not measured (--num_eval_prompts=0)"
  return f"greedy accuracy {before:.3f} -> {after:.3f}"


def _wall(s, config) -> str:
  """The summary line's wall time, marked as saved when a finished run was re-run."""
  if s.get("from_summary_json"):
    return f"wall {s['wall_s']:.0f} s (the finished run's, from summary.json)"
  return f"wall {s['wall_s']:.0f} s"


def report(pipeline, config, logdir, **kw) -> None:
  """Runs the selected pipeline and prints its one-line summary."""
  data = _F.preference_data.value
  if data is None:
    s = pipeline.run_embedded(config, logdir=logdir, log=runtime.primary_print, **kw)
    runtime.primary_print(
        f"embedded {_ALGO.value}: mean reward {s['reward_first']:.3f} (first "
        f"{_steps(s['summary_steps'])}) -> {s['reward_last']:.3f} (last {s['summary_steps']}); "
        f"KL last {pipeline.nats(s['kl_last'])}, max {pipeline.nats(s['kl_max'])}; "
        f"{_accuracy(s['accuracy_before'], s['accuracy_after'])}; "
        f"{_wall(s, config)}; logdir {logdir}")
  else:
    s = pipeline.run_preference(data, config, logdir=logdir, log=runtime.primary_print,
                                **kw)
    lo, hi = s["rm_ci"]
    runtime.primary_print(
        f"{data}: reward model held-out accuracy {s['rm_accuracy']:.3f} "
        f"(95% CI {lo:.3f}-{hi:.3f}, n={s['rm_heldout']}); {_ALGO.value} reward "
        f"{s['reward_first']:.3f} (first {_steps(s['summary_steps'])}) -> "
        f"{s['reward_last']:.3f} (last {s['summary_steps']}; reward-model score/mean "
        f"{s.get('score_first', float('nan')):.3f} -> {s.get('score_last', float('nan')):.3f}), "
        f"KL last {pipeline.nats(s['kl_last'])} max {pipeline.nats(s['kl_max'])}; "
        f"{_wall(s, config)}; logdir {logdir}")


if __name__ == "__main__":
  cli.run(main, alignment_flags.DEPRECATED_ALIASES)
