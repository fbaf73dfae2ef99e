"""KV-cache sampler for :class:`rljax.models.llm.DecoderLM`: jitted prefill, ``while_loop`` decode.

One call of :meth:`Sampler.generate` runs two compiled functions:

1. **prefill** ``[B, P]`` left-padded prompts -> KV cache per layer, and the first sampled
   token. Position ids are ``cumsum(mask) - 1``, so every prompt starts at position 0 whatever
   its padding, and all rows write the same cache slot at every step.
2. **decode** ``lax.while_loop`` s over response steps ``1 .. R-1``: embed the last token, attend
   over the cache, sample. XLA updates the cache in place inside each loop; the loop state is
   donated, and so is the prefill's cache when the decode is one loop. It stops after ``max_new_tokens`` or as soon as every row has produced an EOS id.

The decode runs in segments (:attr:`SamplingConfig.decode_segments`): segment ``j`` is its own
``while_loop`` over steps ``[e_{j-1}, e_j)`` on a cache of ``P + e_j`` slots, which is zero-padded
to the next segment's length between loops. So step ``t`` attends over at most ``P + e_j`` slots
instead of ``P + R``, as paged/varlen attention does (vLLM, Kwon et al. 2023) without leaving
static shapes: with 4 segments the attention reads on average ``P + 5R/8`` slots, not ``P + R``.
Each segment is one more loop body to compile, and while a cache grows the old and the new one
are both alive: the decode's peak cache memory is up to ``1 + e_{n-1} / e_n`` times one full
cache (1.75x with 4 segments). So the automatic setting segments on CPU only, where long
responses run faster (docs/performance.md) and memory is host RAM; on GPU/TPU, where the cache
is what limits the batch, it is one loop.

On CPU a large batch is sampled in row groups side by side (:attr:`SamplingConfig.batch_threads`):
each group's prefill and decode are calls of the same two compiled functions, made from their own
host threads. One call of XLA:CPU does not keep 2 cores busy (measured, not profiled: two
half-batch calls side by side beat one whole-batch call at 32 rows). Row ``i`` of the call draws
its random numbers from ``fold_in(key, i)`` whichever group samples it, so the groups give one
call's tokens up to float rounding (at 16 rows a group the runs measured gave equal tokens, and
log-probs bit for bit on the benchmark's 28M model and within 1e-6 on a toy one; bf16 groups of
4 rows rounded differently from one 8-row call and sampled other tokens).

Shapes are static: prompt lengths and batch sizes are rounded up to buckets
(:class:`SamplingConfig`), so a training run compiles each (batch bucket, prompt bucket) pair
once. Padding rows are dropped from the result.

Sampling uses one uniform number per row and step, by inverse-CDF over the unnormalised
probabilities in two levels (blocks of the vocabulary, then inside one block), instead of the
Gumbel-max trick, which needs ``V`` random numbers per row and dominated the step time on CPU.
No full-vocabulary sort is ever done: top-k uses ``lax.top_k``; top-p (nucleus sampling, Holtzman
et al. 2020, arXiv:1904.09751) is applied within the ``k`` sorted candidates when top-k is on, and
otherwise finds the nucleus threshold by bisection on the probability values. With neither, the
step costs one ``exp`` pass over the vocabulary.

Log-probs are returned twice per token: under the distribution actually sampled from
(temperature, top-k, top-p applied; 0 for greedy, a point mass) and under the plain
temperature-1 full-vocabulary softmax that the PPO trainer scores with.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import runtime
from rljax.models import llm

DEFAULT_PROMPT_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Automatic decode segments (SamplingConfig.decode_segments=None): one per this many response
# tokens, at most MAX_AUTO_SEGMENTS (each segment compiles one more loop body).
SEGMENT_TOKENS = 32
MAX_AUTO_SEGMENTS = 4
# Automatic batch threads (SamplingConfig.batch_threads=0): each host thread samples at least
# this many rows (smaller groups ran slower than one call in f32 on the 2-core CPUs measured).
MIN_ROWS_PER_THREAD = 16
# ... and only for weights of at least this many parameters: below it a call takes a few ms and
# a second thread's overhead (about 2 ms a call) outweighs the gain (docs/performance.md).
MIN_PARAMS_FOR_THREADS = 500_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """How to sample. Frozen and hashable: one compiled sampler per distinct config.

  Attributes:
    max_new_tokens: ``R``, response tokens per prompt (the output width), > 0.
    temperature: softmax temperature, > 0; ``0.0`` means greedy (argmax) decoding.
    top_k: keep the ``k`` most likely tokens; ``0`` (or ``None``) disables it.
    top_p: keep the smallest set of most likely tokens with total probability ``>= top_p``;
      ``1.0`` (or ``None``) disables it. Must be in ``(0, 1]``.
    eos_token_ids: every id that ends a response (e.g. all of ``generation_config.json``'s
      ``eos_token_id``). May be empty: then only ``max_new_tokens`` stops.
    pad_token_id: fills response slots after the EOS and padding rows/columns of prompts.
    prompt_buckets: allowed padded prompt lengths, increasing. A longer prompt is padded to a
      multiple of the largest bucket.
    batch_buckets: allowed padded batch sizes, increasing; larger batches pad to a multiple of
      the largest bucket.
    dtype: ``None`` samples with the model's own dtype. ``'bfloat16'`` (or ``'float32'``)
      samples with a copy of the weights cast to that dtype, the usual RLHF split of an f32
      trained actor and a bf16 generator. On CPU bf16 matmuls (f32 accumulation) are about twice
      as fast as f32 ones for batches of 8 and more, and slower at batch 1. The returned
      log-probs are then those of the bf16 model; re-score in f32 where that matters.
    cache_dtype: KV-cache dtype; ``None`` is the compute dtype. ``'float32'`` with bf16 weights
      keeps the attention products in f32, which is faster on CPU (bf16 batched matmuls are
      slow there) at twice the cache memory.
    decode_segments: how many ``while_loop`` s the decode runs in, each over a cache just long
      enough for its steps (faster for long responses, more peak cache memory: see the module
      docstring); ``1`` is one loop over all ``P + R`` slots. ``None`` (default): on CPU one
      segment per `SEGMENT_TOKENS` (32) response tokens, at most `MAX_AUTO_SEGMENTS` (4), so
      ``R <= 32`` decodes in one loop and ``R >= 128`` in 4; on other backends 1. Must be in
      ``[1, R]``.
    batch_threads: how many host threads sample the (bucketed) batch: the rows are split into
      this many equal groups, each prefilled and decoded by its own call of the same compiled
      functions from its own thread, so that the calls run side by side on the CPU's cores. One
      XLA:CPU call does not keep 2 cores busy, so two half-batch calls beat one at batch 32
      (groups smaller than `MIN_ROWS_PER_THREAD` rows ran slower; docs/performance.md). Each row
      draws the same random numbers whatever its group, so the tokens are those of one call up
      to float rounding (see the module docstring). ``0`` (default) chooses per call
      (`resolve_batch_threads`): on a CPU backend in one process, with weights of at least
      `MIN_PARAMS_FOR_THREADS` (500k) parameters on one device, the most threads up to the
      usable cores that divide the call's batch bucket (17 prompts: bucket 32) with at least
      `MIN_ROWS_PER_THREAD` (16) rows each; else 1. A value ``> 1`` is used for every call,
      without those minimums, and must divide every call's batch bucket (``ValueError`` at
      `Sampler.generate` otherwise: e.g. 2 for one prompt with the default buckets).
  """

  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int = 0
  prompt_buckets: tuple[int, ...] = DEFAULT_PROMPT_BUCKETS
  batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
  dtype: str | None = None
  cache_dtype: str | None = None
  decode_segments: int | None = None
  batch_threads: int = 0

  def __post_init__(self):
    if self.top_k is None:
      object.__setattr__(self, "top_k", 0)
    if self.top_p is None:
      object.__setattr__(self, "top_p", 1.0)
    if self.max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
    if self.temperature < 0 or not math.isfinite(self.temperature):
      raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    for name in ("dtype", "cache_dtype"):
      if getattr(self, name) not in (None, "float32", "bfloat16"):
        raise ValueError(f"{name} must be None, 'float32' or 'bfloat16', got "
                         f"{getattr(self, name)!r}")
    if self.decode_segments is not None and not 1 <= self.decode_segments <= self.max_new_tokens:
      raise ValueError(f"decode_segments must be None or in [1, max_new_tokens="
                       f"{self.max_new_tokens}], got {self.decode_segments}")
    if self.batch_threads < 0:
      raise ValueError(f"batch_threads must be >= 0 (0 = automatic), got {self.batch_threads}")
    object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))
    for name in ("prompt_buckets", "batch_buckets"):
      b = tuple(int(x) for x in getattr(self, name))
      if not b or any(x <= 0 for x in b) or list(b) != sorted(set(b)):
        raise ValueError(f"{name} must be a non-empty increasing tuple of positive ints, got {b}")
      object.__setattr__(self, name, b)

  @property
  def segment_ends(self) -> tuple[int, ...]:
    """Response steps ``e_1 < ... < e_n = R`` at which the decode's segments end.

    Segment ``j`` produces the tokens of steps ``[e_{j-1}, e_j)`` (``e_0 = 1``: the prefill
    samples token 0) on a cache of ``P + e_j`` slots. ``n`` is :attr:`decode_segments`, or
    ``min(MAX_AUTO_SEGMENTS, ceil(R / SEGMENT_TOKENS))`` on CPU (1 elsewhere); the ends split
    ``R`` evenly (rounded up), e.g. ``R = 128 -> (32, 64, 96, 128)``, ``R = 48 -> (24, 48)``.
    """
    r = self.max_new_tokens
    n = self.decode_segments
    if n is None:
      n = min(MAX_AUTO_SEGMENTS, -(-r // SEGMENT_TOKENS)) if jax.default_backend() == "cpu" else 1
    return tuple(-(-r * (j + 1) // n) for j in range(n))

  @property
  def greedy(self) -> bool:
    """Whether decoding takes the argmax token (``temperature == 0``)."""
    return self.temperature == 0.0

  @classmethod
  def from_generation_config(cls, generation_config, *, max_new_tokens: int, **overrides
                             ) -> "SamplingConfig":
    """EOS and pad ids from a :class:`rljax.models.tokenizer.GenerationConfig`.

    Every id of ``generation_config.json``'s ``eos_token_id`` stops a response. The pad id is the
    file's ``pad_token_id``, else its first EOS id, else 0. ``overrides`` set any other field.
    """
    eos = tuple(generation_config.eos_token_ids)
    pad = generation_config.pad_token_id
    if pad is None:
      pad = eos[0] if eos else 0
    kw = {"eos_token_ids": eos, "pad_token_id": pad, **overrides}
    return cls(max_new_tokens=max_new_tokens, **kw)


class SampleOutput(NamedTuple):
  """What :meth:`Sampler.generate` returns (numpy arrays, ``B`` = number of prompts).

  Attributes:
    tokens: ``[B, R]`` int32 response tokens; ``pad_token_id`` after the EOS.
    response_mask: ``[B, R]`` int32, 1 for generated tokens up to and including the EOS.
      ``[t0, t1, eos, pad, pad] -> [1, 1, 1, 0, 0]``.
    log_probs: ``[B, R]`` f32 log-prob of each token under the sampling distribution
      (temperature/top-k/top-p applied; 0 for greedy); 0 where the mask is 0.
    log_probs_t1: ``[B, R]`` f32 log-prob under the plain temperature-1 full-vocabulary
      softmax; 0 where the mask is 0.
    lengths: ``[B]`` int32 ``response_mask.sum(-1)``.
    prompt_tokens: ``[B, P]`` int32 left-padded prompts as fed to the model (bucketed ``P``).
    prompt_mask: ``[B, P]`` int32, 1 on real prompt tokens.
    num_steps: response positions actually decoded (``< R`` when every row stopped early).
  """

  tokens: np.ndarray
  response_mask: np.ndarray
  log_probs: np.ndarray
  log_probs_t1: np.ndarray
  lengths: np.ndarray
  prompt_tokens: np.ndarray
  prompt_mask: np.ndarray
  num_steps: int


class DecodeState(NamedTuple):
  """Loop carry of the decode ``while_loop`` (donated between prefill and decode)."""

  cache: llm.KVCache           # per layer keys [B, K, D, S], values [B, K, S, D]; S = P + e_j
  key_mask: jax.Array          # [B, P + R] bool, valid cache slots (prompt padding is False)
  last_token: jax.Array        # [B] int32, token to feed next
  next_position: jax.Array     # [B] int32, RoPE position of last_token
  step: jax.Array              # () int32, index of the next response token to produce
  done: jax.Array              # [B] bool, an EOS was produced
  lengths: jax.Array           # [B] int32, response length so far (incl. EOS)
  tokens: jax.Array            # [B, R] int32
  log_probs: jax.Array         # [B, R] f32
  log_probs_t1: jax.Array      # [B, R] f32
  uniforms: jax.Array          # [B, R] f32 in (0, 1], drawn once in prefill


def bucket_size(n: int, buckets: Sequence[int]) -> int:
  """Smallest bucket ``>= n``; beyond the largest, the next multiple of the largest."""
  for b in buckets:
    if n <= b:
      return b
  top = buckets[-1]
  return -(-n // top) * top


def left_pad(prompts: Sequence[Sequence[int]], length: int, batch: int, pad_id: int
             ) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads ragged prompts into ``tokens, mask [batch, length]`` int32.

  Rows beyond ``len(prompts)`` are filler rows with a single (pad) token, so that no row is all
  padding.

  Raises:
    ValueError: for an empty prompt or one longer than ``length``.
  """
  tokens = np.full((batch, length), pad_id, np.int32)
  mask = np.zeros((batch, length), np.int32)
  for i, p in enumerate(prompts):
    n = len(p)
    if n == 0 or n > length:
      raise ValueError(f"prompt {i} has {n} tokens; need 1..{length}")
    tokens[i, length - n:] = np.asarray(p, np.int32)
    mask[i, length - n:] = 1
  mask[len(prompts):, -1] = 1
  return tokens, mask


