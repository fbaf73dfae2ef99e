"""Tests for rljax.models.llm: parity with transformers, caching, padding, heads, axes, bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from flax.core import spmd as flax_spmd

from rljax.models import axes, dots, hf_io, llm

VOCAB = 96


def _hf_model(kind: str, **overrides) -> transformers.PreTrainedModel:
  """A tiny random HF model; norms and biases are perturbed so they matter in the comparison."""
  torch.manual_seed(0)
  kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
  kw.update(overrides)
  if kind == "llama":
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
  else:
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or "bias" in name:
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    "llama_mha_untied": ("llama", dict(num_key_value_heads=4)),
    "llama_gqa_tied": ("llama", dict(tie_word_embeddings=True)),
    "llama_gqa_bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama3_rope_scaling": ("llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500_000.0)),
    "qwen2_gqa_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2_gqa_untied": ("qwen2", dict(tie_word_embeddings=False)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> (folder, HF model) for every case, saved once per module."""
  out = {}
  for name, (kind, kw) in CASES.items():
    model = _hf_model(kind, **kw)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    out[name] = (folder, model)
  return out


def _tokens(batch=2, length=40, seed=0):
  return np.random.RandomState(seed).randint(0, VOCAB, (batch, length))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(checkpoints, case):
  folder, hf = checkpoints[case]
  model = hf_io.load_hf_checkpoint(folder)
  tokens = _tokens()
  with torch.no_grad():
    ref = hf(torch.tensor(tokens)).logits.numpy()
  out = np.asarray(model(jnp.asarray(tokens)))
  assert out.dtype == np.float32
  np.testing.assert_array_less(np.abs(out - ref).max(), 1e-4)


def test_config_reflects_case(checkpoints):
  cfg = hf_io.load_hf_checkpoint(checkpoints["llama3_rope_scaling"][0]).config
  assert cfg.rope_scaling == llm.RopeScaling(rope_type="llama3", factor=8.0,
                                             original_max_position_embeddings=16)
  assert cfg.rope_theta == 500_000.0
  qwen = hf_io.load_hf_checkpoint(checkpoints["qwen2_gqa_tied"][0]).config
  assert (qwen.qkv_bias, qwen.o_bias, qwen.tie_word_embeddings) == (True, False, True)
  assert (qwen.num_heads, qwen.num_kv_heads, qwen.num_groups, qwen.head_dim) == (4, 2, 2, 16)


def test_llama3_scaling_changes_logits(checkpoints):
  # Guards the parity test above: without the scaling the logits differ visibly at positions
  # beyond original_max_position_embeddings = 16.
  folder, _ = checkpoints["llama3_rope_scaling"]
  model = hf_io.load_hf_checkpoint(folder)
  plain = hf_io.load_hf_checkpoint(folder)
  plain.config = llm.LMConfig(**{**vars(model.config), "rope_scaling": None})
  tokens = jnp.asarray(_tokens())
  assert float(jnp.abs(model(tokens) - plain(tokens)).max()) > 1e-3


def test_llama3_inv_freq_matches_transformers():
  hf_cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=500_000.0,
                                    rope_scaling=LLAMA3_ROPE)
  init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
  ref, _ = init(hf_cfg, "cpu")
  cfg = llm.LMConfig.from_hf_config({**hf_cfg.to_dict(), "vocab_size": 8})
  np.testing.assert_allclose(cfg.inv_freq(), ref.numpy(), rtol=1e-6)


