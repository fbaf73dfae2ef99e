"""Hugging Face checkpoint IO for :class:`rljax.models.llm.DecoderLM`.

A Hugging Face checkpoint folder holds ``config.json`` and either ``model.safetensors`` or a
sharded set ``model-0000k-of-0000n.safetensors`` listed in ``model.safetensors.index.json``.
:func:`load_hf_checkpoint` reads it with the ``safetensors`` library (one tensor in host memory at
a time), converts each tensor to rljax's layout, checks its shape against ``config.json`` and
places it on a target sharding when one is given. :func:`save_hf_checkpoint` writes the same
format back, so ``transformers`` ``from_pretrained`` (and vLLM) load a trained policy.

Layout map (Hugging Face ``nn.Linear`` weights are ``[out, in]``; rljax kernels are ``[in, out]``
with heads split out)::

  model.embed_tokens.weight                [V, E]      -> embed                 [V, E]
  model.layers.i.self_attn.q_proj.weight   [H*D, E]    -> layers.i.attn.q_kernel [E, H, D]
  model.layers.i.self_attn.{k,v}_proj.weight [K*D, E] -> layers.i.attn.kv_kernel [E, 2, K, D]
  model.layers.i.self_attn.o_proj.weight   [E, H*D]    -> layers.i.attn.o_kernel [H, D, E]
  model.layers.i.mlp.{gate,up}_proj.weight [M, E]      -> layers.i.mlp.gate_up_kernel [E, 2, M]
  model.layers.i.mlp.down_proj.weight      [E, M]      -> layers.i.mlp.down_kernel [M, E]
  model.layers.i.input_layernorm.weight    [E]         -> layers.i.input_norm.scale
  model.norm.weight                        [E]         -> final_norm.scale
  lm_head.weight                           [V, E]      -> lm_head [E, V]  (absent when tied)

The value and reward heads have no Hugging Face counterpart; they are saved to a separate
``rljax_heads.safetensors`` only when asked (so vLLM never sees unknown tensors).

A reward model is saved as ``{Llama,Qwen2}ForSequenceClassification`` with ``num_labels`` 1, the
format of TRL's ``RewardTrainer`` (``AutoModelForSequenceClassification`` reads it; its score is
``score.weight`` applied at the last non-padding token): ``score.weight [1, E]`` is the reward
head's kernel, and there is no ``lm_head``. ``score`` has no bias, so the reward head's bias
(0 after Bradley-Terry training, whose loss only sees score differences) lives, with the value
head, in ``rljax_heads.safetensors``. Such a folder, from rljax or from TRL, loads back into a
``DecoderLM`` whose reward head is ``score.weight`` (bias 0 without the heads file) and whose
LM head, which the folder lacks, is zero (uniform logits; scores do not use it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx

from rljax.models import llm

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
HEADS_FILE = "rljax_heads.safetensors"
SCORE_TENSOR = "score.weight"  # AutoModelForSequenceClassification's head, [num_labels, E]
_REWARD_ARCHITECTURES = {"llama": "LlamaForSequenceClassification",
                         "qwen2": "Qwen2ForSequenceClassification"}
# Files copied next to the weights by ``save_hf_checkpoint(..., copy_files_from=...)``.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json", GENERATION_CONFIG_FILE)

Path = tuple[Any, ...]
ShardingSpec = (jax.sharding.Sharding | Callable[[Path, tuple], jax.sharding.Sharding | None]
                | Mapping[Path, jax.sharding.Sharding] | nnx.State | None)


class CheckpointError(ValueError):
  """A checkpoint does not match its config (missing tensor, wrong shape)."""


@dataclasses.dataclass(frozen=True)
class _TensorMap:
  """Hugging Face tensors (one or more) <-> one rljax parameter."""

  hf_names: tuple[str, ...]
  path: Path                                  # path in the nnx state
  hf_shapes: tuple[tuple[int, ...], ...]      # what config.json implies, per HF tensor
  to_rljax: Callable[..., np.ndarray]         # HF arrays (in hf_names order) -> rljax array
  to_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]


def _one(name, path, shape, to_rljax=None, to_hf=None) -> _TensorMap:
  to_rljax = to_rljax or (lambda x: x)
  to_hf = to_hf or (lambda x: x)
  return _TensorMap((name,), path, (shape,), to_rljax, lambda x: (to_hf(x),))


def _tensor_maps(c: llm.LMConfig, *, lm_head: bool = True) -> list[_TensorMap]:
  """The full name/layout table for config ``c`` (without ``lm_head.weight`` unless ``lm_head``:
  a sequence-classification folder has none)."""
  e, h, k, d, m, v = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                      c.intermediate_size, c.vocab_size)
  t = lambda x: np.ascontiguousarray(x.T)  # noqa: E731
  maps = [_one("model.embed_tokens.weight", ("embed",), (v, e)),
          _one("model.norm.weight", ("final_norm", "scale"), (e,))]
  if lm_head and not c.tie_word_embeddings:
    maps.append(_one("lm_head.weight", ("lm_head",), (v, e), t, t))
  for i in range(c.num_layers):
    p = f"model.layers.{i}."
    attn, mlp = ("layers", i, "attn"), ("layers", i, "mlp")
    maps += [
        _one(p + "input_layernorm.weight", ("layers", i, "input_norm", "scale"), (e,)),
        _one(p + "post_attention_layernorm.weight", ("layers", i, "post_attn_norm", "scale"), (e,)),
        # HF [H*D, E] <-> rljax [E, H, D]
        _one(p + "self_attn.q_proj.weight", attn + ("q_kernel",), (h * d, e),
             lambda x: t(x).reshape(e, h, d), lambda x: t(x.reshape(e, h * d))),
        # HF k, v [K*D, E] each <-> rljax [E, 2, K, D]
        _TensorMap((p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                   attn + ("kv_kernel",), ((k * d, e), (k * d, e)),
                   lambda wk, wv: np.stack([t(wk), t(wv)], 1).reshape(e, 2, k, d),
                   lambda x: (t(x[:, 0].reshape(e, k * d)), t(x[:, 1].reshape(e, k * d)))),
        # HF [E, H*D] <-> rljax [H, D, E]
        _one(p + "self_attn.o_proj.weight", attn + ("o_kernel",), (e, h * d),
             lambda x: t(x).reshape(h, d, e), lambda x: t(x.reshape(h * d, e))),
        # HF gate, up [M, E] each <-> rljax [E, 2, M]
        _TensorMap((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                   mlp + ("gate_up_kernel",), ((m, e), (m, e)),
                   lambda wg, wu: np.stack([t(wg), t(wu)], 1),
                   lambda x: (t(x[:, 0]), t(x[:, 1]))),
        _one(p + "mlp.down_proj.weight", mlp + ("down_kernel",), (e, m), t, t),
    ]
    if c.qkv_bias:
      maps += [
          _one(p + "self_attn.q_proj.bias", attn + ("q_bias",), (h * d,),
               lambda x: x.reshape(h, d), lambda x: x.reshape(h * d)),
          _TensorMap((p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"),
                     attn + ("kv_bias",), ((k * d,), (k * d,)),
                     lambda bk, bv: np.stack([bk, bv]).reshape(2, k, d),
                     lambda x: (x[0].reshape(k * d), x[1].reshape(k * d))),
      ]
    if c.o_bias:
      maps.append(_one(p + "self_attn.o_proj.bias", attn + ("o_bias",), (e,)))
    if c.mlp_bias:
      maps += [
          _TensorMap((p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"),
                     mlp + ("gate_up_bias",), ((m,), (m,)),
                     lambda bg, bu: np.stack([bg, bu]), lambda x: (x[0], x[1])),
          _one(p + "mlp.down_proj.bias", mlp + ("down_bias",), (e,)),
      ]
  return maps


_HEAD_NAMES = {
    ("value_head", "kernel"): "value_head.kernel",
    ("value_head", "bias"): "value_head.bias",
    ("reward_head", "kernel"): "reward_head.kernel",
    ("reward_head", "bias"): "reward_head.bias",
}


def is_reward_model_config(hf_config: Mapping[str, Any]) -> bool:
  """Whether a ``config.json`` dict describes a sequence-classification (reward) model."""
  return any(str(a).endswith("ForSequenceClassification")
             for a in hf_config.get("architectures") or ())


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """``config.json`` of a checkpoint folder as a dict.

  Raises:
    FileNotFoundError: if the folder has no ``config.json``.
  """
  with open(os.path.join(path, CONFIG_FILE)) as f:
    return json.load(f)


class _TensorSource:
  """Name -> numpy tensor over one ``model.safetensors`` or a sharded index."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    index = os.path.join(self.path, INDEX_FILE)
    single = os.path.join(self.path, SINGLE_FILE)
    if os.path.exists(index):
      with open(index) as f:
        self.files = dict(json.load(f)["weight_map"])
    elif os.path.exists(single):
      with safetensors.safe_open(single, framework="numpy") as f:
        self.files = {name: SINGLE_FILE for name in f.keys()}
    else:
      raise FileNotFoundError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    self._open: dict[str, Any] = {}

  def __contains__(self, name: str) -> bool:
    return name in self.files

  def get(self, name: str) -> np.ndarray:
    fname = self.files[name]
    if fname not in self._open:
      self._open[fname] = safetensors.safe_open(os.path.join(self.path, fname), framework="numpy")
    return self._open[fname].get_tensor(name)

  def shape(self, name: str) -> tuple[int, ...]:
    fname = self.files[name]
    if fname not in self._open:
      self._open[fname] = safetensors.safe_open(os.path.join(self.path, fname), framework="numpy")
    return tuple(self._open[fname].get_slice(name).get_shape())

  def close(self):
    for f in self._open.values():
      if hasattr(f, "__exit__"):
        f.__exit__(None, None, None)
    self._open.clear()