# --------------------------------------------------------------------------------------------
# Sampling from one step's logits
# --------------------------------------------------------------------------------------------


def _block_size(v: int) -> int:
  """Block width for the two-level inverse CDF: a power of two near ``sqrt(V)``, at least 8."""
  return max(8, 1 << max(0, round(math.log2(math.sqrt(v)))))


def inverse_cdf_sample(weights: jax.Array, u: jax.Array) -> jax.Array:
  """Index ``i`` with ``sum(w[:i]) < u * sum(w) <= sum(w[:i+1])``, per row. ``[B, V] -> [B]``.

  ``weights`` are non-negative unnormalised probabilities (f32), ``u`` uniform in ``(0, 1]``.
  Two levels: pick a block of ``~sqrt(V)`` entries from the block sums' cumulative sum, then an
  entry inside that block, so only ``O(V)`` work and two short cumulative sums. A zero-weight
  entry is never returned (the in-block target is clipped to the block's own total).
  """
  b, v = weights.shape
  bs = _block_size(v)
  nb = -(-v // bs)
  w = jnp.pad(weights, ((0, 0), (0, nb * bs - v))).reshape(b, nb, bs)
  block_sums = w.sum(-1)                                             # [B, nb]
  cum_blocks = jnp.cumsum(block_sums, axis=-1)
  target = u * cum_blocks[:, -1]                                     # <= total since u <= 1
  blk = jnp.minimum(jnp.sum(cum_blocks < target[:, None], axis=-1), nb - 1)
  before = jnp.where(blk > 0, jnp.take_along_axis(cum_blocks, jnp.maximum(blk - 1, 0)[:, None],
                                                  axis=-1)[:, 0], 0.0)
  inside = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]  # [B, bs]
  cum_inside = jnp.cumsum(inside, axis=-1)
  target_inside = jnp.minimum(target - before, cum_inside[:, -1])
  j = jnp.minimum(jnp.sum(cum_inside < target_inside[:, None], axis=-1), bs - 1)
  return (blk * bs + j).astype(jnp.int32)


