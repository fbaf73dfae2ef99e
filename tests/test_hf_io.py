"""Tests for rljax.models.hf_io and rljax.models.tokenizer against transformers."""

import json
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
import torch
import transformers
from tokenizers import models as tok_models
from tokenizers import pre_tokenizers, processors

from rljax.models import hf_io
from rljax.models import tokenizer as tok_lib

VOCAB = 80


def _hf_model(kind: str, **overrides):
  torch.manual_seed(1)
  kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, eos_token_id=[3, 4], bos_token_id=1)
  kw.update(overrides)
  if kind == "llama":
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
  return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw)).eval()


def _logits(hf_model, tokens):
  with torch.no_grad():
    return hf_model(torch.tensor(tokens)).logits.numpy()


TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, 17))


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize("kind,kw", [
    ("llama", {}),
    ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 50_000.0, "attention_bias": True}),
    ("qwen2", {"tie_word_embeddings": True}),
])
def test_round_trip_loads_in_transformers(tmp_path, kind, kw):
  hf = _hf_model(kind, **kw)
  hf.save_pretrained(tmp_path / "src")
  model = hf_io.load_hf_checkpoint(tmp_path / "src")
  hf_io.save_hf_checkpoint(model, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert type(reloaded) is type(hf)
  np.testing.assert_allclose(_logits(reloaded, TOKENS), _logits(hf, TOKENS), atol=1e-6)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), _logits(reloaded, TOKENS),
                             atol=1e-4)
  gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
  assert gen["eos_token_id"] == [3, 4]
  # Weights are readable as the config is (safetensors alone creates its files 0o600).
  modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "out").iterdir()}
  assert modes["model.safetensors"] == modes["config.json"], modes


def test_sharded_checkpoints_both_ways(tmp_path):
  hf = _hf_model("llama")
  hf.save_pretrained(tmp_path / "src", max_shard_size="20KB")
  assert (tmp_path / "src" / hf_io.INDEX_FILE).exists()
  model = hf_io.load_hf_checkpoint(tmp_path / "src")
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), _logits(hf, TOKENS),
                             atol=1e-4)
  hf_io.save_hf_checkpoint(model, tmp_path / "out", max_shard_size=20_000)
  index = json.loads((tmp_path / "out" / hf_io.INDEX_FILE).read_text())
  assert len(set(index["weight_map"].values())) > 1
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  np.testing.assert_allclose(_logits(reloaded, TOKENS), _logits(hf, TOKENS), atol=1e-6)


