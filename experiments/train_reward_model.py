r"""Bradley-Terry reward model on preference pairs; reports held-out accuracy with a 95% CI.

    python experiments/train_reward_model.py --preference_data=PATH/hh-rlhf-harmless-base-test.jsonl.gz
    python experiments/train_reward_model.py --preference_data=PATH --model=HF_FOLDER

Tokenizer trained on the data, pre-training and SFT on the chosen side, then the reward model
(from the SFT model) on a 90/10 split. With --model (a Hugging Face Llama/Qwen2 folder) the
tokenizer and the initial weights come from that model and pre-training is skipped. Library code: rljax.alignment.reward_model and
rljax.alignment.pipeline. User errors exit 2.

Pre-training, SFT and the reward model save their state under <logdir>/stages every
--stage_checkpoint_every steps, at their end and on a SIGTERM (exit status 75); running the same
command with the same --logdir continues the run exactly (a finished one trains nothing and writes
its hf_model again).
"""

from __future__ import annotations

from rljax import preemption

if __name__ == "__main__":  # first, before the imports (several seconds); the trainer's own
  preemption.exit_on_early_sigterm()  # handler replaces it while it runs

import os  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

from rljax import checkpoint as ckpt_lib  # noqa: E402
from rljax import cli, run_info, runtime  # noqa: E402
from rljax.alignment import flags as alignment_flags  # noqa: E402

# --preference_data, --logdir, --num_steps, --pretrain_steps, --limit, --seed, --verbose, --mesh,
# --sharding_rules, process flags, --wandb, and the data flags (rljax.alignment.flags).
_F = alignment_flags.define_stage_flags(
    logdir_prefix="rm", embedded=False,  # --preference_data is required
    steps_help=f"Reward-model steps ({alignment_flags.default_steps('rm_steps')}).",
    data_help="HH-RLHF or {prompt,chosen,rejected} JSONL(.gz). Required.")
_MARGIN = flags.DEFINE_float("margin", None, "Bradley-Terry margin.")
_SFT_STEPS = alignment_flags.define_sft_steps_flag(
    "SFT steps before the reward model, which starts from the SFT model "
    f"({alignment_flags.default_steps('sft_steps', embedded=False)}; 0 starts it from "
    "--model or the pre-trained model).")


def main(argv):
  del argv
  runtime.configure_logging(_F.verbose.value)

  def run():
    from rljax.alignment import pipeline
    from rljax.checkpoint import check_writable

    placement = _F.start()  # processes joined, --mesh checked, before anything compiles
    data = _F.preference_data.value
    if data is None:
      raise ValueError("--preference_data=PATH is required (HH-RLHF or prompt/chosen/rejected "
                       "JSONL, .jsonl or .jsonl.gz)")
    if not os.path.exists(data):
      raise FileNotFoundError(f"--preference_data {data!r} does not exist")
    logdir = _F.resolved_logdir(time.strftime("%Y%m%d-%H%M%S"))
    steps = _F.checked_num_steps()
    cfg = _F.preference_config(rm_steps=steps,
                               sft_steps=alignment_flags.checked(_SFT_STEPS, at_least=0),
                               rm_margin=alignment_flags.checked(_MARGIN, at_least=0))
    pipeline.check_inputs(cfg, data)  # before the logdir exists
    kw = _F.checkpoint_kwargs()
    check_writable(logdir)
    # A refused resume (another config, or --noresume on a run) leaves the folder as it was.
    ckpt_lib.check_logdir(logdir, pipeline.saved_run(cfg, data, stop_after="rm"),
                          resume=kw["resume"], flag_names={"rm_steps": "--num_steps", "rm_margin": "--margin"})
    run_info.start_run(logdir, cfg, use_wandb=_F.wandb.value)
    _F.compilation_cache.apply()
    from rljax.alignment import checkpointing

    def go(sigterm):
      s = pipeline.run_preference(data, cfg, logdir=logdir, stop_after="rm",
                                  placement=placement, log=runtime.primary_print,
                                  sigterm=sigterm, **kw)
      lo, hi = s["rm_ci"]
      runtime.primary_print(
          f"reward model: held-out accuracy {s['rm_accuracy']:.3f} (95% CI {lo:.3f}-{hi:.3f}, "
          f"n={s['rm_heldout']} of {s['num_pairs']} pairs); wall {s['wall_s']:.0f} s; "
          f"logdir {logdir}")

    return checkpointing.run_preemptible(go)  # 75 after a SIGTERM, the stage's state saved

  runtime.run_main(run, verbose=_F.verbose.value)


if __name__ == "__main__":
  cli.run(main, alignment_flags.DEPRECATED_ALIASES)