def test_from_hf_config_legacy_keys_and_errors():
  base = dict(model_type="llama", vocab_size=10, hidden_size=16, intermediate_size=32,
              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
  cfg = llm.LMConfig.from_hf_config(
      {**base, "rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
  assert cfg.rope_theta == 1234.0
  assert cfg.rope_scaling == llm.RopeScaling(rope_type="linear", factor=2.0)
  # inv_freq_0 = 1 / 1234^0 = 1, divided by the linear factor 2.
  assert cfg.inv_freq()[0] == pytest.approx(0.5)
  with pytest.raises(ValueError, match="'gpt2'"):
    llm.LMConfig.from_hf_config({**base, "model_type": "gpt2"})
  with pytest.raises(ValueError, match="'yarn'"):
    llm.LMConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
  with pytest.raises(ValueError, match="num_kv_heads"):
    llm.LMConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=4,
                 num_kv_heads=3)


def _tiny(**kw) -> llm.DecoderLM:
  cfg = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
             num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True, tie_word_embeddings=True)
  cfg.update(kw)
  return llm.DecoderLM(llm.LMConfig(**cfg), rngs=nnx.Rngs(0))


def _jitted(model, method):
  """``model.method(*args, **kwargs)`` under one ``jax.jit`` (eager NNX dispatch is slow)."""
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda state, *a, **kw: getattr(nnx.merge(graphdef, state), method)(*a, **kw))
  return lambda *a, **kw: fn(state, *a, **kw)


@pytest.mark.parametrize("batch", [1, 2])  # 1: the one-sequence path (split-K matvec, one-step attention)
def test_cached_decoding_equals_full_forward(batch):
  model = _tiny()
  tokens = jnp.asarray(_tokens(batch=batch, length=12, seed=1))
  full = _jitted(model, "__call__")(tokens)                    # [B, 12, V]
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, tokens, positions, cache, index):
    m = nnx.merge(graphdef, state)
    hidden, cache = m.hidden_states(tokens, positions=positions, cache=cache, cache_index=index)
    return m.logits(hidden), cache

  # Prefill 5 tokens, then feed the rest one at a time.
  cache = llm.init_cache(model.config, b, 16)
  logits, cache = step(state, tokens[:, :5], positions[:, :5], cache, jnp.int32(0))
  steps = [logits]
  for i in range(5, t):
    logits, cache = step(state, tokens[:, i:i + 1], positions[:, i:i + 1], cache, jnp.int32(i))
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)


@pytest.mark.parametrize("kw, cache_dtype, tol", [
    (dict(), "float32", 1e-5),
    (dict(tie_word_embeddings=False, qkv_bias=False, intermediate_size=47), "float32", 1e-5),
    (dict(dtype="bfloat16"), "bfloat16", 3e-2),
    (dict(dtype="bfloat16", tie_word_embeddings=False), "float32", 3e-2),
])
def test_one_sequence_step_equals_the_same_row_in_a_batch(kw, cache_dtype, tol):
  """A decoding step of one sequence (``B = T = 1`` on CPU: `llm._one_step_attention`, and
  `dots._split_k_matvec` for the projections and an untied head; the 47-wide MLP's down
  projection has an odd ``K`` and is not split) gives the logits and cache of that row in a batch
  of 2 (the general path): with hidden slots, the new slot visible or hidden, no visible slot at
  all, and the last slot written. f32 and bf16 models, bf16 and f32 caches."""
  model = _tiny(**kw)
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, tokens, positions, mask, cache, index):
    m = nnx.merge(graphdef, state)
    hidden, cache = m.hidden_states(tokens, attention_mask=mask, positions=positions,
                                    cache=cache, cache_index=index)
    return m.logits(hidden), cache

  rng = np.random.RandomState(4)
  slots = 10
  cache = tuple(llm.LayerCache(jnp.asarray(rng.randn(*c.k.shape), cache_dtype),
                               jnp.asarray(rng.randn(*c.v.shape), cache_dtype))
                for c in llm.init_cache(model.config, 2, slots))
  tokens = jnp.asarray(_tokens(batch=2, length=1, seed=5))
  positions = jnp.asarray([[6], [3]])
  cases = []
  # Index `slots`: past the end, written at the last slot as dynamic_update_slice clamps it.
  for index, visible in ((6, True), (6, False), (slots - 1, True), (slots, True)):
    mask = np.ones((2, slots), bool)
    mask[:, [0, 2, 8]] = False                      # padding before, a gap, an empty later slot
    mask[:, min(index, slots - 1)] = visible
    cases.append((index, mask))
  cases.append((6, np.zeros((2, slots), bool)))     # a row that sees nothing: uniform weights
  for index, mask in cases:
    both = step(state, tokens, positions, jnp.asarray(mask), cache, jnp.int32(index))
    one = step(state, tokens[:1], positions[:1], jnp.asarray(mask[:1]),
               tuple(llm.LayerCache(c.k[:1], c.v[:1]) for c in cache), jnp.int32(index))
    np.testing.assert_allclose(one[0], both[0][:1], rtol=tol, atol=tol)
    for c1, c2 in zip(one[1], both[1]):
      # The written slot: the split-K projections sum in another order. The others: untouched.
      f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
      np.testing.assert_allclose(f32(c1.k), f32(c2.k[:1]), rtol=tol, atol=tol)
      np.testing.assert_allclose(f32(c1.v), f32(c2.v[:1]), rtol=tol, atol=tol)
      others = np.arange(slots) != min(index, slots - 1)
      np.testing.assert_array_equal(f32(c1.k)[..., others], f32(c2.k[:1])[..., others])
      np.testing.assert_array_equal(f32(c1.v)[:, :, others], f32(c2.v[:1])[:, :, others])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the split is CPU-only")