def _sharding_lookup(shardings: ShardingSpec) -> Callable[[Path, tuple], Any]:
  if shardings is None:
    return lambda path, names: None
  if isinstance(shardings, jax.sharding.Sharding):
    return lambda path, names: shardings
  if isinstance(shardings, nnx.State):
    flat = {p: (s.get_value() if isinstance(s, nnx.Variable) else s)
            for p, s in nnx.to_flat_state(shardings)}
    return lambda path, names: flat.get(path)
  if isinstance(shardings, Mapping):
    return lambda path, names: shardings.get(path)
  if callable(shardings):
    return shardings
  raise TypeError(f"unsupported shardings argument of type {type(shardings).__name__}")


def _place(arr: np.ndarray, sharding) -> jax.Array:
  if sharding is None:
    return jnp.asarray(arr)
  # Each device (or host, multi-process) materialises only its own slice of the host tensor.
  return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def _np_dtype(dtype) -> np.dtype:
  dtype = jnp.dtype(dtype)
  return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def _check_tensors(source: "_TensorSource", config: llm.LMConfig,
                   hf_config: Mapping[str, Any]) -> None:
  """Every tensor ``config.json`` implies is in ``source`` with its shape (safetensors headers
  only; nothing is read). A reward-model folder needs ``score.weight [1, E]`` and no
  ``lm_head.weight``.

  Raises:
    CheckpointError: naming the missing or misshapen tensor and both shapes.
  """
  reward_folder = is_reward_model_config(hf_config)
  expected_shapes = [(n, shape) for tm in _tensor_maps(config, lm_head=not reward_folder)
                     for n, shape in zip(tm.hf_names, tm.hf_shapes)]
  if reward_folder:
    if SCORE_TENSOR not in source:
      raise CheckpointError(f"tensor {SCORE_TENSOR!r} is missing from {source.path} (needed "
                            f"by config.json's architectures {hf_config['architectures']})")
    expected = (1, config.hidden_size)
    if source.shape(SCORE_TENSOR) != expected:
      raise CheckpointError(
          f"tensor {SCORE_TENSOR!r} in {source.path} has shape {source.shape(SCORE_TENSOR)}, "
          f"expected {expected}: a reward model has one label (num_labels=1)")
  for name, expected in expected_shapes:
    if name not in source:
      raise CheckpointError(
          f"tensor {name!r} is missing from {source.path} (needed by config.json: "
          f"model_type={config.model_type}, tie_word_embeddings={config.tie_word_embeddings})")
    found = source.shape(name)
    if found != expected:
      raise CheckpointError(
          f"tensor {name!r} in {source.path} has shape {found}, but config.json implies "
          f"{expected}")


