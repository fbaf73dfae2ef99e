r"""RLHF with four roles: PPO (with a critic) and the critic-free GRPO, RLOO and REINFORCE++.

One step (``RLHFTrainer.step``), each phase timed (``timing/<phase>``)::

    prompts [B/G] -> repeat G times -> sampler (rljax.sampling): responses [B, R], mask
    REFERENCE : ref_log_probs [B, R]                          (jit; frozen)
    REWARD    : scores [B]  (reward head at the EOS, or a programmatic reward function)
                + missing-EOS penalty + DAPO overlong penalty
    CRITIC    : values [B, R]                                  (jit; PPO only)
    update    : one jit, actor and critic states donated:
                old log-probs recomputed by the actor (same function and minibatch shapes as
                in the loss, so the first ratio is exactly 1) -> per-token KL (rljax.kl)
                -> token rewards = score at the EOS - beta * KL        (KL in the reward)
                -> advantages: compute_gae (PPO) | GRPO | RLOO | REINFORCE++ (rljax.ppo)
                -> ppo_update over {actor, critic}   (penalty_fn for KL in the loss)

References: Ziegler et al. 2019 (arXiv:1909.08593); Ouyang et al. 2022 (arXiv:2203.02155);
Shao et al. 2024 GRPO (arXiv:2402.03300); Ahmadian et al. 2024 RLOO (arXiv:2402.14740);
Hu 2025 REINFORCE++ (arXiv:2501.03262); Yu et al. 2025 DAPO (arXiv:2503.14476).

Metric names follow OpenRLHF/verl: ``reward/mean``, ``reward/std``, ``score/mean``, ``kl``
(nats per response: the batch mean of ``sum_t (log pi - log pi_ref)`` over response tokens, the
k1 estimate, as TRL's ``objective/kl``; also what the adaptive controller reads; ``kl_token`` is
the configured estimator's per-token mean), ``entropy``, ``response_length/mean``,
``response_length/max``, ``pg_loss``, ``vf_loss``,
``clipfrac``, ``approx_kl``, ``grad_norm``, ``kl_coef``, ``timing/{reshard, generation, reference,
reward, critic, update, step}``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from rljax import kl as kl_lib
from rljax import ppo
from rljax import runtime
from rljax.checkpoint import NonFiniteHalt  # one exception class for both trainers
from rljax.alignment import losses, modeling
from rljax.alignment.modeling import Role
from rljax.envs.text import data as text_data
from rljax.sampling import Sampler, SamplingConfig
from rljax.sharding import mesh as mesh_lib
from rljax.sharding import placement as placement_lib
from rljax.sharding import rules as rules_lib


class Algorithm(enum.Enum):
  """The RL algorithm (`RLHFConfig.algo`); all four use `rljax.ppo.ppo_loss`, they differ in
  the advantages."""

  PPO = "ppo"                    # critic + GAE
  GRPO = "grpo"                  # group-relative, std-normalised
  RLOO = "rloo"                  # leave-one-out baseline
  REINFORCE_PP = "reinforce_pp"  # token returns, globally whitened


class KLPlacement(enum.Enum):
  """Where the KL penalty to the reference enters (`RLHFConfig.kl_placement`)."""

  REWARD = "reward"  # r_t -= beta * k(x_t)  (use k1 or k3: unbiased values)
  LOSS = "loss"      # loss += beta * agg(k(x_t))  (use k2: unbiased gradient; GRPO uses k3)


class CriticInit(enum.Enum):
  """What the PPO critic's weights start from (`RLHFConfig.critic_init`)."""

  REWARD = "reward"  # from the reward model (its reward head becomes the value head)
  ACTOR = "actor"    # from the SFT policy (fresh value head)


