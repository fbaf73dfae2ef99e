"""The preference pipeline: real human preferences (HH-RLHF format) to an RL-trained policy.

A BPE tokenizer is trained on the data, a tiny LM is pre-trained on the dialogues and
fine-tuned on the chosen responses, a reward model (from the SFT model) is trained on a 90/10
split and evaluated on the 10% (accuracy with a 95% Wilson interval), normalised on SFT
samples, then PPO runs against it. With ``PreferenceConfig.model`` (the scripts' ``--model``)
a pretrained Hugging Face model gives the tokenizer and the initial weights instead
(`rljax.alignment.hf_models.load_pretrained`; no pre-training).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.alignment import checkpointing, modeling, rl_stage, rlhf, sft, stages
from rljax.alignment import reward_model as rm_lib
from rljax.alignment.hf_models import (
  HF_MODEL_DIR,
  check_hf_folders,
  export_hf_model,
  hf_folder_config,
  load_pretrained,
  load_reward_model,
)
from rljax.alignment.layout import check_placement, train_layout
from rljax.alignment.pipeline_config import PreferenceConfig, tiny_lm_config
from rljax.alignment.runs import (
  make_writer,
  prepare,
  say_if_finished,
  sft_stage,
  stop_on,
)
from rljax.alignment.summary import finished_summary, history_summary, write_summary
from rljax.envs.text import data as text_data
from rljax.models.llm import DecoderLM
from rljax.models.tokenizer import load_tokenizer
from rljax.sampling import Sampler, SamplingConfig


def split_preference_pairs(pairs: Sequence[Any], config: "PreferenceConfig"
                           ) -> tuple[list[Any], list[Any]]:
  """``(train, held_out)``: :func:`rljax.alignment.reward_model.split_pairs` with the config's
  ``eval_fraction`` and ``seed``.

  Raises:
    ValueError: no training pair is left (e.g. ``--limit=1``: its one pair is held out),
      naming the smallest ``--limit`` that leaves one.
  """
  train, held = rm_lib.split_pairs(pairs, config.eval_fraction, config.seed)
  if not train:
    need = next((n for n in range(len(pairs) + 1, len(pairs) + 1000)
                 if rm_lib.split_pairs(range(n), config.eval_fraction, 0)[0]), None)
    limited = config.limit is not None
    hint = ("lower eval_fraction" if need is None else
            f"read at least {need} (--limit >= {need})" if limited else
            f"the data needs at least {need} pairs")
    source = f" (--limit={config.limit})" if limited else ""
    raise ValueError(f"{len(pairs)} preference pair(s){source} leave no training pair after "
                     f"holding out {len(held)} (eval_fraction {config.eval_fraction}): {hint}")
  return train, held


def check_inputs(config: "PreferenceConfig", path: str) -> None:
  """Everything the alignment scripts can check before they create the logdir, so a bad input
  leaves nothing behind that would refuse the corrected command: the model folders
  (:func:`check_hf_folders`), then the data file, read in full (about 1 s for HH-RLHF's 2,312
  pairs), and its split (:func:`split_preference_pairs`); with ``overlong_prompts="reject"``,
  the prompts' lengths in the run's tokenizer (:func:`fresh_tokenizer`: a BPE trained here
  when there is no ``model`` or ``tokenizer``, a few seconds on HH-RLHF); a ``tokenizer``'s
  vocabulary against ``vocab_size``.

  Raises:
    FileNotFoundError, rljax.envs.text.data.DataError: a missing or malformed data file.
    ValueError: as :func:`check_hf_folders`, :func:`split_preference_pairs` and
      :func:`check_prompt_lengths`.
  """
  check_hf_folders(config)
  train_pairs, _ = split_preference_pairs(
      text_data.load_preference_pairs(path, limit=config.limit), config)
  tok = None
  if config.tokenizer is not None:  # config: not with a model
    tok = fresh_tokenizer(config, train_pairs)
    _check_tokenizer_vocab(config, tok)
  if config.overlong_prompts == "reject":  # the run's tokenizer, built only to check them
    tok = tok or fresh_tokenizer(config, train_pairs)
    context = (tiny_lm_config(tok.vocab_size) if config.model is None else
               hf_folder_config(config.model, "--model", "float32")).max_position_embeddings
    _checked_prompts(config, tok, train_pairs, context, log=lambda _: None)


def fresh_tokenizer(config: "PreferenceConfig", train_pairs: Sequence[Any]):
  """The tokenizer a new (not resumed) run of ``config`` uses: ``--model``'s, ``--tokenizer``'s,
  else a byte-level BPE of ``config.vocab_size`` tokens trained on ``train_pairs``' texts
  (prompt + chosen, and rejected; deterministic)."""
  if config.model is not None:
    return load_tokenizer(config.model)
  if config.tokenizer is not None:
    return load_tokenizer(config.tokenizer)
  texts = [p.prompt + " " + p.chosen for p in train_pairs] + [p.rejected for p in train_pairs]
  return text_data.train_bpe_tokenizer(texts, vocab_size=config.vocab_size)


def _check_tokenizer_vocab(config: "PreferenceConfig", tok) -> None:
  """Raises ValueError when ``--tokenizer``'s vocabulary exceeds ``config.vocab_size``."""
  if tok.vocab_size > config.vocab_size:
    raise ValueError(f"the tokenizer {config.tokenizer!r} has a vocabulary of {tok.vocab_size} "
                     f"tokens, more than the model's vocab_size {config.vocab_size}; raise "
                     f"--vocab_size to at least {tok.vocab_size}")