def _nucleus_threshold(probs: jax.Array, top_p: float) -> jax.Array:
  """Largest ``tau`` with ``sum(p[p >= tau]) >= top_p``, per row, by bisection on float bits.

  Non-negative f32 values order like their int32 bit patterns, so 32 halvings of the bit range
  find the exact threshold without sorting. ``[B, V] -> [B]``.
  """
  bits = jax.lax.bitcast_convert_type
  lo = jnp.zeros(probs.shape[:1], jnp.int32)                        # tau = 0: mass 1 >= top_p
  hi = bits(jnp.max(probs, axis=-1), jnp.int32) + 1                  # mass 0 < top_p

  def body(_, lo_hi):
    lo, hi = lo_hi
    mid = lo + (hi - lo) // 2
    tau = bits(mid, jnp.float32)[:, None]
    ok = jnp.sum(jnp.where(probs >= tau, probs, 0.0), axis=-1) >= top_p
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
  return bits(lo, jnp.float32)


def sample_logits(logits: jax.Array, u: jax.Array, config: SamplingConfig
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Samples one token per row. ``logits [B, V]`` f32, ``u [B]`` uniform in ``(0, 1]``.

  Returns ``(tokens [B] int32, log_probs [B], log_probs_t1 [B])``: the log-prob of the token
  under the sampling distribution and under ``softmax(logits)``.
  """
  logits = logits.astype(jnp.float32)
  m1 = jnp.max(logits, axis=-1, keepdims=True)

  def plain_log_prob(tok):
    lse = jnp.log(jnp.sum(jnp.exp(logits - m1), axis=-1)) + m1[:, 0]
    return jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0] - lse

  if config.greedy:
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tok, jnp.zeros(tok.shape, jnp.float32), plain_log_prob(tok)

  inv_t = 1.0 / config.temperature
  if config.top_k:
    k = min(config.top_k, logits.shape[-1])
    vals, idx = jax.lax.top_k(logits, k)                              # sorted, descending
    scaled = vals * inv_t if inv_t != 1.0 else vals
    w = jnp.exp(scaled - scaled[:, :1])
    if config.top_p < 1.0:
      mass_before = (jnp.cumsum(w, axis=-1) - w) / jnp.sum(w, axis=-1, keepdims=True)
      w = jnp.where(mass_before < config.top_p, w, 0.0)
    j = inverse_cdf_sample(w, u)
    tok = jnp.take_along_axis(idx, j[:, None], axis=-1)[:, 0].astype(jnp.int32)
    wj = jnp.take_along_axis(w, j[:, None], axis=-1)[:, 0]
    lp = jnp.log(wj) - jnp.log(jnp.sum(w, axis=-1))
    return tok, lp, plain_log_prob(tok)

  scaled = logits * inv_t if inv_t != 1.0 else logits
  m = m1 * inv_t if inv_t != 1.0 else m1
  w = jnp.exp(scaled - m)
  if config.top_p < 1.0:
    total = jnp.sum(w, axis=-1, keepdims=True)
    tau = _nucleus_threshold(w / total, config.top_p)
    w = jnp.where(w / total >= tau[:, None], w, 0.0)
  tok = inverse_cdf_sample(w, u)
  total = jnp.sum(w, axis=-1)
  wj = jnp.take_along_axis(w, tok[:, None], axis=-1)[:, 0]
  lp = jnp.log(wj) - jnp.log(total)
  if inv_t == 1.0 and config.top_p == 1.0:
    return tok, lp, lp  # the sampling distribution is the plain softmax
  return tok, lp, plain_log_prob(tok)


def _uniforms(key: jax.Array, batch: int, steps: int, first_row: jax.Array | int = 0
              ) -> jax.Array:
  """``[batch, steps]`` uniforms in ``(0, 1]``, drawn once per call (no PRNG work in the loop).

  Row ``i`` of the call's whole batch uses ``fold_in(key, i)``, so its numbers depend neither on
  the batch bucket nor on the thread group (rows ``first_row .. first_row + batch - 1``) that
  samples it.
  """
  rows = jnp.asarray(first_row, jnp.uint32) + jnp.arange(batch, dtype=jnp.uint32)
  draw = lambda i: jax.random.uniform(jax.random.fold_in(key, i), (steps,))  # noqa: E731
  return 1.0 - jax.vmap(draw)(rows)


def resolve_batch_threads(config: SamplingConfig, batch: int, params=None, *,
                          cores: int | None = None) -> int:
  """How many host threads sample a call whose batch bucket is ``batch`` rows.

  ``config.batch_threads`` if set, for every call (no minimum of rows or parameters; it must
  divide ``batch``). ``0`` chooses: 1 on a non-CPU backend, in several processes, when a leaf
  of ``params`` (the sampler's weights) lies on several devices (a sharded or replicated
  sampler already runs on those devices side by side), or when ``params`` has fewer than
  `MIN_PARAMS_FOR_THREADS` (500k) parameters (``None``: not checked); else the largest divisor
  of ``batch`` that is at most ``cores`` (default: the CPUs this process may run on) and leaves
  each thread at least `MIN_ROWS_PER_THREAD` rows (1 if none). E.g. batch 32 on 2 cores: 2;
  batch 16 on 2 cores: 1; batch 64 on 8 cores: 4.

  Raises:
    ValueError: ``batch_threads > 1`` that does not divide ``batch``, or with weights on
      several devices or in several processes.
  """
  leaves = jax.tree.leaves(params)
  devices = max((len(x.sharding.device_set) for x in leaves if isinstance(x, jax.Array)),
                default=1)
  processes = jax.process_count()
  k = config.batch_threads
  if k:
    if k > 1 and (devices > 1 or processes > 1):
      where = f"weights on {devices} devices" if devices > 1 else f"{processes} processes"
      raise ValueError(f"batch_threads={k} needs the weights on one device in one process; this "
                       f"sampler has {where} (use batch_threads=0 or 1)")
    if batch % k:
      raise ValueError(f"batch_threads={k} must divide the batch bucket {batch} (each thread "
                       f"samples batch / batch_threads rows; batch_buckets="
                       f"{config.batch_buckets})")
    return k
  if jax.default_backend() != "cpu" or devices > 1 or processes > 1:
    return 1
  if params is not None and sum(int(np.size(x)) for x in leaves) < MIN_PARAMS_FOR_THREADS:
    return 1
  return runtime.host_threads(batch, MIN_ROWS_PER_THREAD, cores)


# --------------------------------------------------------------------------------------------
# The two compiled functions
# --------------------------------------------------------------------------------------------


def _record(state: DecodeState, tok, lp, lp1, config: SamplingConfig) -> DecodeState:
  """Writes step ``state.step``'s token (pad for finished rows) and updates ``done``/``lengths``."""
  live = ~state.done
  tok = jnp.where(live, tok, config.pad_token_id).astype(jnp.int32)
  lp = jnp.where(live, lp, 0.0)
  lp1 = jnp.where(live, lp1, 0.0)
  col = (0, state.step)
  is_eos = jnp.zeros_like(live)
  for e in config.eos_token_ids:
    is_eos = is_eos | (tok == e)
  return state._replace(
      tokens=jax.lax.dynamic_update_slice(state.tokens, tok[:, None], col),
      log_probs=jax.lax.dynamic_update_slice(state.log_probs, lp[:, None], col),
      log_probs_t1=jax.lax.dynamic_update_slice(state.log_probs_t1, lp1[:, None], col),
      lengths=state.lengths + live.astype(jnp.int32),
      done=state.done | (live & is_eos),
      last_token=tok,
      step=state.step + 1,
  )


def _prefill(graphdef, params, tokens, mask, num_rows, key, first_row, *,
             config: SamplingConfig) -> DecodeState:
  """Prefill of rows ``first_row ..`` of a call's batch, ``num_rows`` of them real."""
  model: llm.DecoderLM = nnx.merge(graphdef, params)
  b, p = tokens.shape
  r = config.max_new_tokens
  slots = p + config.segment_ends[0]  # the first decode segment's cache
  cache = llm.init_cache(model.config, b, slots, dtype=config.cache_dtype)
  key_mask = jnp.concatenate([mask.astype(bool), jnp.ones((b, r), bool)], axis=1)
  positions = llm.positions_from_mask(mask)
  hidden, cache = model.hidden_states(tokens, attention_mask=key_mask[:, :slots],
                                      positions=positions, cache=cache, cache_index=0)
  logits = model.logits(hidden[:, -1])
  state = DecodeState(
      cache=cache,
      key_mask=key_mask,
      last_token=jnp.zeros((b,), jnp.int32),
      next_position=positions[:, -1] + 1,
      step=jnp.zeros((), jnp.int32),
      done=jnp.arange(b) >= num_rows,  # filler rows of the batch bucket never hold the loop
      lengths=jnp.zeros((b,), jnp.int32),
      tokens=jnp.full((b, r), config.pad_token_id, jnp.int32),
      log_probs=jnp.zeros((b, r), jnp.float32),
      log_probs_t1=jnp.zeros((b, r), jnp.float32),
      uniforms=_uniforms(key, b, r, first_row),
  )
  tok, lp, lp1 = sample_logits(logits, state.uniforms[:, 0], config)
  return _record(state, tok, lp, lp1, config)


def _grow_cache(cache: llm.KVCache, slots: int) -> llm.KVCache:
  """Zero-pads every layer's cache to ``slots`` slots (keys ``[B, K, D, S]``, values
  ``[B, K, S, D]``)."""
  def pad(x, axis):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, slots - x.shape[axis])
    return jnp.pad(x, widths)

  return tuple(llm.LayerCache(pad(c.k, 3), pad(c.v, 2)) for c in cache)


