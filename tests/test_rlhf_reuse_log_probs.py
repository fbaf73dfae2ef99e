"""RLHFConfig.reuse_rollout_log_probs: the single-pass update without the old-log-prob forward."""

import numpy as np
import pytest
from flax import nnx

from rljax import ppo
from rljax.alignment import pipeline, rlhf
from rljax.envs.text import arithmetic
from rljax.models.llm import DecoderLM

TOK = arithmetic.CharTokenizer()
TASK = arithmetic.AdditionTask(max_operand=20)
PROMPT_TEXTS = TASK.prompts(32, seed=1)
PROMPTS = [TOK.encode(p) for p in PROMPT_TEXTS]


def _trainer(reuse):
  cfg = rlhf.RLHFConfig(algo="grpo", group_size=4, prompts_per_step=4, max_new_tokens=4,
                        actor_lr=1e-3, kl_coef=0.04, kl_estimator="k3", kl_placement="loss",
                        reuse_rollout_log_probs=reuse,
                        ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=1))
  model = DecoderLM(pipeline.tiny_lm_config(TOK.vocab_size, hidden_size=32, num_layers=1),
                    rngs=nnx.Rngs(0))
  # Reward: the number of digits, so that responses in a group differ.
  reward = lambda s: np.asarray([sum(c.isdigit() for c in t) for t in s.response_text], np.float32)
  return rlhf.RLHFTrainer(cfg, actor=model, tokenizer=TOK, prompts=PROMPTS,
                          prompt_texts=PROMPT_TEXTS, reward_fn=reward)


@pytest.mark.slow
def test_reuse_rollout_log_probs_matches_the_recomputed_update():
  base, fast = _trainer(False), _trainer(True)
  for _ in range(2):  # the second step starts from the (equal) updated actors
    rb, rf = base.step(), fast.step()
    np.testing.assert_array_equal(base.last_batch["response_tokens"],
                                  fast.last_batch["response_tokens"])
    # Single pass: the ratio is exactly 1 either way, and nothing is clipped.
    assert rb["ratio_first"] == 1.0 and rf["ratio_first"] == 1.0
    assert rb["clipfrac"] == 0.0 and rf["clipfrac"] == 0.0
    # The old log-probs differ only by the sampler's rounding (<= 1e-5 in f32), so the losses
    # and the gradient agree to that order.
    assert rb["logprob_drift"] <= 1e-5 and np.isnan(rf["logprob_drift"])
    np.testing.assert_allclose(fast.last_batch["log_probs"], base.last_batch["log_probs"],
                               atol=1e-5)
    for k in ("pg_loss", "kl_loss", "kl", "grad_norm"):
      assert rf[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), k


def test_reuse_rollout_log_probs_needs_a_single_pass():
  with pytest.raises(ValueError, match="single-pass update .* got 2 x 1"):
    rlhf.RLHFConfig(reuse_rollout_log_probs=True,
                    ppo=ppo.PPOConfig(num_epochs=2, num_minibatches=1))