def test_split_k_matvec_is_the_einsum_for_one_row():
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(1, 1, 8), jnp.float32)
  w = jnp.asarray(rng.randn(8, 3, 5), jnp.float32)
  assert dots.is_cpu_matvec("BTE,EHD->BTHD", x, w)
  np.testing.assert_allclose(dots.dot("BTE,EHD->BTHD", x, w),
                             jnp.einsum("BTE,EHD->BTHD", x, w), rtol=1e-6, atol=1e-6)
  assert not dots.is_cpu_matvec("BTE,EHD->BTHD", jnp.ones((2, 1, 8)), w)   # two rows
  assert not dots.is_cpu_matvec("BTE,EHD->BTHD", jnp.ones((1, 1, 7)), jnp.ones((7, 3, 5)))
  assert not dots.is_cpu_matvec("...E,VE->...V", jnp.ones((1, 8)), jnp.ones((5, 8)))  # tied head
  assert not dots.is_cpu_matvec("BTE,EHD->BTDH", x, w)                     # another output order
  assert dots.is_cpu_matvec("NE,EV->NV", jnp.ones((1, 8)), jnp.ones((8, 5)))
  assert dots.is_cpu_matvec("...E,EV->...V", jnp.ones((1, 8)), jnp.ones((8, 5)))  # untied head
  assert dots.is_cpu_matvec("...E,EV->...V", jnp.ones((1, 1, 8)), jnp.ones((8, 5)))
  assert not dots.is_cpu_matvec("...E,EV->...V", jnp.ones((2, 8)), jnp.ones((8, 5)))
  assert not dots.is_cpu_matvec("...E,EV->V", jnp.ones((1, 8)), jnp.ones((8, 5)))


def test_left_padding_gives_unpadded_log_probs():
  model = _tiny()
  graphdef, state = nnx.split(model)
  log_probs = jax.jit(lambda s, t, m: llm.sequence_log_probs(nnx.merge(graphdef, s), t, m))
  rows = [_tokens(1, 9, seed=2)[0], _tokens(1, 4, seed=3)[0]]
  width = 12
  tokens = np.zeros((2, width), np.int32)
  mask = np.zeros((2, width), np.int32)
  for i, r in enumerate(rows):
    tokens[i, width - len(r):] = r
    mask[i, width - len(r):] = 1
  padded = log_probs(state, tokens, mask)
  for i, r in enumerate(rows):
    alone = log_probs(state, r[None], np.ones((1, len(r)), np.int32))
    np.testing.assert_allclose(padded[i, width - len(r):], alone[0], atol=1e-5)
    assert np.all(np.asarray(padded[i, :width - len(r)]) == 0.0)
    assert alone[0, 0] == 0.0 and np.all(np.asarray(alone[0, 1:]) < 0)


