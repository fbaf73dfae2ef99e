"""The embedded default pipeline: pre-training, SFT and RL on the addition task, no data.

A tiny Llama-style LM is pre-trained briefly on code-generated ``"a+b=c"`` lines, fine-tuned
(SFT) on ``"a+b="`` -> ``"c"`` pairs, then trained with RL (PPO by default) against the
programmatic reward :func:`rljax.envs.text.arithmetic.addition_reward` (1 for the exact sum,
partial credit for digits in place). Greedy exact-match accuracy on held-out problems is
measured before and after RL, so the run shows whether the policy learned arithmetic, not
just the reward.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from flax import nnx

from rljax.alignment import checkpointing, reward_functions, rl_stage, rlhf, sft, stages
from rljax.alignment.layout import check_placement, train_layout
from rljax.alignment.pipeline_config import EmbeddedConfig, tiny_lm_config
from rljax.alignment.runs import make_writer, prepare, say_if_finished, sft_stage
from rljax.alignment.summary import finished_summary, history_summary, write_summary
from rljax.envs.text import arithmetic
from rljax.models.llm import DecoderLM
from rljax.sampling import Sampler, SamplingConfig


def greedy_accuracy(model, tokenizer, prompt_texts, *, max_new_tokens: int) -> float:
  """Fraction of ``prompt_texts`` whose greedy answer is exactly right (addition task); NaN
  for no prompts."""
  if not prompt_texts:
    return float("nan")
  sampler = Sampler(model, SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0,
                                          eos_token_ids=(tokenizer.eos_token_id,),
                                          pad_token_id=tokenizer.pad_token_id))
  out = sampler.generate([tokenizer.encode(p) for p in prompt_texts])
  hits = [arithmetic.addition_score(p, tokenizer.decode(row[:n])) == 1.0
          for p, row, n in zip(prompt_texts, out.tokens, out.lengths)]
  return float(np.mean(hits))


def rl_task(config: EmbeddedConfig, task: arithmetic.AdditionTask,
            tokenizer: arithmetic.CharTokenizer) -> tuple[list[str], rlhf.RewardFn]:
  """The RL stage's prompt texts and reward: ``config.prompts``' prompts (else 5,000 generated
  addition problems) and ``config.reward_fn`` over that file's columns (else
  :func:`rljax.envs.text.arithmetic.addition_reward`).

  Raises:
    FileNotFoundError, rljax.envs.text.data.DataError: a missing or broken prompt file.
    ValueError: a prompt with a character the tokenizer lacks (its file, line and character
      named).
    rljax.alignment.reward_functions.RewardFunctionError: a ``reward_fn`` that cannot be loaded.
  """
  if config.prompts is None:
    prompts, fields = task.prompts(5_000, config.seed + 3), {}
  else:
    loaded = reward_functions.load_prompt_file(config.prompts)
    prompts, fields = loaded.prompts, loaded.fields
    for i, p in enumerate(prompts):
      try:
        tokenizer.encode(p)
      except ValueError as e:
        raise ValueError(f"{config.prompts}: prompt {i + 1} ({p!r}): {e}; the embedded model "
                         f"reads additions only (give --preference_data and --model for "
                         f"other text)") from None
  if config.reward_fn is None:
    return prompts, arithmetic.addition_reward
  fn = reward_functions.load_function(config.reward_fn)
  return prompts, reward_functions.ColumnReward(fn, fields, name=config.reward_fn)


def check_rl_task(config: EmbeddedConfig) -> None:
  """Loads ``config``'s prompt file and reward function (`rl_task`), so that a bad one fails
  before anything compiles. Raises as `rl_task`."""
  rl_task(config, arithmetic.AdditionTask(max_operand=config.max_operand),
          arithmetic.CharTokenizer())


def run_embedded(config: EmbeddedConfig, *, logdir: str | None = None, progress: bool = False,
                 log=print, stop_after: str = "rl", checkpoint_every: int = 10,
                 keep_checkpoints: int = 3, resume: bool = True,
                 sigterm=None, placement=None, stage_checkpoint_every: int = 0
                 ) -> dict[str, Any]:
  """Pre-train -> SFT -> RL on the addition task; returns a summary dict.

  Summary keys: ``accuracy_before``/``accuracy_after`` (greedy exact match on held-out
  problems), ``history`` (RL metrics per step), ``reward_first``/``reward_last`` (mean reward
  over the first/last 10 steps), ``kl_max``, ``wall_s`` and per-phase wall times,
  ``resumed_from`` (the RL step a resumed run restarted after, else None).

  With a ``logdir`` the RL stage checkpoints every ``checkpoint_every`` steps (keeping
  ``keep_checkpoints``) and, with ``resume``, continues a run found there: the SFT model
  (the frozen reference and the actor's start) is loaded from ``<logdir>/frozen`` instead of
  being trained again (:mod:`rljax.alignment.checkpointing`); on a finished run it trains and
  logs nothing and returns the saved ``summary.json`` (:func:`finished_summary`).
  A resumed run's ``wall_s`` and ``rl_s`` count its own process. ``sigterm``: an installed
  :class:`rljax.checkpoint.SigtermFlag` (see ``checkpointing.train``). ``placement``: from
  :func:`make_placement`; pre-training and SFT run in the actor's training layout, RL with every
  role placed (batches checked against the data axes first, :func:`check_placement`).
  With a ``logdir`` (whatever ``stop_after``: ``"sft"`` is ``train_sft.py``'s run) the stages
  before RL save their states under ``<logdir>/stages`` at their end, on a SIGTERM and every
  ``stage_checkpoint_every`` of their steps (0: not periodically;
  :func:`rljax.alignment.stages.run_stage`), and a rerun (``resume``) continues from the
  last save, skipping the stages that ended; the config is checked and saved as the run's kind
  (:func:`saved_config`). Each stage's logged records are also printed through ``log``, one
  line each.

  Raises:
    ValueError: ``logdir`` holds a run with another config (or any run, without ``resume``);
      raised before anything compiles.
    rljax.alignment.checkpointing.Preempted: SIGTERM during RL; the RL state is checkpointed.
    rljax.alignment.stages.StageInterrupted: SIGTERM before RL; the stage's state is
      saved (with a ``logdir``).
  """
  check_placement(placement, rl=config.rl if stop_after == "rl" else None,
                  batch_sizes={"batch_size": config.batch_size})
  layout = train_layout(placement)
  t0 = time.perf_counter()
  use_ckpt = logdir is not None and stop_after == "rl"  # RL checkpoints and frozen roles
  resuming = prepare(logdir, config, None, stop_after, resume, log) and use_ckpt
  tok = arithmetic.CharTokenizer()
  task = arithmetic.AdditionTask(max_operand=config.max_operand)
  model = DecoderLM(tiny_lm_config(tok.vocab_size, hidden_size=config.hidden_size,
                                   num_layers=config.num_layers, num_heads=config.num_heads,
                                   num_kv_heads=config.num_kv_heads),
                    rngs=nnx.Rngs(config.seed))
  writer = make_writer(logdir)
  s = config.seed
  pre = [([tok.BOS], tok.encode(x, add_special_tokens=False) + [tok.EOS])
         for x in task.pretraining_text(20_000, s + 1)] if not resuming else []
  if resuming:  # the SFT model, saved before the first RL step: exact, and no re-training
    meta = checkpointing.load_frozen(logdir, {"reference": model})
    log(f"loaded the SFT model from {checkpointing.frozen_dir(logdir)}")
  stage_dir = logdir  # where the stages' states are saved (None: nowhere)
  if stop_after != "rl":
    say_if_finished(logdir, [n for n, steps in (("pretrain", config.pretrain_steps),
                                                 ("sft", config.sft_steps)) if steps], log)
  if config.pretrain_steps and not resuming:
    model, rec = sft_stage(stage_dir, "pretrain", model, pre, sft.SFTConfig(
        num_steps=config.pretrain_steps, batch_size=config.batch_size,
        learning_rate=config.pretrain_lr, log_every=max(config.pretrain_steps // 3, 1), seed=s),
        pad_id=tok.PAD, writer=writer, layout=layout, sigterm=sigterm, log=log,
        save_every=stage_checkpoint_every)
    log(f"pretrain: {config.pretrain_steps} steps, loss {rec['pretrain/loss']:.3f}")
  t_pre = time.perf_counter()
  examples = sft.tokenize_examples(task.sft_examples(20_000, s + 2), tok, max_prompt_len=16,
                                   max_response_len=8)
  if config.sft_steps and not resuming:
    model, rec = sft_stage(stage_dir, "sft", model, examples, sft.SFTConfig(
        num_steps=config.sft_steps, batch_size=config.batch_size, learning_rate=config.sft_lr,
        log_every=max(config.sft_steps // 2, 1), seed=s), pad_id=tok.PAD, writer=writer,
        layout=layout, sigterm=sigterm, log=log, save_every=stage_checkpoint_every)
    log(f"sft: {config.sft_steps} steps at learning rate {config.sft_lr:g}, response loss "
        f"{rec['sft/loss']:.3f}")
  t_sft = time.perf_counter()

  eval_prompts = task.prompts(config.num_eval_prompts, s + 1000)
  if resuming:
    acc_before = float(meta["accuracy_before"])
  else:
    acc_before = greedy_accuracy(model, tok, eval_prompts,
                                 max_new_tokens=config.rl.max_new_tokens)
    if use_ckpt:
      checkpointing.save_frozen(logdir, {"reference": model}, {"accuracy_before": acc_before})
      stages.drop_stages(logdir)
  if eval_prompts:
    log(f"greedy exact-match accuracy after SFT: {acc_before:.3f}")
  if stop_after == "sft":
    if writer is not None:
      # Its own stage: redone (not kept) by a rerun, as the saved stages' records are.
      writer.write(config.sft_steps, {"eval/accuracy": acc_before}, stage="eval")
      writer.close()
    return dict(accuracy_before=acc_before, wall_s=time.perf_counter() - t0,
                pretrain_s=t_pre - t0, sft_s=t_sft - t_pre)
  train_prompts, reward_fn = rl_task(config, task, tok)
  trainer = rlhf.RLHFTrainer(config.rl, actor=model, tokenizer=tok,
                             prompts=[tok.encode(p) for p in train_prompts],
                             prompt_texts=train_prompts, reward_fn=reward_fn,
                             placement=placement)

  history, resumed_from = rl_stage.run_rl(
      trainer, logdir, use_ckpt=use_ckpt, writer=writer, log=log, show_every=20,
      checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints, resume=resume,
      sigterm=sigterm)
  t_rl = time.perf_counter()
  # Every process evaluates, finished run or not: the sampler's programs span all of them.
  acc_after = greedy_accuracy(trainer.actor_model(), tok, eval_prompts,
                              max_new_tokens=config.rl.max_new_tokens)
  saved = finished_summary(logdir, resumed_from, config.rl.num_steps, history)
  if saved is not None:  # a finished run: nothing trained, so nothing to log again
    writer.close()
    return saved
  if eval_prompts:
    log(f"greedy exact-match accuracy after RL: {acc_after:.3f}")
  if writer is not None:
    writer.write(config.rl.num_steps, {"eval/accuracy_before": acc_before,
                                       "eval/accuracy_after": acc_after}, stage="eval")
    writer.close()
  summary = dict(
      accuracy_before=acc_before, accuracy_after=acc_after, **history_summary(history, 10),
      wall_s=time.perf_counter() - t0, pretrain_s=t_pre - t0, sft_s=t_sft - t_pre,
      rl_s=t_rl - t_sft, history=history, resumed_from=resumed_from)
  write_summary(logdir, summary)
  return summary
