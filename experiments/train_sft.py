r"""Supervised fine-tuning (loss on response tokens only).

    python experiments/train_sft.py                        # embedded addition task
    python experiments/train_sft.py --preference_data=PATH # SFT on the chosen responses
    python experiments/train_sft.py --preference_data=PATH --model=HF_FOLDER  # from a pretrained HF model

Library code: rljax.alignment.sft and rljax.alignment.pipeline. User errors exit 2.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app, flags

from rljax import run_info, runtime
from rljax.alignment import flags as alignment_flags
from rljax.sharding import distributed

_DATA = flags.DEFINE_string("preference_data", None,
                            "HH-RLHF or {prompt,chosen,rejected} JSONL(.gz); default: embedded task.")
_LOGDIR = flags.DEFINE_string("logdir", None, "Output directory (default runs/sft-<time>).")
_STEPS = flags.DEFINE_integer("num_steps", None, "SFT steps.")
_LIMIT = flags.DEFINE_integer("limit", None, "Read at most this many pairs.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Print tracebacks for user errors.")
# Devices (rljax.alignment.pipeline.make_placement): the model trains on --mesh by --sharding_rules.
_MESH_FLAGS = alignment_flags.define_mesh_flags()
distributed.define_flags()
_WANDB = run_info.define_wandb_flag()

# Preference data: prompt budget, tokenizer, --model (rljax.alignment.flags).
_DATA_FLAGS = alignment_flags.define_data_flags()


def main(argv):
  del argv
  runtime.configure_logging(_VERBOSE.value)

  def run():
    from rljax.alignment import pipeline
    from rljax.checkpoint import check_writable

    distributed.initialize_from_flags()  # no-op for one process outside SLURM
    placement = pipeline.make_placement(_MESH_FLAGS.mesh.value, _MESH_FLAGS.sharding_rules.value)  # checked before compiling
    logdir = _LOGDIR.value or os.path.join("runs", f"sft-{time.strftime('%Y%m%d-%H%M%S')}")
    if _STEPS.value is not None and _STEPS.value < 1:
      raise ValueError(f"--num_steps must be >= 1, got {_STEPS.value}")
    _DATA_FLAGS.check_data(_DATA.value)
    if _DATA_FLAGS.rm_lr.value is not None:
      raise ValueError("--rm_lr does nothing in train_sft.py (it trains no reward model); "
                       "use it with train_reward_model.py or train_rlhf.py")
    check_writable(logdir)
    runtime.enable_compilation_cache()
    if _DATA.value is None:
      cfg = pipeline.EmbeddedConfig(seed=_SEED.value)
      if _STEPS.value is not None:
        cfg = dataclasses.replace(cfg, sft_steps=_STEPS.value)
      run_info.start_run(logdir, cfg, use_wandb=_WANDB.value)
      s = pipeline.run_embedded(cfg, logdir=logdir, stop_after="sft", placement=placement,
                                log=runtime.primary_print)
      runtime.primary_print(
          f"embedded SFT: greedy exact-match accuracy {s['accuracy_before']:.3f}; "
          f"wall {s['wall_s']:.0f} s; logdir {logdir}")
    else:
      cfg = dataclasses.replace(_DATA_FLAGS.base_config(), limit=_LIMIT.value,
                                seed=_SEED.value, **_DATA_FLAGS.overrides())
      if _STEPS.value is not None:
        cfg = dataclasses.replace(cfg, sft_steps=_STEPS.value)
      run_info.start_run(logdir, cfg, use_wandb=_WANDB.value)
      s = pipeline.run_preference(_DATA.value, cfg, logdir=logdir, stop_after="sft",
                                  placement=placement, log=runtime.primary_print)
      runtime.primary_print(
          f"SFT on {s['num_pairs']} chosen responses: response loss {s['sft_loss']:.3f}; "
          f"wall {s['wall_s']:.0f} s; logdir {logdir}")

  runtime.run_main(run, verbose=_VERBOSE.value)


if __name__ == "__main__":
  app.run(main)