def _checked_prompts(config: "PreferenceConfig", tok, train_pairs: Sequence[Any], context: int,
                     log=print) -> list[list[int]]:
  """``train_pairs``' prompt token ids, within the budget (:func:`check_prompt_lengths`)."""
  return check_prompt_lengths(
      [text_data.encode_prompt(tok, p.prompt, p.messages) for p in train_pairs],
      max_prompt_len=config.max_prompt_len, context=context,
      response_len=max(config.max_response_len, config.rl.max_new_tokens),
      mode=config.overlong_prompts, log=log)


# Fewer held-out pairs than this get a note: the 95% CI of an accuracy near 0.5 measured on n
# pairs is about +-1/sqrt(n) wide, +-0.18 at 30.
MIN_HELD_OUT = 30


def held_out_note(num_held_out: int, eval_fraction: float) -> str | None:
  """The note logged when 1 to ``MIN_HELD_OUT - 1`` pairs are held out, naming the pair count
  that would hold out ``MIN_HELD_OUT``; None otherwise."""
  if not 0 < num_held_out < MIN_HELD_OUT:
    return None
  return (f"note: {num_held_out} held-out pair(s) measure the reward model's accuracy only "
          f"roughly (see its 95% CI); {MIN_HELD_OUT} or more need about "
          f"{math.ceil(MIN_HELD_OUT / eval_fraction)} pairs (--limit)")


def _tokenizer_dir(config: PreferenceConfig, logdir: str | None) -> str | None:
  """The folder whose tokenizer files go beside an exported model: ``--model``'s, else the
  run's own ``<logdir>/tokenizer``."""
  if config.model is not None:
    return config.model
  return None if logdir is None else os.path.join(logdir, "tokenizer")


def check_prompt_lengths(prompts: list[list[int]], *, max_prompt_len: int, context: int,
                         response_len: int, mode: str, log=print) -> list[list[int]]:
  """Applies the prompt budget ``min(max_prompt_len, context - response_len)`` tokens.

  Longer prompts keep their last tokens (``mode="truncate"``; the count is logged) or are
  refused (``mode="reject"``).

  Raises:
    ValueError: ``mode="reject"`` and some prompt is too long (the message gives the count,
      the longest length and the budget), or the context leaves no room for a prompt.
  """
  budget = min(max_prompt_len, context - response_len)
  if budget < 1:
    raise ValueError(f"the model's context of {context} tokens leaves no room for a prompt "
                     f"next to a {response_len}-token response")
  long = [len(p) for p in prompts if len(p) > budget]
  if not long:
    return prompts
  what = (f"{len(long)} of {len(prompts)} prompts are longer than {budget} tokens "
          f"(max_prompt_len {max_prompt_len}, model context {context} - response length "
          f"{response_len}; the longest has {max(long)})")
  if mode == "reject":
    raise ValueError(f"{what}; pass --overlong_prompts=truncate to keep their last {budget} "
                     f"tokens, or raise --max_prompt_len")
  log(f"{what}: truncated to their last {budget} tokens")
  return [list(p)[-budget:] for p in prompts]


