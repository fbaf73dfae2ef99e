"""Tests for rljax.sampling: parity with transformers generate, EOS, padding, seeds, filters."""

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rljax import runtime, sampling
from rljax.models import hf_io, llm, tokenizer

VOCAB = 64
PAD = 0


def _hf_model(kind: str, **overrides):
  torch.manual_seed(2)
  kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
  kw.update(overrides)
  if kind == "llama":
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
  else:
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
  # A larger untied output layer makes the next-token distribution peaked, like a trained
  # model's, so greedy paths are not decided by float-rounding-level ties.
  with torch.no_grad():
    if not model.config.tie_word_embeddings:
      model.lm_head.weight.mul_(40.0)
  return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  out = {}
  for name, kind, kw in [("llama_gqa", "llama", {}),
                         ("qwen2_tied", "qwen2", {"tie_word_embeddings": True})]:
    hf = _hf_model(kind, **kw)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    out[name] = (hf, hf_io.load_hf_checkpoint(folder))
  return out


def _prompts(lengths, seed=0):
  rs = np.random.RandomState(seed)
  return [rs.randint(1, VOCAB, n).tolist() for n in lengths]


def _config(**kw) -> sampling.SamplingConfig:
  """Tests share one batch bucket and small prompt buckets, so most calls reuse compilations."""
  base = dict(max_new_tokens=8, pad_token_id=PAD, batch_buckets=(4,), prompt_buckets=(16, 32))
  return sampling.SamplingConfig(**{**base, **kw})


GREEDY = _config(temperature=0.0)


@pytest.mark.parametrize("case", ["llama_gqa", "qwen2_tied"])
def test_greedy_matches_transformers(models, case):
  hf, model = models[case]
  prompts = _prompts([7, 3, 11])
  out = sampling.Sampler(model, GREEDY).generate(prompts)
  assert out.tokens.shape == (3, 8) and out.tokens.dtype == np.int32
  for i, p in enumerate(prompts):
    with torch.no_grad():
      ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=PAD,
                        output_logits=True, return_dict_in_generate=True)
    np.testing.assert_array_equal(out.tokens[i], ref.sequences[0, len(p):].numpy())
    ref_lp = torch.stack(ref.logits, 1)[0].log_softmax(-1)
    ref_lp = ref_lp.gather(-1, ref.sequences[:, len(p):].T)[:, 0].numpy()
    np.testing.assert_allclose(out.log_probs_t1[i], ref_lp, atol=1e-4)
  np.testing.assert_array_equal(out.response_mask, 1)
  np.testing.assert_array_equal(out.log_probs, 0.0)  # greedy: a point mass


def _rescore(model, out, temperature):
  """Log-probs of the responses from one full forward over [left-padded prompt, response]."""
  tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1)
  mask = np.concatenate([out.prompt_mask, out.response_mask], axis=1)
  lp = llm.sequence_log_probs(model, jnp.asarray(tokens), jnp.asarray(mask),
                              temperature=temperature)
  return np.asarray(lp[:, out.prompt_tokens.shape[1]:])


@pytest.mark.slow
def test_sampled_log_probs_match_full_forward(models):
  _, model = models["llama_gqa"]
  config = _config(temperature=0.7)
  out = sampling.Sampler(model, config).generate(_prompts([5, 9, 2], seed=1), seed=0)
  np.testing.assert_allclose(out.log_probs, _rescore(model, out, 0.7), atol=1e-4)
  np.testing.assert_allclose(out.log_probs_t1, _rescore(model, out, 1.0), atol=1e-4)
  assert np.all(out.log_probs < 0) and np.all(out.log_probs_t1 < 0)


def test_left_padding_does_not_change_results(models):
  _, model = models["llama_gqa"]
  prompt = _prompts([4], seed=3)[0]
  sampler = sampling.Sampler(model, _config(batch_buckets=(1, 4)))
  alone = sampler.generate([prompt], seed=5)
  # Row 0 of a bigger batch (other buckets, 28 slots of padding in front of it). Each row's
  # random stream depends only on (seed, row, step), so the samples must agree too.
  batch = sampler.generate([prompt] + _prompts([24, 13], seed=4), seed=5)
  assert batch.prompt_tokens.shape == (3, 32) and alone.prompt_tokens.shape == (1, 16)
  np.testing.assert_array_equal(batch.tokens[0], alone.tokens[0])
  np.testing.assert_allclose(batch.log_probs[0], alone.log_probs[0], atol=1e-5)
  np.testing.assert_allclose(batch.log_probs_t1[0], alone.log_probs_t1[0], atol=1e-5)