def test_bf16_save_and_load(tmp_path):
  hf = _hf_model("qwen2")
  hf.save_pretrained(tmp_path / "src")
  model = hf_io.load_hf_checkpoint(tmp_path / "src", dtype="bfloat16")
  hf_io.save_hf_checkpoint(model, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
  assert reloaded.dtype == torch.bfloat16
  back = hf_io.load_hf_checkpoint(tmp_path / "out", dtype="bfloat16")
  np.testing.assert_array_equal(
      np.asarray(back.layers[1].mlp.down_kernel[...], np.float32),
      np.asarray(model.layers[1].mlp.down_kernel[...], np.float32))


def test_heads_saved_only_on_request(tmp_path):
  hf = _hf_model("llama")
  hf.save_pretrained(tmp_path / "src")
  model = hf_io.load_hf_checkpoint(tmp_path / "src", seed=3)
  model.value_head.bias[...] = jnp.float32(1.5)
  hf_io.save_hf_checkpoint(model, tmp_path / "plain")
  assert not (tmp_path / "plain" / hf_io.HEADS_FILE).exists()
  hf_io.save_hf_checkpoint(model, tmp_path / "heads", include_heads=True)
  back = hf_io.load_hf_checkpoint(tmp_path / "heads")
  assert float(back.value_head.bias[...]) == 1.5
  np.testing.assert_array_equal(back.reward_head.kernel[...], model.reward_head.kernel[...])


# Right-padded rows (pad id 0 never occurs in the content): the last real token is at 16 and 9.
RM_TOKENS = np.random.RandomState(2).randint(5, VOCAB, (2, 17))
RM_MASK = np.ones_like(RM_TOKENS)
RM_MASK[1, 10:] = 0
RM_TOKENS[RM_MASK == 0] = 0


def _rljax_scores(model):
  hidden, _ = model.hidden_states(jnp.asarray(RM_TOKENS), attention_mask=jnp.asarray(RM_MASK))
  return np.asarray(model.rewards(hidden, jnp.asarray(RM_MASK)))


def _hf_scores(path):
  hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(
      path, output_loading_info=True)
  with torch.no_grad():
    out = hf.eval()(torch.tensor(RM_TOKENS), attention_mask=torch.tensor(RM_MASK)).logits
  return out.numpy(), info, hf


@pytest.mark.parametrize("kind,tied", [("llama", False), ("qwen2", True)])
def test_reward_model_saves_as_sequence_classification(tmp_path, kind, tied):
  """``reward_model=True`` writes TRL's reward-model format: transformers'
  ``AutoModelForSequenceClassification`` loads it with no missing weight and scores the
  right-padded rows as rljax does (at the last non-padding token); rljax loads it back with
  the exact heads, including a reward bias that HF's bias-free ``score`` cannot hold."""
  _hf_model(kind, tie_word_embeddings=tied, pad_token_id=0).save_pretrained(tmp_path / "src")
  model = hf_io.load_hf_checkpoint(tmp_path / "src", seed=4)
  hf_io.save_hf_checkpoint(model, tmp_path / "rm", reward_model=True)
  config = json.loads((tmp_path / "rm" / "config.json").read_text())
  assert config["architectures"] == [hf_io._REWARD_ARCHITECTURES[kind]]
  tensors = safetensors.numpy.load_file(tmp_path / "rm" / "model.safetensors")
  assert "lm_head.weight" not in tensors and tensors["score.weight"].shape == (1, 32)
  scores, info, hf = _hf_scores(tmp_path / "rm")
  assert type(hf).__name__ == hf_io._REWARD_ARCHITECTURES[kind]
  assert not info["missing_keys"], info
  assert scores.shape == (2, 1)
  np.testing.assert_allclose(scores[:, 0], _rljax_scores(model), atol=1e-4)
  # Back into rljax: identical scores; a reward bias survives in rljax_heads.safetensors.
  model.reward_head.bias[...] = jnp.float32(0.75)
  hf_io.save_hf_checkpoint(model, tmp_path / "rm_bias", reward_model=True)
  back = hf_io.load_hf_checkpoint(tmp_path / "rm_bias")
  np.testing.assert_allclose(_rljax_scores(back), _rljax_scores(model), atol=1e-6)
  assert float(back.reward_head.bias[...]) == 0.75


def test_transformers_reward_model_folder_loads(tmp_path):
  """A ``Qwen2ForSequenceClassification`` saved by transformers (what TRL's RewardTrainer
  writes; no rljax heads file): rljax's reward head is ``score.weight`` with bias 0 and its
  scores equal HF's logits; a 2-label head is refused, naming the tensor."""
  torch.manual_seed(3)
  cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, pad_token_id=0, num_labels=1)
  transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "trl")
  model = hf_io.load_hf_checkpoint(tmp_path / "trl")
  scores, _, _ = _hf_scores(tmp_path / "trl")
  np.testing.assert_allclose(_rljax_scores(model), scores[:, 0], atol=1e-4)
  assert float(model.reward_head.bias[...]) == 0.0
  assert not np.any(np.asarray(model.lm_head[...]))  # the folder has no LM head
  cfg.num_labels = 2
  transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "two")
  with pytest.raises(hf_io.CheckpointError,
                     match=r"'score\.weight' .* has shape \(2, 32\), expected \(1, 32\)"):
    hf_io.load_hf_checkpoint(tmp_path / "two")


def test_target_sharding(tmp_path):
  hf = _hf_model("llama")
  hf.save_pretrained(tmp_path / "src")
  mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  named = jax.sharding.NamedSharding(mesh, jax.P())
  model = hf_io.load_hf_checkpoint(tmp_path / "src", shardings=named)
  assert model.layers[0].attn.q_kernel[...].sharding == named
  seen = []

  def by_name(path, logical_axes):
    seen.append((path, logical_axes))
    spec = jax.P(*("fsdp" if a == "embed" else None for a in logical_axes))
    return jax.sharding.NamedSharding(mesh, spec)

  model = hf_io.load_hf_checkpoint(tmp_path / "src", shardings=by_name)
  assert (("layers", 0, "mlp", "gate_up_kernel"), ("embed", None, "mlp")) in seen
  assert model.layers[0].mlp.gate_up_kernel[...].sharding.spec == jax.P("fsdp", None, None)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), _logits(hf, TOKENS),
                             atol=1e-4)


