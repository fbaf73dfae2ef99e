"""RLHF non-finite guard (rljax/alignment/rlhf.py, RLHFConfig.nonfinite): a NaN reward at step k
never reaches the actor or critic, is counted in ``nonfinite/skipped_updates`` and warned about
("skip"), or stops the run with the last good state checkpointed ("halt")."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rlhf import _model, _trainer

from rljax.alignment import checkpointing, rlhf
from rljax.control.trainer import NonFiniteHalt
from rljax.envs.text import arithmetic

K = 2  # the step whose reward is NaN


def _nan_reward_at(k):
  """The addition reward, but NaN for every row at the k-th call (the k-th RL step)."""
  calls = [0]

  def fn(samples):
    calls[0] += 1
    r = np.asarray(arithmetic.addition_reward(samples), np.float32)
    return np.full_like(r, np.nan) if calls[0] == k else r

  return fn


def _snapshot(tr):
  """Host copies of the trained state (the update donates the device buffers)."""
  ps = tr.state.ppo_state
  return ([np.array(x) for x in jax.tree.leaves(ps.params["actor"])],
          [np.array(x) for x in jax.tree.leaves(ps.params["critic"])],
          [np.array(x) for x in jax.tree.leaves(ps.opt_state)],
          float(tr.state.kl_state.kl_coef))


def _equal(a, b):
  return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _all_finite(tr):
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tr.state.ppo_state))


def _run_and_check(tr, caplog, inject=None):
  """Three steps, the reward NaN at step K; checks skip, count, warning and finiteness."""
  snaps, recs = [], []
  with caplog.at_level(logging.WARNING):
    for step in range(1, 4):
      if inject is not None:
        inject(step)
      recs.append(tr.step())
      snaps.append(_snapshot(tr))
  assert _all_finite(tr)
  (a1, c1, o1, kl1), (a2, c2, o2, kl2), (a3, c3, _, _) = snaps
  # Step K left the actor, the critic, both optimizer states and the KL controller as they
  # were after step K - 1, bit for bit; the steps around it did update.
  assert _equal(a2, a1) and _equal(c2, c1) and _equal(o2, o1) and kl2 == kl1
  assert not _equal(a3, a2) and not _equal(c3, c2)
  assert [r["nonfinite/skipped_updates"] for r in recs] == [0.0, 1.0, 1.0]
  assert [r["nonfinite/reward"] for r in recs] == [0.0, 1.0, 0.0]
  assert np.isnan(recs[1]["reward/mean"])
  assert tr.state.step == 3 and tr.state.skipped_updates == 1
  # The message names the quantity (the NaN reward also made the loss non-finite) and step.
  assert any(m.startswith("non-finite reward") and f"at RL step {K}: update skipped" in m
             for m in caplog.messages), caplog.messages


@pytest.mark.slow
def test_nan_reward_fn_is_skipped_counted_and_warned(caplog):
  # Adaptive KL: the controller's state must not move at the skipped step either.
  tr = _trainer(algo="ppo", num_steps=3, kl_controller="adaptive", reward_fn=_nan_reward_at(K))
  _run_and_check(tr, caplog)


def test_nan_reward_model_score_is_skipped(caplog):
  # The learned-reward path: the reward model's parameters are NaN for step K only.
  tr = _trainer(algo="ppo", num_steps=3, reward_model=_model(seed=3))
  good = tr.params[rlhf.Role.REWARD]
  bad = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), good)

  def inject(step):
    tr.params[rlhf.Role.REWARD] = bad if step == K else good

  _run_and_check(tr, caplog, inject)


def test_halt_checkpoints_last_good_state_and_raises(tmp_path):
  tr = _trainer(algo="ppo", num_steps=3, nonfinite="halt", reward_fn=_nan_reward_at(K))
  logdir = str(tmp_path / "run")
  with pytest.raises(NonFiniteHalt, match=rf"non-finite reward.* at RL step {K}.*halted with the "
                                          rf"last good state checkpointed in {logdir}"):
    checkpointing.train(tr, logdir, checkpoint_every=1, keep=10, log=lambda *_: None)
  assert tr.state.step == K and _all_finite(tr)
  # The checkpoint of step K holds the parameters and optimizer states of step K - 1.
  step, policy, train = checkpointing.load_state_items(logdir)
  assert step == K
  _, policy_prev, train_prev = checkpointing.load_state_items(logdir, step=K - 1)
  for new, old in ((policy, policy_prev), (train, train_prev)):
    for k in old:
      if k not in ("step", "data_position", "key", "skipped_updates"):  # these advance
        np.testing.assert_array_equal(new[k], old[k], err_msg=k)
  assert all(np.all(np.isfinite(v)) for v in policy.values())
  # The skip count is part of the checkpoint, so a resumed run keeps counting from it.
  assert int(train["skipped_updates"]) == 1 and int(train_prev["skipped_updates"]) == 0
  fresh = _trainer(algo="ppo", num_steps=3, nonfinite="halt", reward_fn=_nan_reward_at(K))
  restored = checkpointing.state_from_items(fresh.state, *checkpointing.state_items(tr.state))
  assert restored.skipped_updates == 1 and restored.step == K


def test_bad_nonfinite_value_is_refused():
  with pytest.raises(ValueError, match="nonfinite must be 'skip' or 'halt', got 'ignore'"):
    rlhf.RLHFConfig(nonfinite="ignore")


def test_history_summary_ignores_non_finite_steps():
  """A skipped step's NaN reward does not make the run summary NaN (rljax.alignment.pipeline)."""
  from rljax.alignment import pipeline

  history = [{"reward/mean": 0.2, "kl": 0.1}, {"reward/mean": float("nan"), "kl": float("nan")},
             {"reward/mean": 0.4, "kl": 0.5}, {"reward/mean": 0.8, "kl": 0.3}]
  s = pipeline.history_summary(history, 2)
  assert s["reward_first"] == pytest.approx(0.2)   # the NaN step is left out of the first 2
  assert s["reward_last"] == pytest.approx(0.6)    # mean of 0.4 and 0.8
  assert s["kl_max"] == pytest.approx(0.5) and s["kl_last"] == pytest.approx(0.3)
  assert s["summary_steps"] == 2
  nan = pipeline.history_summary([{"reward/mean": float("nan")}], 5)
  assert np.isnan(nan["reward_first"]) and np.isnan(nan["kl_max"])
  assert nan["summary_steps"] == 1  # a 1-step run's summary says "first 1 step", not "10"
  # Short runs compare disjoint windows: 4 steps with k = 10 -> the first 2 against the last 2.
  short = pipeline.history_summary([{"reward/mean": r} for r in (0.0, 1.0, 2.0, 4.0)], 10)
  assert short["summary_steps"] == 2
  assert short["reward_first"] == pytest.approx(0.5) and short["reward_last"] == pytest.approx(3.0)
  odd = pipeline.history_summary([{"reward/mean": r} for r in (0.0, 1.0, 2.0)], 10)
  assert (odd["summary_steps"], odd["reward_first"], odd["reward_last"]) == (1, 0.0, 2.0)