def run_preference(path: str, config: PreferenceConfig, *, logdir: str | None = None,
                   log=print, stop_after: str = "rl", placement=None,
                   checkpoint_every: int = 10, keep_checkpoints: int = 3, resume: bool = True,
                   sigterm=None, stage_checkpoint_every: int = 0) -> dict[str, Any]:
  """Tokenizer -> pre-train -> SFT (chosen) -> reward model (90/10) -> PPO; returns a summary
  with the reward model's held-out accuracy and CI and the RL history. ``placement``: as in
  :func:`run_embedded`. With ``config.model`` the tokenizer and the initial weights come from
  that Hugging Face folder (:func:`load_pretrained`) and pre-training is skipped.

  Summary times (s): ``pretrain_s`` from the start to the end of pre-training (the ``model``
  load, reading the data, the tokenizer and pre-training), then ``sft_s``, ``rm_s``, ``rl_s``,
  and ``wall_s`` for all; a run resumed from an older checkpoint without ``pretrain_s`` reports
  0 there. Re-running a finished run trains nothing, keeps its ``hf_model`` and
  ``summary.json``, and returns that summary (:func:`finished_summary`).
  ``stage_checkpoint_every``: as in :func:`run_embedded`, for pre-training, SFT and the reward
  model.

  Raises:
    FileNotFoundError / rljax.envs.text.data.DataError: for a missing or malformed file.
    rljax.sharding.mesh.MeshError: a batch the training mesh's data axes do not divide.
    ValueError: no training pair after the held-out split (:func:`split_preference_pairs`);
      overlong prompts with ``overlong_prompts="reject"``; a ``tokenizer`` larger
      than ``vocab_size``; a ``logdir`` holding another run (see :func:`run_embedded` for
      checkpoints and resume: here the frozen roles are the SFT model and the reward model);
      a bad ``model`` folder (:func:`load_pretrained`; checked first, before the ``logdir``).
  """
  check_placement(placement, rl=config.rl if stop_after == "rl" else None,
                  batch_sizes={"batch_size": config.batch_size,
                               "2 * rm_batch_size": 2 * config.rm_batch_size})
  # A pretrained model (--model) and a reward model (--reward_model) are loaded, and so
  # checked, before anything is written. The wall times count from here, so ``wall_s`` and
  # ``pretrain_s`` include those loads.
  t0 = time.perf_counter()
  pretrained = (None if config.model is None else
                load_pretrained(config.model, layout=train_layout(placement), seed=config.seed))
  loaded_rm = (None if config.reward_model is None else  # config: with a model, so a tokenizer
               load_reward_model(config.reward_model, pretrained[1],
                                 layout=train_layout(placement), seed=config.seed))
  # The data is read (and so checked) before the logdir records this run's config: a bad file
  # leaves nothing that would refuse the corrected command.
  pairs = text_data.load_preference_pairs(path, limit=config.limit)
  use_ckpt = logdir is not None and stop_after == "rl"  # RL checkpoints and frozen roles
  resuming = prepare(logdir, config, path, stop_after, resume, log) and use_ckpt
  stage_dir = logdir  # where the stages' states are saved (None: nowhere)
  staged = logdir is not None and bool(stages.saved_stages(logdir))  # a stage to continue
  if stop_after != "rl":
    say_if_finished(logdir, [n for n, run in (
        ("pretrain", config.pretrain_steps and pretrained is None), ("sft", config.sft_steps),
        ("rm", stop_after == "rm" and loaded_rm is None)) if run], log)
  layout = train_layout(placement)
  train_pairs, held_pairs = split_preference_pairs(pairs, config)
  log(f"{path}: {len(pairs)} pairs ({len(train_pairs)} train / {len(held_pairs)} held out)")
  note = held_out_note(len(held_pairs), config.eval_fraction)
  if note is not None and stop_after != "sft":  # SFT scores no held-out pairs
    log(note)
  if resuming or staged:  # the tokenizer the interrupted run trained (and saved)
    tok = load_tokenizer(os.path.join(logdir, "tokenizer"))
  elif pretrained is not None:
    tok = pretrained[1]
  else:
    tok = fresh_tokenizer(config, train_pairs)
  model_vocab = config.vocab_size if config.tokenizer is not None else tok.vocab_size
  if config.tokenizer is not None:
    _check_tokenizer_vocab(config, tok)
  if pretrained is not None:  # vocabulary checked by load_pretrained
    lm_config = pretrained[0].config
  else:
    lm_config = tiny_lm_config(model_vocab, hidden_size=config.hidden_size,
                               num_layers=config.num_layers, num_heads=config.num_heads,
                               num_kv_heads=config.num_kv_heads, eos=tok.eos_token_id,
                               pad=tok.pad_token_id, bos=tok.bos_token_id)
  prompts = _checked_prompts(config, tok, train_pairs, lm_config.max_position_embeddings, log=log)
  if logdir is not None and not (resuming or staged):
    text_data.save_tokenizer(tok, os.path.join(logdir, "tokenizer"))
  model = (pretrained[0] if pretrained is not None
           else DecoderLM(lm_config, rngs=nnx.Rngs(config.seed)))
  writer = make_writer(logdir)
  max_len = config.max_prompt_len + config.max_response_len
  buckets = tuple(b for b in sft.DEFAULT_LENGTH_BUCKETS if b < max_len) + (max_len,)
  sft_data = sft.tokenize_examples(text_data.sft_from_pairs(train_pairs), tok,
                                   max_prompt_len=config.max_prompt_len,
                                   max_response_len=config.max_response_len)
  if resuming:
    if loaded_rm is not None:  # the template: its architecture may differ from the policy's
      rm_model = loaded_rm
    else:
      gd, st = nnx.split(model)
      rm_model = nnx.merge(gd, jax.tree.map(jnp.copy, st))
    meta = checkpointing.load_frozen(logdir, {"reference": model, "reward": rm_model})
    log(f"loaded the SFT and reward models from {checkpointing.frozen_dir(logdir)}")
    # This process's times (as run_embedded's): the load, instead of the saved run's stages.
    meta = dict(meta, pretrain_s=time.perf_counter() - t0, sft_s=0.0, rm_s=0.0)
    return _preference_rl(config, tok, prompts, model, rm_model, meta, logdir=logdir,
                          tokenizer_dir=_tokenizer_dir(config, logdir), writer=writer, log=log,
                          placement=placement, t0=t0,
                          num_pairs=len(pairs), checkpoint_every=checkpoint_every,
                          keep_checkpoints=keep_checkpoints, resume=resume, sigterm=sigterm)
  if config.pretrain_steps and pretrained is None:
    # Language modelling on whole (truncated) dialogues: every token is a target.
    lm_data = [([tok.bos_token_id], (list(p) + list(r))[1:]) for p, r in sft_data]
    model, rec = sft_stage(stage_dir, "pretrain", model, lm_data, sft.SFTConfig(
        num_steps=config.pretrain_steps, batch_size=config.batch_size, learning_rate=config.pretrain_lr,
        length_buckets=buckets, log_every=50, seed=config.seed, packing=config.packing,
        pack_length=2 * max_len), pad_id=tok.pad_token_id,
        writer=writer, layout=layout, sigterm=sigterm, log=log,
        save_every=stage_checkpoint_every)
    log(f"pretrain: {config.pretrain_steps} steps, loss {rec['pretrain/loss']:.3f}")
  t_pre = time.perf_counter()
  sft_loss = float("nan")
  if config.sft_steps:
    model, rec = sft_stage(stage_dir, "sft", model, sft_data, sft.SFTConfig(
        num_steps=config.sft_steps, batch_size=config.batch_size,
        learning_rate=config.sft_learning_rate,
        length_buckets=buckets, log_every=50, seed=config.seed, packing=config.packing,
        pack_length=2 * max_len), pad_id=tok.pad_token_id,
        writer=writer, layout=layout, sigterm=sigterm, log=log,
        save_every=stage_checkpoint_every)
    sft_loss = rec["sft/loss"]
    log(f"sft: {config.sft_steps} steps at learning rate {config.sft_learning_rate:g}, "
        f"response loss {sft_loss:.3f}")
  else:
    log("sft: skipped (sft_steps=0); the policy and the reference are the initial model")
  t_sft = time.perf_counter()
  tokenizer_dir = _tokenizer_dir(config, logdir)
  if stop_after == "sft":
    if writer is not None:
      writer.close()
    hf_model = None if logdir is None else export_hf_model(
        model, logdir, tokenizer_dir=tokenizer_dir, log=log)
    return dict(num_pairs=len(pairs), num_train_pairs=len(train_pairs),
                sft_loss=sft_loss, wall_s=t_sft - t0, hf_model=hf_model)

  ho = rm_lib.tokenize_pairs(held_pairs, tok, max_prompt_len=config.max_prompt_len,
                             max_response_len=config.max_response_len)
  if loaded_rm is not None:
    rm_model = loaded_rm
    ev = _held_out_record(rm_model, ho, tok, buckets)
    log(f"reward model: loaded from {config.reward_model}")
  else:
    gd, st = nnx.split(model)
    rm_model = nnx.merge(gd, jax.tree.map(jnp.copy, st))  # the reward model starts from SFT
    tr = rm_lib.tokenize_pairs(train_pairs, tok, max_prompt_len=config.max_prompt_len,
                               max_response_len=config.max_response_len)
    rm_config = rm_lib.RewardModelConfig(
        num_steps=config.rm_steps, batch_size=config.rm_batch_size, learning_rate=config.rm_lr,
        margin=config.rm_margin, length_buckets=buckets, log_every=50, seed=config.seed)
    train = functools.partial(rm_lib.train_reward_model, train_pairs=tr, config=rm_config,
                              pad_id=tok.pad_token_id, eval_pairs=ho, writer=writer,
                              layout=layout, should_stop=stop_on(sigterm), log=log)
    rm_model, ev, _ = stages.run_stage(
        stage_dir, "rm", lambda m, state, checkpoint: train(m, state=state,
                                                            checkpoint=checkpoint),
        rm_model, lambda: rm_lib.fresh_state(rm_model, rm_config),
        save_every=stage_checkpoint_every, log=log)
  if stop_after != "rm":  # train_reward_model.py prints it in its summary line
    trained = "" if loaded_rm is not None else f" ({config.rm_steps} steps)"
    log(f"reward model{trained}: held-out accuracy {ev['rm/eval_accuracy']:.3f} "
        f"(95% CI {ev['rm/eval_accuracy_ci_low']:.3f}-{ev['rm/eval_accuracy_ci_high']:.3f}, "
        f"n={len(ho)})")
  t_rm = time.perf_counter()
  if stop_after == "rm":
    if writer is not None:
      writer.close()
    hf_model = None if logdir is None else export_hf_model(
        rm_model, logdir, tokenizer_dir=tokenizer_dir, reward_model=True, log=log)
    return dict(num_pairs=len(pairs), rm_accuracy=ev["rm/eval_accuracy"],
                rm_ci=(ev["rm/eval_accuracy_ci_low"], ev["rm/eval_accuracy_ci_high"]),
                rm_heldout=len(ho), wall_s=t_rm - t0, hf_model=hf_model)

  if config.normalize_reward:  # on SFT samples, before PPO (and before the frozen save)
    n = min(config.reward_norm_samples, len(prompts))
    mean, std = normalize_reward_head(rm_model, model, prompts[:n], tok,
                                      max_new_tokens=config.rl.max_new_tokens, seed=config.seed)
    log(f"reward model normalised on {n} SFT samples: raw score mean {mean:.3f}, std {std:.3f}")
    if writer is not None:
      # Its own stage: the last reward-model record (stage "rm", the same step) stays the one
      # record of that step, and a resume before RL redoes it (it is not a saved stage).
      writer.write(config.rm_steps, {"rm/norm_mean": mean, "rm/norm_std": std},
                   stage="rm_norm")
  meta = {"rm/eval_accuracy": ev["rm/eval_accuracy"],
          "rm/eval_accuracy_ci_low": ev["rm/eval_accuracy_ci_low"],
          "rm/eval_accuracy_ci_high": ev["rm/eval_accuracy_ci_high"], "rm_heldout": len(ho),
          "pretrain_s": t_pre - t0, "sft_s": t_sft - t_pre, "rm_s": t_rm - t_sft}
  if use_ckpt:
    checkpointing.save_frozen(logdir, {"reference": model, "reward": rm_model}, meta)
    stages.drop_stages(logdir)
  return _preference_rl(config, tok, prompts, model, rm_model, meta, logdir=logdir,
                        tokenizer_dir=tokenizer_dir, writer=writer, log=log, placement=placement,
                        t0=t0, num_pairs=len(pairs), checkpoint_every=checkpoint_every,
                        keep_checkpoints=keep_checkpoints,
                        resume=resume, sigterm=sigterm, use_ckpt=use_ckpt)