def _greedy_tokens(model, prompts):
  return sampling.Sampler(model, GREEDY).generate(prompts).tokens


def test_eos_mask_and_reward_index(models):
  _, model = models["llama_gqa"]
  # Find a prompt whose greedy continuation t0 t1 t2 has t2 not among t0, t1.
  for seed in range(50):
    prompt = _prompts([6], seed=seed)
    t = _greedy_tokens(model, prompt)[0]
    if t[2] not in t[:2]:
      break
  else:
    pytest.fail("no suitable prompt")
  eos = int(t[2])
  config = _config(max_new_tokens=5, temperature=0.0, eos_token_ids=(eos,))
  out = sampling.Sampler(model, config).generate(prompt)
  np.testing.assert_array_equal(out.tokens[0], [t[0], t[1], eos, PAD, PAD])
  np.testing.assert_array_equal(out.response_mask[0], [1, 1, 1, 0, 0])
  assert llm.last_token_index(jnp.asarray(out.response_mask))[0] == 2
  assert out.lengths[0] == 3 and out.num_steps == 3  # the loop stopped after the EOS
  np.testing.assert_array_equal(out.log_probs_t1[0, 3:], 0.0)


def test_two_eos_ids_stop_on_either(models):
  _, model = models["llama_gqa"]
  # Row 0 must stop at step 1 on id a, row 1 at step 3 on id b.
  for seed in range(200):
    prompts = _prompts([5, 8], seed=seed)
    r0, r1 = _greedy_tokens(model, prompts)
    a, b = int(r0[1]), int(r1[3])
    if a != b and a not in r0[:1] and b not in r0[:2] and a not in r1[:4] and b not in r1[:3]:
      break
  else:
    pytest.fail("no suitable prompts")
  config = _config(max_new_tokens=6, temperature=0.0, eos_token_ids=(a, b))
  out = sampling.Sampler(model, config).generate(prompts)
  np.testing.assert_array_equal(out.lengths, [2, 4])
  np.testing.assert_array_equal(out.tokens[0], [r0[0], a, PAD, PAD, PAD, PAD])
  np.testing.assert_array_equal(out.tokens[1], [*r1[:3], b, PAD, PAD])
  assert out.num_steps == 4


@pytest.mark.slow
def test_decode_segments_equal_one_loop(models):
  """The decode in segments (each a loop over a cache just long enough for its steps, grown
  between loops) gives the one-loop decode's tokens and log-probs: sampled, with an EOS that
  stops rows in the first and in the last segment, and rescored by a full forward."""
  _, model = models["llama_gqa"]
  prompts = _prompts([5, 9, 2], seed=1)
  one = sampling.Sampler(model, _config(temperature=0.7, decode_segments=1)).generate(
      prompts, seed=0)
  eos = (int(one.tokens[0, 1]), int(one.tokens[2, 6]))
  for extra in ({}, {"eos_token_ids": eos}):
    ref = (one if not extra else sampling.Sampler(
        model, _config(temperature=0.7, decode_segments=1, **extra)).generate(prompts, seed=0))
    config = _config(temperature=0.7, decode_segments=3, **extra)
    assert config.segment_ends == (3, 6, 8)  # caches of P + 3, P + 6, P + 8 slots
    out = sampling.Sampler(model, config).generate(prompts, seed=0)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    assert out.num_steps == ref.num_steps
    np.testing.assert_allclose(out.log_probs, ref.log_probs, atol=1e-5)
    np.testing.assert_allclose(out.log_probs_t1, ref.log_probs_t1, atol=1e-5)
    np.testing.assert_allclose(out.log_probs, _rescore(model, out, 0.7), atol=1e-4)
  assert ref.lengths[0] == 2 and ref.lengths[2] <= 7  # the EOS case stops rows early


