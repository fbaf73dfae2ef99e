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
  With ``PreferenceConfig.model`` (the scripts' ``--model``) a pretrained Hugging Face model
  gives the tokenizer and the initial weights instead (:func:`load_pretrained`; no pre-training).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import kl as kl_lib
from rljax import checkpoint as ckpt
from rljax import ppo, runtime
from rljax.alignment import reward_model as rm_lib
from rljax.alignment import modeling, rlhf, sft
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
    num_eval_prompts: held-out problems for greedy accuracy (0: no accuracy evaluation;
      the summary's accuracies are then NaN).
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
                 "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    if self.num_eval_prompts < 0:
      raise ValueError(f"num_eval_prompts must be >= 0, got {self.num_eval_prompts}.")
    if self.pretrain_steps < 0 or self.sft_steps < 0:
      raise ValueError("pretrain_steps and sft_steps must be >= 0.")


def history_summary(history: Sequence[Mapping[str, float]], k: int) -> dict[str, float]:
  """``reward_first``/``reward_last`` (mean ``reward/mean`` of the first and last ``k`` steps)
  and ``kl_max`` over finite values only, so a step whose reward was not finite (its update
  skipped by the non-finite guard) does not turn them into NaN; an empty selection gives NaN.
  ``kl_last`` is the last step's ``kl`` as logged (NaN when it was not finite or not measured);
  ``summary_steps``: the window actually used, ``min(k, len(history) // 2)`` so that the first
  and last windows do not overlap (1 for a 1-step run, whose two windows are its one step)."""

  def finite(values):
    a = np.asarray(list(values), np.float64)
    return a[np.isfinite(a)]

  def mean(values):
    a = finite(values)
    return float(a.mean()) if a.size else float("nan")

  k = max(1, min(k, len(history) // 2))
  rewards = [h["reward/mean"] for h in history]
  kls = finite(h.get("kl", np.nan) for h in history)
  return dict(reward_first=mean(rewards[:k]), reward_last=mean(rewards[-k:]),
              kl_max=float(kls.max()) if kls.size else float("nan"),
              kl_last=float(history[-1].get("kl", np.nan)) if history else float("nan"),
              summary_steps=min(k, len(history)))


def nats(x: float) -> str:
  """A KL value (nats) for the console: 3 decimals, with no ``-0.000``. The k1 estimate of a
  policy still at the reference is a few 1e-5 either side of 0, and a minus sign there reads
  as a bug (``-0.0006`` still shows as ``-0.001``)."""
  text = f"{x:.3f}"
  return "0.000" if text == "-0.000" else text


def rl_step_line(record: Mapping[str, float]) -> str:
  """The console line of one RL step, the same for every pipeline and algorithm, e.g.
  ``rl step   20: reward 0.512  kl 0.031  entropy 1.204  len 3.10  step 0.412s`` (``kl`` is NaN
  when not measured, see :func:`nats`; ``entropy`` is left out of records without it)."""
  entropy = f"  entropy {record['entropy']:.3f}" if "entropy" in record else ""
  return (f"rl step {int(record['step']):4d}: reward {record['reward/mean']:.3f}  "
          f"kl {nats(record.get('kl', float('nan')))}{entropy}  "
          f"len {record['response_length/mean']:.2f}  step {record['timing/step']:.3f}s")


def _shows_step(step: int, every: int, num_steps: int) -> bool:
  """Whether the console shows RL step ``step``: the first, every ``every``-th and the last."""
  return step == 1 or step % every == 0 or step == num_steps


def write_summary(logdir: str | None, summary: Mapping[str, Any]) -> None:
  """Writes ``summary`` without its ``history`` to ``<logdir>/summary.json`` (process 0 only,
  atomically: a crash leaves the previous file or none). Nothing without a ``logdir``."""
  if logdir is not None and runtime.is_primary():
    ckpt.write_json_atomic(os.path.join(logdir, "summary.json"),
                           {k: v for k, v in summary.items() if k != "history"})


def finished_summary(logdir: str | None, resumed_from: int | None, num_steps: int,
                     history: Sequence[Mapping[str, float]]) -> dict[str, Any] | None:
  """The saved ``<logdir>/summary.json`` when this call resumed a run that had already finished
  (``resumed_from == num_steps``: nothing was trained), with this call's ``history`` and
  ``resumed_from``, and ``from_summary_json=True``; None otherwise (or when the file is
  missing). The file is left as the run wrote it, so its stage and wall times stay the
  training run's, not the re-run's."""
  if logdir is None or resumed_from != num_steps:
    return None
  path = os.path.join(logdir, "summary.json")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  return dict(saved, history=list(history), resumed_from=resumed_from, from_summary_json=True)


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
  """A small Llama-style `LMConfig` for the embedded task and tests (SwiGLU width
  ``3 * hidden_size``; special token ids ``eos``, ``pad``, ``bos``)."""
  return LMConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                  intermediate_size=3 * hidden_size, num_layers=num_layers, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, eos_token_id=eos, pad_token_id=pad, bos_token_id=bos)


def load_pretrained(path: str, *, layout=None, seed: int = 0, dtype: str = "float32"):
  """A pretrained Hugging Face model folder (the scripts' ``--model``): ``(model, tokenizer)``.

  The folder holds ``config.json`` (``model_type`` llama or qwen2), ``model.safetensors`` (or a
  sharded ``model.safetensors.index.json``) and ``tokenizer.json`` (+ ``tokenizer_config.json``).
  The model's transformer and LM head come from the checkpoint; its value and reward heads are
  fresh (seeded by ``seed``), so the actor, the reference, and the reward model's and critic's
  trunks all start from the pretrained weights (OpenRLHF's ``--pretrain``). A tokenizer without
  a pad token pads with its EOS token (as TRL/OpenRLHF do); one without an EOS token takes the
  first ``eos_token_id`` of ``config.json``.

  Nothing is compiled here, so a bad folder fails before any training. ``layout``: a
  :class:`rljax.alignment.layout.TrainLayout`; each tensor is then created directly in its
  training sharding (``hf_io.load_hf_checkpoint``'s ``shardings``), never whole on one device.

  Raises:
    FileNotFoundError: no such folder, or no ``config.json``, weights or ``tokenizer.json`` in it.
    ValueError: an unsupported ``model_type`` (naming it and the supported ones) or other
      unusable ``config.json``; a tokenizer larger than the model's vocabulary or without EOS.
    rljax.models.hf_io.CheckpointError: a missing tensor, or one whose shape does not match
      ``config.json`` (naming the tensor and both shapes).
  """
  from rljax.models.tokenizer import load_tokenizer

  lm_config = _hf_folder_config(path, "--model", dtype)
  tok = load_tokenizer(path)
  if tok.eos_token_id is None and lm_config.eos_token_id:
    tok.special_tokens["eos_token"] = tok.backend.id_to_token(lm_config.eos_token_id[0])
  if tok.eos_token_id is None:
    raise ValueError(f"--model {path!r}: the tokenizer has no EOS token and config.json no "
                     f"eos_token_id; responses could not end")
  if tok.pad_token_id is None:
    tok.special_tokens["pad_token"] = tok.eos_token
  if tok.vocab_size > lm_config.vocab_size:
    raise ValueError(f"--model {path!r}: the tokenizer has {tok.vocab_size} tokens, more than "
                     f"the model's vocab_size {lm_config.vocab_size}")
  return _load_hf_folder(path, lm_config, layout=layout, seed=seed, dtype=dtype), tok


def _hf_folder_config(path: str, flag: str, dtype: str) -> LMConfig:
  """The ``LMConfig`` of the Hugging Face folder that ``flag`` names, checked.

  Raises:
    FileNotFoundError: no such folder, or no ``config.json`` in it.
    ValueError: an unusable ``config.json`` (naming ``flag``, the folder and why).
  """
  from rljax.models import hf_io

  if not os.path.isdir(path):
    raise FileNotFoundError(f"{flag} {path!r}: no such folder (expected a Hugging Face model "
                            f"folder with config.json, model.safetensors and tokenizer.json)")
  if not os.path.exists(os.path.join(path, hf_io.CONFIG_FILE)):
    hint = (f"; a run's exported model is in {os.path.join(path, HF_MODEL_DIR)}"
            if os.path.isdir(os.path.join(path, HF_MODEL_DIR)) else "")
    raise FileNotFoundError(f"{flag} {path!r}: no {hf_io.CONFIG_FILE} in the folder (expected a "
                            f"Hugging Face model folder){hint}")
  try:
    return LMConfig.from_hf_config(hf_io.read_hf_config(path), dtype=dtype)
  except (ValueError, KeyError, TypeError, AttributeError) as e:  # incl. malformed JSON
    what = f"missing key {e.args[0]!r}" if isinstance(e, KeyError) and e.args else str(e)
    raise ValueError(f"{flag} {path!r}: {what}") from e


def _reward_folder_config(path: str, dtype: str) -> LMConfig:
  """:func:`_hf_folder_config` of a ``--reward_model`` folder, which must hold a trained head.

  Raises:
    FileNotFoundError, ValueError: as :func:`_hf_folder_config`; ValueError also for a folder
      with neither a ``*ForSequenceClassification`` config nor ``rljax_heads.safetensors``.
  """
  from rljax.models import hf_io

  lm_config = _hf_folder_config(path, "--reward_model", dtype)
  if not (hf_io.is_reward_model_config(hf_io.read_hf_config(path))
          or os.path.exists(os.path.join(path, hf_io.HEADS_FILE))):
    raise ValueError(f"--reward_model {path!r} is not a trained reward model: its config.json "
                     f"names no *ForSequenceClassification architecture and it has no "
                     f"{hf_io.HEADS_FILE} (train_reward_model.py writes one in <logdir>/"
                     f"{HF_MODEL_DIR})")
  return lm_config


def check_hf_folders(config: "PreferenceConfig") -> None:
  """Checks ``config.model`` and ``config.reward_model`` (the folder, a readable and supported
  ``config.json``, a trained reward head, every tensor's name and shape from the safetensors
  headers) for the scripts, before they create the logdir, so a bad folder leaves nothing
  behind. Tokenizers are checked when loaded.

  Raises:
    FileNotFoundError, ValueError: as :func:`load_pretrained` and :func:`load_reward_model`.
  """
  from rljax.models import hf_io

  if config.model is not None:
    _hf_folder_config(config.model, "--model", "float32")
    hf_io.check_hf_checkpoint(config.model)  # tensor names and shapes, from the headers
  if config.reward_model is not None:
    _reward_folder_config(config.reward_model, "float32")
    hf_io.check_hf_checkpoint(config.reward_model)


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
               _hf_folder_config(config.model, "--model", "float32")).max_position_embeddings
    _checked_prompts(config, tok, train_pairs, context, log=lambda _: None)


def fresh_tokenizer(config: "PreferenceConfig", train_pairs: Sequence[Any]):
  """The tokenizer a new (not resumed) run of ``config`` uses: ``--model``'s, ``--tokenizer``'s,
  else a byte-level BPE of ``config.vocab_size`` tokens trained on ``train_pairs``' texts
  (prompt + chosen, and rejected; deterministic)."""
  from rljax.models.tokenizer import load_tokenizer

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


def _load_hf_folder(path: str, lm_config: LMConfig, *, layout, seed: int, dtype: str) -> DecoderLM:
  """``hf_io.load_hf_checkpoint``, each tensor placed in ``layout``'s training sharding."""
  from rljax.models import hf_io

  shardings = None
  if layout is not None:
    from rljax.sharding import rules as rules_lib

    abstract = nnx.eval_shape(lambda: DecoderLM(lm_config, rngs=nnx.Rngs(seed)))
    shardings = rules_lib.shardings(nnx.state(abstract), layout.mesh, layout.preset)
  return hf_io.load_hf_checkpoint(path, dtype=dtype, shardings=shardings, seed=seed)


def load_reward_model(path: str, tokenizer, *, layout=None, seed: int = 0,
                      dtype: str = "float32") -> DecoderLM:
  """A trained reward model's Hugging Face folder (``--reward_model``) as a ``DecoderLM``.

  Either rljax's export (``train_reward_model.py``'s ``hf_model``: a
  ``*ForSequenceClassification`` config with ``score.weight`` and ``rljax_heads.safetensors``)
  or a one-label ``*ForSequenceClassification`` folder from transformers/TRL: its score is the
  reward head, read at each sequence's last token as in training (``hf_io``). ``tokenizer`` is
  the policy's: the folder's ``tokenizer.json``, when it has one, must hold the same
  vocabulary, and the model's ``vocab_size`` must cover it.

  Raises:
    FileNotFoundError: no such folder, or no ``config.json`` or weights in it.
    ValueError: a folder that holds no trained reward head (a plain ``*ForCausalLM`` without
      ``rljax_heads.safetensors``), or another tokenizer (naming both folders' vocabularies).
    rljax.models.hf_io.CheckpointError: a missing or misshapen tensor (e.g. 2 labels).
  """
  from rljax.models.tokenizer import load_tokenizer

  lm_config = _reward_folder_config(path, dtype)
  if os.path.exists(os.path.join(path, "tokenizer.json")):
    own = load_tokenizer(path).backend.get_vocab()
    if own != tokenizer.backend.get_vocab():
      raise ValueError(f"--reward_model {path!r} has another tokenizer than --model "
                       f"({len(own)} against {tokenizer.vocab_size} tokens, or the same count "
                       f"with other ids): the reward model must read the policy's token ids")
  if tokenizer.vocab_size > lm_config.vocab_size:
    raise ValueError(f"--reward_model {path!r}: the policy's tokenizer has "
                     f"{tokenizer.vocab_size} tokens, more than the reward model's vocab_size "
                     f"{lm_config.vocab_size}")
  return _load_hf_folder(path, lm_config, layout=layout, seed=seed, dtype=dtype)


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


def _writer(logdir, total=None):
  from rljax.metrics import MetricsWriter

  if logdir is None:
    return None
  return MetricsWriter(logdir, total=total, unit="steps",
                       console_keys=("reward/mean", "kl", "accuracy"), tensorboard=True)


def _stop_on(sigterm):
  """The stages' ``should_stop``: whether the installed ``SigtermFlag`` (or None) was raised
  in any process (a collective with several, asked by all before each step)."""
  return None if sigterm is None else sigterm.any_process


def _sft_stage(logdir: str | None, stage: str, model, examples, config: sft.SFTConfig, *,
               pad_id: int, writer, layout, sigterm, log, save_every: int
               ) -> tuple[Any, dict[str, Any]]:
  """`sft.train_sft` as stage ``stage`` (``"pretrain"`` or ``"sft"``) through
  `checkpointing.run_stage`: saved under ``<logdir>/stages`` (None: not saved) every
  ``save_every`` steps, resumed from there; each logged record goes to ``log`` as a line.
  Returns the model and the stage's last record."""
  from rljax.alignment import checkpointing

  def train(m, state, checkpoint):
    return sft.train_sft(m, examples, config, pad_id=pad_id, writer=writer, state=state,
                         prefix=f"{stage}/", layout=layout, should_stop=_stop_on(sigterm),
                         checkpoint=checkpoint, log=log)

  model, record, _ = checkpointing.run_stage(
      logdir, stage, train, model, lambda: sft.fresh_state(model, config),
      save_every=save_every, log=log)
  return model, record


def saved_config(config: EmbeddedConfig | PreferenceConfig, data: str | None = None,
                 stop_after: str = "rl") -> dict[str, Any]:
  """What a run saves and checks in ``<logdir>/checkpoints/config.json``: the keyword
  arguments ``section``, ``config_json`` and ``defaults`` of
  :func:`rljax.alignment.checkpointing.prepare`. ``data``: the preference data path
  (``PreferenceConfig`` only; saved as an absolute path). The section names the run's kind:
  ``rlhf_embedded`` / ``rlhf_preference`` for RL runs, ``sft_...`` and ``rm_...`` for runs
  that stop after SFT or the reward model (``stop_after``; the stage scripts), so a logdir of
  one kind does not resume as another."""
  from rljax.alignment import checkpointing

  config_json = checkpointing.config_to_json(config)
  kind = "rlhf" if stop_after == "rl" else stop_after
  if isinstance(config, EmbeddedConfig):
    return dict(section=f"{kind}_embedded", config_json=config_json,
                defaults=ckpt.dataclass_defaults(EmbeddedConfig))
  return dict(section=f"{kind}_preference",
              config_json=dict(config_json, data=os.path.abspath(data)),
              defaults=ckpt.dataclass_defaults(PreferenceConfig))


def check_logdir(config: EmbeddedConfig | PreferenceConfig, logdir: str, *,
                 data: str | None = None, resume: bool = True, stop_after: str = "rl",
                 flag_names: dict[str, str] | None = None) -> None:
  """Whether `run_embedded`/`run_preference` (with ``stop_after``) would accept ``logdir``,
  writing nothing: the scripts call it before ``run_info.json`` is written, so a refused
  command leaves the run's folder as it was. ``flag_names``: the config fields a script's
  flags name otherwise, for the messages (``{"sft_steps": "--num_steps"}``).

  Raises:
    ValueError: ``logdir`` holds a run (saved stages, frozen roles or RL checkpoints) of
      another kind or config, or any (without ``resume``).
  """
  from rljax.alignment import checkpointing

  _refuse_export_without_state(logdir)
  checkpointing.check_logdir(logdir, **saved_config(config, data, stop_after), resume=resume,
                             flag_names=flag_names)


def _prepare(logdir: str | None, config: EmbeddedConfig | PreferenceConfig, data: str | None,
             stop_after: str, resume: bool, log) -> bool:
  """`check_logdir`'s checks, then `rljax.alignment.checkpointing.prepare` (the config
  written); whether the frozen roles are saved to resume RL from (False without a
  ``logdir``)."""
  from rljax.alignment import checkpointing

  if logdir is None:
    return False
  _refuse_export_without_state(logdir)
  return checkpointing.prepare(logdir, **saved_config(config, data, stop_after), resume=resume,
                               log=log)


def _say_if_finished(logdir: str | None, stages: list[str], log) -> None:
  """Logs that a stage script's run in ``logdir`` has nothing left to train when each of its
  ``stages`` is saved as ended (a rerun of a finished run)."""
  from rljax.alignment import checkpointing

  saved = checkpointing.saved_stages(logdir) if logdir is not None else {}
  if stages and all(saved.get(n, {}).get("done") for n in stages):
    log(f"{logdir} has finished its stages ({', '.join(stages)}): nothing left to train")


def _refuse_export_without_state(logdir: str) -> None:
  """A ``logdir`` with an exported model (``hf_model``) but no saved state to resume from (a
  finished run of an rljax version whose stage scripts did not save their stages) is refused:
  a new run there would drop its records and replace its model.

  Raises:
    ValueError: naming ``logdir`` and what it holds.
  """
  from rljax.alignment import checkpointing

  if (os.path.isdir(os.path.join(logdir, HF_MODEL_DIR))
      and checkpointing.saved_state(logdir) is None):
    raise ValueError(f"--logdir {logdir!r} holds a finished run's {HF_MODEL_DIR} but no saved "
                     f"state to resume it from; use a new --logdir (nothing in it was changed)")


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
  :func:`rljax.alignment.checkpointing.run_stage`), and a rerun (``resume``) continues from the
  last save, skipping the stages that ended; the config is checked and saved as the run's kind
  (:func:`saved_config`). Each stage's logged records are also printed through ``log``, one
  line each.

  Raises:
    ValueError: ``logdir`` holds a run with another config (or any run, without ``resume``);
      raised before anything compiles.
    rljax.alignment.checkpointing.Preempted: SIGTERM during RL; the RL state is checkpointed.
    rljax.alignment.checkpointing.StageInterrupted: SIGTERM before RL; the stage's state is
      saved (with a ``logdir``).
  """
  from rljax.alignment import checkpointing

  check_placement(placement, rl=config.rl if stop_after == "rl" else None,
                  batch_sizes={"batch_size": config.batch_size})
  layout = train_layout(placement)
  t0 = time.perf_counter()
  use_ckpt = logdir is not None and stop_after == "rl"  # RL checkpoints and frozen roles
  resuming = _prepare(logdir, config, None, stop_after, resume, log) and use_ckpt
  tok = arithmetic.CharTokenizer()
  task = arithmetic.AdditionTask(max_operand=config.max_operand)
  model = DecoderLM(tiny_lm_config(tok.vocab_size, hidden_size=config.hidden_size,
                                   num_layers=config.num_layers, num_heads=config.num_heads,
                                   num_kv_heads=config.num_kv_heads),
                    rngs=nnx.Rngs(config.seed))
  writer = _writer(logdir)
  s = config.seed
  pre = [([tok.BOS], tok.encode(x, add_special_tokens=False) + [tok.EOS])
         for x in task.pretraining_text(20_000, s + 1)] if not resuming else []
  if resuming:  # the SFT model, saved before the first RL step: exact, and no re-training
    meta = checkpointing.load_frozen(logdir, {"reference": model})
    log(f"loaded the SFT model from {checkpointing.frozen_dir(logdir)}")
  stage_dir = logdir  # where the stages' states are saved (None: nowhere)
  if stop_after != "rl":
    _say_if_finished(logdir, [n for n, steps in (("pretrain", config.pretrain_steps),
                                                 ("sft", config.sft_steps)) if steps], log)
  if config.pretrain_steps and not resuming:
    model, rec = _sft_stage(stage_dir, "pretrain", model, pre, sft.SFTConfig(
        num_steps=config.pretrain_steps, batch_size=config.batch_size,
        learning_rate=config.pretrain_lr, log_every=max(config.pretrain_steps // 3, 1), seed=s),
        pad_id=tok.PAD, writer=writer, layout=layout, sigterm=sigterm, log=log,
        save_every=stage_checkpoint_every)
    log(f"pretrain: {config.pretrain_steps} steps, loss {rec['pretrain/loss']:.3f}")
  t_pre = time.perf_counter()
  examples = sft.tokenize_examples(task.sft_examples(20_000, s + 2), tok, max_prompt_len=16,
                                   max_response_len=8)
  if config.sft_steps and not resuming:
    model, rec = _sft_stage(stage_dir, "sft", model, examples, sft.SFTConfig(
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
      checkpointing.drop_stages(logdir)
  if eval_prompts:
    log(f"greedy exact-match accuracy after SFT: {acc_before:.3f}")
  if stop_after == "sft":
    if writer is not None:
      # Its own stage: redone (not kept) by a rerun, as the saved stages' records are.
      writer.write(config.sft_steps, {"eval/accuracy": acc_before}, stage="eval")
      writer.close()
    return dict(accuracy_before=acc_before, wall_s=time.perf_counter() - t0,
                pretrain_s=t_pre - t0, sft_s=t_sft - t_pre)
  train_prompts = task.prompts(5_000, s + 3)
  trainer = rlhf.RLHFTrainer(config.rl, actor=model, tokenizer=tok,
                             prompts=[tok.encode(p) for p in train_prompts],
                             prompt_texts=train_prompts, reward_fn=arithmetic.addition_reward,
                             placement=placement)

  def show(rec):
    if _shows_step(int(rec["step"]), 20, config.rl.num_steps):
      log(rl_step_line(rec))

  resumed_from = None
  if use_ckpt:
    history, resumed_from = checkpointing.train(
        trainer, logdir, checkpoint_every=checkpoint_every, keep=keep_checkpoints,
        resume=resume, writer=writer, callback=show, log=log, sigterm=sigterm)
    if resumed_from is not None:  # the whole RL history, from before the resume too
      history = checkpointing.rl_history(writer.jsonl_path, history)
  else:
    history = trainer.train(writer=writer, callback=show)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferenceConfig:
  """The real-data pipeline (HH-RLHF format).

  Attributes:
    vocab_size: BPE vocabulary trained on the data.
    hidden_size, num_layers, num_heads, num_kv_heads: the tiny LM.
    max_prompt_len, max_response_len: token truncation (prompt keeps its end).
    pretrain_steps, sft_steps, rm_steps: steps of each stage.
    batch_size: SFT/pre-training batch; ``rm_batch_size``: pairs per RM step.
    lr, rm_lr: learning rates: pre-training at ``lr``, SFT at ``lr / 2`` (unless ``sft_lr``),
      the reward model at ``rm_lr``. Tuned for the tiny model trained from scratch;
      :func:`preference_defaults` gives the lower ones for a pretrained ``model``.
    sft_lr: SFT's learning rate; None (default) means ``lr / 2``. With a ``model`` (no
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
  lr: float = 2e-3
  rm_lr: float = 5e-4
  sft_lr: float | None = None
  rm_margin: float = 0.0
  eval_fraction: float = 0.1
  packing: bool = True
  normalize_reward: bool = True
  reward_norm_samples: int = 256
  rl: rlhf.RLHFConfig = dataclasses.field(default_factory=lambda: rlhf.RLHFConfig(
      algo="ppo", num_steps=100, prompts_per_step=32, max_new_tokens=32, actor_lr=5e-5,
      critic_lr=5e-4, kl_coef=0.1, adaptive_kl=True, kl_target=2.0, kl_horizon=320,
      critic_init="reward", missing_eos_penalty=0.5,
      ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=2, value_clip_eps=0.2)))
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
    for name in ("lr", "rm_lr", "sft_lr"):
      value = getattr(self, name)
      if value is not None and not value > 0:  # also refuses NaN
        raise ValueError(f"{name} must be > 0, got {value}.")

  @property
  def sft_learning_rate(self) -> float:
    """SFT's learning rate: ``sft_lr``, or ``lr / 2`` when that is None."""
    return self.lr / 2 if self.sft_lr is None else self.sft_lr


