"""The configurations of the two alignment pipelines and their defaults.

* `EmbeddedConfig`: the embedded default run (the addition task, no data);
* `PreferenceConfig`: the real-data run on human preference pairs (HH-RLHF format).

Both nest an `rljax.alignment.rlhf_config.RLHFConfig` as ``rl``; `default_rl_config` is the
embedded task's RL setting per algorithm and `preference_defaults` the preference run's, with
OpenRLHF's learning rates for a pretrained ``--model`` (`PRETRAINED_LEARNING_RATES`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rljax.alignment.rlhf_config import Algorithm, RLHFConfig, default_ppo_config
from rljax.models.llm import LMConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddedConfig:
  """The embedded default run (addition task).

  Attributes:
    max_operand: operands in ``[0, max_operand)``.
    hidden_size, num_layers, num_heads, num_kv_heads: the tiny LM.
    pretrain_steps, sft_steps: brief pre-training on full lines, SFT on answers.
    pretrain_lr, sft_lr: their learning rates.
    batch_size: pre-training/SFT batch.
    num_eval_prompts: held-out problems for greedy accuracy (0: no accuracy evaluation;
      the summary's accuracies are then NaN).
    rl: the RL configuration (its ``algo`` is the script's ``--algo``).
    seed: model init and data seed.
    prompts: a JSONL(.gz) prompt file (``prompt`` plus any other columns) whose prompts RL
      trains on instead of the task's own (`rljax.alignment.reward_functions.load_prompt_file`);
      its characters must be the character tokenizer's. None: generated addition problems.
    reward_fn: ``package.module:function`` (or ``file.py:function``) scoring the responses,
      ``fn(responses, **columns) -> list[float]`` (`rljax.alignment.reward_functions`), instead
      of the addition task's exact-match reward. None: the addition reward.
  """

  max_operand: int = 20
  hidden_size: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  pretrain_steps: int = 800
  sft_steps: int = 150
  pretrain_lr: float = 3e-3
  sft_lr: float = 1e-3
  batch_size: int = 64
  num_eval_prompts: int = 256
  rl: RLHFConfig = dataclasses.field(default_factory=lambda: default_rl_config("ppo"))
  seed: int = 0
  prompts: str | None = None
  reward_fn: str | None = None

  def __post_init__(self):
    for name in ("max_operand", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    if self.num_eval_prompts < 0:
      raise ValueError(f"num_eval_prompts must be >= 0, got {self.num_eval_prompts}.")
    if self.pretrain_steps < 0 or self.sft_steps < 0:
      raise ValueError("pretrain_steps and sft_steps must be >= 0.")


def default_rl_config(algo: str, **overrides) -> RLHFConfig:
  """The embedded default's RL settings for ``algo`` (``ppo|grpo|rloo|reinforce_pp``)."""
  algo = Algorithm(algo) if not isinstance(algo, Algorithm) else algo
  group = 1 if algo in (Algorithm.PPO, Algorithm.REINFORCE_PP) else 4
  kw: dict[str, Any] = dict(
      algo=algo, num_steps=200, prompts_per_step=64 // group, group_size=group,
      max_new_tokens=5, actor_lr=5e-4, critic_lr=1e-3, kl_coef=0.02, missing_eos_penalty=0.5,
      # Two epochs; GRPO's group-standardised advantages are not whitened again.
      ppo=dataclasses.replace(default_ppo_config(), num_epochs=2,
                              normalize_advantages=algo != Algorithm.GRPO))
  kw.update(overrides)
  return RLHFConfig(**kw)


def tiny_lm_config(vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, eos: int = 2, pad: int = 0,
                   bos: int = 1) -> LMConfig:
  """A small Llama-style `LMConfig` for the embedded task and tests (SwiGLU width
  ``3 * hidden_size``; special token ids ``eos``, ``pad``, ``bos``)."""
  return LMConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                  intermediate_size=3 * hidden_size, num_layers=num_layers, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, eos_token_id=eos, pad_token_id=pad, bos_token_id=bos)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferenceConfig:
  """The real-data pipeline (HH-RLHF format).

  Attributes:
    vocab_size: BPE vocabulary trained on the data.
    hidden_size, num_layers, num_heads, num_kv_heads: the tiny LM.
    max_prompt_len, max_response_len: token truncation (prompt keeps its end).
    pretrain_steps, sft_steps, rm_steps: steps of each stage.
    batch_size: SFT/pre-training batch; ``rm_batch_size``: pairs per RM step.
    pretrain_lr, rm_lr: learning rates: pre-training at ``pretrain_lr``, SFT at
      ``pretrain_lr / 2`` (unless ``sft_lr``),
      the reward model at ``rm_lr``. Tuned for the tiny model trained from scratch;
      :func:`preference_defaults` gives the lower ones for a pretrained ``model``.
    sft_lr: SFT's learning rate; None (default) means ``pretrain_lr / 2``. With a ``model`` (no
      pre-training) this is the one rate SFT uses, as OpenRLHF's ``train_sft --learning_rate``.
    rm_margin: Bradley-Terry margin (>= 0).
    eval_fraction: reward-model held-out fraction.
    packing: pack pre-training/SFT examples into rows of ``2 * (max_prompt_len +
      max_response_len)`` tokens (:func:`rljax.alignment.sft.pack_examples`) instead of
      length buckets: padding drops from ~16% of the tokens to ~1%.
    normalize_reward: affinely rescale the trained reward model's head so that its scores on
      responses sampled from the SFT policy have mean 0 and std 1 (Ziegler et al. 2019,
      arXiv:1909.08593, Sec. 2.2; OpenRLHF's ``--normalize_reward``). The raw scores' scale is
      arbitrary (std ~2.2 here), and the KL coefficient is only meaningful relative to it.
    reward_norm_samples: responses sampled for that normalisation.
    rl: RL configuration (prompts from the training split). The defaults keep the KL bounded
      on HH-RLHF: KL in the reward (k1) with an adaptive coefficient (Ziegler et al.'s
      controller) aiming at ``kl_target`` nats per response, on normalised rewards, with a
      lower actor learning rate than the embedded task's (see the README for before/after).
    limit: read at most this many pairs (None: all).
    seed: split/init seed.
    overlong_prompts: ``"truncate"`` (keep a prompt's last tokens) or ``"reject"`` (raise) for
      prompts longer than ``max_prompt_len`` or than the model's context
      (``max_position_embeddings``) minus the response length; the count is logged.
    tokenizer: a tokenizer folder (``tokenizer.json``) to use instead of training a BPE one;
      the model then has ``vocab_size`` rows, which must cover the tokenizer's vocabulary.
    model: a pretrained Hugging Face model folder (:func:`load_pretrained`; OpenRLHF's
      ``--pretrain``): tokenizer and initial weights come from it, pre-training is skipped, and
      ``vocab_size``, ``hidden_size``, ``num_layers``, ``num_heads``, ``num_kv_heads`` and
      ``pretrain_steps`` are unused. Not with ``tokenizer``. Setting only ``model`` keeps the
      from-scratch learning rates; ``preference_defaults(model)`` (what the scripts use)
      starts from fine-tuning ones.
    reward_model: a trained reward model's Hugging Face folder (OpenRLHF's
      ``--reward_pretrain``): ``train_reward_model.py``'s ``hf_model``, or a
      ``*ForSequenceClassification`` folder with one label as TRL's ``RewardTrainer`` saves
      (:func:`load_reward_model`). It scores the PPO rollouts (after ``normalize_reward``) and
      starts the critic; the reward-model stage, ``rm_steps`` and ``rm_lr`` are skipped, and
      its held-out accuracy is measured on this data's split. Needs ``model``: both must share
      one tokenizer.

  ``sft_steps`` may be 0 (no SFT: the policy and the reference are the loaded ``model``, or
  the pre-trained one).
  """

  vocab_size: int = 2048
  hidden_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  max_prompt_len: int = 64
  max_response_len: int = 32
  pretrain_steps: int = 150
  sft_steps: int = 100
  rm_steps: int = 150
  batch_size: int = 32
  rm_batch_size: int = 32
  pretrain_lr: float = 2e-3
  rm_lr: float = 5e-4
  sft_lr: float | None = None
  rm_margin: float = 0.0
  eval_fraction: float = 0.1
  packing: bool = True
  normalize_reward: bool = True
  reward_norm_samples: int = 256
  rl: RLHFConfig = dataclasses.field(default_factory=lambda: RLHFConfig(
      max_new_tokens=32, actor_lr=5e-5, critic_lr=5e-4, kl_coef=0.1, kl_controller="adaptive",
      kl_target=2.0, kl_horizon=320, critic_init="reward", missing_eos_penalty=0.5))
  limit: int | None = None
  seed: int = 0
  overlong_prompts: str = "truncate"
  tokenizer: str | None = None
  model: str | None = None
  reward_model: str | None = None

  def __post_init__(self):
    if self.model is not None and self.tokenizer is not None:
      raise ValueError("--tokenizer cannot be combined with --model: the tokenizer comes from "
                       f"the model folder {self.model!r}")
    if self.reward_model is not None and self.model is None:
      raise ValueError(f"--reward_model {self.reward_model!r} needs --model (the policy it "
                       f"scores must share its tokenizer; a tokenizer trained here would not)")
    if self.overlong_prompts not in ("truncate", "reject"):
      raise ValueError(f"overlong_prompts must be 'truncate' or 'reject', got "
                       f"{self.overlong_prompts!r}")
    for name in ("vocab_size", "max_prompt_len", "max_response_len", "rm_steps",
                 "batch_size", "rm_batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    for name in ("pretrain_steps", "sft_steps"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
    if self.limit is not None and self.limit < 1:
      raise ValueError(f"limit (--limit, preference pairs to read) must be >= 1, got "
                       f"{self.limit}.")
    for name in ("pretrain_lr", "rm_lr", "sft_lr"):
      value = getattr(self, name)
      if value is not None and not value > 0:  # also refuses NaN
        raise ValueError(f"{name} must be > 0, got {value}.")

  @property
  def sft_learning_rate(self) -> float:
    """SFT's learning rate: ``sft_lr``, or ``pretrain_lr / 2`` when that is None."""
    return self.pretrain_lr / 2 if self.sft_lr is None else self.sft_lr


# Learning rates for a pretrained ``--model``, from OpenRLHF's example scripts for 1-8B models:
# SFT 5e-6 (``pretrain_lr`` is 1e-5 because SFT runs at ``pretrain_lr / 2``), reward model 9e-6, PPO actor 5e-7
# and critic 9e-6. ``PreferenceConfig``'s own defaults are tuned for the tiny model trained from
# scratch here (SFT at 1e-3, actor at 5e-5): 200x and 100x these, enough to move a pretrained
# model far from its weights within a few steps.
PRETRAINED_LEARNING_RATES = {"pretrain_lr": 1e-5, "rm_lr": 9e-6, "actor_lr": 5e-7, "critic_lr": 9e-6}


def preference_defaults(model: str | None = None) -> PreferenceConfig:
  """The default :class:`PreferenceConfig`: as declared, or for a pretrained ``model`` folder
  with that ``model`` and :data:`PRETRAINED_LEARNING_RATES` (what the scripts start from
  before their flags are applied)."""
  config = PreferenceConfig()
  if model is None:
    return config
  lrs = PRETRAINED_LEARNING_RATES
  rl = dataclasses.replace(config.rl, actor_lr=lrs["actor_lr"], critic_lr=lrs["critic_lr"])
  return dataclasses.replace(config, model=model, pretrain_lr=lrs["pretrain_lr"], rm_lr=lrs["rm_lr"], rl=rl)


def upgrade_saved_config(saved: dict[str, Any]) -> dict[str, Any]:
  """A saved pipeline config in today's layout: the preference pipeline's pre-training rate,
  saved as ``lr`` by earlier versions, is ``pretrain_lr``; the RL config's ``adaptive_kl``
  (true/false) is ``kl_controller`` (``"adaptive"``/``"fixed"``)."""
  if "lr" in saved and "pretrain_lr" not in saved:
    saved = {("pretrain_lr" if k == "lr" else k): v for k, v in saved.items()}
  rl = saved.get("rl")
  if isinstance(rl, dict) and "adaptive_kl" in rl:
    rl = dict(rl)
    adaptive = rl.pop("adaptive_kl")
    rl.setdefault("kl_controller", "adaptive" if adaptive else "fixed")
    saved = {**saved, "rl": rl}
  return saved