@pytest.mark.slow
def test_batch_threads_equal_one_call(models):
  """Row groups sampled on threads give one call's tokens and log-probs: sampled and greedy, a
  group whose last rows are filler and a group of filler only, rows stopped by an EOS at
  different steps (the result's ``num_steps`` is the longest group's)."""
  _, model = models["qwen2_tied"]
  prompts = _prompts([5, 9, 2, 7, 3], seed=4)  # batch bucket 8 (twice the largest bucket, 4)
  one = sampling.Sampler(model, _config(temperature=0.8, batch_threads=1)).generate(
      prompts, seed=5)
  eos = (int(one.tokens[1, 2]), int(one.tokens[4, 5]))
  refs = []
  for extra in ({"temperature": 0.8}, {"temperature": 0.8, "eos_token_ids": eos},
                {"temperature": 0.0, "eos_token_ids": eos}):
    ref = sampling.Sampler(model, _config(batch_threads=1, **extra)).generate(prompts, seed=5)
    refs.append(ref)
    for threads in (2, 4):  # groups of 4 rows (1 real in the second); of 2 (the last: filler)
      sampler = sampling.Sampler(model, _config(batch_threads=threads, **extra))
      out = sampler.generate(prompts, seed=5)
      assert sampler.last_timing["batch_threads"] == threads
      np.testing.assert_array_equal(out.tokens, ref.tokens)
      np.testing.assert_array_equal(out.lengths, ref.lengths)
      np.testing.assert_array_equal(out.prompt_tokens, ref.prompt_tokens)
      assert out.tokens.shape == (5, 8) and out.num_steps == ref.num_steps
      np.testing.assert_allclose(out.log_probs, ref.log_probs, atol=1e-5)
      np.testing.assert_allclose(out.log_probs_t1, ref.log_probs_t1, atol=1e-5)
  # The sampled EOS case stops rows 1 and 4 early, at different steps.
  assert refs[1].lengths[1] <= 3 and refs[1].lengths[4] <= 6 and len(set(refs[1].lengths)) > 1
  np.testing.assert_array_equal(one.tokens, sampling.Sampler(
      model, _config(temperature=0.8)).generate(prompts, seed=5).tokens)  # 0: one call here