# Learning rates for a pretrained ``--model``, from OpenRLHF's example scripts for 1-8B models:
# SFT 5e-6 (``lr`` is 1e-5 because SFT runs at ``lr / 2``), reward model 9e-6, PPO actor 5e-7
# and critic 9e-6. ``PreferenceConfig``'s own defaults are tuned for the tiny model trained from
# scratch here (SFT at 1e-3, actor at 5e-5): 200x and 100x these, enough to move a pretrained
# model far from its weights within a few steps.
PRETRAINED_LEARNING_RATES = {"lr": 1e-5, "rm_lr": 9e-6, "actor_lr": 5e-7, "critic_lr": 9e-6}


def preference_defaults(model: str | None = None) -> PreferenceConfig:
  """The default :class:`PreferenceConfig`: as declared, or for a pretrained ``model`` folder
  with that ``model`` and :data:`PRETRAINED_LEARNING_RATES` (what the scripts start from
  before their flags are applied)."""
  config = PreferenceConfig()
  if model is None:
    return config
  lrs = PRETRAINED_LEARNING_RATES
  rl = dataclasses.replace(config.rl, actor_lr=lrs["actor_lr"], critic_lr=lrs["critic_lr"])
  return dataclasses.replace(config, model=model, lr=lrs["lr"], rm_lr=lrs["rm_lr"], rl=rl)


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


