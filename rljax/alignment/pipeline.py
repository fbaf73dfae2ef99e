"""The two end-to-end pipelines behind ``experiments/train_rlhf.py``.

* :func:`run_embedded`: no data, no downloads. A tiny Llama-style LM is pre-trained briefly on
  code-generated ``"a+b=c"`` lines, fine-tuned (SFT) on ``"a+b="`` -> ``"c"`` pairs, then
  trained with RL (PPO by default) against the programmatic reward
  :func:`rljax.envs.text.arithmetic.addition_reward` (1 for the exact sum, partial credit for
  digits in place). Greedy exact-match accuracy on held-out problems is measured before and
  after RL, so the run shows whether the policy learned arithmetic, not just the reward.
* :func:`run_preference`: real human preferences (HH-RLHF format). A BPE tokenizer is trained
  on the data, a tiny LM is pre-trained on the dialogues and fine-tuned on the chosen
  responses, a reward model (from the SFT model) is trained on a 90/10 split and evaluated on
  the 10% (accuracy with a 95% Wilson interval), then PPO runs against that reward model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import kl as kl_lib
from rljax import ppo
from rljax.alignment import reward_model as rm_lib
from rljax.alignment import rlhf, sft
from rljax.envs.text import arithmetic
from rljax.envs.text import data as text_data
from rljax.models.llm import DecoderLM, LMConfig
from rljax.sampling import Sampler, SamplingConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddedConfig:
  """The embedded default run (addition task).

  Attributes:
    max_operand: operands in ``[0, max_operand)``.
    hidden_size, num_layers, num_heads, num_kv_heads: the tiny LM.
    pretrain_steps, sft_steps: brief pre-training on full lines, SFT on answers.
    pretrain_lr, sft_lr: their learning rates.
    batch_size: pre-training/SFT batch.
    num_eval_prompts: held-out problems for greedy accuracy.
    rl: the RL configuration (its ``algo`` is the script's ``--algo``).
    seed: model init and data seed.
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
  rl: rlhf.RLHFConfig = dataclasses.field(default_factory=lambda: default_rl_config("ppo"))
  seed: int = 0

  def __post_init__(self):
    for name in ("max_operand", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "batch_size", "num_eval_prompts"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    if self.pretrain_steps < 0 or self.sft_steps < 0:
      raise ValueError("pretrain_steps and sft_steps must be >= 0.")


def default_rl_config(algo: str, **overrides) -> rlhf.RLHFConfig:
  """The embedded default's RL settings for ``algo`` (``ppo|grpo|rloo|reinforce_pp``)."""
  algo = rlhf.Algorithm(algo) if not isinstance(algo, rlhf.Algorithm) else algo
  group = 1 if algo in (rlhf.Algorithm.PPO, rlhf.Algorithm.REINFORCE_PP) else 4
  kw: dict[str, Any] = dict(
      algo=algo, num_steps=200, prompts_per_step=64 // group, group_size=group,
      max_new_tokens=5, actor_lr=5e-4, critic_lr=1e-3, kl_coef=0.02,
      kl_estimator=kl_lib.KLEstimator.K1, missing_eos_penalty=0.5, seed=0,
      ppo=ppo.PPOConfig(num_epochs=2, num_minibatches=2, value_clip_eps=0.2,
                        normalize_advantages=algo != rlhf.Algorithm.GRPO))
  kw.update(overrides)
  return rlhf.RLHFConfig(**kw)


def tiny_lm_config(vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, eos: int = 2, pad: int = 0,
                   bos: int = 1) -> LMConfig:
  return LMConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                  intermediate_size=3 * hidden_size, num_layers=num_layers, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, eos_token_id=eos, pad_token_id=pad, bos_token_id=bos)


def greedy_accuracy(model, tokenizer, prompt_texts, *, max_new_tokens: int) -> float:
  """Fraction of ``prompt_texts`` whose greedy answer is exactly right (addition task)."""
  sampler = Sampler(model, SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0,
                                          eos_token_ids=(tokenizer.eos_token_id,),
                                          pad_token_id=tokenizer.pad_token_id))
  out = sampler.generate([tokenizer.encode(p) for p in prompt_texts])
  hits = [arithmetic.addition_score(p, tokenizer.decode(row[:n])) == 1.0
          for p, row, n in zip(prompt_texts, out.tokens, out.lengths)]
  return float(np.mean(hits))