def check_hf_checkpoint(path: str | os.PathLike) -> None:
  """Checks a checkpoint folder as :func:`load_hf_checkpoint` would, from ``config.json`` and
  the safetensors headers alone (no tensor is read).

  Raises:
    As :func:`load_hf_checkpoint`.
  """
  hf_config = read_hf_config(path)
  config = llm.LMConfig.from_hf_config(hf_config)
  source = _TensorSource(path)
  try:
    _check_tensors(source, config, hf_config)
  finally:
    source.close()


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    shardings: ShardingSpec = None,
    seed: int = 0,
) -> llm.DecoderLM:
  """Loads a Hugging Face Llama/Qwen2 checkpoint folder into a :class:`~rljax.models.llm.DecoderLM`.

  A ``*ForSequenceClassification`` folder (a reward model, e.g. TRL's ``RewardTrainer`` output
  or ``save_hf_checkpoint(..., reward_model=True)``) has ``score.weight [1, E]`` instead of
  ``lm_head.weight``: it becomes the reward head's kernel (unless ``rljax_heads.safetensors``
  holds the exact heads) and the LM head is zero.

  Args:
    path: folder with ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json``.
    dtype: parameter/activation dtype of the returned model, ``'float32'`` or ``'bfloat16'``
      (tensors are cast on the host while loading).
    shardings: where to put each parameter: ``None`` (default device), one
      ``jax.sharding.Sharding`` for all, a mapping or ``nnx.State`` of shardings keyed like the
      model state (e.g. from ``nnx.get_named_sharding``), or a callable
      ``(state_path, logical_axis_names) -> Sharding | None``. Each tensor is created directly
      with that sharding via ``jax.make_array_from_callback``.
    seed: initialises the value/reward heads when the folder has no ``rljax_heads.safetensors``.

  Returns:
    The model, with parameters from the checkpoint.

  Raises:
    ValueError: unsupported ``model_type`` (or other unsupported config field), naming it.
    CheckpointError: a tensor is missing or its shape does not match ``config.json`` (for a
      reward model folder: ``score.weight`` other than ``[1, E]``); the message names the
      tensor, the expected and the found shape.
    FileNotFoundError: no ``config.json`` or no safetensors weights in the folder.
  """
  hf_config = read_hf_config(path)
  config = llm.LMConfig.from_hf_config(hf_config, dtype=dtype)
  reward_folder = is_reward_model_config(hf_config)
  abstract = nnx.eval_shape(lambda: llm.DecoderLM(config, rngs=nnx.Rngs(seed)))
  graphdef, abstract_state = nnx.split(abstract)
  variables = dict(nnx.to_flat_state(abstract_state))
  where = _sharding_lookup(shardings)
  param_dtype = _np_dtype(config.jnp_dtype)

  def put(p: Path, arr: np.ndarray) -> jax.Array:
    return _place(arr, where(p, variables[p].get_metadata().get("out_sharding")))

  source = _TensorSource(path)
  values: dict[Path, jax.Array] = {}
  score = None
  try:
    _check_tensors(source, config, hf_config)
    if reward_folder:  # TRL's reward model format: score.weight [1, E], no lm_head
      score = source.get(SCORE_TENSOR)[0].astype(np.float32)
      if not config.tie_word_embeddings:
        values[("lm_head",)] = put(("lm_head",), np.zeros(
            variables[("lm_head",)].get_value().shape, param_dtype))
    for tm in _tensor_maps(config, lm_head=not reward_folder):
      arr = tm.to_rljax(*(source.get(name) for name in tm.hf_names)).astype(param_dtype)
      values[tm.path] = put(tm.path, arr)
  finally:
    source.close()

  heads_file = os.path.join(path, HEADS_FILE)
  if os.path.exists(heads_file):
    with safetensors.safe_open(heads_file, framework="numpy") as f:
      for p, name in _HEAD_NAMES.items():
        arr = f.get_tensor(name).astype(np.float32)
        expected = variables[p].get_value().shape
        if arr.shape != expected:
          raise CheckpointError(
              f"tensor {name!r} in {heads_file} has shape {arr.shape}, expected {expected}")
        values[p] = put(p, arr)
  else:
    rngs = nnx.Rngs(seed)
    for head in ("value_head", "reward_head"):
      fresh = nnx.to_flat_state(nnx.state(llm.ScalarHead(config.hidden_size, rngs=rngs)))
      for sub, v in fresh:
        p = (head,) + tuple(sub)
        values[p] = put(p, np.asarray(v.get_value()))
    if score is not None:  # bias: the fresh head's 0, as HF's bias-free score
      values[("reward_head", "kernel")] = put(("reward_head", "kernel"), score)

  missing = set(variables) - set(values)
  if missing:  # pragma: no cover - guards the name table against model changes
    raise CheckpointError(f"no checkpoint tensor maps to parameters {sorted(missing)}")
  state = nnx.from_flat_state([(p, variables[p].replace(values[p])) for p in variables])
  return nnx.merge(graphdef, state)


