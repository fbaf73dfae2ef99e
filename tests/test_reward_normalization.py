"""Reward-model normalisation on policy samples (pipeline.normalize_reward_head)."""

import jax
import numpy as np
import pytest
from flax import nnx

from rljax.alignment import modeling, pipeline
from rljax.models import llm
from rljax.sampling import Sampler, SamplingConfig


class _Tok:
  eos_token_id, pad_token_id = 2, 0


@pytest.mark.slow
def test_normalized_head_gives_unit_scores_on_policy_samples_and_keeps_order():
  cfg = pipeline.tiny_lm_config(40, hidden_size=32, num_heads=2, num_kv_heads=1)
  policy = llm.DecoderLM(cfg, rngs=nnx.Rngs(0))
  rm = llm.DecoderLM(cfg, rngs=nnx.Rngs(1))
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, 40, int(n)).tolist() for n in rng.integers(2, 6, 16)]

  gd, _ = nnx.split(rm, nnx.Param)
  score = jax.jit(lambda p, t, m: modeling.sequence_scores(gd, p, t, m))
  tokens, mask = modeling.pad_right([[1, 5, 6, 7, 2], [1, 9, 2], [1, 30, 31, 2]], 6, 0)
  raw = np.asarray(score(nnx.split(rm, nnx.Param)[1], tokens, mask))

  mean, std = pipeline.normalize_reward_head(rm, policy, prompts, _Tok(), max_new_tokens=4,
                                             seed=3, batch_size=8)
  assert std > 0
  new = np.asarray(score(nnx.split(rm, nnx.Param)[1], tokens, mask))
  # Affine in the score for any input: (raw - mean) / std, so the order is kept.
  np.testing.assert_allclose(new, (raw - mean) / std, rtol=1e-5, atol=1e-5)

  # Re-sample exactly what the normaliser scored (same sampler, same keys): mean 0, std 1.
  sampler = Sampler(policy, SamplingConfig(max_new_tokens=4, temperature=1.0, eos_token_ids=(2,),
                                           pad_token_id=0))
  key = jax.random.key(3 + 7919)
  scores = []
  for s in range(0, len(prompts), 8):
    key, sub = jax.random.split(key)
    out = sampler.generate(prompts[s:s + 8], key=sub)
    t, m = modeling.concat(out.prompt_tokens, out.prompt_mask, out.tokens, out.response_mask)
    scores.append(np.asarray(score(nnx.split(rm, nnx.Param)[1], t, m)))
  scores = np.concatenate(scores)
  assert float(np.mean(scores)) == pytest.approx(0.0, abs=1e-5)
  assert float(np.std(scores)) == pytest.approx(1.0, abs=1e-5)

  with pytest.raises(ValueError, match="no prompts"):
    pipeline.normalize_reward_head(rm, policy, [], _Tok(), max_new_tokens=4)
