r"""Bradley-Terry reward model on preference pairs; reports held-out accuracy with a 95% CI.

    python experiments/train_reward_model.py --preference_data=../shared/data/hh-rlhf-harmless-base-test.jsonl.gz
    python experiments/train_reward_model.py --preference_data=PATH --model=HF_FOLDER

Tokenizer trained on the data, pre-training and SFT on the chosen side, then the reward model
(from the SFT model) on a 90/10 split. With --model (a Hugging Face Llama/Qwen2 folder) the
tokenizer and the initial weights come from that model and pre-training is skipped. Library code: rljax.alignment.reward_model and
rljax.alignment.pipeline. User errors exit 2.
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
                            "HH-RLHF or {prompt,chosen,rejected} JSONL(.gz). Required.")
_LOGDIR = flags.DEFINE_string("logdir", None, "Output directory (default runs/rm-<time>).")
_STEPS = flags.DEFINE_integer("num_steps", None, "Reward-model steps.")
_MARGIN = flags.DEFINE_float("margin", None, "Bradley-Terry margin.")
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
    if _DATA.value is None:
      raise ValueError("--preference_data=PATH is required (HH-RLHF or prompt/chosen/rejected "
                       "JSONL, .jsonl or .jsonl.gz)")
    if not os.path.exists(_DATA.value):
      raise FileNotFoundError(f"--preference_data {_DATA.value!r} does not exist")
    logdir = _LOGDIR.value or os.path.join("runs", f"rm-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = dataclasses.replace(_DATA_FLAGS.base_config(), limit=_LIMIT.value,
                                seed=_SEED.value, **_DATA_FLAGS.overrides())
    if _STEPS.value is not None:
      cfg = dataclasses.replace(cfg, rm_steps=_STEPS.value)
    if _MARGIN.value is not None:
      if _MARGIN.value < 0:
        raise ValueError(f"--margin must be >= 0, got {_MARGIN.value}")
      cfg = dataclasses.replace(cfg, rm_margin=_MARGIN.value)
    check_writable(logdir)
    run_info.start_run(logdir, cfg, use_wandb=_WANDB.value)
    runtime.enable_compilation_cache()
    s = pipeline.run_preference(_DATA.value, cfg, logdir=logdir, stop_after="rm",
                                placement=placement, log=runtime.primary_print)
    lo, hi = s["rm_ci"]
    runtime.primary_print(
        f"reward model: held-out accuracy {s['rm_accuracy']:.3f} (95% CI {lo:.3f}-{hi:.3f}, "
        f"n={s['rm_heldout']} of {s['num_pairs']} pairs); wall {s['wall_s']:.0f} s; "
        f"logdir {logdir}")

  runtime.run_main(run, verbose=_VERBOSE.value)


if __name__ == "__main__":
  app.run(main)