def _to_host(x: jax.Array) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def _save_safetensors(tensors: dict[str, np.ndarray], file: str, metadata: dict[str, str]) -> None:
  """``safetensors.numpy.save_file``, then the mode a plain ``open`` gives (``0o666`` less the
  umask): safetensors creates its files ``0o600``, which a server running as another user
  (e.g. vLLM) could not read beside the ``0o644`` config and tokenizer files."""
  from rljax.checkpoint import current_umask  # imports orbax: only when saving

  safetensors.numpy.save_file(tensors, file, metadata=metadata)
  os.chmod(file, 0o666 & ~current_umask())


def _write_shards(tensors: dict[str, np.ndarray], path: str, max_shard_bytes: int) -> None:
  total = sum(a.nbytes for a in tensors.values())
  meta = {"format": "pt"}
  if total <= max_shard_bytes:
    _save_safetensors(tensors, os.path.join(path, SINGLE_FILE), meta)
    return
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, arr in tensors.items():
    if shards[-1] and size + arr.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = arr
    size += arr.nbytes
  weight_map = {}
  n = len(shards)
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    _save_safetensors(shard, os.path.join(path, fname), meta)
    weight_map.update({name: fname for name in shard})
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_hf_checkpoint(
    model: llm.DecoderLM,
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_size: int = 5 * 1024**3,
    include_heads: bool = False,
    copy_files_from: str | os.PathLike | None = None,
    reward_model: bool = False,
) -> None:
  """Writes ``model`` as a Hugging Face checkpoint folder that ``transformers`` and vLLM load.

  Writes ``config.json``, ``model.safetensors`` (or shards plus ``model.safetensors.index.json``
  when larger than ``max_shard_size`` bytes) and, when the config has EOS ids,
  ``generation_config.json``. Multi-host: every process must call it (arrays are gathered), only
  process 0 writes.

  Args:
    model: the model to save.
    path: output folder (created if needed).
    dtype: tensor dtype on disk (``'float32'``/``'bfloat16'``); default the model's dtype.
    max_shard_size: maximum bytes per safetensors file.
    include_heads: also write the value and reward heads to ``rljax_heads.safetensors``.
    copy_files_from: a folder whose tokenizer and generation-config files are copied alongside.
    reward_model: save as ``{Llama,Qwen2}ForSequenceClassification`` (``num_labels`` 1), the
      format ``AutoModelForSequenceClassification`` and TRL read: ``score.weight`` is the
      reward head's kernel ``[1, E]``, no ``lm_head``; implies ``include_heads`` (the exact
      heads, with the reward bias that ``score`` lacks).
  """
  config: llm.LMConfig = model.config
  dtype = dtype or config.dtype
  np_dtype = _np_dtype(dtype)
  flat = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  tensors = {}
  for tm in _tensor_maps(config, lm_head=not reward_model):
    for name, arr in zip(tm.hf_names, tm.to_hf(_to_host(flat[tm.path]).astype(np_dtype))):
      tensors[name] = np.array(arr, order="C")
  hf_config = config.to_hf_config(torch_dtype=dtype)
  if reward_model:
    kernel = _to_host(flat[("reward_head", "kernel")])
    tensors[SCORE_TENSOR] = np.array(kernel[None, :], dtype=np_dtype, order="C")
    hf_config.update(architectures=[_REWARD_ARCHITECTURES[config.model_type]],
                     id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
  heads = {name: np.array(_to_host(flat[p]), dtype=np.float32, order="C")
           for p, name in _HEAD_NAMES.items()} if include_heads or reward_model else None
  if jax.process_index() != 0:
    return
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  if copy_files_from is not None:
    for name in TOKENIZER_FILES:
      src = os.path.join(copy_files_from, name)
      if os.path.exists(src):
        shutil.copyfile(src, os.path.join(path, name))
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)
  _write_shards(tensors, path, max_shard_size)
  if heads is not None:
    _save_safetensors(heads, os.path.join(path, HEADS_FILE), {"format": "pt"})
  gen_path = os.path.join(path, GENERATION_CONFIG_FILE)
  if config.eos_token_id and not os.path.exists(gen_path):
    eos = list(config.eos_token_id)
    with open(gen_path, "w") as f:
      json.dump({"bos_token_id": config.bos_token_id,
                 "eos_token_id": eos[0] if len(eos) == 1 else eos,
                 "pad_token_id": config.pad_token_id}, f, indent=2)
