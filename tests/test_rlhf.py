"""RLHF trainer (rljax/alignment/rlhf.py) on a tiny LM and the addition task: values, not smoke."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax import ppo
from rljax.alignment import modeling, pipeline, rlhf
from rljax.alignment import stages as stages_lib
from rljax.envs.text import arithmetic
from rljax.models.llm import DecoderLM

TOK = arithmetic.CharTokenizer()
TASK = arithmetic.AdditionTask(max_operand=20)
PROMPT_TEXTS = TASK.prompts(64, seed=1)
PROMPTS = [TOK.encode(p) for p in PROMPT_TEXTS]


def _model(seed=0):
  return DecoderLM(pipeline.tiny_lm_config(TOK.vocab_size, hidden_size=32, num_layers=1),
                   rngs=nnx.Rngs(seed))


def _trainer(**kw):
  kw.setdefault("prompts_per_step", 8)
  kw.setdefault("max_new_tokens", 4)
  kw.setdefault("actor_lr", 1e-3)
  reward_model = kw.pop("reward_model", None)
  reward_fn = kw.pop("reward_fn", arithmetic.addition_reward)
  cfg = rlhf.RLHFConfig(**kw)
  return rlhf.RLHFTrainer(
      cfg, actor=_model(), tokenizer=TOK, prompts=PROMPTS, prompt_texts=PROMPT_TEXTS,
      reward_model=reward_model, reward_fn=None if reward_model is not None else reward_fn)


@pytest.mark.slow
def test_ppo_first_minibatch_ratio_one_and_old_log_probs_exact():
  tr = _trainer(algo="ppo", ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=1))
  params0 = jax.tree.map(jnp.copy, tr.actor_params())
  rec = tr.step()
  # One epoch, one minibatch: the only SGD step sees the rollout's own weights.
  assert rec["ratio_first"] == 1.0
  assert rec["clipfrac"] == 0.0
  b = tr.last_batch
  # The rollout's old log-probs equal the trainer's recomputation at the same weights
  # (same function, same shapes): drift exactly 0 in f32.
  lp, _ = jax.jit(lambda p, *a: modeling.policy_outputs(tr.graphdefs[rlhf.Role.ACTOR], p, *a))(
      params0, b["prompt_tokens"], b["prompt_mask"], b["response_tokens"], b["mask"])
  np.testing.assert_array_equal(np.asarray(lp), b["log_probs"])
  # The sampler's KV-cache log-probs agree with the full forward to float rounding.
  assert rec["logprob_drift"] <= 1e-5
  # The update changed the actor.
  diff = jax.tree.map(lambda a, c: float(jnp.max(jnp.abs(a - c))), params0, tr.actor_params())
  assert max(jax.tree.leaves(diff)) > 0


@pytest.mark.slow
def test_ppo_ratio_one_at_first_of_several_minibatches():
  tr = _trainer(algo="ppo", ppo=ppo.PPOConfig(num_epochs=2, num_minibatches=2))
  rec = tr.step()
  assert rec["ratio_first"] == 1.0
  assert np.isfinite(rec["vf_loss"]) and rec["vf_loss"] > 0  # the critic is trained
  for k in ("timing/generation", "timing/reference", "timing/reward", "timing/critic",
            "timing/update", "timing/step"):
    assert rec[k] > 0


@pytest.mark.slow
@pytest.mark.parametrize("algo, extra", [("ppo", {}), ("grpo", dict(group_size=4, kl_placement="loss"))])
def test_microbatches_give_the_same_step(algo, extra):
  # Gradient accumulation (2 parts per minibatch) is the same step as one pass, for PPO with
  # its critic and for GRPO with the KL penalty in the loss, and the first ratio is still
  # exactly 1.
  def step(g):
    tr = _trainer(algo=algo, **extra,
                  ppo=ppo.PPOConfig(num_epochs=2, num_minibatches=2, num_microbatches=g))
    return tr.step(), tr.actor_params()

  (rec1, p1), (rec2, p2) = step(1), step(2)
  assert rec2["ratio_first"] == 1.0
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
  for k in ("pg_loss", "approx_kl", "clipfrac", "entropy", "loss", "grad_norm"):
    np.testing.assert_allclose(rec2[k], rec1[k], rtol=1e-5, atol=1e-6, err_msg=k)
  if algo == "ppo":
    np.testing.assert_allclose(rec2["vf_loss"], rec1["vf_loss"], rtol=1e-5, atol=1e-6)
  else:
    np.testing.assert_allclose(rec2["kl_loss"], rec1["kl_loss"], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_grpo_beta0_pg_loss_is_minus_mean_normalised_advantage():
  tr = _trainer(algo="grpo", group_size=4, prompts_per_step=4, kl_coef=0.0,
                ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=1, normalize_advantages=False))
  rec = tr.step()
  b = tr.last_batch
  # Advantages: scores normalised within each group of 4 (population std).
  s = b["scores"].reshape(4, 4)
  expect = ((s - s.mean(1, keepdims=True)) / (s.std(1, keepdims=True) + 1e-6)).reshape(-1)
  m = b["mask"].astype(np.float32)
  np.testing.assert_allclose(b["advantages"], expect[:, None] * m, atol=1e-5)
  # ratio = 1 and no clipping at the single update: pg_loss = -token-mean(A).
  np.testing.assert_allclose(rec["pg_loss"], -np.sum(b["advantages"] * m) / np.sum(m),
                             atol=1e-6)
  assert rec["vf_loss"] == 0.0  # no critic


@pytest.mark.slow
def test_beta0_skips_the_reference_pass_without_changing_the_update():
  """beta = 0 with a fixed controller: no reference forward (as TRL at beta = 0), same update.

  An adaptive controller started at beta = 0 stays at 0 (its update is multiplicative), but
  it keeps the reference pass and the KL metrics: the two runs must give bitwise-equal actors.
  """
  kw = dict(algo="grpo", group_size=4, prompts_per_step=4, kl_coef=0.0,
            ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=2))
  skip = _trainer(**kw)
  keep = _trainer(kl_controller="adaptive", **kw)
  assert not skip.config.uses_reference and keep.config.uses_reference
  def no_reference(*args):
    raise AssertionError("the reference model ran at beta = 0")

  skip._ref_fn = no_reference
  rec_skip, rec_keep = skip.step(), keep.step()
  assert "kl" not in rec_skip and "kl" in rec_keep and rec_keep["kl_coef"] == 0.0
  for a, b in zip(jax.tree.leaves(skip.actor_params()), jax.tree.leaves(keep.actor_params())):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_kl_metric_is_the_k1_sum_per_response_whatever_the_estimator():
  """``kl`` is TRL's ``objective/kl``: the batch mean of ``sum_t (log pi - log pi_ref)``
  (k1, per response, in nats), also with ``kl_estimator="k3"`` in the reward; ``kl_token`` is
  the configured estimator's masked token mean. At step 2 the actor has moved off the
  reference, so both are non-zero and k1 != k3."""
  tr = _trainer(algo="ppo", kl_coef=0.05, kl_estimator="k3", actor_lr=3e-2,
                ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=1))
  tr.step()
  rec = tr.step()
  b = tr.last_batch
  m = b["mask"].astype(np.float64)
  d = (b["log_probs"].astype(np.float64) - b["ref_log_probs"]) * m
  k1 = d.sum(-1).mean()
  k3 = ((np.expm1(-d) + d) * m).sum() / m.sum()
  assert abs(k1) > 1e-4
  np.testing.assert_allclose(rec["kl"], k1, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(rec["kl_token"], k3, rtol=1e-4, atol=1e-7)
  assert abs(rec["kl_token"] - rec["kl"] / m.sum(-1).mean()) > 1e-6  # not k1 per token


def test_console_kl_has_no_negative_zero():
  """k1 at the reference is a few 1e-5 either side of 0: the console shows 0.000 for those,
  and keeps the sign of anything that rounds away from 0."""
  assert [pipeline.nats(x) for x in (-4e-5, 0.0, 3e-5, -6e-4, 1.2346)] == \
      ["0.000", "0.000", "0.000", "-0.001", "1.235"]
  rec = {"step": 3, "reward/mean": 0.5, "kl": -2e-5, "response_length/mean": 4.0,
         "timing/step": 0.25}
  assert pipeline.rl_step_line(rec) == "rl step    3: reward 0.500  kl 0.000  len 4.00  step 0.250s"


@pytest.mark.slow
def test_kl_in_loss_is_zero_at_the_reference():
  # A reward that differs within groups (sum of token ids), so the policy moves.
  by_length = lambda smp: np.asarray([sum(ids) for ids in smp.response_ids], np.float32)
  tr = _trainer(algo="rloo", group_size=2, prompts_per_step=4, kl_coef=0.1, kl_estimator="k3",
                kl_placement="loss", reward_fn=by_length,
                ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=1))
  rec = tr.step()
  # Actor == reference before the first update: k3 = 0 on every token.
  assert abs(rec["kl_loss"]) < 1e-6
  rec = tr.step()
  assert rec["kl_loss"] > 0  # after an update the policy has moved


@pytest.mark.slow
def test_reward_model_score_at_eos_and_reinforce_pp():
  rm = _model(seed=3)
  tr = _trainer(algo="reinforce_pp", kl_coef=0.0, reward_model=rm,
                ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=1))
  tr.step()
  b = tr.last_batch
  gd, params = nnx.split(rm, nnx.Param)
  tokens, mask = modeling.concat(b["prompt_tokens"], b["prompt_mask"], b["response_tokens"],
                                 b["mask"])
  scores = modeling.sequence_scores(gd, params, tokens, mask)
  np.testing.assert_allclose(b["scores"], scores, rtol=1e-5, atol=1e-6)
  # beta = 0: each row's token reward is its score at the last response token, 0 elsewhere.
  last = b["mask"].sum(1) - 1
  for i in range(len(last)):
    row = b["token_rewards"][i]
    np.testing.assert_allclose(row[last[i]], b["scores"][i], rtol=1e-6)
    assert np.count_nonzero(np.delete(row, last[i])) == 0


def test_config_validation():
  with pytest.raises(ValueError, match="algo=grpo needs group_size >= 2, got 1"):
    rlhf.RLHFConfig(algo="grpo")
  with pytest.raises(ValueError, match=r"algo must be one of .* got 'dpo'"):
    rlhf.RLHFConfig(algo="dpo")
  with pytest.raises(ValueError, match="not divisible by ppo.num_minibatches = 3"):
    rlhf.RLHFConfig(prompts_per_step=8, ppo=ppo.PPOConfig(num_minibatches=3))
  with pytest.raises(ValueError, match="minibatch's 4 sequences .* not divisible by "
                                       "ppo.num_microbatches = 3"):
    rlhf.RLHFConfig(prompts_per_step=8, ppo=ppo.PPOConfig(num_minibatches=2, num_microbatches=3))


@pytest.mark.slow
def test_embedded_default_raises_reward():
  # The embedded default (pre-train -> SFT -> PPO on addition), fewer RL steps. Measured on
  # 2 CPU cores: mean reward ~0.43 over the first 10 steps, ~0.65 over steps 71-80, and greedy
  # exact-match accuracy 0.50 -> ~0.7. Each step's mean over 64 samples has a standard error
  # of ~0.05, so a 10-step mean has ~0.015; requiring +0.1 is > 6 standard errors above no
  # learning yet well below the ~+0.2 observed.
  cfg = pipeline.EmbeddedConfig(rl=pipeline.default_rl_config("ppo", num_steps=80))
  s = pipeline.run_embedded(cfg, log=lambda *_: None)
  assert s["reward_last"] >= s["reward_first"] + 0.1, (s["reward_first"], s["reward_last"])
  assert s["accuracy_after"] > s["accuracy_before"]
  assert s["kl_last"] < 5.0  # bounded: the KL penalty keeps the policy near the SFT model


@pytest.mark.slow
def test_sft_and_reward_model_stages_stop_when_asked():
  """``should_stop`` (the scripts pass their SIGTERM flag) is asked before every step: SFT and
  the reward model raise `Interrupted` naming the stage and the steps done."""
  from rljax.alignment import reward_model as rm_lib
  from rljax.alignment import sft

  texts = ["1+2=", "3+4=", "5+6=", "7+8="]
  examples = [(TOK.encode(p), TOK.encode("3", add_special_tokens=False) + [TOK.EOS])
              for p in texts]
  pairs = [(p, r, TOK.encode("9", add_special_tokens=False) + [TOK.EOS]) for p, r in examples]
  asked = []

  def stop_after(n):
    def should_stop():
      asked.append(1)
      return len(asked) > n
    return should_stop

  model = DecoderLM(pipeline.tiny_lm_config(TOK.vocab_size, hidden_size=16, num_layers=1),
                    rngs=nnx.Rngs(0))
  with pytest.raises(sft.Interrupted, match=r"^preempted by SIGTERM during sft \(after step 2 "
                                            r"of 5\): the stage's state was not saved"):
    sft.train_sft(model, examples, sft.SFTConfig(num_steps=5, batch_size=2), pad_id=TOK.PAD,
                  should_stop=stop_after(2))
  asked.clear()
  with pytest.raises(sft.Interrupted, match=r"during rm \(after step 0 of 3\)") as e:
    rm_lib.train_reward_model(model, pairs, rm_lib.RewardModelConfig(num_steps=3, batch_size=2),
                              pad_id=TOK.PAD, should_stop=stop_after(0))
  assert (e.value.stage, e.value.step, e.value.num_steps) == ("rm", 0, 3)


def _no_wall(records):
  return [{k: v for k, v in r.items() if not k.endswith("wall_s")} for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_stage_interrupted_then_resumed_from_its_saved_state_equals_an_uninterrupted_one(
    stage, tmp_path):
  """`stages_lib.run_stage`: a SIGTERM after step 3 of 6 saves the stage's state under
  ``<logdir>/stages`` (orbax folder + marker); the rerun continues from it and ends with the
  uninterrupted run's parameters, bit for bit, and its records (the step-4 record's window
  spans the interruption); a third run loads the ended stage without training."""
  import os

  from rljax.alignment import sft
  from rljax.alignment import reward_model as rm_lib

  prompts = [TOK.encode(f"{a}+{b}=") for a in range(4) for b in range(3)]
  examples = [(p, TOK.encode(str(i % 10), add_special_tokens=False) + [TOK.EOS])
              for i, p in enumerate(prompts)]
  pairs = [(p, r, TOK.encode("99", add_special_tokens=False) + [TOK.EOS]) for p, r in examples]
  histories = []
  if stage == "sft":
    config = sft.SFTConfig(num_steps=6, batch_size=2, log_every=4, warmup_steps=2)
    fresh = sft.fresh_state

    def train(m, state, checkpoint=None, should_stop=None):
      out = sft.train_sft(m, examples, config, pad_id=TOK.PAD, state=state,
                          should_stop=should_stop, checkpoint=checkpoint)
      histories.append(out[2])
      return out
  else:
    config = rm_lib.RewardModelConfig(num_steps=6, batch_size=2, log_every=4, warmup_steps=2)
    fresh = rm_lib.fresh_state

    def train(m, state, checkpoint=None, should_stop=None):
      out = rm_lib.train_reward_model(m, pairs, config, pad_id=TOK.PAD, eval_pairs=pairs[:4],
                                      state=state, should_stop=should_stop,
                                      checkpoint=checkpoint)
      histories.append(out[2])
      return out

  def model():
    return DecoderLM(pipeline.tiny_lm_config(TOK.vocab_size, hidden_size=16, num_layers=1),
                     rngs=nnx.Rngs(0))

  def params(m):
    return jax.tree.leaves(nnx.state(m, nnx.Param))

  ref, _, ref_history = train(model(), None)
  assert [r["step"] for r in ref_history] == [4, 6]
  logdir = str(tmp_path)
  asked = []

  def stop_after_3():
    asked.append(1)
    return len(asked) > 3

  m = model()
  with pytest.raises(sft.Interrupted) as e:
    stages_lib.run_stage(logdir, stage, lambda m, s, c: train(m, s, c, stop_after_3), m,
                            lambda: fresh(m, config))
  saved_in = os.path.join(logdir, "stages", f"{stage}-3")
  assert e.value.step == 3 and e.value.saved_in == saved_in
  assert str(e.value) == (f"preempted by SIGTERM during {stage} (after step 3 of 6): "
                          f"its state is saved in {saved_in}, and the same command resumes it")
  marker = stages_lib.saved_stages(logdir)[stage]
  assert (marker["step"], marker["done"], marker["window"]["n"]) == (3, False, 3)

  lines = []
  m = model()
  m, record, ran = stages_lib.run_stage(logdir, stage, train, m, lambda: fresh(m, config),
                                           log=lines.append)
  assert ran and lines == [f"{stage}: resuming after step 3 from {saved_in}"]
  for a, b in zip(params(m), params(ref), strict=True):
    np.testing.assert_array_equal(a, b)
  assert _no_wall(histories[-1]) == _no_wall(ref_history) and record == histories[-1][-1]
  assert sorted(os.listdir(os.path.join(logdir, "stages"))) == [f"{stage}-6-done",
                                                                 f"{stage}.json"]

  def must_not_train(m, state, checkpoint):
    raise AssertionError("the ended stage was trained again")

  m = model()
  m, record, ran = stages_lib.run_stage(logdir, stage, must_not_train, m,
                                           lambda: fresh(m, config), log=lines.append)
  assert not ran and _no_wall([record]) == _no_wall(ref_history[-1:])
  assert lines[-1] == (f"{stage}: loaded the finished stage (6 steps) from "
                       f"{os.path.join(logdir, 'stages', f'{stage}-6-done')}")
  for a, b in zip(params(m), params(ref), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_stage_saved_every_n_steps_resumes_after_a_crash_as_if_uninterrupted(stage, tmp_path):
  """`stages_lib.run_stage(save_every=2)`: the stage's state is saved before steps 3 and 5
  (after steps 2 and 4); a crash in step 5 (no SIGTERM, so nothing saved then: a SIGKILL)
  leaves the step-4 save alone under ``<logdir>/stages``, and the rerun continues from it
  with the uninterrupted run's parameters, bit for bit, and its last record."""
  import os

  from rljax.alignment import sft
  from rljax.alignment import reward_model as rm_lib

  prompts = [TOK.encode(f"{a}+{b}=") for a in range(4) for b in range(3)]
  examples = [(p, TOK.encode(str(i % 10), add_special_tokens=False) + [TOK.EOS])
              for i, p in enumerate(prompts)]
  pairs = [(p, r, TOK.encode("99", add_special_tokens=False) + [TOK.EOS]) for p, r in examples]
  if stage == "sft":
    config = sft.SFTConfig(num_steps=6, batch_size=2, log_every=4, warmup_steps=2)
    fresh, run = sft.fresh_state, functools.partial(sft.train_sft, examples=examples)
  else:
    config = rm_lib.RewardModelConfig(num_steps=6, batch_size=2, log_every=4, warmup_steps=2)
    fresh = rm_lib.fresh_state
    run = functools.partial(rm_lib.train_reward_model, train_pairs=pairs, eval_pairs=pairs[:4])
  saves = []  # the step of each state the checkpoint hook was called with

  def train(m, state, checkpoint, crash_at=None):
    def saving(s):
      saves.append(s.step)
      checkpoint(s)

    def crash():  # asked after the hook, before step saves[-1] + 1
      if crash_at is not None and saves[-1] + 1 == crash_at:
        raise RuntimeError("killed")
      return False

    return run(m, config=config, pad_id=TOK.PAD, state=state, should_stop=crash,
               checkpoint=saving)

  def model():
    return DecoderLM(pipeline.tiny_lm_config(TOK.vocab_size, hidden_size=16, num_layers=1),
                     rngs=nnx.Rngs(0))

  ref, _, ref_history = run(model(), config=config, pad_id=TOK.PAD)
  logdir = str(tmp_path)
  m = model()
  with pytest.raises(RuntimeError, match="killed"):
    stages_lib.run_stage(logdir, stage, lambda m, s, c: train(m, s, c, crash_at=5), m,
                            lambda: fresh(m, config), save_every=2)
  assert saves == [0, 1, 2, 3, 4]
  stages = os.path.join(logdir, "stages")
  assert sorted(os.listdir(stages)) == [f"{stage}-4", f"{stage}.json"]
  marker = stages_lib.saved_stages(logdir)[stage]
  assert (marker["step"], marker["done"], marker["window"]["n"]) == (4, False, 0)

  lines, saves[:] = [], []
  m = model()
  m, record, ran = stages_lib.run_stage(logdir, stage, train, m, lambda: fresh(m, config),
                                           save_every=2, log=lines.append)
  assert ran and lines == [f"{stage}: resuming after step 4 from {stages}/{stage}-4"]
  assert saves == [4, 5]  # step 4's state is saved already: not written again
  for a, b in zip(jax.tree.leaves(nnx.state(m, nnx.Param)),
                  jax.tree.leaves(nnx.state(ref, nnx.Param)), strict=True):
    np.testing.assert_array_equal(a, b)
  assert _no_wall([record]) == _no_wall(ref_history[-1:])
  assert sorted(os.listdir(stages)) == [f"{stage}-6-done", f"{stage}.json"]
  with pytest.raises(ValueError, match="stage_checkpoint_every must be >= 0.*got -1"):
    stages_lib.run_stage(logdir, stage, train, m, lambda: fresh(m, config), save_every=-1)


