"""The RLHF trainer's configuration: one `RLHFConfig` for PPO, GRPO, RLOO and REINFORCE++.

`RLHFConfig` nests the shared `rljax.ppo.PPOConfig` as ``ppo`` (clip range, epochs,
minibatches, value clipping, loss aggregation); `default_ppo_config` is its default, the one
place the RLHF PPO defaults are written.
"""

from __future__ import annotations

import dataclasses
import enum

from rljax import kl as kl_lib
from rljax import nonfinite, ppo


class Algorithm(enum.Enum):
  """The RL algorithm (`RLHFConfig.algo`); all four use `rljax.ppo.ppo_loss`, they differ in
  the advantages (`rljax.alignment.advantages`, by the algorithm's value)."""

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



def default_ppo_config() -> ppo.PPOConfig:
  """`RLHFConfig.ppo`'s default: one epoch of two minibatches, values clipped at 0.2 (PPO2)."""
  return ppo.PPOConfig(num_epochs=1, num_minibatches=2, value_clip_eps=0.2)


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
    kl_controller: what sets ``beta`` after each step (:class:`rljax.kl.KLControl` or its
      value): ``fixed`` (``kl_coef`` throughout), ``adaptive`` (Ziegler et al.'s controller
      with ``kl_target``/``kl_horizon``) or ``pi`` (a proportional-integral controller that
      holds ``kl_target``; :func:`rljax.kl.pi_kl_controller`, which needs ``kl_coef > 0``).
    kl_target: the target KL of ``adaptive`` and ``pi``, in nats per response (> 0).
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
      :class:`rljax.nonfinite.NonFiniteHalt` after that skipped step, once the host loop
      (`rljax.loop.run`) has checkpointed its still finite state.
      Skips are counted in the ``nonfinite/skipped_updates`` metric.
    compute_dtype: ``None`` (compute in the parameters' own dtype), ``"float32"`` or
      ``"bfloat16"``: mixed precision, as TRL/Accelerate's ``bf16=True`` autocast. The
      floating parameters of every role are cast to this dtype inside each jitted forward
      (generation, reference, reward, critic and the update's forward and backward), so
      gradients, parameters and optimizer states stay in their stored dtype (f32 master
      weights). Log-probs, softmax, norms, the KV cache of an f32 model and the losses stay
      f32 (``rljax.models.llm``).
    max_staleness: asynchronous RLHF (``>= 0``). 0 generates, scores and trains each batch
      in turn. ``s > 0`` generates batch ``k`` on a generator thread with the weights after
      update ``k - s`` while the earlier batches train, so that generation overlaps the
      update; no sample is trained more than ``s`` updates after the policy that generated
      it (`rljax.alignment.rollouts`). The update then uses the decoupled PPO objective
      (`rljax.ppo.ppo_loss`): the clip is centred on the current (proximal) policy and each
      token's term is weighted by ``min(pi_prox / pi_behav, behaviour_weight_cap)``, where
      ``pi_behav`` is the sampler's full-vocabulary probability of the sampled token under
      the generating weights.
    behaviour_weight_cap: truncation of that importance weight (``>= 1``), as IMPALA's
      ``rho_bar`` (Espeholt et al. 2018, arXiv:1802.01561).
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
  kl_controller: kl_lib.KLControl = kl_lib.KLControl.FIXED
  kl_target: float = 1.0
  kl_horizon: int = 10_000
  gamma: float = 1.0
  gae_lambda: float = 0.95
  ppo: ppo.PPOConfig = dataclasses.field(default_factory=default_ppo_config)
  critic_init: CriticInit = CriticInit.ACTOR
  grpo_normalize_std: bool = True
  missing_eos_penalty: float | None = None
  overlong_buffer: int = 0
  overlong_factor: float = 1.0
  reuse_rollout_log_probs: bool = False
  seed: int = 0
  nonfinite: str = "skip"
  compute_dtype: str | None = None
  max_staleness: int = 0
  behaviour_weight_cap: float = 5.0

  def __post_init__(self):
    object.__setattr__(self, "algo", _enum(Algorithm, self.algo, "algo"))
    object.__setattr__(self, "kl_placement", _enum(KLPlacement, self.kl_placement, "kl_placement"))
    object.__setattr__(self, "kl_estimator",
                       _enum(kl_lib.KLEstimator, self.kl_estimator, "kl_estimator"))
    object.__setattr__(self, "critic_init", _enum(CriticInit, self.critic_init, "critic_init"))
    object.__setattr__(self, "kl_controller",
                       _enum(kl_lib.KLControl, self.kl_controller, "kl_controller"))
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
    if self.kl_controller is kl_lib.KLControl.PI and not self.kl_coef > 0:
      raise ValueError(f"kl_controller='pi' needs kl_coef > 0 (it scales beta by factors), got "
                       f"{self.kl_coef}.")
    nonfinite.check_policy(self.nonfinite)
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
    if self.max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0 (0: synchronous), got {self.max_staleness}.")
    if not self.behaviour_weight_cap >= 1:
      raise ValueError(f"behaviour_weight_cap must be >= 1, got {self.behaviour_weight_cap}.")
    if self.reuse_rollout_log_probs and self.max_staleness:
      raise ValueError(
          f"reuse_rollout_log_probs needs max_staleness=0 (got {self.max_staleness}): an "
          f"asynchronous update recomputes the proximal log-probs its clip is centred on.")
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
    return self.kl_coef > 0 or self.kl_controller is not kl_lib.KLControl.FIXED

  @property
  def uses_critic(self) -> bool:
    return self.algo == Algorithm.PPO