def test_resolve_batch_threads(monkeypatch):
  config = lambda k=0: sampling.SamplingConfig(max_new_tokens=4, batch_threads=k)  # noqa: E731
  resolve = sampling.resolve_batch_threads
  # Automatic on CPU: the most threads up to the cores that divide the batch with >= 16 rows.
  assert [resolve(config(), b, cores=2) for b in (1, 8, 16, 24, 32, 48, 64, 96)] == [
      1, 1, 1, 1, 2, 2, 2, 2]
  assert [resolve(config(), b, cores=8) for b in (32, 48, 64, 96, 256)] == [2, 3, 4, 6, 8]
  assert resolve(config(), 32, cores=1) == 1
  # ... for weights of at least 500k parameters (a toy model's call is faster in one thread).
  assert resolve(config(), 32, {"w": np.zeros((1000, 500))}, cores=2) == 2
  assert resolve(config(), 32, {"w": np.zeros((1000, 499)), "b": jnp.zeros(999)}, cores=2) == 1
  assert resolve(config(2), 32, {"w": np.zeros(3)}, cores=2) == 2  # set: no minimum
  # cores=None: the CPUs this process may run on (the rule shared with the control rollout).
  usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  assert resolve(config(), 1024) == runtime.host_threads(1024, 16) == max(
      k for k in range(1, usable + 1) if 1024 % k == 0 and 1024 // k >= 16)
  # Set: used as given, if it divides the batch bucket.
  assert resolve(config(4), 8, cores=2) == 4 and resolve(config(1), 64, cores=2) == 1
  with pytest.raises(ValueError, match=r"batch_threads=3 must divide the batch bucket 32"):
    resolve(config(3), 32)
  with pytest.raises(ValueError, match="batch_threads must be >= 0"):
    config(-1)
  # Not on CPU: one call (an accelerator runs the whole batch at once).
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert resolve(config(), 64, cores=8) == 1 and resolve(config(2), 64) == 2


@pytest.mark.slow
def test_batch_threads_with_weights_on_several_devices():
  """A sampler whose weights lie on several devices samples in one call (0), and refuses > 1;
  the same sampler on one device uses 2 threads on 2 cores, with the same tokens."""
  code = textwrap.dedent("""
      import jax, numpy as np
      from flax import nnx
      from rljax import sampling
      from rljax.models import llm
      lm = llm.DecoderLM(llm.LMConfig(vocab_size=2048, hidden_size=128, intermediate_size=64,
                                      num_layers=1, num_heads=4, num_kv_heads=2),
                         rngs=nnx.Rngs(0))  # 0.6M parameters: above the automatic minimum
      config = sampling.SamplingConfig(max_new_tokens=4, batch_buckets=(32,))
      prompts = np.random.RandomState(0).randint(1, 2048, (32, 5)).tolist()
      one_device = sampling.Sampler(lm, config)
      replicated = sampling.Sampler(lm, config)
      mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
      replicated.update_params(jax.device_put(replicated.params, jax.NamedSharding(mesh, jax.P())))
      assert sampling.resolve_batch_threads(config, 32, one_device.params, cores=2) == 2
      assert sampling.resolve_batch_threads(config, 32, replicated.params, cores=2) == 1
      a = one_device.generate(prompts, seed=0)
      b = replicated.generate(prompts, seed=0)
      print("THREADS", one_device.last_timing["batch_threads"],
            replicated.last_timing["batch_threads"], len(jax.devices()))
      np.testing.assert_array_equal(a.tokens, b.tokens)
      try:
        sampling.resolve_batch_threads(
            sampling.SamplingConfig(max_new_tokens=4, batch_threads=2), 64, replicated.params)
      except ValueError as e:
        print("ERROR:", e)
  """)
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  assert f"THREADS {2 if cores >= 2 else 1} 1 2" in proc.stdout
  assert ("ERROR: batch_threads=2 needs the weights on one device in one process; this sampler "
          "has weights on 2 devices (use batch_threads=0 or 1)") in proc.stdout


def test_decode_segment_ends(monkeypatch):
  ends = lambda r, n=None: sampling.SamplingConfig(max_new_tokens=r,  # noqa: E731
                                                   decode_segments=n).segment_ends
  # Automatic, on CPU: one segment per 32 response tokens, at most 4, ends split R evenly (ceil).
  assert [ends(r) for r in (1, 32, 33, 48, 96, 128, 1000)] == [
      (1,), (32,), (17, 33), (24, 48), (32, 64, 96), (32, 64, 96, 128), (250, 500, 750, 1000)]
  assert ends(10, 3) == (4, 7, 10) and ends(10, 1) == (10,) and ends(4, 4) == (1, 2, 3, 4)
  # Elsewhere one loop (the segments' peak cache memory), unless asked for.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert ends(512) == (512,) and ends(512, 4) == (128, 256, 384, 512)
  for bad in (0, 11):
    with pytest.raises(ValueError, match=rf"decode_segments must be None or in \[1, "
                       rf"max_new_tokens=10\], got {bad}"):
      sampling.SamplingConfig(max_new_tokens=10, decode_segments=bad)


def test_same_seed_same_tokens(models):
  _, model = models["llama_gqa"]
  sampler = sampling.Sampler(model, _config())
  prompts = _prompts([3, 6, 4], seed=6)
  a = sampler.generate(prompts, seed=3)
  b = sampler.generate(prompts, seed=3)
  c = sampler.generate(prompts, key=jax.random.key(4))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.log_probs, b.log_probs)
  assert not np.array_equal(a.tokens, c.tokens)
  with pytest.raises(ValueError, match="seed"):
    sampler.generate(prompts)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_top_k_1_equals_greedy(models, temperature):
  _, model = models["llama_gqa"]
  prompts = _prompts([3, 7], seed=7)
  greedy = sampling.Sampler(model, GREEDY).generate(prompts)
  config = _config(temperature=temperature, top_k=1)
  top1 = sampling.Sampler(model, config).generate(prompts, seed=11)
  np.testing.assert_array_equal(top1.tokens, greedy.tokens)
  np.testing.assert_allclose(top1.log_probs, 0.0, atol=1e-6)  # log 1: one candidate
  np.testing.assert_allclose(top1.log_probs_t1, greedy.log_probs_t1, atol=1e-6)


def test_inverse_cdf_sampling_follows_the_distribution():
  # 20000 draws of one 12-way distribution with two zero-probability entries.
  w = np.array([0.5, 0.0, 1.0, 2.0, 0.25, 0.0, 3.0, 0.75, 1.5, 0.1, 0.4, 0.5], np.float32)
  n = 20_000
  u = 1.0 - jax.random.uniform(jax.random.key(0), (n,))
  idx = np.asarray(sampling.inverse_cdf_sample(jnp.tile(w, (n, 1)), u))
  freq = np.bincount(idx, minlength=len(w)) / n
  np.testing.assert_allclose(freq, w / w.sum(), atol=0.012)  # ~4 standard errors
  assert freq[1] == 0 and freq[5] == 0
  # The extremes of u never pick a zero-weight entry.
  edge = np.asarray(sampling.inverse_cdf_sample(jnp.tile(w, (2, 1)), jnp.array([1.0, 1e-9])))
  np.testing.assert_array_equal(edge, [11, 0])