def _held_out_record(rm_model: DecoderLM, pairs, tokenizer, buckets) -> dict[str, float]:
  """A loaded reward model's held-out evaluation, keyed as the trained one's last record
  (``rm/eval_accuracy`` and its 95% CI, ``rm/eval_loss``)."""
  gd, params = nnx.split(rm_model, nnx.Param)
  return rm_lib.evaluate(gd, params, pairs, pad_id=tokenizer.pad_token_id,
                         length_buckets=buckets).record()


def normalize_reward_head(rm_model: DecoderLM, policy: DecoderLM, prompts, tokenizer, *,
                          max_new_tokens: int, seed: int = 0, batch_size: int = 32
                          ) -> tuple[float, float]:
  r"""Rescales ``rm_model``'s reward head in place so that its scores on responses sampled from
  ``policy`` (temperature 1) have mean 0 and std 1; returns the raw ``(mean, std)``.

  ``w <- w / std``, ``b <- (b - mean) / std``: the score ``h.w + b`` becomes
  ``(score - mean) / std`` for every input, so pairwise preferences (and the held-out
  accuracy) are unchanged. Ziegler et al. 2019 (arXiv:1909.08593), Sec. 2.2: "we normalize the
  reward model's output so that it has mean 0 and variance 1 on x ~ D, y ~ rho(.|x)". A critic
  initialised from this reward model inherits the scale.

  Args:
    rm_model: a ``DecoderLM`` with a trained reward head (modified in place).
    policy: the policy to sample from (the SFT model).
    prompts: token-id lists; responses are sampled in chunks of ``batch_size``.
    tokenizer: gives ``eos_token_id`` and ``pad_token_id``.

  Raises:
    ValueError: no prompts, or scores with zero spread.
  """
  if not prompts:
    raise ValueError("normalize_reward_head: no prompts")
  sampler = Sampler(policy, SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0,
                                           eos_token_ids=(tokenizer.eos_token_id,),
                                           pad_token_id=tokenizer.pad_token_id))
  gd, params = nnx.split(rm_model, nnx.Param)

  @jax.jit
  def score(p, pt, pm, rt, rm):
    tokens, mask = modeling.concat(pt, pm, rt, rm)
    return modeling.sequence_scores(gd, p, tokens, mask)

  key = jax.random.key(seed + 7919)
  scores = []
  for s in range(0, len(prompts), batch_size):
    key, sub = jax.random.split(key)
    out = sampler.generate(list(prompts[s:s + batch_size]), key=sub)
    scores.append(np.asarray(score(params, out.prompt_tokens, out.prompt_mask, out.tokens,
                                   out.response_mask)))
  scores = np.concatenate(scores)
  mean, std = float(np.mean(scores)), float(np.std(scores))
  if not std > 0:
    raise ValueError(f"normalize_reward_head: scores have no spread (std {std})")
  head = rm_model.reward_head
  head.kernel[...] = head.kernel[...] / std
  head.bias[...] = (head.bias[...] - mean) / std
  return mean, std