def _decode(graphdef, params, state: DecodeState, cache: llm.KVCache, *, config: SamplingConfig
            ) -> DecodeState:
  """The decode loops from the prefill's ``state`` (its ``cache`` passed apart, see
  `_compiled`)."""
  model: llm.DecoderLM = nnx.merge(graphdef, params)
  state = state._replace(cache=cache)
  prompt_len = state.key_mask.shape[1] - config.max_new_tokens

  def segment(state: DecodeState, end: int) -> DecodeState:
    """Steps up to ``end`` (exclusive) on a cache of ``prompt_len + end`` slots."""
    key_mask = state.key_mask[:, :prompt_len + end]

    def cond(s: DecodeState):
      return (s.step < end) & ~jnp.all(s.done)

    def body(s: DecodeState):
      hidden, cache = model.hidden_states(
          s.last_token[:, None], attention_mask=key_mask, positions=s.next_position[:, None],
          cache=s.cache, cache_index=prompt_len + s.step - 1)
      logits = model.logits(hidden[:, 0])
      u = jax.lax.dynamic_index_in_dim(s.uniforms, s.step, axis=1, keepdims=False)
      tok, lp, lp1 = sample_logits(logits, u, config)
      s = s._replace(cache=cache, next_position=s.next_position + 1)
      return _record(s, tok, lp, lp1, config)

    return jax.lax.while_loop(cond, body, state)

  for end in config.segment_ends:
    if state.cache[0].v.shape[2] < prompt_len + end:
      state = state._replace(cache=_grow_cache(state.cache, prompt_len + end))
    state = segment(state, end)
  return state