def _enum(cls, value, name):
  try:
    return value if isinstance(value, cls) else cls(value)
  except ValueError:
    raise ValueError(f"{name} must be one of {[e.value for e in cls]}, got {value!r}.") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLHFConfig:
  """RLHF hyperparameters (one config for all four algorithms).

  Attributes:
    algo: :class:`Algorithm` (or its string).
    num_steps: RL steps (> 0).
    prompts_per_step: prompts sampled per step (> 0).
    group_size: responses per prompt ``G`` (GRPO/RLOO need >= 2).
    max_new_tokens: response length ``R`` (> 0).
    temperature, top_k, top_p: sampling (``rljax.sampling.SamplingConfig``).
    stop_ids: ids that end a response; empty means the tokenizer's EOS. The missing-EOS
      penalty uses these ids.
    actor_lr, critic_lr: Adam learning rates (> 0).
    max_grad_norm: global-norm clip per role (> 0).
    kl_coef: initial ``beta`` (>= 0).
    kl_estimator: ``k1``, ``k2`` or ``k3`` (:class:`rljax.kl.KLEstimator`).
    kl_placement: ``reward`` or ``loss`` (:class:`KLPlacement`).
    adaptive_kl: use Ziegler et al.'s adaptive controller with ``kl_target``/``kl_horizon``.
    gamma, gae_lambda: GAE (PPO) and REINFORCE++ discount.
    ppo: the shared :class:`rljax.ppo.PPOConfig` (clip, clip-higher, epochs, minibatches,
      aggregation). ``vf_coef`` weights the critic loss.
    critic_init: :class:`CriticInit`.
    grpo_normalize_std: GRPO divides by the group std (False: Dr. GRPO).
    missing_eos_penalty: subtracted from the score of a response without a stop id (None: off).
    overlong_buffer: DAPO ``L_cache`` in tokens (0: off); ``L_max = max_new_tokens``.
    overlong_factor: scale of the overlong penalty.
    reuse_rollout_log_probs: skip the update's separate old-log-prob forward pass and take the
      old log-probs from the sampler (its temperature-1 log-probs, equal to the trainer's to
      float rounding, <= 1e-5 in f32). Needs a single-pass update (``ppo.num_epochs == 1`` and
      ``ppo.num_minibatches == 1``): the loss then uses ``old + (log pi - stop_grad(log pi))``
      as the new log-prob, whose value is ``old`` and whose gradient is ``grad log pi``, so the
      ratio is exactly 1, as in TRL's ``GRPOTrainer`` with ``num_iterations=1`` (old =
      ``detach(new)``). ``logprob_drift`` is then not measured (NaN).
    seed: sampling, shuffling and minibatch seed.
    nonfinite: what a non-finite reward (from ``reward_fn`` or the reward model, penalties
      included), loss or gradient does (as in ``rljax.control.config.ControlConfig``):
      ``"skip"`` skips that step's update (actor and critic parameters, optimizer states and
      the KL controller unchanged; the step, data position and PRNG key advance) with a
      warning naming the step and the quantity; ``"halt"`` raises
      :class:`rljax.checkpoint.NonFiniteHalt` after that skipped step
      (``rljax.alignment.checkpointing.train`` checkpoints its still finite state first).
      Skips are counted in the ``nonfinite/skipped_updates`` metric.
    compute_dtype: ``None`` (compute in the parameters' own dtype), ``"float32"`` or
      ``"bfloat16"``: mixed precision, as TRL/Accelerate's ``bf16=True`` autocast. The
      floating parameters of every role are cast to this dtype inside each jitted forward
      (generation, reference, reward, critic and the update's forward and backward), so
      gradients, parameters and optimizer states stay in their stored dtype (f32 master
      weights). Log-probs, softmax, norms, the KV cache of an f32 model and the losses stay
      f32 (``rljax.models.llm``).
  """

  algo: Algorithm = Algorithm.PPO
  num_steps: int = 100
  prompts_per_step: int = 32
  group_size: int = 1
  max_new_tokens: int = 16
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_ids: tuple[int, ...] = ()
  actor_lr: float = 1e-5
  critic_lr: float = 1e-4
  max_grad_norm: float = 1.0
  kl_coef: float = 0.05
  kl_estimator: kl_lib.KLEstimator = kl_lib.KLEstimator.K1
  kl_placement: KLPlacement = KLPlacement.REWARD
  adaptive_kl: bool = False
  kl_target: float = 1.0
  kl_horizon: int = 10_000
  gamma: float = 1.0
  gae_lambda: float = 0.95
  ppo: ppo.PPOConfig = dataclasses.field(
      default_factory=lambda: ppo.PPOConfig(num_epochs=1, num_minibatches=2, value_clip_eps=0.2))
  critic_init: CriticInit = CriticInit.ACTOR
  grpo_normalize_std: bool = True
  missing_eos_penalty: float | None = None
  overlong_buffer: int = 0
  overlong_factor: float = 1.0
  reuse_rollout_log_probs: bool = False
  seed: int = 0
  nonfinite: str = "skip"
  compute_dtype: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "algo", _enum(Algorithm, self.algo, "algo"))
    object.__setattr__(self, "kl_placement", _enum(KLPlacement, self.kl_placement, "kl_placement"))
    object.__setattr__(self, "kl_estimator",
                       _enum(kl_lib.KLEstimator, self.kl_estimator, "kl_estimator"))
    object.__setattr__(self, "critic_init", _enum(CriticInit, self.critic_init, "critic_init"))
    object.__setattr__(self, "stop_ids", tuple(int(s) for s in self.stop_ids))
    for name in ("num_steps", "prompts_per_step", "group_size", "max_new_tokens", "kl_horizon"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    if self.algo in (Algorithm.GRPO, Algorithm.RLOO) and self.group_size < 2:
      raise ValueError(f"algo={self.algo.value} needs group_size >= 2, got {self.group_size}.")
    for name in ("actor_lr", "critic_lr", "max_grad_norm", "kl_target"):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")
    if self.kl_coef < 0:
      raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}.")
    if self.nonfinite not in ("skip", "halt"):
      raise ValueError(f"nonfinite must be 'skip' or 'halt', got {self.nonfinite!r}.")
    if self.compute_dtype not in (None, "float32", "bfloat16"):
      raise ValueError(
          f"compute_dtype must be None, 'float32' or 'bfloat16', got {self.compute_dtype!r}.")
    if not 0 <= self.gamma <= 1 or not 0 <= self.gae_lambda <= 1:
      raise ValueError(f"gamma and gae_lambda must be in [0, 1], got {self.gamma}, {self.gae_lambda}.")
    if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
      raise ValueError(f"missing_eos_penalty must be >= 0, got {self.missing_eos_penalty}.")
    if not 0 <= self.overlong_buffer <= self.max_new_tokens:
      raise ValueError(
          f"overlong_buffer must be in [0, max_new_tokens={self.max_new_tokens}], got "
          f"{self.overlong_buffer}.")
    if self.reuse_rollout_log_probs and (self.ppo.num_epochs, self.ppo.num_minibatches) != (1, 1):
      raise ValueError(
          f"reuse_rollout_log_probs needs a single-pass update (ppo.num_epochs == 1 and "
          f"ppo.num_minibatches == 1), got {self.ppo.num_epochs} x {self.ppo.num_minibatches}.")
    if self.batch_size % self.ppo.num_minibatches:
      raise ValueError(
          f"prompts_per_step * group_size = {self.batch_size} is not divisible by "
          f"ppo.num_minibatches = {self.ppo.num_minibatches}.")
    if (self.batch_size // self.ppo.num_minibatches) % self.ppo.num_microbatches:
      raise ValueError(
          f"a minibatch's {self.batch_size // self.ppo.num_minibatches} sequences "
          f"(prompts_per_step * group_size = {self.batch_size} / ppo.num_minibatches = "
          f"{self.ppo.num_minibatches}) are not divisible by ppo.num_microbatches = "
          f"{self.ppo.num_microbatches}.")

  @property
  def batch_size(self) -> int:
    return self.prompts_per_step * self.group_size

  @property
  def uses_reference(self) -> bool:
    """False when ``kl_coef == 0`` with a fixed controller: no KL term, no reference pass."""
    return self.kl_coef > 0 or self.adaptive_kl

  @property
  def uses_critic(self) -> bool:
    return self.algo == Algorithm.PPO


@dataclasses.dataclass
class Samples:
  """What a programmatic reward function receives (``B`` rows, responses cut at their mask)."""

  prompt_text: list[str]
  response_text: list[str]
  prompt_ids: list[list[int]]
  response_ids: list[list[int]]


RewardFn = Callable[[Samples], Sequence[float] | np.ndarray]


class RLHFState(NamedTuple):
  """Train state: the trained roles' parameters and optimizer (``ppo.PPOState`` over
  ``{"actor": ..., "critic": ...}``), KL controller, step, data position, PRNG key and the
  number of updates skipped so far by the non-finite guard."""

  ppo_state: ppo.PPOState
  kl_state: kl_lib.KLControllerState
  step: int
  data_position: text_data.DataPosition
  key: jax.Array
  skipped_updates: int = 0


def _critic_from_reward(reward_params):
  """Critic parameters from the reward model's: the reward head becomes the value head."""
  params = jax.tree.map(lambda x: x, reward_params)
  params["value_head"] = jax.tree.map(lambda x: x, reward_params["reward_head"])
  return params


def cast_floating(tree, dtype):
  """``tree`` with its floating leaves cast to ``dtype`` (others untouched; ``dtype=None``
  returns ``tree``). Differentiable: the gradient of a cast f32 leaf is cast back to f32
  (mixed precision with f32 master weights)."""
  if dtype is None:
    return tree
  dtype = jnp.dtype(dtype)
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype
      else x, tree)