def _preference_rl(config: PreferenceConfig, tok, prompts, model, rm_model, meta, *, logdir,
                   tokenizer_dir, writer, log, placement, t0, num_pairs, checkpoint_every,
                   keep_checkpoints, resume, sigterm, use_ckpt=True) -> dict[str, Any]:
  """The PPO stage of :func:`run_preference` (also where a resumed run starts); the trained
  actor is exported with :func:`export_hf_model` when there is a ``logdir``."""
  t_rm = time.perf_counter()
  trainer = rlhf.RLHFTrainer(config.rl, actor=model, tokenizer=tok, prompts=prompts,
                             reward_model=rm_model, placement=placement)

  history, resumed_from = rl_stage.run_rl(
      trainer, logdir, use_ckpt=use_ckpt, writer=writer, log=log, show_every=10,
      checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints, resume=resume,
      sigterm=sigterm)
  if writer is not None:
    writer.close()
  hf_model = None
  if logdir is not None:
    hf_model = os.path.join(logdir, HF_MODEL_DIR)
    if resumed_from == config.rl.num_steps and os.path.isdir(hf_model):
      log(f"kept {hf_model}: the finished run exported it")  # nothing trained here
      saved = finished_summary(logdir, resumed_from, config.rl.num_steps, history)
      if saved is not None:
        return saved
    else:
      hf_model = export_hf_model(trainer.actor_model(), logdir, tokenizer_dir=tokenizer_dir,
                                 log=log)
  summary = dict(
      hf_model=hf_model, num_pairs=num_pairs, rm_accuracy=meta["rm/eval_accuracy"],
      rm_ci=(meta["rm/eval_accuracy_ci_low"], meta["rm/eval_accuracy_ci_high"]),
      rm_heldout=meta["rm_heldout"], **history_summary(history, 5),
      wall_s=time.perf_counter() - t0, pretrain_s=meta.get("pretrain_s", 0.0),
      sft_s=meta["sft_s"], rm_s=meta["rm_s"],
      rl_s=time.perf_counter() - t_rm, history=history, resumed_from=resumed_from)
  write_summary(logdir, summary)
  return summary