def _writer(logdir, total=None):
  from rljax.metrics import MetricsWriter

  if logdir is None:
    return None
  return MetricsWriter(logdir, total=total, unit="steps",
                       console_keys=("reward/mean", "kl", "accuracy"), tensorboard=True)


def run_embedded(config: EmbeddedConfig, *, logdir: str | None = None, progress: bool = False,
                 log=print, stop_after: str = "rl") -> dict[str, Any]:
  """Pre-train -> SFT -> RL on the addition task; returns a summary dict.

  Summary keys: ``accuracy_before``/``accuracy_after`` (greedy exact match on held-out
  problems), ``history`` (RL metrics per step), ``reward_first``/``reward_last`` (mean reward
  over the first/last 10 steps), ``kl_max``, ``wall_s`` and per-phase wall times.
  """
  t0 = time.perf_counter()
  tok = arithmetic.CharTokenizer()
  task = arithmetic.AdditionTask(max_operand=config.max_operand)
  model = DecoderLM(tiny_lm_config(tok.vocab_size, hidden_size=config.hidden_size,
                                   num_layers=config.num_layers, num_heads=config.num_heads,
                                   num_kv_heads=config.num_kv_heads),
                    rngs=nnx.Rngs(config.seed))
  writer = _writer(logdir)
  s = config.seed
  pre = [([tok.BOS], tok.encode(x, add_special_tokens=False) + [tok.EOS])
         for x in task.pretraining_text(20_000, s + 1)]
  if config.pretrain_steps:
    model, _, h = sft.train_sft(model, pre, sft.SFTConfig(
        num_steps=config.pretrain_steps, batch_size=config.batch_size,
        learning_rate=config.pretrain_lr, log_every=max(config.pretrain_steps // 3, 1), seed=s),
        pad_id=tok.PAD, writer=writer, prefix="pretrain/")
    log(f"pretrain: {config.pretrain_steps} steps, loss {h[-1]['pretrain/loss']:.3f}")
  t_pre = time.perf_counter()
  examples = sft.tokenize_examples(task.sft_examples(20_000, s + 2), tok, max_prompt_len=16,
                                   max_response_len=8)
  if config.sft_steps:
    model, _, h = sft.train_sft(model, examples, sft.SFTConfig(
        num_steps=config.sft_steps, batch_size=config.batch_size, learning_rate=config.sft_lr,
        log_every=max(config.sft_steps // 2, 1), seed=s), pad_id=tok.PAD, writer=writer,
        prefix="sft/")
    log(f"sft: {config.sft_steps} steps, response loss {h[-1]['sft/loss']:.3f}")
  t_sft = time.perf_counter()

  eval_prompts = task.prompts(config.num_eval_prompts, s + 1000)
  acc_before = greedy_accuracy(model, tok, eval_prompts, max_new_tokens=config.rl.max_new_tokens)
  log(f"greedy exact-match accuracy after SFT: {acc_before:.3f}")
  if stop_after == "sft":
    if writer is not None:
      writer.write(config.sft_steps, {"eval/accuracy": acc_before})
      writer.close()
    return dict(accuracy_before=acc_before, wall_s=time.perf_counter() - t0,
                pretrain_s=t_pre - t0, sft_s=t_sft - t_pre)
  train_prompts = task.prompts(5_000, s + 3)
  trainer = rlhf.RLHFTrainer(config.rl, actor=model, tokenizer=tok,
                             prompts=[tok.encode(p) for p in train_prompts],
                             prompt_texts=train_prompts, reward_fn=arithmetic.addition_reward)

  def show(rec):
    st = int(rec["step"])
    if st == 1 or st % 20 == 0 or st == config.rl.num_steps:
      log(f"rl step {st:4d}: reward {rec['reward/mean']:.3f}  kl {rec['kl']:.3f}  "
          f"entropy {rec['entropy']:.3f}  len {rec['response_length/mean']:.2f}  "
          f"step {rec['timing/step']:.3f}s")

  history = trainer.train(writer=writer, callback=show)
  t_rl = time.perf_counter()
  acc_after = greedy_accuracy(trainer.actor_model(), tok, eval_prompts,
                              max_new_tokens=config.rl.max_new_tokens)
  log(f"greedy exact-match accuracy after RL: {acc_after:.3f}")
  if writer is not None:
    writer.write(config.rl.num_steps, {"eval/accuracy_before": acc_before,
                                       "eval/accuracy_after": acc_after})
    writer.close()
  rewards = [h["reward/mean"] for h in history]
  k = min(10, len(rewards))
  summary = dict(
      accuracy_before=acc_before, accuracy_after=acc_after,
      reward_first=float(np.mean(rewards[:k])), reward_last=float(np.mean(rewards[-k:])),
      kl_max=float(max(h["kl"] for h in history)), kl_last=float(history[-1]["kl"]),
      wall_s=time.perf_counter() - t0, pretrain_s=t_pre - t0, sft_s=t_sft - t_pre,
      rl_s=t_rl - t_sft, history=history)
  if logdir is not None:
    with open(os.path.join(logdir, "summary.json"), "w") as f:
      json.dump({k: v for k, v in summary.items() if k != "history"}, f, indent=2)
  return summary


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferenceConfig:
  """The real-data pipeline (HH-RLHF format).

  Attributes:
    vocab_size: BPE vocabulary trained on the data.
    hidden_size, num_layers, num_heads, num_kv_heads: the tiny LM.
    max_prompt_len, max_response_len: token truncation (prompt keeps its end).
    pretrain_steps, sft_steps, rm_steps: steps of each stage.
    batch_size: SFT/pre-training batch; ``rm_batch_size``: pairs per RM step.
    lr, rm_lr: learning rates.
    rm_margin: Bradley-Terry margin (>= 0).
    eval_fraction: reward-model held-out fraction.
    rl: RL configuration (prompts from the training split).
    limit: read at most this many pairs (None: all).
    seed: split/init seed.
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
  lr: float = 2e-3
  rm_lr: float = 5e-4
  rm_margin: float = 0.0
  eval_fraction: float = 0.1
  rl: rlhf.RLHFConfig = dataclasses.field(default_factory=lambda: rlhf.RLHFConfig(
      algo="ppo", num_steps=40, prompts_per_step=32, max_new_tokens=32, actor_lr=2e-4,
      critic_lr=5e-4, kl_coef=0.05, critic_init="reward", missing_eos_penalty=0.5,
      ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=2, value_clip_eps=0.2)))
  limit: int | None = None
  seed: int = 0


def run_preference(path: str, config: PreferenceConfig, *, logdir: str | None = None,
                   log=print, stop_after: str = "rl") -> dict[str, Any]:
  """Tokenizer -> pre-train -> SFT (chosen) -> reward model (90/10) -> PPO; returns a summary
  with the reward model's held-out accuracy and CI and the RL history.

  Raises:
    FileNotFoundError / rljax.envs.text.data.DataError: for a missing or malformed file.
  """
  t0 = time.perf_counter()
  pairs = text_data.load_preference_pairs(path, limit=config.limit)
  train_pairs, held_pairs = rm_lib.split_pairs(pairs, config.eval_fraction, config.seed)
  log(f"{path}: {len(pairs)} pairs ({len(train_pairs)} train / {len(held_pairs)} held out)")
  texts = [p.prompt + " " + p.chosen for p in train_pairs] + [p.rejected for p in train_pairs]
  tok = text_data.train_bpe_tokenizer(texts, vocab_size=config.vocab_size)
  if logdir is not None:
    text_data.save_tokenizer(tok, os.path.join(logdir, "tokenizer"))
  model = DecoderLM(tiny_lm_config(tok.vocab_size, hidden_size=config.hidden_size,
                                   num_layers=config.num_layers, num_heads=config.num_heads,
                                   num_kv_heads=config.num_kv_heads, eos=tok.eos_token_id,
                                   pad=tok.pad_token_id, bos=tok.bos_token_id),
                    rngs=nnx.Rngs(config.seed))
  writer = _writer(logdir)
  max_len = config.max_prompt_len + config.max_response_len
  buckets = tuple(b for b in sft.DEFAULT_LENGTH_BUCKETS if b < max_len) + (max_len,)
  sft_data = sft.tokenize_examples(text_data.sft_from_pairs(train_pairs), tok,
                                   max_prompt_len=config.max_prompt_len,
                                   max_response_len=config.max_response_len)
  if config.pretrain_steps:
    # Language modelling on whole (truncated) dialogues: every token is a target.
    lm_data = [([tok.bos_token_id], (list(p) + list(r))[1:]) for p, r in sft_data]
    model, _, h = sft.train_sft(model, lm_data, sft.SFTConfig(
        num_steps=config.pretrain_steps, batch_size=config.batch_size, learning_rate=config.lr,
        length_buckets=buckets, log_every=50, seed=config.seed), pad_id=tok.pad_token_id,
        writer=writer, prefix="pretrain/")
    log(f"pretrain: loss {h[-1]['pretrain/loss']:.3f}")
  model, _, h = sft.train_sft(model, sft_data, sft.SFTConfig(
      num_steps=config.sft_steps, batch_size=config.batch_size, learning_rate=config.lr / 2,
      length_buckets=buckets, log_every=50, seed=config.seed), pad_id=tok.pad_token_id,
      writer=writer, prefix="sft/")
  log(f"sft: response loss {h[-1]['sft/loss']:.3f}")
  t_sft = time.perf_counter()
  if stop_after == "sft":
    if writer is not None:
      writer.close()
    return dict(num_pairs=len(pairs), sft_loss=h[-1]["sft/loss"], wall_s=t_sft - t0)

  gd, st = nnx.split(model)
  rm_model = nnx.merge(gd, jax.tree.map(jnp.copy, st))  # the reward model starts from SFT
  tr = rm_lib.tokenize_pairs(train_pairs, tok, max_prompt_len=config.max_prompt_len,
                             max_response_len=config.max_response_len)
  ho = rm_lib.tokenize_pairs(held_pairs, tok, max_prompt_len=config.max_prompt_len,
                             max_response_len=config.max_response_len)
  rm_model, _, h = rm_lib.train_reward_model(rm_model, tr, rm_lib.RewardModelConfig(
      num_steps=config.rm_steps, batch_size=config.rm_batch_size, learning_rate=config.rm_lr,
      margin=config.rm_margin,
      length_buckets=buckets, log_every=50, seed=config.seed), pad_id=tok.pad_token_id,
      eval_pairs=ho, writer=writer)
  ev = h[-1]
  log(f"reward model: held-out accuracy {ev['rm/eval_accuracy']:.3f} "
      f"(95% CI {ev['rm/eval_accuracy_ci_low']:.3f}-{ev['rm/eval_accuracy_ci_high']:.3f}, "
      f"n={len(ho)})")
  t_rm = time.perf_counter()
  if stop_after == "rm":
    if writer is not None:
      writer.close()
    return dict(num_pairs=len(pairs), rm_accuracy=ev["rm/eval_accuracy"],
                rm_ci=(ev["rm/eval_accuracy_ci_low"], ev["rm/eval_accuracy_ci_high"]),
                rm_heldout=len(ho), wall_s=t_rm - t0)

  prompts = [text_data.encode_prompt(tok, p.prompt, p.messages)[-config.max_prompt_len:]
             for p in train_pairs]
  trainer = rlhf.RLHFTrainer(config.rl, actor=model, tokenizer=tok, prompts=prompts,
                             reward_model=rm_model)

  def show(rec):
    st = int(rec["step"])
    if st == 1 or st % 10 == 0 or st == config.rl.num_steps:
      log(f"ppo step {st:4d}: reward {rec['reward/mean']:.3f}  kl {rec['kl']:.3f}  "
          f"len {rec['response_length/mean']:.1f}  step {rec['timing/step']:.2f}s")

  history = trainer.train(writer=writer, callback=show)
  if writer is not None:
    writer.close()
  k = min(5, len(history))
  return dict(
      num_pairs=len(pairs), rm_accuracy=ev["rm/eval_accuracy"],
      rm_ci=(ev["rm/eval_accuracy_ci_low"], ev["rm/eval_accuracy_ci_high"]),
      rm_heldout=len(ho),
      reward_first=float(np.mean([x["reward/mean"] for x in history[:k]])),
      reward_last=float(np.mean([x["reward/mean"] for x in history[-k:]])),
      kl_last=float(history[-1]["kl"]), kl_max=float(max(x["kl"] for x in history)),
      wall_s=time.perf_counter() - t0, sft_s=t_sft - t0, rm_s=t_rm - t_sft,
      rl_s=time.perf_counter() - t_rm, history=history)