def test_top_p_keeps_the_nucleus():
  logits = jax.random.normal(jax.random.key(1), (6, 40)) * 2.0
  probs = np.asarray(jax.nn.softmax(logits))
  top_p = 0.7
  tau = np.asarray(sampling._nucleus_threshold(jnp.asarray(probs), top_p))
  for row, t in zip(probs, tau):
    order = np.sort(row)[::-1]
    # Reference by sorting: the smallest prefix of the sorted probabilities with mass >= top_p.
    k = int(np.searchsorted(np.cumsum(order), top_p) + 1)
    assert t == order[k - 1]
  config = sampling.SamplingConfig(max_new_tokens=1, top_p=top_p)
  u = jax.random.uniform(jax.random.key(2), (6,), minval=1e-6, maxval=1.0)
  tok, lp, lp1 = sampling.sample_logits(logits, u, config)
  kept = probs >= tau[:, None]
  tok = np.asarray(tok)
  assert kept[np.arange(6), tok].all()
  nucleus = np.where(kept, probs, 0).sum(-1)
  np.testing.assert_allclose(lp, np.log(probs[np.arange(6), tok] / nucleus), atol=1e-5)
  np.testing.assert_allclose(lp1, np.log(probs[np.arange(6), tok]), atol=1e-5)


def test_top_k_with_top_p_and_temperature_log_probs():
  logits = jax.random.normal(jax.random.key(3), (4, 30)) * 3.0
  config = sampling.SamplingConfig(max_new_tokens=1, temperature=0.5, top_k=5, top_p=0.9)
  u = jax.random.uniform(jax.random.key(4), (4,), minval=1e-6, maxval=1.0)
  tok, lp, _ = sampling.sample_logits(logits, u, config)
  for i in range(4):
    scaled = np.asarray(logits[i]) / 0.5
    top = np.sort(scaled)[::-1][:5]
    p = np.exp(top - top.max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep = p[before < 0.9]
    assert scaled[int(tok[i])] in top[:len(keep)]
    j = int(np.where(top == scaled[int(tok[i])])[0][0])
    np.testing.assert_allclose(lp[i], np.log(keep[j] / keep.sum()), atol=1e-5)


def test_no_recompile_within_buckets(models):
  _, model = models["llama_gqa"]
  config = sampling.SamplingConfig(max_new_tokens=4, temperature=0.0, pad_token_id=PAD,
                                   prompt_buckets=(8, 16), batch_buckets=(2, 4))
  sampler = sampling.Sampler(model, config)
  sampler.generate(_prompts([5, 7]))
  prefill, decode = sampler._prefill, sampler._decode
  sizes = (prefill._cache_size(), decode._cache_size())
  sampler.generate(_prompts([3, 8], seed=1))               # same buckets (2, 8)
  sampler.generate(_prompts([6], seed=2))                  # batch 1 -> bucket 2
  sampling.Sampler(model, config).generate(_prompts([2, 2]))  # a new Sampler, same model
  assert (prefill._cache_size(), decode._cache_size()) == sizes
  sampler.generate(_prompts([9, 2, 2], seed=3))            # new buckets (4, 16)
  assert prefill._cache_size() == sizes[0] + 1
  assert sampler.shapes_for(3, 9) == (4, 16) and sampler.shapes_for(9, 40) == (12, 48)


def test_array_prompts_and_update_params(models):
  _, model = models["llama_gqa"]
  prompts = _prompts([4, 2], seed=8)
  right_padded = np.zeros((2, 6), np.int32)
  mask = np.zeros((2, 6), np.int32)
  for i, p in enumerate(prompts):
    right_padded[i, :len(p)] = p
    mask[i, :len(p)] = 1
  sampler = sampling.Sampler(model, GREEDY)
  a = sampler.generate(prompts)
  b = sampler.generate(right_padded, prompt_mask=mask)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  # New weights of the same shapes (an actor after an update) swap in without recompiling.
  sizes = (sampler._prefill._cache_size(), sampler._decode._cache_size())
  sampler.update_params(jax.tree.map(lambda x: -x, sampler.params))
  c = sampler.generate(prompts)
  assert not np.array_equal(a.tokens, c.tokens)
  assert (sampler._prefill._cache_size(), sampler._decode._cache_size()) == sizes


def test_decode_donates_the_cache(models):
  _, model = models["llama_gqa"]
  sampler = sampling.Sampler(model, GREEDY)
  tokens, mask = sampling.left_pad(_prompts([3]), 16, 4, PAD)
  state = sampler._prefill(sampler.params, tokens, mask, 1, jax.random.key(0), 0)
  out = sampler._decode(sampler.params, state._replace(cache=()), state.cache)
  assert state.cache[0].k.is_deleted() and state.tokens.is_deleted()  # reused in place
  assert out.cache[0].v.shape == (4, model.config.num_kv_heads, 16 + 8, model.config.head_dim)
  # In segments the prefill's cache holds the first segment's slots (16 + 3) and the decode
  # returns all 16 + 8; the loop state is still donated, the cache (another shape) is not.
  sampler = sampling.Sampler(model, _config(temperature=0.0, decode_segments=3))
  state = sampler._prefill(sampler.params, tokens, mask, 1, jax.random.key(0), 0)
  assert state.cache[0].v.shape[2] == 16 + 3
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no "donated buffers were not usable"
    out = sampler._decode(sampler.params, state._replace(cache=()), state.cache)
  assert state.tokens.is_deleted() and not state.cache[0].k.is_deleted()
  assert out.cache[0].v.shape[2] == 16 + 8


def test_bucket_and_left_pad_helpers():
  assert [sampling.bucket_size(n, (4, 8)) for n in (1, 4, 5, 8, 9, 17)] == [4, 4, 8, 8, 16, 24]
  tokens, mask = sampling.left_pad([[5, 6], [7]], 4, 3, pad_id=9)
  np.testing.assert_array_equal(tokens, [[9, 9, 5, 6], [9, 9, 9, 7], [9, 9, 9, 9]])
  # The filler row keeps one visible token so that no attention row is fully masked.
  np.testing.assert_array_equal(mask, [[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1]])
  with pytest.raises(ValueError, match="prompt 0"):
    sampling.left_pad([[]], 4, 1, pad_id=0)


def test_config_validation():
  with pytest.raises(ValueError, match="max_new_tokens"):
    sampling.SamplingConfig(max_new_tokens=0)
  with pytest.raises(ValueError, match="top_p"):
    sampling.SamplingConfig(max_new_tokens=1, top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    sampling.SamplingConfig(max_new_tokens=1, temperature=-1.0)
  with pytest.raises(ValueError, match="cache_dtype"):
    sampling.SamplingConfig(max_new_tokens=1, cache_dtype="float16")
  with pytest.raises(ValueError, match="prompt_buckets"):
    sampling.SamplingConfig(max_new_tokens=1, prompt_buckets=(8, 4))


@pytest.mark.slow
def test_bf16_sampling_copy_of_f32_model(models):
  _, model = models["qwen2_tied"]
  config = _config(dtype="bfloat16", cache_dtype="float32")
  sampler = sampling.Sampler(model, config)
  assert sampler.params["layers"][0]["attn"]["q_kernel"].get_value().dtype == jnp.bfloat16
  assert sampler.params["value_head"]["kernel"].get_value().dtype == jnp.float32
  assert model.layers[0].attn.q_kernel[...].dtype == jnp.float32  # the model is untouched
  tokens, mask = sampling.left_pad(_prompts([3]), 16, 4, PAD)
  state = sampler._prefill(sampler.params, tokens, mask, 1, jax.random.key(0), 0)
  assert state.cache[0].k.dtype == jnp.float32 and state.cache[0].v.dtype == jnp.float32
  out = sampler.generate(_prompts([5, 3], seed=9), seed=1)
  # The bf16 sampler's log-probs agree with an f32 re-scoring to bf16 precision.
  np.testing.assert_allclose(out.log_probs_t1, _rescore(model, out, 1.0), atol=0.05)


def test_config_from_generation_config(tmp_path):
  (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 9], "bos_token_id": 1}')
  gen = tokenizer.load_generation_config(tmp_path)
  config = sampling.SamplingConfig.from_generation_config(gen, max_new_tokens=4, top_k=3)
  assert (config.eos_token_ids, config.pad_token_id, config.top_k) == ((7, 9), 7, 3)
