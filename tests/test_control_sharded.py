"""The control train step on 8 fake CPU devices equals the 1-device step.

XLA_FLAGS must be set before jax is imported, so the comparison runs in a subprocess.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

CODE = textwrap.dedent(r'''
    import json, jax, numpy as np
    from jax.sharding import AxisType
    from rljax.control import trainer
    from rljax.control.config import ControlConfig, ConfigError
    assert jax.device_count() == 8
    config = ControlConfig().replace(
        env="playground/CartpoleBalance", num_timesteps=2 * 2 * 16 * 8, num_envs=16,
        unroll_length=8, num_minibatches=2, num_epochs=2, num_evals=3, num_eval_envs=8,
        episode_length=50, policy_hidden=(8,), value_hidden=(8,))
    mesh = jax.make_mesh((8, 1, 1), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    one = trainer.train(config, None, progress=False)
    import logging
    chunk_compiles = []
    class Count(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Compiling jit(chunk)"):
                chunk_compiles.append(1)
    logging.getLogger("jax").addHandler(Count(level=logging.WARNING))
    jax.config.update("jax_log_compiles", True)
    eight = trainer.train(config, None, progress=False, mesh=mesh)
    jax.config.update("jax_log_compiles", False)
    diffs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(one.train_state.params), jax.tree.leaves(eight.train_state.params))]
    leaf = jax.tree.leaves(eight.train_state.params)[0]
    tr, params = trainer.make_trainer(config, mesh=mesh)
    ts, env_state = tr.init(params)
    obs_sharding = env_state.obs.sharding
    try:
        trainer.make_trainer(config.replace(num_envs=12, batch_size=0, num_minibatches=2), mesh=mesh)
        err = None
    except ConfigError as e:
        err = str(e)
    print("RESULT " + json.dumps(dict(
        max_diff=max(diffs),
        rewards=[[h["eval/episode_reward"] for h in r.history] for r in (one, eight)],
        num_compiled=eight.num_compiled,
        chunk_compiles=len(chunk_compiles),
        param_replicated=leaf.sharding.is_fully_replicated,
        obs_spec_is_data=obs_sharding.spec == jax.sharding.PartitionSpec("data"),
        obs_shard_shape=list(obs_sharding.shard_shape(env_state.obs.shape)),
        error=err)))
''')


@pytest.fixture(scope="module")
def result():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env,
                       timeout=900)
  assert out.returncode == 0, out.stderr[-4000:]
  line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
  return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_sharded_params_equal_single_device(result):
  assert result["max_diff"] < 1e-5, result


def test_sharded_evaluations_equal_single_device(result):
  # Every evaluation (before training and after each chunk) of the 8-device run scores what
  # the 1-device run's does: the same environments, split over the data axis.
  one, eight = result["rewards"]
  assert len(one) == len(eight) == 3
  np.testing.assert_allclose(eight, one, rtol=1e-4)
  assert len(set(one)) > 1  # the evaluations see the policy change


def test_shardings_follow_the_rules(result):
  # Environments split over the data axis (16 envs / 8 devices = 2 per device),
  # parameters replicated.
  assert result["param_replicated"]
  assert result["obs_spec_is_data"]
  assert result["obs_shard_shape"] == [2, 5]


def test_no_recompilation_across_chunks(result):
  assert result["num_compiled"] == 2
  # The ahead-of-time compile from abstract shapes (with their shardings) is the only one.
  assert result["chunk_compiles"] == 1, result


def test_indivisible_envs_named_before_compiling(result):
  assert "num_envs=12" in result["error"] and "8 devices" in result["error"]