def test_shape_mismatch_names_the_tensor(tmp_path):
  hf = _hf_model("llama")
  hf.save_pretrained(tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["intermediate_size"] = 64
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf_io.CheckpointError,
                     match=r"'model\.layers\.0\.mlp\.gate_proj\.weight'.*\(48, 32\).*\(64, 32\)"):
    hf_io.load_hf_checkpoint(tmp_path)


def test_missing_tensor_names_it(tmp_path):
  hf = _hf_model("llama")
  hf.save_pretrained(tmp_path)
  path = tmp_path / "model.safetensors"
  tensors = safetensors.numpy.load_file(path)
  del tensors["model.layers.1.self_attn.v_proj.weight"]
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(hf_io.CheckpointError, match=r"'model\.layers\.1\.self_attn\.v_proj\.weight'"):
    hf_io.load_hf_checkpoint(tmp_path)


def test_unsupported_model_type_is_named(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "vocab_size": 8}))
  with pytest.raises(ValueError, match="unsupported model_type 'mistral'"):
    hf_io.load_hf_checkpoint(tmp_path)


# ---- tokenizers -----------------------------------------------------------------------------

WORDS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "hello", "world",
         "user", "assistant", "system", "you", "are", "a", "bot", "hi", "\n", ":", "<unk>"]
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}<|im_end|>\n{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tok")
  backend = tokenizers.Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                                      unk_token="<unk>"))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  backend.add_special_tokens(WORDS[:6])
  backend.post_processor = processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
  hf_tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
      unk_token="<unk>")
  hf_tok.chat_template = TEMPLATE
  hf_tok.save_pretrained(folder)
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 4]}))
  return folder


def test_tokenizer_matches_transformers(tokenizer_dir):
  hf_tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  tok = tok_lib.load_tokenizer(tokenizer_dir)
  text = "hello world : you are a bot"
  assert tok.encode(text) == hf_tok(text).input_ids == [1, 6, 7, 17, 11, 12, 13, 14]
  plain = hf_tok(text, add_special_tokens=False).input_ids
  assert tok.encode(text, add_special_tokens=False) == plain
  assert tok.decode([1, 6, 7, 2]) == hf_tok.decode([1, 6, 7, 2], skip_special_tokens=True)
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
  assert tok.vocab_size == len(WORDS)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(tokenizer_dir, add_generation_prompt):
  hf_tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  tok = tok_lib.load_tokenizer(tokenizer_dir)
  messages = [{"role": "system", "content": "you are a bot"}, {"role": "user", "content": "hi"}]
  tools = [{"name": "hello", "parameters": {}}]
  for kwargs in ({}, {"tools": tools}):
    ref_text = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                          tokenize=False, **kwargs)
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                   tokenize=False, **kwargs)
    assert text == ref_text
    ref_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
    if isinstance(ref_ids, Mapping):
      ref_ids = ref_ids["input_ids"]
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                   **kwargs) == list(ref_ids)
  # <|im_start|> system \n you are a bot <|im_end|> \n ... : starts with id 3, then "system" (10).
  assert tok.apply_chat_template(messages)[:2] == [3, 10]


def test_generation_config_eos_ids(tokenizer_dir):
  gen = tok_lib.load_generation_config(tokenizer_dir)
  assert gen.eos_token_ids == (5, 4)
  tok = tok_lib.load_tokenizer(tokenizer_dir)
  # Every generation_config id, then the tokenizer's own eos_token (</s> = 2).
  assert tok_lib.eos_token_ids(tokenizer_dir, tok) == (5, 4, 2)


def test_save_copies_tokenizer_files(tmp_path, tokenizer_dir):
  hf = _hf_model("qwen2")
  hf.save_pretrained(tmp_path / "src")
  model = hf_io.load_hf_checkpoint(tmp_path / "src")
  hf_io.save_hf_checkpoint(model, tmp_path / "out", copy_files_from=tokenizer_dir)
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    assert (tmp_path / "out" / name).exists(), name
  assert tok_lib.load_tokenizer(tmp_path / "out").encode("hi") == [1, 15]
  # The copied generation_config.json wins over the one derived from config.json.
  assert tok_lib.load_generation_config(tmp_path / "out").eos_token_ids == (5, 4)
  assert os.path.exists(tmp_path / "out" / "model.safetensors")