@functools.lru_cache(maxsize=64)
def _compiled(graphdef, config: SamplingConfig):
  prefill = jax.jit(functools.partial(_prefill, graphdef, config=config))
  # The loop state is donated. So is the cache when the decode runs in one segment (XLA then
  # updates it in place); with several, the prefill's cache is smaller than the one returned, so
  # XLA could not reuse its buffers (it copies them into the first loop instead).
  donate = (1, 2) if len(config.segment_ends) == 1 else (1,)
  decode = jax.jit(functools.partial(_decode, graphdef, config=config), donate_argnums=donate)
  return prefill, decode


class Sampler:
  """Samples responses from a :class:`~rljax.models.llm.DecoderLM` with a KV cache.

  Example::

    sampler = Sampler(model, SamplingConfig(max_new_tokens=128, eos_token_ids=(2,)))
    out = sampler.generate([[1, 5, 9], [1, 7]], seed=0)
    out.tokens, out.response_mask, out.log_probs_t1      # [2, 128] each

  After a training step, ``sampler.update_params(nnx.state(model, nnx.Param))`` swaps weights
  without recompiling (same shapes, dtypes and shardings).

  Attributes:
    config: the :class:`SamplingConfig`.
    params: the weights sampled with (cast to ``config.dtype``).
    last_timing: the last :meth:`generate` call's wall times in seconds, ``prefill_s``,
      ``decode_s`` and ``generate_s`` (compilation included on a call that compiled; with
      several batch threads each phase runs from the first group's start to the last group's
      end), and the int ``batch_threads`` it used.
  """

  def __init__(self, model: llm.DecoderLM, config: SamplingConfig):
    self.config = config
    if config.dtype is None or config.dtype == model.config.dtype:
      self.graphdef, params = nnx.split(model, nnx.Param)
      self._param_dtypes = None
    else:  # a graph whose activations and cache use config.dtype, and weights cast to it
      cfg = dataclasses.replace(model.config, dtype=config.dtype)
      abstract = nnx.eval_shape(lambda: llm.DecoderLM(cfg, rngs=nnx.Rngs(0)))
      self.graphdef, abstract_params = nnx.split(abstract, nnx.Param)
      self._param_dtypes = jax.tree.map(lambda a: a.dtype, abstract_params)
      params = nnx.state(model, nnx.Param)
    self.params: nnx.State = None  # set by update_params
    self.update_params(params)
    self._prefill, self._decode = _compiled(self.graphdef, config)
    self.last_timing: dict[str, float | int] = {}

  def update_params(self, params: nnx.State) -> None:
    """Replaces the weights (e.g. the actor's after an update), cast to ``config.dtype``."""
    if self._param_dtypes is not None:
      params = jax.tree.map(lambda p, d: p.astype(d), params, self._param_dtypes)
    self.params = params

  def shapes_for(self, num_prompts: int, max_prompt_len: int) -> tuple[int, int]:
    """The bucketed ``(batch, prompt_length)`` a call with these sizes compiles for."""
    return (bucket_size(num_prompts, self.config.batch_buckets),
            bucket_size(max_prompt_len, self.config.prompt_buckets))

  def generate(
      self,
      prompts: Sequence[Sequence[int]] | np.ndarray,
      *,
      prompt_mask: np.ndarray | None = None,
      seed: int | None = None,
      key: jax.Array | None = None,
  ) -> SampleOutput:
    """Samples ``max_new_tokens`` response tokens for each prompt.

    Args:
      prompts: a list of token-id lists (ragged), or an int array ``[B, P]`` whose real tokens
        are given by ``prompt_mask`` (left or right padding; they are re-packed to the left).
      prompt_mask: ``[B, P]`` 0/1, required with an array of ``prompts``; ignored for lists.
      seed: an int seed; the same seed, prompts and config give the same tokens.
      key: a PRNG key instead of ``seed``. One of the two is required unless greedy.

    Returns:
      A :class:`SampleOutput` of numpy arrays with ``B = len(prompts)`` rows.

    Raises:
      ValueError: empty batch, an empty prompt, or no seed/key for stochastic sampling.
    """
    if isinstance(prompts, np.ndarray) or hasattr(prompts, "shape"):
      arr = np.asarray(prompts)
      if prompt_mask is None:
        raise ValueError("prompt_mask is required when prompts is an array")
      m = np.asarray(prompt_mask).astype(bool)
      prompts = [row[mrow].tolist() for row, mrow in zip(arr, m)]
    n = len(prompts)
    if n == 0:
      raise ValueError("generate: no prompts")
    if key is None:
      if seed is None and not self.config.greedy:
        raise ValueError("generate: pass seed= or key= for stochastic sampling")
      key = jax.random.key(0 if seed is None else seed)
    b, p = self.shapes_for(n, max(len(x) for x in prompts))
    tokens, mask = left_pad(prompts, p, b, self.config.pad_token_id)

    threads = resolve_batch_threads(self.config, b, self.params)
    rows = b // threads
    groups = [(slice(g * rows, (g + 1) * rows), np.int32(min(max(n - g * rows, 0), rows)),
               np.int32(g * rows)) for g in range(threads)]

    def prefill(group):
      sl, num_rows, first_row = group
      state = self._prefill(self.params, tokens[sl], mask[sl], num_rows, key, first_row)
      return jax.block_until_ready(state)

    def decode(state):
      state = self._decode(self.params, state._replace(cache=()), state.cache)
      return jax.device_get((state.tokens, state.lengths, state.log_probs, state.log_probs_t1,
                             state.step))

    t0 = time.perf_counter()
    states = runtime.map_on_threads(prefill, groups)
    t1 = time.perf_counter()
    outs = runtime.map_on_threads(decode, states)
    t2 = time.perf_counter()
    self.last_timing = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "generate_s": t2 - t0,
                        "batch_threads": threads}
    toks, lengths, lp, lp1 = (np.concatenate([np.asarray(o[i]) for o in outs])[:n]
                              for i in range(4))
    num_steps = max(int(o[4]) for o in outs)
    resp_mask = (np.arange(self.config.max_new_tokens)[None, :] < lengths[:, None]).astype(np.int32)
    return SampleOutput(
        tokens=toks, response_mask=resp_mask, log_probs=lp, log_probs_t1=lp1,
        lengths=lengths.astype(np.int32), prompt_tokens=tokens[:n], prompt_mask=mask[:n],
        num_steps=num_steps)


def generate(model: llm.DecoderLM, prompts, config: SamplingConfig, **kwargs) -> SampleOutput:
  """One-shot convenience: ``Sampler(model, config).generate(prompts, **kwargs)``."""
  return Sampler(model, config).generate(prompts, **kwargs)
