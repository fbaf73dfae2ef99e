r"""RLHF with four roles: PPO (with a critic) and the critic-free GRPO, RLOO and REINFORCE++.

One step (``RLHFTrainer.step``), each phase timed (``timing/<phase>``)::

    prompts [B/G] -> repeat G times -> sampler (rljax.sampling): responses [B, R], mask
    REFERENCE : ref_log_probs [B, R]                          (jit; frozen)
    REWARD    : scores [B]  (reward head at the EOS, or a programmatic reward function)
                + missing-EOS penalty + DAPO overlong penalty
    CRITIC    : values [B, R]                                  (jit; PPO only)
    update    : one jit, actor and critic states donated (rljax.alignment.rlhf_update):
                old log-probs recomputed by the actor -> per-token KL (rljax.kl)
                -> token rewards = score at the EOS - beta * KL        (KL in the reward)
                -> advantages by the algorithm (rljax.alignment.advantages)
                -> ppo_update over {actor, critic}   (penalty_fn for KL in the loss)

`RLHFTrainer.train` runs the steps in the host loop every trainer shares (`rljax.loop`);
`rljax.alignment.checkpointing.train` adds checkpoints, resume and preemption.

With ``RLHFConfig.max_staleness = s > 0`` generation, reference and reward (the rollout,
`rljax.alignment.rollouts`) run on a generator thread ``s`` batches ahead of the update, with
the weights of ``s`` updates earlier, while the critic and the update run here; the update then
corrects for the stale behaviour policy with the decoupled PPO objective (`rljax.ppo.ppo_loss`)
and a truncated importance weight ``min(pi_prox / pi_behav, behaviour_weight_cap)``.

References: Ziegler et al. 2019 (arXiv:1909.08593); Ouyang et al. 2022 (arXiv:2203.02155);
Shao et al. 2024 GRPO (arXiv:2402.03300); Ahmadian et al. 2024 RLOO (arXiv:2402.14740);
Hu 2025 REINFORCE++ (arXiv:2501.03262); Yu et al. 2025 DAPO (arXiv:2503.14476).

Metric names follow OpenRLHF/verl: ``reward/mean``, ``reward/std``, ``score/mean``, ``kl``
(nats per response: the batch mean of ``sum_t (log pi - log pi_ref)`` over response tokens, the
k1 estimate, as TRL's ``objective/kl``; also what the adaptive controller reads; ``kl_token`` is
the configured estimator's per-token mean), ``entropy``, ``response_length/mean``,
``response_length/max``, ``pg_loss``, ``vf_loss``,
``clipfrac``, ``approx_kl``, ``grad_norm``, ``kl_coef``, ``timing/{reshard, generation, reference,
reward, critic, update, step}``; ``rollout/policy_lag_mean`` and ``rollout/policy_lag_max``
(updates between the generating and the trained policy). Asynchronous runs add
``rollout/is_weight_mean``, ``rollout/is_weight_max`` (before truncation),
``rollout/is_weight_truncated`` (fraction of tokens at the cap), ``timing/sync`` (copying the
actor for the generator and resharding it), ``timing/wait`` (waiting for the rollout) and
``timing/overlap`` (seconds of this step's critic and update during which the generator
worked). Synchronous runs report the CPU cores each phase kept busy (a count, not seconds: its
process CPU time over its wall time): ``timing/rollout_cores`` (generation, reference, reward)
and ``timing/update_cores`` (critic and update); on an accelerator they count the host's work.
"""

from __future__ import annotations

import dataclasses
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
from rljax import loop, nonfinite, ppo, runtime
from rljax.checkpoint import SigtermFlag
from rljax.alignment import losses, modeling, rollouts
from rljax.alignment.modeling import Role
from rljax.alignment.rlhf_config import Algorithm, CriticInit, KLPlacement, RLHFConfig
from rljax.alignment.rlhf_update import cast_floating, make_update_fn
from rljax.envs.text import data as text_data
from rljax.nonfinite import NonFiniteHalt
from rljax.sampling import Sampler, SamplingConfig
from rljax.sharding import mesh as mesh_lib
from rljax.sharding import placement as placement_lib
from rljax.sharding import rules as rules_lib

__all__ = ["Algorithm", "CriticInit", "KLPlacement", "NonFiniteHalt", "RLHFConfig",
           "RLHFState", "RLHFTrainer", "RewardFn", "Role", "Samples", "cast_floating",
           "make_update_fn"]


@dataclasses.dataclass
class Samples:
  """What a programmatic reward function receives (``B`` rows, responses cut at their mask).

  ``prompt_index``: each row's index into the trainer's ``prompts`` (rows of a group share
  one); ``step``: the RL step (1-based) the batch is trained in.
  """

  prompt_text: list[str]
  response_text: list[str]
  prompt_ids: list[list[int]]
  response_ids: list[list[int]]
  prompt_index: list[int] = dataclasses.field(default_factory=list)
  step: int = 0