def test_stage_record_line():
  """`sft.record_line`: a stage's logged record as the console line the pipeline prints."""
  from rljax.alignment import sft

  rec = {"rm/loss": 0.69314, "rm/train_accuracy": 0.5, "rm/grad_norm": 3.0, "rm/wall_s": 12.34,
         "rm/eval_accuracy": 0.625}
  assert sft.record_line("rm/", 50, 150, rec) == (
      "rm step 50/150: loss 0.693, train_accuracy 0.500, eval_accuracy 0.625 (12.3 s)")
  rec = {"pretrain/loss": 2.0, "pretrain/padding_fraction": 0.125, "pretrain/wall_s": 1.0}
  assert sft.record_line("pretrain/", 1, 800, rec) == (
      "pretrain step 1/800: loss 2.000, padding_fraction 0.125 (1.0 s)")


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_unreadable_stage_is_set_aside_and_the_stage_starts_again(damage, tmp_path):
  """A stage whose saved folder is corrupt (its array files emptied) or missing: the rerun says
  so, moves the folder to ``<folder>.unreadable`` (kept), drops the stage's records from
  ``metrics.jsonl`` (others kept) and trains the stage from its start, ending as an
  uninterrupted run."""
  import json
  import os
  import shutil

  from rljax.alignment import sft

  prompts = [TOK.encode(f"{a}+{b}=") for a in range(4) for b in range(3)]
  examples = [(p, TOK.encode(str(i % 10), add_special_tokens=False) + [TOK.EOS])
              for i, p in enumerate(prompts)]
  config = sft.SFTConfig(num_steps=6, batch_size=2, log_every=4, warmup_steps=2)

  def model():
    return DecoderLM(pipeline.tiny_lm_config(TOK.vocab_size, hidden_size=16, num_layers=1),
                     rngs=nnx.Rngs(0))

  def train(m, state, checkpoint, stop=None):
    return sft.train_sft(m, examples, config, pad_id=TOK.PAD, state=state, should_stop=stop,
                         checkpoint=checkpoint)

  def crash_before_step_5():
    crash_before_step_5.calls += 1
    if crash_before_step_5.calls == 5:
      raise RuntimeError("killed")
    return False

  crash_before_step_5.calls = 0
  ref, _, _ = train(model(), None, None)
  logdir = str(tmp_path)
  m = model()
  with pytest.raises(RuntimeError, match="killed"):
    stages_lib.run_stage(logdir, "sft", lambda m, s, c: train(m, s, c, crash_before_step_5),
                            m, lambda: sft.fresh_state(m, config), save_every=2)
  folder = os.path.join(logdir, "stages", "sft-4")
  records = [{"step": 3, "stage": "pretrain", "pretrain/loss": 2.0},
             {"step": 4, "stage": "sft", "sft/loss": 1.0}]
  with open(os.path.join(logdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  if damage == "missing":
    shutil.rmtree(folder)
  else:
    emptied = 0
    for root, _, files in os.walk(folder):
      for name in files if f"{os.sep}d" in root else ():
        open(os.path.join(root, name), "w").close()
        emptied += 1
    assert emptied
  lines = []
  m = model()
  m, _, ran = stages_lib.run_stage(logdir, "sft", lambda m, s, c: train(m, s, c), m,
                                      lambda: sft.fresh_state(m, config), log=lines.append)
  assert ran and len(lines) == 1, lines
  assert lines[0].startswith(f"sft: the saved sft state in {folder} cannot be read (")
  moved = f"moved to {folder}.unreadable, " if damage == "corrupt" else ""
  assert lines[0].endswith(f"); {moved}the stage starts again"), lines[0]
  assert os.path.isdir(folder + ".unreadable") == (damage == "corrupt")
  from rljax.metrics import read_jsonl

  assert read_jsonl(os.path.join(logdir, "metrics.jsonl")) == records[:1]
  for a, b in zip(jax.tree.leaves(nnx.state(m, nnx.Param)),
                  jax.tree.leaves(nnx.state(ref, nnx.Param)), strict=True):
    np.testing.assert_array_equal(a, b)
