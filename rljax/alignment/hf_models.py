"""Hugging Face model folders in the alignment pipelines: pretrained models and reward models
read (``--model``, ``--reward_model``), checked before a run writes anything, and trained
models written as ``<logdir>/hf_model`` (`export_hf_model`).
"""

from __future__ import annotations

import os
import shutil

from flax import nnx

from rljax import runtime
from rljax.alignment.pipeline_config import PreferenceConfig
from rljax.models import hf_io
from rljax.models.llm import DecoderLM, LMConfig
from rljax.models.tokenizer import load_tokenizer
from rljax.sharding import rules as rules_lib

# Where the preference pipeline writes its trained model in Hugging Face format.
HF_MODEL_DIR = "hf_model"


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
  lm_config = hf_folder_config(path, "--model", dtype)
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


def hf_folder_config(path: str, flag: str, dtype: str) -> LMConfig:
  """The ``LMConfig`` of the Hugging Face folder that ``flag`` names, checked.

  Raises:
    FileNotFoundError: no such folder, or no ``config.json`` in it.
    ValueError: an unusable ``config.json`` (naming ``flag``, the folder and why).
  """
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
  """:func:`hf_folder_config` of a ``--reward_model`` folder, which must hold a trained head.

  Raises:
    FileNotFoundError, ValueError: as :func:`hf_folder_config`; ValueError also for a folder
      with neither a ``*ForSequenceClassification`` config nor ``rljax_heads.safetensors``.
  """
  lm_config = hf_folder_config(path, "--reward_model", dtype)
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
  if config.model is not None:
    hf_folder_config(config.model, "--model", "float32")
    hf_io.check_hf_checkpoint(config.model)  # tensor names and shapes, from the headers
  if config.reward_model is not None:
    _reward_folder_config(config.reward_model, "float32")
    hf_io.check_hf_checkpoint(config.reward_model)


def _load_hf_folder(path: str, lm_config: LMConfig, *, layout, seed: int, dtype: str) -> DecoderLM:
  """``hf_io.load_hf_checkpoint``, each tensor placed in ``layout``'s training sharding."""
  shardings = None
  if layout is not None:
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