RewardFn = Callable[[Samples], Sequence[float] | np.ndarray]


class RLHFState(NamedTuple):
  """Train state: the trained roles' parameters and optimizer (``ppo.PPOState`` over
  ``{"actor": ..., "critic": ...}``), KL controller, step, data position, PRNG key, the
  number of updates skipped so far by the non-finite guard and, with ``max_staleness = s > 0``,
  ``lagged_actor``: the ``s`` actor weights (training layout) that generate batches
  ``step .. step + s - 1`` (versions ``max(0, step + i - s)``), so that a checkpoint holds what
  the in-flight rollouts need."""

  ppo_state: ppo.PPOState
  kl_state: kl_lib.KLControllerState
  step: int
  data_position: text_data.DataPosition
  key: jax.Array
  skipped_updates: int = 0
  lagged_actor: tuple = ()  # actor weights generating the in-flight batches (max_staleness > 0)


def _critic_from_reward(reward_params):
  """Critic parameters from the reward model's: the reward head becomes the value head."""
  params = jax.tree.map(lambda x: x, reward_params)
  params["value_head"] = jax.tree.map(lambda x: x, reward_params["reward_head"])
  return params


def _batch_names(ndim: int) -> tuple[str | None, ...]:
  """Logical names of a per-step array ``[B, ...]``: rows are the batch, the rest unsharded."""
  return ("batch",) + (None,) * (ndim - 1)


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
      (``timing/reshard``); see :meth:`_apply_placement`. With
      ``placement.remote_generator`` the actor generates on another process instead
      (`rljax.alignment.remote_generation`).

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
    self.kl_controller = kl_lib.make_kl_controller(
        config.kl_controller, config.kl_coef, target=config.kl_target, horizon=config.kl_horizon)
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
      if placement.remote_generator is not None:
        placement.remote_generator.start(self.graphdefs[Role.ACTOR], self.sampler.config,
                                         self.actor_params())
    if config.max_staleness:  # batches 0 .. s - 1 are generated by the starting weights
      start = loop.snapshot(self.actor_params())
      self.state = self.state._replace(lagged_actor=(start,) * config.max_staleness)
    self.timeline: list[tuple[str, int, float, float]] = []  # (stage, step, start, end)
    self._generator: rollouts.Generator | None = None
    self._generator_step = -1

  # ---- phases --------------------------------------------------------------------------------

  def _scores(self, prompt_ids, out, rows, step: int) -> np.ndarray:
    mask = out.response_mask
    if self.reward_fn is not None:
      resp_ids = [row[:int(n)].tolist() for row, n in zip(out.tokens, out.lengths)]
      texts = self.tokenizer_decode(resp_ids)
      prompt_text = ([self.prompt_texts[i] for i in rows] if self.prompt_texts is not None
                     else self.tokenizer_decode(prompt_ids))
      samples = Samples(list(prompt_text), texts, [list(p) for p in prompt_ids], resp_ids,
                        prompt_index=[int(i) for i in rows], step=step)
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

  def _generation_params(self, params=None) -> tuple[Any, float]:
    """Actor weights (default: the current ones) in the generation layout, and the seconds
    the reshard took."""
    params = self.actor_params() if params is None else params
    if self.placement is None:
      return params, 0.0
    m: dict[str, float] = {}
    params = placement_lib.reshard(params, to=self.placement.generation, metrics=m)
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

    With ``max_staleness = 0`` it generates, scores and trains one batch in turn; with
    ``s > 0`` it hands the current weights to the generator thread (for batch ``step + s``)
    and trains batch ``step``, generated ``s`` updates ago (`rljax.alignment.rollouts`).

    A non-finite reward, loss or gradient skips the step's update (``self.state`` keeps the
    actor, critic, optimizer and KL controller as they were; the step, data position and key
    advance), counted in ``nonfinite/skipped_updates``; with ``config.nonfinite == "skip"``
    it is also logged as a warning, and with ``"halt"`` the host loop stops the run after
    this step (`train`, `rljax.alignment.checkpointing.train`).

    Raises:
      rljax.alignment.rollouts.GeneratorError: the generator thread failed (it names the
        step); the train state is the last step's.
    """
    if self.config.max_staleness:
      return self._step_async()
    t_step = time.perf_counter()
    plan = self._plan(self.state.step, self.state.key, self.state.data_position)
    rollout = self._make_rollout(plan, None, self.state.step)
    return self._train_on(rollout, t_step)

  def _plan(self, index, key, position) -> rollouts.BatchPlan:
    cfg = self.config
    return rollouts.plan_batch(index, key, position, num_prompts=len(self.prompts),
                               prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size)

  def _make_rollout(self, plan: rollouts.BatchPlan, params, version: int) -> rollouts.Rollout:
    """Generation, reference and reward of batch ``plan`` with actor weights ``params``
    (training layout; None: the current ones) of policy ``version``."""
    cfg = self.config
    prompt_ids = [self.prompts[i] for i in plan.rows]
    t0, cpu0 = time.perf_counter(), time.process_time()
    remote = None if self.placement is None else self.placement.remote_generator
    if remote is not None:  # on the generator process (rljax.alignment.remote_generation)
      out, reshard_s = remote.generate(self.actor_params() if params is None else params,
                                       prompt_ids, plan.gen_key, step=plan.index + 1)
      t = t0 + reshard_s
    else:
      gen_params, reshard_s = self._generation_params(params)
      t = time.perf_counter()
      self.sampler.update_params(gen_params)
      out = self.sampler.generate(prompt_ids, key=plan.gen_key)
    t_gen = time.perf_counter()
    timing = {"timing/generation": t_gen - t, "timing/reshard": reshard_s}

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
    raw_scores = self._scores(prompt_ids, out, plan.rows, plan.index + 1)
    scores = raw_scores.copy()
    if cfg.missing_eos_penalty is not None:
      scores += np.asarray(losses.missing_eos_penalty(
          out.tokens, out.response_mask, stop_ids=self.stop_ids, penalty=cfg.missing_eos_penalty))
    if cfg.overlong_buffer > 0:
      scores += np.asarray(losses.overlong_penalty(
          out.lengths, max_length=cfg.max_new_tokens, buffer_length=cfg.overlong_buffer,
          factor=cfg.overlong_factor))
    t_end = time.perf_counter()
    timing["timing/reward"] = t_end - t
    if not cfg.max_staleness:  # alone in the process: its CPU time over its wall time
      timing["timing/rollout_cores"] = (time.process_time() - cpu0) / max(t_end - t0, 1e-9)
    spans = (("sync", t0, t0 + reshard_s), ("generate", t_gen - timing["timing/generation"],
                                            t_gen), ("score", t_gen, t_end))
    return rollouts.Rollout(plan, version, out, ref_lp, raw_scores, scores, timing, spans)

  def _step_async(self) -> dict[str, float]:
    v = self.state.step
    t_step = time.perf_counter()
    if self._generator is None or self._generator_step != v:  # first step, or a new state
      self.close()
      self._generator = rollouts.Generator(self._make_rollout, self._plan,
                                           num_steps=self.config.num_steps)
      self._generator.start(v, self.state.key, self.state.data_position,
                            self.state.lagged_actor)
    current = loop.snapshot(self.actor_params())  # the update donates the actor's
    sync_s = time.perf_counter() - t_step
    self._generator.submit(current, v)
    rollout, wait_s = self._generator.next(v)
    rec = self._train_on(rollout, t_step, lagged=self.state.lagged_actor[1:] + (current,))
    rec["timing/sync"] = sync_s + rollout.timing["timing/reshard"]
    rec["timing/wait"] = wait_s
    self._generator_step = v + 1
    self.timeline.append(("sync", v + 1, t_step, t_step + sync_s))
    return rec

  def _train_on(self, rollout: rollouts.Rollout, t_step: float, lagged: tuple = ()
                ) -> dict[str, float]:
    """Critic and update on ``rollout`` (the batch of step ``self.state.step``); its record."""
    cfg = self.config
    out, plan, scores, raw_scores = (rollout.out, rollout.plan, rollout.scores,
                                     rollout.raw_scores)
    timing = dict(rollout.timing)
    step = self.state.step + 1
    self.timeline.extend((stage, step, t0, t1) for stage, t0, t1 in rollout.spans)
    lag = self.state.step - rollout.version
    args = (out.prompt_tokens, out.prompt_mask, out.tokens, out.response_mask)
    t_train = t = time.perf_counter()
    cpu_train = time.process_time()
    if cfg.uses_critic:
      values = jax.block_until_ready(self._critic_fn(self.state.ppo_state.params["critic"],
                                                     *self._inputs(Role.CRITIC, args)))
    else:
      values = np.zeros(out.tokens.shape, np.float32)
    timing["timing/critic"] = time.perf_counter() - t

    batch = dict(prompt_tokens=out.prompt_tokens, prompt_mask=out.prompt_mask,
                 response_tokens=out.tokens, mask=out.response_mask,
                 ref_log_probs=rollout.ref_log_probs, values=values, scores=scores,
                 sampler_log_probs=out.log_probs_t1)
    if cfg.max_staleness:
      batch["policy_lag"] = np.full((len(scores),), lag, np.int32)
    batch = self._inputs(Role.ACTOR, batch)
    t = time.perf_counter()
    kl_coef = self.state.kl_state.kl_coef
    ppo_state, metrics, extras = self._update_fn(self.state.ppo_state, batch, plan.update_key,
                                                 kl_coef)
    metrics = runtime.to_host(metrics)
    t_end = time.perf_counter()
    timing["timing/update"] = t_end - t
    if not cfg.max_staleness:
      timing["timing/update_cores"] = ((time.process_time() - cpu_train)
                                       / max(t_end - t_train, 1e-9))
    self.timeline.append(("train", step, t_train, t_end))
    if self._generator is not None:
      timing["timing/overlap"] = self._generator.busy_within(t_train, t_end)

    skipped = bool(metrics["nonfinite/skipped"] > 0)
    kl_state = (self.state.kl_state if skipped else
                self.kl_controller.update(self.state.kl_state, metrics["kl"], cfg.batch_size))
    num_skipped = self.state.skipped_updates + int(skipped)
    self.state = RLHFState(ppo_state, kl_state, step, plan.next_position, plan.next_key,
                           num_skipped, lagged)
    batch.pop("policy_lag", None)
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
        "rollout/policy_lag_mean": float(lag), "rollout/policy_lag_max": float(lag),
    }
    if cfg.uses_reference:
      rec["kl"], rec["kl_token"] = float(metrics["kl"]), float(metrics["kl_token"])
    for k in ("pg_loss", "vf_loss", "clipfrac", "approx_kl", "grad_norm", "ratio_first",
              "logprob_drift", "loss"):
      rec[k] = float(metrics[k])
    for k in ("kl_loss", "rollout/is_weight_mean", "rollout/is_weight_max",
              "rollout/is_weight_truncated"):
      if k in metrics:
        rec[k] = float(metrics[k])
    for k in ("nonfinite/reward", "nonfinite/loss_or_grad"):
      rec[k] = float(metrics[k])
    rec["nonfinite/skipped_updates"] = float(num_skipped)
    timing["timing/step"] = time.perf_counter() - t_step
    rec.update(timing)
    if skipped and cfg.nonfinite == "skip":  # with "halt" the host loop stops the run
      logging.warning(skip_message(self.state.step, rec, num_skipped))
    return rec

  def close(self) -> None:
    """Stops the generator thread of an asynchronous run (if any); the next `step` starts a
    new one from ``self.state``."""
    if self._generator is not None:
      self._generator.close()
    self._generator = None
    self._generator_step = -1

  def train(self, *, writer=None, log_every: int = 1, callback=None) -> list[dict[str, float]]:
    """Runs ``config.num_steps - state.step`` steps in the host loop (`rljax.loop.run`), with
    no checkpoints (`rljax.alignment.checkpointing.train` adds them); returns the per-step
    metrics. ``writer`` receives every ``log_every``-th record (stage ``rl``) and the last;
    ``callback(record)`` each record.

    Raises:
      rljax.nonfinite.NonFiniteHalt: ``config.nonfinite == "halt"`` and an update was
        skipped.
    """
    start = self.state.step
    with SigtermFlag() as sigterm:
      try:
        _, history = loop.run(
            loop.LoopSpec(num_steps=self.config.num_steps, log_every=log_every), self.state,
            self.loop_step, sigterm=sigterm, start=start, writer=writer, stage="rl",
            on_record=None if callback is None else lambda step, state, rec: callback(rec),
            watch=self.nonfinite_watch())
      finally:
        self.close()
    return history

  def loop_step(self, state: RLHFState, step: int) -> tuple[RLHFState, dict[str, float]]:
    """`step` from ``state`` as the host loop calls it: ``(state, step) -> (state, record)``."""
    del step
    self.state = state
    rec = self.step()
    return self.state, rec

  def nonfinite_watch(self) -> nonfinite.Watch:
    """The host loop's non-finite policy for this trainer (`step` warns of skips itself)."""
    return nonfinite.Watch(self.config.nonfinite, lambda state: state.skipped_updates,
                           lambda step, state, rec, before, now: skip_message(step, rec, now))


def skip_message(step: int, record: dict[str, float], num_skipped: int) -> str:
  """The message of an RL step whose update the non-finite guard skipped."""
  which = [k.split("/")[1] for k in ("nonfinite/reward", "nonfinite/loss_or_grad")
           if record[k] > 0]
  return (f"non-finite {', '.join(which)} at RL step {step}: update skipped (actor, critic "
          f"and optimizer states unchanged), {num_skipped} skipped in total")
