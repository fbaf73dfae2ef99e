"""Generation throughput: rljax's KV-cache sampler vs Hugging Face ``generate``, one process.

    python benchmarks/generation_throughput.py --out=/tmp/generation.json
    python benchmarks/generation_throughput.py --batch_sizes=32 --nobf16 --out=/tmp/b32.json

Setup: a Qwen2-style model of ~28M parameters made with ``transformers`` and saved to a
temporary folder (hidden 512, 8 layers, 8 heads, 2 KV heads, SwiGLU width 1536, vocabulary 8192,
tied embeddings); prompts of 64 random tokens; 128 new tokens; multinomial sampling at
temperature 1 over the full vocabulary (HF: ``do_sample=True, top_k=0, top_p=1``); no EOS, so
both run all 128 steps. HF runs PyTorch on CPU with its KV cache, timed with each of the torch
thread counts in ``--hf_threads`` (default: torch's default and one thread); the fastest is the
baseline (on a loaded machine OpenMP's default threads can be many times slower). rljax loads
the same checkpoint with ``rljax.models.load_hf_checkpoint``. The headline comparison is f32
against f32; rljax is also timed sampling from a bf16 copy of the weights
(``SamplingConfig(dtype='bfloat16', cache_dtype='float32')``, f32 accumulation), reported in
separate columns, against HF with the checkpoint loaded in bf16 as its users load it
(``from_pretrained(path, dtype=torch.bfloat16)``, same thread settings):
``ratio_bf16_vs_hf_bf16`` compares the two at the same weight dtype, and ``ratio_bf16_vs_hf``
rljax's bf16 run against HF's f32 one.

rljax samples with its default ``SamplingConfig.decode_segments`` (at 128 new tokens, 4 decode
loops over caches of ``P + 32 .. P + 128`` slots); ``--decode_segments=1`` times one loop over
the whole cache. Likewise with its default ``SamplingConfig.batch_threads`` (automatic: on a
2-core CPU batch 32 is sampled as two groups of 16 rows on two host threads, smaller batches in
one call; ``rljax_batch_threads`` in the JSON); ``--batch_threads=1`` times one call for every
batch size.

tokens/s = batch_size * new_tokens / wall time of one generate call (prefill included), the
median of ``--repeats`` calls after one warm-up call, rljax's and HF's calls taking turns.
``rljax_compile_s`` is the first call's wall time minus the median.

The decode roofline (see ``docs/performance.md``) uses this machine's measured memory bandwidth
(the faster of a GEMV and a sum over a 128 MiB array) and f32 matmul throughput (a large GEMM):

  t_step(B) = max((W + KV(B)) / BW, (2 * N * B + A(B)) / F),   roofline = B / t_step(B)
  end-to-end (prefill included): B * R / (2 * N * B * P / F + (R - 1) * t_step(B))

The roofline assumes the large-GEMM rate ``F`` at any row count. Unless ``--nomatmul_bound``,
the benchmark also times the decode's projection matmuls alone (`matmul_bound`): the model's own
weights chained over ``R - 1`` steps in XLA and in PyTorch, and the ratio to HF that a decode step
costing only those matmuls would give with the measured prefill.

Flags (``--helpfull`` lists them with their defaults): ``--batch_sizes``, ``--prompt_len``,
``--new_tokens``, ``--repeats``; the model's sizes ``--vocab``, ``--hidden``, ``--layers``,
``--heads``, ``--kv_heads``, ``--mlp``; ``--skip_hf`` (time rljax only), ``--hf_threads``,
``--[no]bf16``, ``--decode_segments``, ``--batch_threads``, ``--[no]matmul_bound`` and ``--out``.
The hyphenated spellings of earlier versions (``--batch-sizes``, ``--no-bf16``, ``--skip-hf``,
``--no-matmul-bound``, ...) still work for one release, with a warning naming the new flag.

The JSON holds ``results``: one object per batch size with ``batch_size``,
``rljax_tokens_per_s``, ``hf_tokens_per_s``, ``ratio_vs_hf``, ``rljax_compile_s``,
``rljax_batch_threads``, ``roofline_tokens_per_s`` (f32 decode bound),
``roofline_e2e_tokens_per_s`` (with prefill) and the same for bf16 (``rljax_bf16_tokens_per_s``,
``hf_bf16_tokens_per_s``, ``ratio_bf16_vs_hf_bf16``, ``ratio_bf16_vs_hf``,
``roofline_bf16_tokens_per_s``, ``roofline_e2e_bf16_tokens_per_s``); plus the measured
``machine`` figures, the load average and ``decode_segment_ends``. Unless ``--nomatmul_bound``,
each result also holds the f32 decode step's split and its matmul bound:
``rljax_prefill_s``, ``rljax_decode_step_ms``, ``xla_matmul_step_ms``, ``xla_matmul_threads``,
``torch_matmul_step_ms``, ``decode_step_ms_for_3x_hf`` and ``{xla,torch}_matmul_bound_ratio_vs_hf``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from absl import app, flags

from rljax import cli, runtime, sampling
from rljax.models import hf_io

_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Batch sizes to time, in order.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt length P (random tokens).")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "New tokens R per row (no EOS).")
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "Timed calls per measurement (after one warm-up call); the median counts.")
_VOCAB = flags.DEFINE_integer("vocab", 8192, "The model's vocabulary size.")
_HIDDEN = flags.DEFINE_integer("hidden", 512, "The model's hidden size.")
_LAYERS = flags.DEFINE_integer("layers", 8, "The model's decoder layers.")
_HEADS = flags.DEFINE_integer("heads", 8, "The model's attention heads.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 2, "The model's key/value heads.")
_MLP = flags.DEFINE_integer("mlp", 1536, "The model's SwiGLU width.")
_SKIP_HF = flags.DEFINE_bool("skip_hf", False, "Time rljax only.")
_HF_THREADS = flags.DEFINE_list(
    "hf_threads", [str(torch.get_num_threads()), "1"],
    "torch thread counts to time HF with (default: torch's default and 1); the fastest is the "
    "baseline.")
_BF16 = flags.DEFINE_bool(
    "bf16", True, "Also time bf16 (rljax: SamplingConfig(dtype='bfloat16'); HF: the checkpoint "
    "loaded with dtype=torch.bfloat16); --nobf16 skips it.")
_DECODE_SEGMENTS = flags.DEFINE_integer(
    "decode_segments", None,
    "SamplingConfig.decode_segments (default: automatic; 1: one decode loop over the whole cache).")
_BATCH_THREADS = flags.DEFINE_integer(
    "batch_threads", 0,
    "SamplingConfig.batch_threads (default 0: automatic; 1: the whole batch in one call).")
_MATMUL_BOUND = flags.DEFINE_bool(
    "matmul_bound", True, "Also time the decode's projection matmuls alone (XLA and torch) and "
    "report the ratio to HF they bound; --nomatmul_bound skips it.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")

# Old (argparse) spellings -> new ones, accepted for one release (rljax.cli.run).
DEPRECATED_FLAGS = {
    "--batch-sizes": "--batch_sizes",
    "--prompt-len": "--prompt_len",
    "--new-tokens": "--new_tokens",
    "--kv-heads": "--kv_heads",
    "--skip-hf": "--skip_hf",
    "--hf-threads": "--hf_threads",
    "--no-bf16": "--nobf16",
    "--decode-segments": "--decode_segments",
    "--batch-threads": "--batch_threads",
    "--no-matmul-bound": "--nomatmul_bound",
}


def make_checkpoint(path: str, *, vocab: int, hidden: int, layers: int, heads: int,
                    kv_heads: int, mlp: int, seed: int = 0) -> transformers.PreTrainedModel:
  torch.manual_seed(seed)
  config = transformers.Qwen2Config(
      vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
      num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=True,
      max_position_embeddings=4096, use_sliding_window=False)
  model = transformers.Qwen2ForCausalLM(config).eval()
  model.save_pretrained(path)
  return model


def measure_machine(repeats: int = 7) -> dict[str, float]:
  """Memory bandwidth (bytes/s): the faster of two reads of a 128 MiB f32 array, a GEMV and a
  sum (``bandwidth_gemv_bytes_per_s``, ``bandwidth_sum_bytes_per_s``; XLA:CPU's GEMV alone can
  read slower than the memory allows: 16.5 GB/s on a 2-core Xeon model 207, below the rate at
  which rljax's batch-1 decode read its weights, benchmarks/HISTORY.md, 2026-12-05); f32 and bf16 (f32-accumulated) matmul throughput
  (flop/s) from a 1024 x 1024 x 2048 GEMM, all with XLA on this machine."""

  def best(f, *args):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      jax.block_until_ready(f(*args))
      times.append(time.perf_counter() - t)
    return min(times)

  mv = jax.jit(lambda x, w: x @ w)
  w = jnp.ones((8192, 4096), jnp.float32)  # 128 MiB: beyond a 32 MiB L3 (Zen 3/4 here)
  x = jnp.ones((1, 8192), jnp.float32)
  gemv = w.nbytes / best(mv, x, w)
  total = w.nbytes / best(jax.jit(jnp.sum), w)
  del w
  mm = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
  out = {"bandwidth_bytes_per_s": max(gemv, total), "bandwidth_gemv_bytes_per_s": gemv,
         "bandwidth_sum_bytes_per_s": total}
  for name, dtype in (("matmul_flops_per_s", jnp.float32),
                      ("bf16_matmul_flops_per_s", jnp.bfloat16)):
    a = jnp.ones((1024, 1024), dtype)
    b = jnp.ones((1024, 2048), dtype)
    out[name] = 2 * 1024 * 1024 * 2048 / best(mm, a, b)
  return out


def decode_step_bound_s(batch: int, *, n_params: int, weight_bytes: int, layers: int,
                        kv_heads: int, heads: int, head_dim: int, prompt_len: int,
                        new_tokens: int, bandwidth: float, flops: float,
                        bytes_per_el: int = 4) -> float:
  """Lower bound on one decode step's time at the mean cache length ``S = P + R / 2``."""
  s = prompt_len + new_tokens / 2
  kv_bytes = batch * layers * 2 * kv_heads * s * head_dim * bytes_per_el
  attn_flops = batch * layers * 2 * 2 * heads * s * head_dim
  t_mem = (weight_bytes + kv_bytes) / bandwidth
  t_compute = (2 * n_params * batch + attn_flops) / flops
  return max(t_mem, t_compute)


def roofline_tokens_per_s(batch: int, **geometry) -> float:
  """Decode roofline: ``B / t_step(B)`` (see the module docstring)."""
  return batch / decode_step_bound_s(batch, **geometry)


def roofline_e2e_tokens_per_s(batch: int, **geometry) -> float:
  """End-to-end bound of one generate call, prefill (``2 N B P`` flops) included."""
  t_prefill = 2 * geometry["n_params"] * batch * geometry["prompt_len"] / geometry["flops"]
  r = geometry["new_tokens"]
  return batch * r / (t_prefill + (r - 1) * decode_step_bound_s(batch, **geometry))


def _rljax_projections(model) -> tuple[list[tuple[jax.Array, ...]], jax.Array]:
  """The decode's projection weights as 2-D f32 matrices, in the model's own layout: per layer
  ``(q [E, H*D], kv [E, 2*K*D], o [H*D, E], gate_up [E, 2*M], down [M, E])``, and the LM head
  ``[V, E]`` (the tied embedding) or ``[E, V]``."""
  layers = []
  for layer in model.layers:
    a, m = layer.attn, layer.mlp
    e = a.q_kernel.shape[0]
    layers.append((a.q_kernel[...].reshape(e, -1), a.kv_kernel[...].reshape(e, -1),
                   a.o_kernel[...].reshape(-1, e), m.gate_up_kernel[...].reshape(e, -1),
                   m.down_kernel[...]))
  head = model.embed[...] if model.lm_head is None else model.lm_head[...]
  return layers, head


def _matmul_chain(x, layers, head, steps: int, tied: bool):
  """``steps`` decode steps of only the projection matmuls (`_rljax_projections`) on ``x [B,
  E]``, each step's input the last one's output, joined by the fewest elementwise operations
  (adds, one ``tanh`` a layer to keep the values bounded); no attention, norms or sampling. The
  products are the model's own (``rljax.models.dots.f32_product``: at one row on CPU a split-K
  matvec)."""
  try:
    from rljax.models.dots import f32_product
  except ImportError:  # before the helper moved to rljax.models.dots
    from rljax.models.llm import _f32_product as f32_product

  def mm(x, w):
    return f32_product("be,ef->bf", x, w)

  def step(_, h):
    for q_w, kv_w, o_w, gu_w, down_w in layers:
      q = mm(h, q_w)
      kv = mm(h, kv_w)
      o = mm(q.at[:, :kv.shape[1]].add(kv), o_w)
      gate_up = mm(h, gu_w)
      h = jnp.tanh(h + o + mm(gate_up[:, :down_w.shape[0]], down_w))
    logits = jnp.einsum("be,ve->bv", h, head) if tied else mm(h, head)
    return h + 1e-3 * logits[:, :h.shape[1]]

  return jax.lax.fori_loop(0, steps, step, x)


def xla_matmul_step_s(model, batch: int, steps: int, threads: int, repeats: int) -> float:
  """Seconds per decode step of the batch's projection matmuls alone in XLA (`_matmul_chain`),
  the batch split into ``threads`` row groups called side by side as the sampler's
  ``batch_threads`` does; the median of ``repeats`` runs after a warm-up."""
  layers, head = _rljax_projections(model)
  tied = model.lm_head is None
  chain = jax.jit(functools.partial(_matmul_chain, steps=steps, tied=tied))
  e = model.config.hidden_size
  xs = [jnp.full((batch // threads, e), 0.1, jnp.float32) for _ in range(threads)]
  run = lambda x: jax.block_until_ready(chain(x, layers, head))
  with concurrent.futures.ThreadPoolExecutor(max(threads - 1, 1)) as pool:
    runtime.map_on_threads(run, xs, pool)
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      runtime.map_on_threads(run, xs, pool)
      times.append(time.perf_counter() - t)
  return statistics.median(times) / steps


def torch_matmul_step_s(hf_model, batch: int, steps: int, repeats: int) -> float:
  """The same as `xla_matmul_step_s` with PyTorch (its default threads; MKL on x86) on the HF
  model's own ``nn.Linear`` weights: per layer q, k, v, o, gate, up and down, then the LM head;
  one call per matmul, as HF's forward makes them."""
  body = hf_model.model
  layers = [(l.self_attn.q_proj.weight, l.self_attn.k_proj.weight, l.self_attn.v_proj.weight,
             l.self_attn.o_proj.weight, l.mlp.gate_proj.weight, l.mlp.up_proj.weight,
             l.mlp.down_proj.weight) for l in body.layers]
  head = hf_model.lm_head.weight
  lin = torch.nn.functional.linear

  def run():
    h = torch.full((batch, head.shape[1]), 0.1)
    with torch.no_grad():
      for _ in range(steps):
        for q_w, k_w, v_w, o_w, g_w, u_w, d_w in layers:
          q, k, v = lin(h, q_w), lin(h, k_w), lin(h, v_w)
          q[:, :k.shape[1]] += k + v
          o = lin(q, o_w)
          h = torch.tanh(h + o + lin(lin(h, g_w) * lin(h, u_w), d_w))
        h = h + 1e-3 * lin(h, head)[:, :h.shape[1]]

  run()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    run()
    times.append(time.perf_counter() - t)
  return statistics.median(times) / steps


def matmul_bound(model, hf_model, sampler, batch: int, new_tokens: int, hf_tps: float,
                 repeats: int) -> dict[str, float]:
  """Where rljax's f32 decode step stands against its projection matmuls alone.

  Returns ``rljax_prefill_s`` and ``rljax_decode_step_ms`` (the sampler's last call, as
  ``Sampler.last_timing`` splits it), ``xla_matmul_step_ms`` (`xla_matmul_step_s`: the faster of
  one call and the sampler's row groups, ``xla_matmul_threads`` says which), ``torch_matmul_step_ms``
  (`torch_matmul_step_s`), ``decode_step_ms_for_3x_hf`` (the step time at which this call, with
  its measured prefill, would run at 3x HF's tokens/s; below 0: the prefill alone is too slow)
  and ``{xla,torch}_matmul_bound_ratio_vs_hf``: the ratio to HF if each decode step took only
  those matmuls' time (attention, norms, sampling free), with the measured prefill.
  """
  timing = sampler.last_timing
  prefill_s, threads = timing["prefill_s"], timing["batch_threads"]
  steps = new_tokens - 1
  by_threads = {t: xla_matmul_step_s(model, batch, steps, t, repeats)
                for t in dict.fromkeys((1, threads))}
  xla_threads = min(by_threads, key=by_threads.get)
  xla_s = by_threads[xla_threads]
  torch_s = torch_matmul_step_s(hf_model, batch, steps, repeats)
  tokens = batch * new_tokens
  has_hf = hf_tps == hf_tps  # NaN with --skip_hf
  target_step = (tokens / (3 * hf_tps) - prefill_s) / steps if has_hf else None
  ratio = lambda step_s: (round(tokens / (prefill_s + steps * step_s) / hf_tps, 2) if has_hf
                          else None)
  return {
      "rljax_prefill_s": round(prefill_s, 3),
      "rljax_decode_step_ms": round(timing["decode_s"] / steps * 1e3, 2),
      "xla_matmul_step_ms": round(xla_s * 1e3, 2),
      "xla_matmul_threads": xla_threads,
      "torch_matmul_step_ms": round(torch_s * 1e3, 2),
      "decode_step_ms_for_3x_hf": None if target_step is None else round(target_step * 1e3, 2),
      "xla_matmul_bound_ratio_vs_hf": ratio(xla_s),
      "torch_matmul_bound_ratio_vs_hf": ratio(torch_s),
  }


def with_torch_threads(threads: int, fn):
  """Runs ``fn()`` with ``torch.set_num_threads(threads)``, then restores the setting."""
  before = torch.get_num_threads()
  torch.set_num_threads(threads)
  try:
    return fn()
  finally:
    torch.set_num_threads(before)


def time_interleaved(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
  """``name -> (first call s, median of the next `repeats` calls s)``.

  After one warm-up call each, the functions take turns, so a change in machine load hits all
  of them alike.
  """
  first, times = {}, {name: [] for name in fns}
  for name, fn in fns.items():
    t = time.perf_counter()
    fn()
    first[name] = time.perf_counter() - t
  for _ in range(repeats):
    for name, fn in fns.items():
      t = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t)
  return {name: (first[name], statistics.median(times[name])) for name in fns}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    batch_sizes = [int(b) for b in _BATCH_SIZES.value]
    hf_threads = list(dict.fromkeys(int(t) for t in _HF_THREADS.value))
  except ValueError as e:
    raise app.UsageError(f"--batch_sizes and --hf_threads take integers: {e}") from None
  p, r = _PROMPT_LEN.value, _NEW_TOKENS.value

  machine = measure_machine()
  print(f"machine: {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"bandwidth {machine['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"f32 matmul {machine['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, "
        f"bf16 matmul {machine['bf16_matmul_flops_per_s'] / 1e9:.0f} GFLOP/s", flush=True)

  rows = []
  with tempfile.TemporaryDirectory() as ckpt:
    hf_model = make_checkpoint(ckpt, vocab=_VOCAB.value, hidden=_HIDDEN.value,
                               layers=_LAYERS.value, heads=_HEADS.value, kv_heads=_KV_HEADS.value,
                               mlp=_MLP.value)
    # HF's bf16 run: the same checkpoint loaded in bf16, as its users load it.
    hf_models = {"": hf_model}
    if _BF16.value and not _SKIP_HF.value:
      hf_models["bf16_"] = transformers.AutoModelForCausalLM.from_pretrained(
          ckpt, dtype=torch.bfloat16).eval()
    model = hf_io.load_hf_checkpoint(ckpt)
    cfg = model.config
    n_params = cfg.num_params()  # every weight is read once per decode step (tied head included)
    print(f"model: {n_params / 1e6:.1f}M parameters, {4 * n_params / 1e6:.0f} MB f32", flush=True)
    # bf16: weights and activations in bf16, KV cache and attention products in f32 (the faster
    # choice on CPU, see SamplingConfig.cache_dtype).
    samplers = {
        dtype: sampling.Sampler(model, sampling.SamplingConfig(
            max_new_tokens=r, temperature=1.0, eos_token_ids=(), pad_token_id=0, dtype=dtype,
            cache_dtype="float32", decode_segments=_DECODE_SEGMENTS.value,
            batch_threads=_BATCH_THREADS.value))
        for dtype in (["float32", "bfloat16"] if _BF16.value else ["float32"])}
    rng = np.random.default_rng(0)
    for b in batch_sizes:
      prompts = rng.integers(0, _VOCAB.value, size=(b, p))
      seeds = iter(range(1_000_000))
      fns = {dtype: functools.partial(
          lambda s: s.generate(prompts.tolist(), seed=next(seeds)), sampler)
             for dtype, sampler in samplers.items()}
      if not _SKIP_HF.value:
        ids = torch.tensor(prompts)
        attn = torch.ones_like(ids)

        def hf_generate(hf_model):
          with torch.no_grad():
            out = hf_model.generate(
                input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=r, min_new_tokens=r, use_cache=True,
                pad_token_id=0, eos_token_id=None)
          assert out.shape == (b, p + r), out.shape

        for prefix, m in hf_models.items():
          for threads in hf_threads:
            fns[f"hf_{prefix}{threads}"] = functools.partial(
                with_torch_threads, threads, functools.partial(hf_generate, m))
      timed = time_interleaved(fns, _REPEATS.value)
      first, rl_s = timed["float32"]
      rl_tps = b * r / rl_s

      def hf_rates(prefix: str) -> dict[int, float]:
        """HF's tokens/s by torch thread count (none with --skip_hf or --nobf16)."""
        return {t: b * r / timed[f"hf_{prefix}{t}"][1] for t in hf_threads
                if f"hf_{prefix}{t}" in timed}

      hf_by_threads = hf_rates("")
      # The baseline is HF's best thread setting (its default one wins on an idle machine; one
      # thread wins when other processes load the CPUs and OpenMP threads wait on each other).
      hf_tps = max(hf_by_threads.values()) if hf_by_threads else float("nan")
      geometry = dict(n_params=n_params, layers=cfg.num_layers, kv_heads=cfg.num_kv_heads,
                      heads=cfg.num_heads, head_dim=cfg.head_dim, prompt_len=p, new_tokens=r,
                      bandwidth=machine["bandwidth_bytes_per_s"])
      f32 = dict(geometry, weight_bytes=4 * n_params, flops=machine["matmul_flops_per_s"])
      row = {
          "batch_size": b,
          "rljax_tokens_per_s": round(rl_tps, 1),
          "hf_tokens_per_s": round(hf_tps, 1),
          "ratio_vs_hf": round(rl_tps / hf_tps, 2) if hf_tps == hf_tps else None,
          "rljax_compile_s": round(first - rl_s, 2),
          "rljax_batch_threads": samplers["float32"].last_timing["batch_threads"],
          **{f"hf_{t}_threads_tokens_per_s": round(v, 1) for t, v in hf_by_threads.items()},
          "roofline_tokens_per_s": round(roofline_tokens_per_s(b, **f32), 1),
          "roofline_e2e_tokens_per_s": round(roofline_e2e_tokens_per_s(b, **f32), 1),
      }
      if _MATMUL_BOUND.value:
        row.update(matmul_bound(model, hf_model, samplers["float32"], b, r, hf_tps,
                                _REPEATS.value))
      if "bfloat16" in timed:
        bf_tps = b * r / timed["bfloat16"][1]
        hf_bf16 = hf_rates("bf16_")
        hf_bf16_tps = max(hf_bf16.values()) if hf_bf16 else float("nan")
        bf16 = dict(geometry, weight_bytes=2 * n_params, bytes_per_el=2,
                    flops=machine["bf16_matmul_flops_per_s"])
        row.update({
            "rljax_bf16_tokens_per_s": round(bf_tps, 1),
            "hf_bf16_tokens_per_s": round(hf_bf16_tps, 1),
            "ratio_bf16_vs_hf_bf16": (round(bf_tps / hf_bf16_tps, 2)
                                      if hf_bf16_tps == hf_bf16_tps else None),
            **{f"hf_bf16_{t}_threads_tokens_per_s": round(v, 1) for t, v in hf_bf16.items()},
            "ratio_bf16_vs_hf": round(bf_tps / hf_tps, 2) if hf_tps == hf_tps else None,
            "roofline_bf16_tokens_per_s": round(roofline_tokens_per_s(b, **bf16), 1),
            "roofline_e2e_bf16_tokens_per_s": round(roofline_e2e_tokens_per_s(b, **bf16), 1),
        })
      rows.append(row)
      print(json.dumps(row), flush=True)

  header = ["batch", "rljax f32 tok/s", "HF f32 tok/s", "ratio", "compile s", "rljax threads",
            "roofline f32 (decode / e2e)"]
  if _BF16.value:
    header += ["rljax bf16 tok/s", "HF bf16 tok/s", "bf16 ratio (vs HF bf16 / f32)",
               "roofline bf16 (decode / e2e)"]
  print("\n| " + " | ".join(header) + " |")
  print("|" + "---|" * len(header))
  for row in rows:
    cells = [row["batch_size"], f"{row['rljax_tokens_per_s']:.0f}",
             f"{row['hf_tokens_per_s']:.0f}", f"{row['ratio_vs_hf']}",
             f"{row['rljax_compile_s']:.1f}", row["rljax_batch_threads"],
             f"{row['roofline_tokens_per_s']:.0f} / {row['roofline_e2e_tokens_per_s']:.0f}"]
    if _BF16.value:
      cells += [f"{row['rljax_bf16_tokens_per_s']:.0f}", f"{row['hf_bf16_tokens_per_s']:.0f}",
                f"{row['ratio_bf16_vs_hf_bf16']} / {row['ratio_bf16_vs_hf']}",
                f"{row['roofline_bf16_tokens_per_s']:.0f} / "
                f"{row['roofline_e2e_bf16_tokens_per_s']:.0f}"]
    print("| " + " | ".join(str(c) for c in cells) + " |")
  if _MATMUL_BOUND.value and not _SKIP_HF.value:
    header = ["batch", "rljax prefill s", "rljax decode step ms", "step ms for 3x HF",
              "matmuls alone ms: XLA / torch", "ratio if a step were its matmuls: XLA / torch"]
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
      cells = [row["batch_size"], row["rljax_prefill_s"], row["rljax_decode_step_ms"],
               row["decode_step_ms_for_3x_hf"],
               f"{row['xla_matmul_step_ms']} / {row['torch_matmul_step_ms']}",
               f"{row['xla_matmul_bound_ratio_vs_hf']} / {row['torch_matmul_bound_ratio_vs_hf']}"]
      print("| " + " | ".join(str(c) for c in cells) + " |")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"results": rows, "machine": machine, "n_params": n_params, "load_avg":
                 os.getloadavg(),
                 "prompt_len": p, "new_tokens": r, "jax": jax.__version__,
                 "decode_segment_ends": samplers["float32"].config.segment_ends,
                 "torch": torch.__version__, "transformers": transformers.__version__}, f,
                indent=2)


if __name__ == "__main__":
  cli.run(main, DEPRECATED_FLAGS)
