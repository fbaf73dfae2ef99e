"""The two end-to-end pipelines behind ``experiments/train_rlhf.py`` (and the stage scripts).

* `run_embedded` (`rljax.alignment.embedded`): no data, no downloads. A tiny Llama-style LM
  is pre-trained on code-generated additions, fine-tuned (SFT), then trained with RL against
  an exact-match reward; greedy accuracy is measured before and after RL.
* `run_preference` (`rljax.alignment.preference`): human preference pairs (HH-RLHF format) to a
  tokenizer, SFT, a Bradley-Terry reward model with its held-out accuracy, then PPO.

This module gathers their public names in one place; each lives in the module of its concern:
configs (`rljax.alignment.pipeline_config`), Hugging Face folders
(`rljax.alignment.hf_models`), the run's folder (`rljax.alignment.runs`), the RL stage both end
with (`rljax.alignment.rl_stage`), summaries (`rljax.alignment.summary`) and device placement
(`rljax.alignment.layout`).
"""

from rljax.alignment.embedded import check_rl_task, greedy_accuracy, run_embedded
from rljax.alignment.hf_models import (HF_MODEL_DIR, check_hf_folders, export_hf_model,
                                       load_pretrained, load_reward_model)
from rljax.alignment.layout import PLACEMENTS, check_placement, make_placement, train_layout
from rljax.alignment.pipeline_config import (PRETRAINED_LEARNING_RATES, EmbeddedConfig,
                                             PreferenceConfig, default_rl_config,
                                             preference_defaults, tiny_lm_config)
from rljax.alignment.preference import (MIN_HELD_OUT, check_inputs, check_prompt_lengths,
                                        fresh_tokenizer, held_out_note, normalize_reward_head,
                                        run_preference, split_preference_pairs)
from rljax.alignment.runs import saved_run
from rljax.alignment.summary import (finished_summary, history_summary, nats, rl_step_line,
                                     write_summary)

__all__ = [
    "EmbeddedConfig", "HF_MODEL_DIR", "MIN_HELD_OUT", "PLACEMENTS", "PRETRAINED_LEARNING_RATES",
    "PreferenceConfig", "check_hf_folders", "check_inputs", "check_placement",
    "check_prompt_lengths", "check_rl_task", "default_rl_config", "export_hf_model",
    "finished_summary", "fresh_tokenizer", "greedy_accuracy", "held_out_note", "history_summary", "load_pretrained",
    "load_reward_model", "make_placement", "nats", "normalize_reward_head", "preference_defaults",
    "rl_step_line", "run_embedded", "run_preference", "saved_run", "split_preference_pairs",
    "tiny_lm_config", "train_layout", "write_summary",
]
