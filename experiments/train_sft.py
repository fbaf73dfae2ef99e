r"""Supervised fine-tuning (loss on response tokens only).

    python experiments/train_sft.py                        # embedded addition task
    python experiments/train_sft.py --preference_data=PATH # SFT on the chosen responses
    python experiments/train_sft.py --preference_data=PATH --model=HF_FOLDER  # from a pretrained HF model

Library code: rljax.alignment.sft and rljax.alignment.pipeline. User errors exit 2.

Pre-training and SFT save their state under <logdir>/stages every --stage_checkpoint_every steps,
at their end and on a SIGTERM (exit status 75); running the same command with the same --logdir
continues the run exactly (a finished one trains nothing and writes its hf_model again).
"""

from __future__ import annotations

from rljax import preemption

if __name__ == "__main__":  # first, before the imports (several seconds); the trainer's own
  preemption.exit_on_early_sigterm()  # handler replaces it while it runs

import dataclasses  # noqa: E402
import time  # noqa: E402

from absl import app  # noqa: E402

from rljax import checkpoint as ckpt_lib  # noqa: E402
from rljax import cli, run_info, runtime  # noqa: E402
from rljax.alignment import flags as alignment_flags  # noqa: E402

# --preference_data, --logdir, --num_steps, --pretrain_steps, --limit, --seed, --verbose, --mesh,
# --sharding_rules, process flags, --wandb, and the data flags but --rm_lr (rljax.alignment.flags).
_F = alignment_flags.define_stage_flags(
    logdir_prefix="sft", steps_help=f"SFT steps ({alignment_flags.default_steps('sft_steps')}).",
    data_help="HH-RLHF or {prompt,chosen,rejected} JSONL(.gz); default: embedded task.",
    reward_model=False)  # no --rm_lr: SFT trains no reward model


def main(argv):
  del argv
  runtime.configure_logging(_F.verbose.value)

  def run():
    from rljax.alignment import pipeline
    from rljax.checkpoint import check_writable

    placement = _F.start()  # processes joined, --mesh checked, before anything compiles
    logdir = _F.resolved_logdir(time.strftime("%Y%m%d-%H%M%S"))
    steps = _F.checked_num_steps()
    data = _F.preference_data.value
    _F.check_data(data)
    if data is None:
      cfg = _F.with_pretrain_steps(pipeline.EmbeddedConfig(seed=_F.seed.value))
      if steps is not None:
        cfg = dataclasses.replace(cfg, sft_steps=steps)
    else:
      cfg = _F.preference_config(sft_steps=steps)
      pipeline.check_inputs(cfg, data)  # before the logdir exists
    kw = _F.checkpoint_kwargs()
    check_writable(logdir)
    # A refused resume (another config, or --noresume on a run) leaves the folder as it was.
    ckpt_lib.check_logdir(logdir, pipeline.saved_run(cfg, data, stop_after="sft"),
                          resume=kw["resume"], flag_names={"sft_steps": "--num_steps"})
    run_info.start_run(logdir, cfg, use_wandb=_F.wandb.value)
    _F.compilation_cache.apply()
    from rljax.alignment import checkpointing

    def go(sigterm):
      if data is None:
        s = pipeline.run_embedded(cfg, logdir=logdir, stop_after="sft", placement=placement,
                                  log=runtime.primary_print, sigterm=sigterm, **kw)
        runtime.primary_print(
            f"embedded SFT: greedy exact-match accuracy {s['accuracy_before']:.3f}; "
            f"wall {s['wall_s']:.0f} s; logdir {logdir}")
      else:
        s = pipeline.run_preference(data, cfg, logdir=logdir, stop_after="sft",
                                    placement=placement, log=runtime.primary_print,
                                    sigterm=sigterm, **kw)
        runtime.primary_print(
            f"SFT on {s['num_train_pairs']} chosen responses (of {s['num_pairs']} pairs; the "
            f"rest held out): response loss {s['sft_loss']:.3f}; wall {s['wall_s']:.0f} s; "
            f"logdir {logdir}")

    return checkpointing.run_preemptible(go)  # 75 after a SIGTERM, the stage's state saved

  runtime.run_main(run, verbose=_F.verbose.value)


if __name__ == "__main__":
  cli.run(main, alignment_flags.DEPRECATED_ALIASES)