def make_update_fn(actor_graphdef, critic_graphdef, optimizer, config: RLHFConfig, *,
                   out_shardings=None):
  """The jitted update: ``(ppo_state, batch, key, kl_coef) -> (ppo_state, metrics, extras)``.

  ``batch`` holds ``prompt_tokens, prompt_mask [B, P]``, ``response_tokens, mask [B, R]``,
  ``ref_log_probs [B, R]``, ``values [B, R]`` (zeros without a critic), ``scores [B]`` and
  ``sampler_log_probs [B, R]``. ``extras`` returns the computed ``log_probs``, ``advantages``,
  ``returns`` and ``token_rewards`` for inspection. ``ppo_state`` is donated.

  Non-finite guard: when a score is not finite, or a minibatch's loss or gradient is not
  (``ppo_update`` skips those minibatches), the returned ``ppo_state`` is the input one,
  selected in the jit (no host round trip); ``metrics`` then has ``nonfinite/skipped`` = 1
  and ``nonfinite/reward``, ``nonfinite/loss_or_grad`` say why.

  ``out_shardings`` (optional, ``(ppo_state shardings, metrics sharding, extras sharding)``)
  pins the output layout on a mesh, so that a step's output state is laid out like its input
  and the next step does not recompile.
  """
  pcfg = config.ppo
  m = pcfg.num_minibatches * pcfg.num_microbatches  # chunks shaped like one loss part

  def actor_apply(params, mb):
    return modeling.policy_outputs(actor_graphdef, params, mb["prompt_tokens"], mb["prompt_mask"],
                                   mb["response_tokens"], mb["mask"])

  reuse = config.reuse_rollout_log_probs

  def apply_fn(params, mb):
    params = cast_floating(params, config.compute_dtype)
    lp, ent = actor_apply(params["actor"], mb)
    if reuse:  # value: the rollout's log-prob (ratio exactly 1); gradient: grad log pi
      lp = mb["log_probs"] + (lp - jax.lax.stop_gradient(lp))
    if config.uses_critic:
      values = modeling.critic_values(critic_graphdef, params["critic"], mb["prompt_tokens"],
                                      mb["prompt_mask"], mb["response_tokens"], mb["mask"])
    else:
      values = jnp.zeros_like(lp)
    return lp, values, ent

  def penalty_fn(params, mb, log_probs, mask):
    del params
    k = kl_lib.kl_estimate(log_probs, mb["ref_log_probs"], config.kl_estimator)
    term = ppo.aggregate_loss(k, mask, pcfg.loss_aggregation)
    return mb["kl_coef"] * term, {"kl_loss": term}

  def update(state: ppo.PPOState, batch, key, kl_coef):
    mask = batch["mask"].astype(jnp.float32)
    n = mask.shape[0]
    if reuse:  # the sampler's log-probs; no extra forward pass
      old_lp = jax.lax.stop_gradient(batch["sampler_log_probs"].astype(jnp.float32) * mask)
    else:
      # Old log-probs: the actor's own function on chunks shaped like the loss's (minibatch
      # or micro-batch) rows, so that at the first minibatch the ratio is exactly 1.
      chunks = jax.tree.map(lambda x: x.reshape((m, n // m) + x.shape[1:]), batch)
      old_lp, _ = jax.lax.map(lambda mb: actor_apply(state.params["actor"], mb), chunks)
      old_lp = jax.lax.stop_gradient(old_lp.reshape(n, -1))

    ref = batch["ref_log_probs"]
    k_tok = kl_lib.kl_estimate(old_lp, ref, config.kl_estimator) * mask
    # The logged (and adaptive-controller) KL: per-sequence sum of log pi - log pi_ref (k1),
    # TRL's objective/kl and Ziegler et al.'s controller input. k3 is unbiased too but heavy-
    # tailed: a sampled token with log pi = -9.5 and log pi_ref = -1.8 has k3 = 2,113, so a
    # 64-row batch whose k1 read 0.72 nats read 33.5 with k3 (embedded run, 8 fake devices).
    kl_seq = jnp.sum(kl_lib.kl_k1(old_lp, ref) * mask, axis=-1)
    beta_reward = kl_coef if config.kl_placement == KLPlacement.REWARD else 0.0
    token_rewards = losses.token_level_rewards(batch["scores"], k_tok, mask, kl_coef=beta_reward)
    values = batch["values"] * mask

    if config.algo == Algorithm.PPO:
      bootstrap = jnp.pad(values[:, 1:], ((0, 0), (0, 1)))
      adv, returns = ppo.compute_gae(token_rewards, values, bootstrap, jnp.ones_like(mask), mask,
                                     gamma=config.gamma, gae_lambda=config.gae_lambda)
    elif config.algo == Algorithm.REINFORCE_PP:
      adv = ppo.reinforce_pp_advantages(token_rewards, mask, gamma=config.gamma)
      returns = jnp.zeros_like(adv)
    else:
      seq_reward = jnp.sum(token_rewards, axis=-1)  # score - beta * sum_t k_t
      if config.algo == Algorithm.GRPO:
        seq_adv = ppo.group_relative_advantages(seq_reward, group_size=config.group_size,
                                                normalize_std=config.grpo_normalize_std)
      else:
        seq_adv = ppo.rloo_advantages(seq_reward, group_size=config.group_size)
      adv = ppo.sequence_to_token_advantages(seq_adv, mask)
      returns = jnp.zeros_like(adv)

    ppo_batch = dict(
        prompt_tokens=batch["prompt_tokens"], prompt_mask=batch["prompt_mask"],
        response_tokens=batch["response_tokens"], mask=mask, ref_log_probs=ref,
        log_probs=old_lp, values=values, advantages=adv, returns=returns,
        kl_coef=jnp.broadcast_to(kl_coef, (n,)))
    in_loss = config.kl_placement == KLPlacement.LOSS and config.kl_coef > 0
    old_state = state
    state, metrics = ppo.ppo_update(state, ppo_batch, key, apply_fn=apply_fn,
                                    optimizer=optimizer, config=pcfg,
                                    penalty_fn=_mean_coef(penalty_fn) if in_loss else None)
    # Non-finite guard (as in rljax.control.trainer): a non-finite score, loss or gradient
    # never reaches the actor or critic parameters or the optimizer states.
    finite_reward = jnp.all(jnp.isfinite(batch["scores"]))
    finite_update = metrics["nonfinite_steps"] == 0
    apply = finite_reward & finite_update
    state = jax.tree.map(lambda new, old: jnp.where(apply, new, old), state, old_state)
    drift = (jnp.float32(jnp.nan) if reuse
             else jnp.max(jnp.abs(old_lp - batch["sampler_log_probs"]) * mask))
    metrics = dict(metrics, kl=jnp.mean(kl_seq), kl_token=ppo.masked_mean(k_tok, mask),
                   logprob_drift=drift)
    metrics["nonfinite/reward"] = 1.0 - finite_reward.astype(jnp.float32)
    metrics["nonfinite/loss_or_grad"] = 1.0 - finite_update.astype(jnp.float32)
    metrics["nonfinite/skipped"] = 1.0 - apply.astype(jnp.float32)
    extras = dict(log_probs=old_lp, advantages=adv, returns=returns, token_rewards=token_rewards)
    return state, metrics, extras

  if out_shardings is None:
    return jax.jit(update, donate_argnums=(0,))
  return jax.jit(update, donate_argnums=(0,), out_shardings=out_shardings)


def _batch_names(ndim: int) -> tuple[str | None, ...]:
  """Logical names of a per-step array ``[B, ...]``: rows are the batch, the rest unsharded."""
  return ("batch",) + (None,) * (ndim - 1)


def _mean_coef(penalty_fn):
  """Uses the minibatch's (constant) ``kl_coef`` row as the scalar coefficient."""

  def fn(params, mb, log_probs, mask):
    value, metrics = penalty_fn(params, dict(mb, kl_coef=jnp.mean(mb["kl_coef"])), log_probs, mask)
    return value, metrics

  return fn


class RLHFTrainer:
  """Holds the four roles and runs RLHF steps.

  Args:
    config: :class:`RLHFConfig`.
    actor: the policy (a ``DecoderLM``, usually after SFT). Its current weights also become the
      frozen reference unless ``reference`` is given.
    tokenizer: anything with ``decode`` and ``eos_token_id`` (``pad_token_id`` optional).
    prompts: tokenized prompts (lists of ids).
    prompt_texts: the prompts as text, for programmatic rewards (default: decoded ids).
    reward_model: a ``DecoderLM`` scored with its reward head (REWARD role), or None.
    reward_fn: a programmatic reward ``fn(Samples) -> [B]`` used instead of a reward model.
    reference: the REFERENCE model (default: a frozen copy of ``actor``).
    critic: the CRITIC model (PPO; default from ``config.critic_init``).
    placement: where each role lives (:class:`rljax.sharding.placement.Placement`), or None
      for the default device. The actor and critic train in their placement's layout (e.g.
      ``fsdp``) and the actor is resharded to ``placement.generation`` before every generation
      (``timing/reshard``); see :meth:`_apply_placement`.

  Raises:
    ValueError: neither or both of ``reward_model`` and ``reward_fn``; no prompts; no stop ids;
      actor and critic placed differently.
    rljax.sharding.mesh.MeshError: ``prompts_per_step * group_size`` not divisible by the
      training mesh's data axes (raised before anything compiles).
  """

  def __init__(self, config: RLHFConfig, *, actor, tokenizer, prompts: Sequence[Sequence[int]],
               prompt_texts: Sequence[str] | None = None, reward_model=None,
               reward_fn: RewardFn | None = None, reference=None, critic=None,
               placement: placement_lib.Placement | None = None):
    if (reward_model is None) == (reward_fn is None):
      raise ValueError("pass exactly one of reward_model= and reward_fn=")
    if not prompts:
      raise ValueError("RLHFTrainer: empty prompt set")
    self.config = config
    self.tokenizer = tokenizer
    self.prompts = [list(p) for p in prompts]
    self.prompt_texts = list(prompt_texts) if prompt_texts is not None else None
    self.reward_fn = reward_fn
    stop_ids = config.stop_ids or ((tokenizer.eos_token_id,)
                                   if tokenizer.eos_token_id is not None else ())
    if not stop_ids:
      raise ValueError("no stop ids: set RLHFConfig.stop_ids or use a tokenizer with an EOS")
    self.stop_ids = tuple(stop_ids)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    self.pad_id = 0 if pad_id is None else int(pad_id)

    self.graphdefs: dict[Role, Any] = {}
    self.params: dict[Role, Any] = {}
    self.graphdefs[Role.ACTOR], actor_params = nnx.split(actor, nnx.Param)
    ref = reference if reference is not None else actor
    self.graphdefs[Role.REFERENCE], ref_params = nnx.split(ref, nnx.Param)
    self.params[Role.REFERENCE] = jax.tree.map(jnp.copy, ref_params)
    if reward_model is not None:
      self.graphdefs[Role.REWARD], self.params[Role.REWARD] = nnx.split(reward_model, nnx.Param)
    trained = {"actor": jax.tree.map(jnp.copy, actor_params)}
    if config.uses_critic:
      if critic is not None:
        self.graphdefs[Role.CRITIC], critic_params = nnx.split(critic, nnx.Param)
      elif config.critic_init == CriticInit.REWARD and reward_model is not None:
        self.graphdefs[Role.CRITIC] = self.graphdefs[Role.REWARD]
        critic_params = _critic_from_reward(self.params[Role.REWARD])
      else:
        self.graphdefs[Role.CRITIC] = self.graphdefs[Role.ACTOR]
        critic_params = actor_params
      trained["critic"] = jax.tree.map(jnp.copy, critic_params)

    def role_opt(lr):
      return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr))

    labels = {k: jax.tree.map(lambda _: k, v) for k, v in trained.items()}
    self.optimizer = optax.multi_transform(
        {"actor": role_opt(config.actor_lr), "critic": role_opt(config.critic_lr)}, labels)
    self.kl_controller = (
        kl_lib.adaptive_kl_controller(config.kl_coef, target=config.kl_target,
                                      horizon=config.kl_horizon)
        if config.adaptive_kl else kl_lib.fixed_kl_controller(config.kl_coef))
    self.state = RLHFState(
        ppo.PPOState(trained, self.optimizer.init(trained)), self.kl_controller.init(), 0,
        text_data.init_data_position(config.seed), jax.random.key(config.seed))

    self.sampler = Sampler(actor, SamplingConfig(
        max_new_tokens=config.max_new_tokens, temperature=config.temperature,
        top_k=config.top_k, top_p=config.top_p, eos_token_ids=self.stop_ids,
        pad_token_id=self.pad_id, dtype=config.compute_dtype,
        # bf16 weights with an f32 cache: bf16 batched attention matmuls are slower on CPU.
        cache_dtype="float32" if config.compute_dtype == "bfloat16" else None))
    gd = self.graphdefs
    cast = functools.partial(cast_floating, dtype=config.compute_dtype)
    self._ref_fn = jax.jit(lambda p, pt, pm, rt, rm: modeling.policy_outputs(
        gd[Role.REFERENCE], cast(p), pt, pm, rt, rm, with_entropy=False)[0])
    if Role.REWARD in gd:
      def score(p, pt, pm, rt, rm):
        tokens, mask = modeling.concat(pt, pm, rt, rm)
        return modeling.sequence_scores(gd[Role.REWARD], cast(p), tokens, mask)
      self._reward_model_fn = jax.jit(score)
    if config.uses_critic:
      self._critic_fn = jax.jit(lambda p, pt, pm, rt, rm: modeling.critic_values(
          gd[Role.CRITIC], cast(p), pt, pm, rt, rm))
    self._update_fn = make_update_fn(gd[Role.ACTOR], gd.get(Role.CRITIC), self.optimizer, config)
    self.last_batch: dict[str, np.ndarray] = {}
    self.placement: placement_lib.Placement | None = None
    if placement is not None:
      self._apply_placement(placement)

  # ---- phases --------------------------------------------------------------------------------

  def _scores(self, prompt_ids, out) -> np.ndarray:
    mask = out.response_mask
    if self.reward_fn is not None:
      resp_ids = [row[:int(n)].tolist() for row, n in zip(out.tokens, out.lengths)]
      texts = self.tokenizer_decode(resp_ids)
      prompt_text = (self._batch_prompt_texts if self.prompt_texts is not None
                     else self.tokenizer_decode(prompt_ids))
      samples = Samples(list(prompt_text), texts, [list(p) for p in prompt_ids], resp_ids)
      scores = np.asarray(self.reward_fn(samples), np.float32)
      if scores.shape != (len(prompt_ids),):
        raise ValueError(f"reward_fn returned shape {scores.shape}, expected ({len(prompt_ids)},)")
    else:
      scores = runtime.to_host(self._reward_model_fn(
          self._frozen_params(Role.REWARD),
          *self._inputs(Role.REWARD, (out.prompt_tokens, out.prompt_mask, out.tokens, mask))))
    return scores

  def tokenizer_decode(self, rows):
    """Decoded text of each token-id row (e.g. ``SampleOutput.tokens [B, R]``)."""
    return [self.tokenizer.decode(r) for r in rows]

  def actor_params(self):
    """The actor's current parameters (``nnx.State``, in the training layout)."""
    return self.state.ppo_state.params["actor"]

  def actor_model(self):
    """The current policy as an NNX module."""
    return nnx.merge(self.graphdefs[Role.ACTOR], self.actor_params())

  # ---- placement: meshes, rules, resharding (rljax.sharding.placement) ----------------------

  def _role_placement(self, role: Role) -> placement_lib.RolePlacement:
    return self.placement[placement_lib.Role(role.value)]

  def _apply_placement(self, placement: placement_lib.Placement) -> None:
    """Moves every role onto its mesh in its rules' layout and re-jits with pinned layouts.

    * ACTOR and CRITIC (one ``ppo_state``, one update): params and optimizer state sharded by
      the actor placement's preset (e.g. ``fsdp``: ``embed`` over the ``fsdp`` axis); the
      update's output state is pinned to the same shardings, so steps never recompile.
    * REFERENCE and REWARD: sharded on their meshes; kept in host memory between uses when
      their placement says ``offload``.
    * Per-step batches ``[B, ...]`` are split over the data axes (``data`` x ``fsdp``) of the
      mesh of the role that reads them; metrics and ``extras`` come back replicated.

    Raises:
      ValueError: the actor and critic placements differ (they share one update).
      MeshError: ``config.batch_size`` not divisible by the training mesh's data axes.
    """
    self.placement = placement
    train = self._role_placement(Role.ACTOR)
    if self.config.uses_critic:
      crit = self._role_placement(Role.CRITIC)
      if crit.mesh != train.mesh or crit.preset != train.preset:
        raise ValueError(
            f"the actor and critic train in one update and must share a placement; got actor "
            f"{dict(train.mesh.shape)} {train.preset.value}, critic {dict(crit.mesh.shape)} "
            f"{crit.preset.value}")
    mesh_lib.check_batch_divisible(self.config.batch_size, train.mesh,
                                   what="prompts_per_step * group_size")
    ps = self.state.ppo_state
    ps = ppo.PPOState(rules_lib.shard(ps.params, train.mesh, train.preset),
                      rules_lib.shard(ps.opt_state, train.mesh, train.preset))
    self.state = self.state._replace(ppo_state=ps)
    for role in (Role.REFERENCE, Role.REWARD):
      if role in self.params:
        rp = self._role_placement(role)
        self.params[role] = (placement_lib.offload(self.params[role], rp) if rp.offload else
                             rules_lib.shard(self.params[role], rp.mesh, rp.preset))

    def rows(role, ndim):  # the sharding of a per-step [B, ...] output of ``role``
      rp = self._role_placement(role)
      shape = (self.config.batch_size,) + (self.config.max_new_tokens,) * (ndim - 1)
      return rules_lib.activation_sharding(_batch_names(ndim), shape, rp.mesh, rp.preset)

    self._ref_fn = jax.jit(self._ref_fn.__wrapped__, out_shardings=rows(Role.REFERENCE, 2))
    if self.config.uses_critic:
      self._critic_fn = jax.jit(self._critic_fn.__wrapped__, out_shardings=rows(Role.CRITIC, 2))
    if Role.REWARD in self.graphdefs:
      rep = jax.sharding.NamedSharding(self._role_placement(Role.REWARD).mesh,
                                       jax.sharding.PartitionSpec())
      self._reward_model_fn = jax.jit(self._reward_model_fn.__wrapped__, out_shardings=rep)
    rep = jax.sharding.NamedSharding(train.mesh, jax.sharding.PartitionSpec())
    state_sh = jax.tree.map(lambda x: x.sharding, ps)
    self._update_fn = make_update_fn(self.graphdefs[Role.ACTOR], self.graphdefs.get(Role.CRITIC),
                                     self.optimizer, self.config,
                                     out_shardings=(state_sh, rep, rep))

  def _generation_params(self) -> tuple[Any, float]:
    """The actor's weights in the generation layout, and the seconds the reshard took."""
    if self.placement is None:
      return self.actor_params(), 0.0
    m: dict[str, float] = {}
    params = placement_lib.reshard(self.actor_params(), to=self.placement.generation, metrics=m)
    return params, m["timing/reshard"]

  def generation_params(self):
    """The actor's current weights resharded to the generation layout (what the sampler uses)."""
    return self._generation_params()[0]

  def _frozen_params(self, role: Role):
    """A frozen role's params on device (brought back from host memory if offloaded)."""
    params = self.params[role]
    if self.placement is not None and self._role_placement(role).offload:
      params = placement_lib.onload(params, self._role_placement(role))
    return params

  def _inputs(self, role: Role, tree):
    """Per-step host or device arrays ``[B, ...]`` as global arrays split over the data axes of
    ``role``'s mesh (identity without a placement). Every process holds the same host batch."""
    if self.placement is None:
      return tree
    rp = self._role_placement(role)

    def put(x):
      shape = tuple(np.shape(x))
      sharding = rules_lib.activation_sharding(_batch_names(len(shape)), shape, rp.mesh, rp.preset)
      if isinstance(x, jax.Array):
        return x if x.sharding == sharding else jax.device_put(x, sharding)
      host = np.asarray(x)
      return jax.make_array_from_callback(shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree)

  def step(self) -> dict[str, float]:
    """One RLHF step; returns its metrics (floats).

    Raises:
      rljax.checkpoint.NonFiniteHalt: ``config.nonfinite == "halt"`` and this step's
        update was skipped (a non-finite reward, loss or gradient); ``self.state`` is then the
        skipped step's (finite) state.
    """
    cfg = self.config
    t_step = time.perf_counter()
    idx, pos = text_data.next_batch_indices(self.state.data_position, len(self.prompts),
                                            cfg.prompts_per_step)
    rows = [int(i) for i in idx for _ in range(cfg.group_size)]
    prompt_ids = [self.prompts[i] for i in rows]
    if self.prompt_texts is not None:
      self._batch_prompt_texts = [self.prompt_texts[i] for i in rows]
    key, gen_key, upd_key = jax.random.split(self.state.key, 3)

    gen_params, reshard_s = self._generation_params()
    t = time.perf_counter()
    self.sampler.update_params(gen_params)
    out = self.sampler.generate(prompt_ids, key=gen_key)
    timing = {"timing/generation": time.perf_counter() - t, "timing/reshard": reshard_s}

    args = (out.prompt_tokens, out.prompt_mask, out.tokens, out.response_mask)
    t = time.perf_counter()
    if cfg.uses_reference:
      ref_lp = jax.block_until_ready(self._ref_fn(self._frozen_params(Role.REFERENCE),
                                                  *self._inputs(Role.REFERENCE, args)))
    else:
      # beta == 0 and fixed: the KL term is multiplied by 0, so the reference forward is
      # skipped (as TRL does at beta = 0); the rollout's own log-probs stand in, and the
      # KL metrics are not reported.
      ref_lp = out.log_probs_t1
    timing["timing/reference"] = time.perf_counter() - t

    t = time.perf_counter()
    raw_scores = self._scores(prompt_ids, out)
    scores = raw_scores.copy()
    if cfg.missing_eos_penalty is not None:
      scores += np.asarray(losses.missing_eos_penalty(
          out.tokens, out.response_mask, stop_ids=self.stop_ids, penalty=cfg.missing_eos_penalty))
    if cfg.overlong_buffer > 0:
      scores += np.asarray(losses.overlong_penalty(
          out.lengths, max_length=cfg.max_new_tokens, buffer_length=cfg.overlong_buffer,
          factor=cfg.overlong_factor))
    timing["timing/reward"] = time.perf_counter() - t

    t = time.perf_counter()
    if cfg.uses_critic:
      values = jax.block_until_ready(self._critic_fn(self.state.ppo_state.params["critic"],
                                                     *self._inputs(Role.CRITIC, args)))
    else:
      values = np.zeros(out.tokens.shape, np.float32)
    timing["timing/critic"] = time.perf_counter() - t

    batch = dict(prompt_tokens=out.prompt_tokens, prompt_mask=out.prompt_mask,
                 response_tokens=out.tokens, mask=out.response_mask, ref_log_probs=ref_lp,
                 values=values, scores=scores, sampler_log_probs=out.log_probs_t1)
    batch = self._inputs(Role.ACTOR, batch)
    t = time.perf_counter()
    kl_coef = self.state.kl_state.kl_coef
    ppo_state, metrics, extras = self._update_fn(self.state.ppo_state, batch, upd_key, kl_coef)
    metrics = runtime.to_host(metrics)
    timing["timing/update"] = time.perf_counter() - t

    skipped = bool(metrics["nonfinite/skipped"] > 0)
    kl_state = (self.state.kl_state if skipped else
                self.kl_controller.update(self.state.kl_state, metrics["kl"], cfg.batch_size))
    num_skipped = self.state.skipped_updates + int(skipped)
    self.state = RLHFState(ppo_state, kl_state, self.state.step + 1, pos, key, num_skipped)
    self.last_batch = dict(runtime.to_host(batch), **runtime.to_host(extras))

    lengths = out.lengths
    rec = {
        "reward/mean": float(np.mean(scores)), "reward/std": float(np.std(scores)),
        "score/mean": float(np.mean(raw_scores)),
        "kl_coef": float(kl_coef),
        "entropy": float(metrics["entropy"]),
        "response_length/mean": float(np.mean(lengths)),
        "response_length/max": float(np.max(lengths)),
        "eos_fraction": float(np.mean(np.asarray(
            losses.ends_with_stop(out.tokens, out.response_mask, self.stop_ids)))),
    }
    if cfg.uses_reference:
      rec["kl"], rec["kl_token"] = float(metrics["kl"]), float(metrics["kl_token"])
    for k in ("pg_loss", "vf_loss", "clipfrac", "approx_kl", "grad_norm", "ratio_first",
              "logprob_drift", "loss"):
      rec[k] = float(metrics[k])
    if "kl_loss" in metrics:
      rec["kl_loss"] = float(metrics["kl_loss"])
    for k in ("nonfinite/reward", "nonfinite/loss_or_grad"):
      rec[k] = float(metrics[k])
    rec["nonfinite/skipped_updates"] = float(num_skipped)
    timing["timing/step"] = time.perf_counter() - t_step
    rec.update(timing)
    if skipped:
      which = [k.split("/")[1] for k in ("nonfinite/reward", "nonfinite/loss_or_grad")
               if rec[k] > 0]
      msg = (f"non-finite {', '.join(which)} at RL step {self.state.step}: update skipped "
             f"(actor, critic and optimizer states unchanged), {num_skipped} skipped in total")
      if cfg.nonfinite == "halt":
        raise NonFiniteHalt(msg)
      logging.warning(msg)
    return rec

  def train(self, *, writer=None, log_every: int = 1, callback=None) -> list[dict[str, float]]:
    """Runs ``config.num_steps - state.step`` steps; returns the per-step metrics."""
    history = []
    while self.state.step < self.config.num_steps:
      rec = self.step()
      rec["step"] = self.state.step
      history.append(rec)
      if writer is not None and (self.state.step % log_every == 0
                                 or self.state.step == self.config.num_steps):
        writer.write(self.state.step, {k: v for k, v in rec.items() if k != "step"},
                     progress=self.state.step, stage="rl")
      if callback is not None:
        callback(rec)
    return history