# Where the preference pipeline writes its trained model in Hugging Face format.
HF_MODEL_DIR = "hf_model"


def export_hf_model(model: DecoderLM, logdir: str, *, tokenizer_dir: str | None,
                    reward_model: bool = False, log=print) -> str:
  """Writes ``model`` to ``<logdir>/hf_model`` as a Hugging Face folder and returns its path.

  ``config.json``, ``model.safetensors`` and ``generation_config.json``
  (:func:`rljax.models.hf_io.save_hf_checkpoint`) with the tokenizer files of ``tokenizer_dir``
  (``tokenizer.json``, ``tokenizer_config.json``, ...), so ``transformers``'
  ``AutoModelForCausalLM.from_pretrained`` and vLLM load it; ``reward_model`` writes TRL's
  reward-model format instead (``*ForSequenceClassification`` with ``score.weight``, and the
  value and reward heads in ``rljax_heads.safetensors``; ``hf_io.save_hf_checkpoint``). The
  folder is written beside as ``hf_model.partial`` and then renamed, so a crash never leaves a
  half-written ``hf_model``; an older one is replaced. Every process calls it; process 0 writes.
  """
  from rljax.models import hf_io

  path = os.path.join(logdir, HF_MODEL_DIR)
  partial = path + ".partial"
  if runtime.is_primary() and os.path.exists(partial):
    shutil.rmtree(partial)
  hf_io.save_hf_checkpoint(model, partial, copy_files_from=tokenizer_dir,
                           reward_model=reward_model)
  if runtime.is_primary():
    if os.path.exists(path):
      shutil.rmtree(path)
    os.replace(partial, path)
    log(f"saved the model in Hugging Face format to {path}")
  runtime.sync_processes("rljax-export-hf")
  return path


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
  from rljax.alignment import checkpointing

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
  resuming = _prepare(logdir, config, path, stop_after, resume, log) and use_ckpt
  stage_dir = logdir  # where the stages' states are saved (None: nowhere)
  staged = logdir is not None and bool(checkpointing.saved_stages(logdir))  # a stage to continue
  if stop_after != "rl":
    _say_if_finished(logdir, [n for n, run in (
        ("pretrain", config.pretrain_steps and pretrained is None), ("sft", config.sft_steps),
        ("rm", stop_after == "rm" and loaded_rm is None)) if run], log)
  layout = train_layout(placement)
  train_pairs, held_pairs = split_preference_pairs(pairs, config)
  log(f"{path}: {len(pairs)} pairs ({len(train_pairs)} train / {len(held_pairs)} held out)")
  note = held_out_note(len(held_pairs), config.eval_fraction)
  if note is not None and stop_after != "sft":  # SFT scores no held-out pairs
    log(note)
  from rljax.models.tokenizer import load_tokenizer

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
  writer = _writer(logdir)
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
    model, rec = _sft_stage(stage_dir, "pretrain", model, lm_data, sft.SFTConfig(
        num_steps=config.pretrain_steps, batch_size=config.batch_size, learning_rate=config.lr,
        length_buckets=buckets, log_every=50, seed=config.seed, packing=config.packing,
        pack_length=2 * max_len), pad_id=tok.pad_token_id,
        writer=writer, layout=layout, sigterm=sigterm, log=log,
        save_every=stage_checkpoint_every)
    log(f"pretrain: {config.pretrain_steps} steps, loss {rec['pretrain/loss']:.3f}")
  t_pre = time.perf_counter()
  sft_loss = float("nan")
  if config.sft_steps:
    model, rec = _sft_stage(stage_dir, "sft", model, sft_data, sft.SFTConfig(
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
                              layout=layout, should_stop=_stop_on(sigterm), log=log)
    rm_model, ev, _ = checkpointing.run_stage(
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
    checkpointing.drop_stages(logdir)
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
  from rljax.alignment import checkpointing

  t_rm = time.perf_counter()
  trainer = rlhf.RLHFTrainer(config.rl, actor=model, tokenizer=tok, prompts=prompts,
                             reward_model=rm_model, placement=placement)

  def show(rec):
    if _shows_step(int(rec["step"]), 10, config.rl.num_steps):
      log(rl_step_line(rec))

  resumed_from = None
  if use_ckpt:
    history, resumed_from = checkpointing.train(
        trainer, logdir, checkpoint_every=checkpoint_every, keep=keep_checkpoints,
        resume=resume, writer=writer, callback=show, log=log, sigterm=sigterm)
    if resumed_from is not None:
      history = checkpointing.rl_history(writer.jsonl_path, history)
  else:
    history = trainer.train(writer=writer, callback=show)
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


# ---- device placement from the scripts' --mesh / --sharding_rules / --placement flags ----------

PLACEMENTS = ("colocated", "disaggregated")


def make_placement(mesh: str | None = None, sharding_rules: str = "fsdp",
                   placement: str = "colocated", *, offload_frozen: bool = False,
                   ) -> "placement_lib.Placement | None":
  """The RLHF :class:`~rljax.sharding.placement.Placement` the scripts' flags describe.

  Args:
    mesh: ``--mesh=D,F,T`` (``data,fsdp,tensor``). ``colocated``: the mesh over all devices
      (default: all on ``data``). ``disaggregated``: the *training* mesh; the devices it leaves
      generate, laid out on ``tensor`` (default: the largest power of two of devices that
      leaves at least a quarter of them, and at least one, to generate trains on ``fsdp``, so
      that power-of-two batches divide it: 8 devices train on 4 and generate on 4, 16 on 8
      and 8, 2 on 1 and 1; the rest generate).
    sharding_rules: the training preset (``fsdp``, ``fsdp_tp``, ``dp``; :mod:`rljax.sharding.rules`).
      The actor generates in ``tp`` (tensor-parallel, no fsdp all-gathers per decoded token).
    placement: ``colocated`` (all roles on one mesh) or ``disaggregated``.
    offload_frozen: keep the frozen roles (REFERENCE, REWARD) in host memory (``pinned_host``)
      between uses (:func:`rljax.sharding.placement.offload`; on CPU the same RAM).

  Returns:
    ``None`` for a colocated run on one device without ``mesh`` or offload (the plain
    single-device path).

  Raises:
    ValueError: an unknown preset or placement (naming it).
    rljax.sharding.mesh.MeshError: a mesh that does not fit the devices (naming both numbers),
      or a disaggregated run with fewer than 2 devices or no device left for generation.
  """
  from rljax.sharding import mesh as mesh_lib
  from rljax.sharding import placement as placement_lib
  from rljax.sharding import rules as rules_lib

  preset = rules_lib.as_preset(sharding_rules)
  if placement not in PLACEMENTS:
    raise ValueError(f"--placement must be one of {list(PLACEMENTS)}, got {placement!r}")
  cfg = mesh_lib.parse_mesh_flag(mesh)
  n = jax.device_count()
  if placement == "colocated":
    if mesh is None and n == 1 and not offload_frozen:
      return None
    return placement_lib.Placement.colocated(mesh_lib.make_mesh(cfg), train_preset=preset,
                                             offload_frozen=offload_frozen)
  if n < 2:
    raise mesh_lib.MeshError(f"--placement=disaggregated needs >= 2 devices, got {n}")
  if mesh is None:  # the largest power of two that leaves at least a quarter to generate
    num_train = 1 << (n - max(1, n // 4)).bit_length() - 1
    cfg = mesh_lib.MeshConfig(data=1, fsdp=num_train)
  elif cfg.data == -1:
    raise mesh_lib.MeshError(
        f"with --placement=disaggregated, --mesh is the training mesh and needs an explicit data "
        f"size, got {mesh!r}")
  num_train = cfg.data * cfg.fsdp * cfg.tensor
  if num_train >= n:
    raise mesh_lib.MeshError(
        f"--placement=disaggregated: the training mesh data={cfg.data} x fsdp={cfg.fsdp} x "
        f"tensor={cfg.tensor} = {num_train} devices leaves none of the {n} devices for generation")
  return placement_lib.Placement.disaggregated_split(num_generate=n - num_train, train_mesh=cfg,
                                                     train_preset=preset,
                                                     offload_frozen=offload_frozen)


def train_layout(placement) -> "layout_lib.TrainLayout | None":
  """The SFT / reward-model layout of a placement: the actor's training mesh and preset."""
  from rljax.alignment import layout as layout_lib
  from rljax.sharding.placement import Role

  return None if placement is None else layout_lib.TrainLayout.of(placement[Role.ACTOR])


def check_placement(placement, *, rl: rlhf.RLHFConfig | None = None,
                    batch_sizes: dict[str, int] | None = None) -> None:
  """Checks, before anything compiles, that the batches split over the training data axes.

  Args:
    placement: from :func:`make_placement` (``None``: nothing to check).
    rl: its ``prompts_per_step * group_size`` is checked.
    batch_sizes: more ``{name: rows}`` to check (SFT batch, reward-model rows).

  Raises:
    rljax.sharding.mesh.MeshError: naming the batch, its size and the data axes' sizes.
  """
  layout = train_layout(placement)
  if layout is None:
    return
  sizes = dict(batch_sizes or {})
  if rl is not None:
    sizes["prompts_per_step * group_size"] = rl.batch_size
  for what, size in sizes.items():
    layout.check_batch(size, what=what)
