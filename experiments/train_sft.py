r"""Supervised fine-tuning (loss on response tokens only).

    python experiments/train_sft.py                        # embedded addition task
    python experiments/train_sft.py --preference_data=PATH # SFT on the chosen responses
    python experiments/train_sft.py --preference_data=PATH --model=HF_FOLDER  # from a pretrained HF model

Library code: rljax.alignment.sft and rljax.alignment.pipeline. User errors exit 2.
"""

from __future__ import annotations

import dataclasses
import time

from absl import app

from rljax import run_info, runtime
from rljax.alignment import flags as alignment_flags

# --preference_data, --logdir, --num_steps, --pretrain_steps, --limit, --seed, --verbose, --mesh,
# --sharding_rules, process flags, --wandb, and the data flags but --rm_lr (rljax.alignment.flags).
_F = alignment_flags.define_stage_flags(
    logdir_prefix="sft", steps_help="SFT steps.",
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
    pipeline.check_stage_logdir(logdir, "train_sft.py")
    check_writable(logdir)
    runtime.enable_compilation_cache()
    if data is None:
      run_info.start_run(logdir, cfg, use_wandb=_F.wandb.value)
      s = pipeline.run_embedded(cfg, logdir=logdir, stop_after="sft", placement=placement,
                                log=runtime.primary_print)
      runtime.primary_print(
          f"embedded SFT: greedy exact-match accuracy {s['accuracy_before']:.3f}; "
          f"wall {s['wall_s']:.0f} s; logdir {logdir}")
    else:
      run_info.start_run(logdir, cfg, use_wandb=_F.wandb.value)
      s = pipeline.run_preference(data, cfg, logdir=logdir, stop_after="sft",
                                  placement=placement, log=runtime.primary_print)
      runtime.primary_print(
          f"SFT on {s['num_train_pairs']} chosen responses (of {s['num_pairs']} pairs; the rest "
          f"held out): response loss {s['sft_loss']:.3f}; wall {s['wall_s']:.0f} s; "
          f"logdir {logdir}")

  runtime.run_main(run, verbose=_F.verbose.value)


if __name__ == "__main__":
  app.run(main)