def test_positions_and_last_token_index():
  mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0]])
  np.testing.assert_array_equal(llm.positions_from_mask(mask),
                                [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 1, 2, 2]])
  # [t0, t1, eos, pad, pad] -> the reward is read at index 2.
  np.testing.assert_array_equal(llm.last_token_index(mask), [4, 2, 3])


def test_value_and_reward_heads():
  model = _tiny()
  tokens = jnp.asarray(_tokens(2, 5, seed=4))
  mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
  hidden, _ = model.hidden_states(tokens, attention_mask=mask)
  values = model.values(hidden)
  rewards = model.rewards(hidden, mask)
  assert values.shape == (2, 5) and values.dtype == jnp.float32
  assert rewards.shape == (2,) and rewards.dtype == jnp.float32
  w, b = model.reward_head.kernel[...], model.reward_head.bias[...]
  np.testing.assert_allclose(rewards, [hidden[0, 2] @ w + b, hidden[1, 4] @ w + b], rtol=1e-5)
  np.testing.assert_allclose(values, hidden @ model.value_head.kernel[...]
                             + model.value_head.bias[...], rtol=1e-5, atol=1e-6)


def test_every_param_has_logical_axes():
  model = _tiny(qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=False,
                model_type="llama")
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = var.get_metadata()["out_sharding"]
    assert len(names) == var.get_value().ndim, path
    assert all(n is None or n in axes.ALL_AXES for n in names), (path, names)
  rules = (("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("vocab", "tensor"))
  with flax_spmd.logical_axis_rules(rules):
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  assert specs["layers"][0]["mlp"]["gate_up_kernel"].get_value() == jax.P("fsdp", None, "tensor")
  assert specs["embed"].get_value() == jax.P("tensor", "fsdp")


def test_constrain_is_identity_without_mesh_and_works_with_one():
  x = jnp.ones((2, 3))
  assert axes.constrain(x, (axes.BATCH, axes.EMBED)) is x
  for kind in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
    mesh = jax.make_mesh((1,), ("data",), axis_types=(kind,))
    with flax_spmd.logical_axis_rules(((axes.BATCH, "data"),)), jax.set_mesh(mesh):
      y = jax.jit(lambda v: axes.constrain(v * 2, (axes.BATCH, axes.EMBED)))(x)
    np.testing.assert_array_equal(y, 2 * x)
  with pytest.raises(ValueError, match="rank"):
    axes.constrain(x, (axes.BATCH,))


def test_split_merge_jit_matches_eager():
  model = _tiny()
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(_tokens(2, 7, seed=5))

  @jax.jit
  def forward(state, tokens):
    return nnx.merge(graphdef, state)(tokens)

  np.testing.assert_allclose(forward(state, tokens), model(tokens), atol=1e-6)


def test_bf16_option_keeps_f32_logits(checkpoints):
  folder, _ = checkpoints["qwen2_gqa_tied"]
  f32 = hf_io.load_hf_checkpoint(folder)
  bf16 = hf_io.load_hf_checkpoint(folder, dtype="bfloat16")
  assert bf16.layers[0].attn.q_kernel[...].dtype == jnp.bfloat16
  tokens = jnp.asarray(_tokens())
  out = bf16(tokens)
  assert out.dtype == jnp.float32
  hidden, _ = bf16.hidden_states(tokens)
  assert hidden.dtype == jnp.bfloat16
  assert bf16.values(hidden).dtype == jnp.float32
  # bf16 has 8 mantissa bits: logits of a 2-layer model stay within a few percent.
  assert float(jnp.abs(out - f32(tokens)).max()) < 0.1
