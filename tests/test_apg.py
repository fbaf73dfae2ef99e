"""Analytic policy gradients: differentiable MJX, gradient correctness, the APG trainer."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import envs
from rljax.control import apg, trainer
from rljax.control.config import ConfigError
from rljax.metrics import read_jsonl

WHILE_LOOP_ERROR = "Reverse-mode differentiation does not work for lax.while_loop"


def _call_compiled_quickly(fn, *args):
  """``jit(fn)(*args)`` with XLA's CPU backend optimisations off: MJX gradients compile
  ~1.5x faster, and these tests run each program once."""
  return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})(*args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_envs=0), "num_envs must be a positive integer, got 0"),
        (dict(horizon_length=32, truncation_length=5),
         "truncation_length=5 must divide horizon_length=32"),
        (dict(truncation_length=-1), "truncation_length must be a non-negative integer, got -1"),
        (dict(learning_rate=0.0), "learning_rate must be > 0, got 0.0"),
        (dict(lr_decay=1.5), r"lr_decay must be in \(0, 1\], got 1.5"),
        (dict(max_grad_norm=0.0), "max_grad_norm must be > 0 or None, got 0.0"),
        (dict(gamma=0.0), r"gamma must be in \(0, 1\], got 0.0"),
        (dict(solver_iterations=0), "solver_iterations must be a positive integer or None, got 0"),
        (dict(activation="gelu"), "activation 'gelu' is not one of"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    apg.APGConfig(**kwargs)


def test_build_apg_config_from_script_overrides():
  config = apg.build_apg_config("playground/CartpoleSwingup", {"num_envs": 8, "lr_decay": 0.9})
  assert (config.num_envs, config.lr_decay, config.horizon_length) == (8, 0.9, 128)
  with pytest.raises(ConfigError, match="--num_minibatches does not apply to --algo=apg; "
                                        "APG's settings .* are .*--horizon_length") as e:
    apg.build_apg_config("playground/CartpoleSwingup", {"num_minibatches": 4})
  # env_kwargs is no flag of train_control.py, so it is not listed as one.
  assert "--env_kwargs" not in str(e.value)
  assert str(e.value).endswith("--truncation_length (and env_kwargs, in Python only).")
  only = apg.apg_only_fields()
  assert "horizon_length" in only and "solver_iterations" in only and "num_envs" not in only


def test_discount_weights_and_segments():
  # gamma = 0.5, H = 3: weights 1, 0.5, 0.25 over their sum 1.75.
  np.testing.assert_allclose(apg.discount_weights(3, 0.5), [1 / 1.75, 0.5 / 1.75, 0.25 / 1.75],
                             rtol=1e-6)
  np.testing.assert_allclose(apg.discount_weights(4, 1.0), [0.25] * 4)
  assert apg.APGConfig(horizon_length=32, truncation_length=8).segment_length == 8
  assert apg.APGConfig(horizon_length=32).segment_length == 32


def _rollout_objective(env, obs_weight=0.1):
  """``(actions [T, A], state0) -> sum_t (reward_t + obs_weight * sum(obs_t))`` via ``env.step``.

  The observation term makes the objective depend smoothly on the whole physical
  state (positions, velocities), not only on what the reward measures.
  """

  def f(actions, state0):
    def body(state, action):
      state = env.step(state, action)
      return state, state.reward + obs_weight * jnp.sum(state.obs)

    return jnp.sum(jax.lax.scan(body, state0, actions)[1])

  return f


@pytest.mark.slow
def test_mjx_reverse_mode_needs_one_solver_iteration():
  """Brax's reacher on MJX (iterations=100) cannot be reverse-differentiated until
  `make_differentiable` sets opt.iterations = 1. Tracing the gradient is enough to
  see it (the error is raised while JAX transposes the while_loop), so nothing compiles."""
  env = envs.make("brax/reacher")
  assert apg.solver_options(env)["iterations"] == 100
  state0 = jax.eval_shape(env.reset, jax.random.PRNGKey(0))  # abstract: nothing compiles
  actions = jnp.full((3, env.action_size), 0.1)
  with pytest.raises(ValueError, match=WHILE_LOOP_ERROR):
    jax.make_jaxpr(jax.grad(_rollout_objective(env)))(actions, state0)
  diff = apg.make_differentiable(env, solver_iterations=1, ls_iterations=4)
  assert apg.solver_options(diff) == {"iterations": 1, "ls_iterations": 4}
  assert apg.solver_options(env)["iterations"] == 100  # the original is untouched
  jaxpr = jax.make_jaxpr(jax.grad(_rollout_objective(diff)))(actions, state0)
  assert jaxpr.out_avals[0].shape == (3, env.action_size)
  # Brax's generalized backend has no MJX solver: returned unchanged.
  gen = envs.make("brax/reacher", backend="generalized")
  assert apg.make_differentiable(gen) is gen


@pytest.mark.slow
def test_gradient_through_env_step_matches_finite_differences():
  """Playground CartpoleBalance (MJX solver with opt.iterations=1, slider-limit rows).

  In float64 the central difference ``(f(a + e) - f(a - e)) / 2e`` with e = 1e-6 has
  truncation error ~ e^2 |f'''| / 6 ~ 1e-12 and rounding error ~ 1e-16 |f| / e ~ 1e-9
  (|f| ~ 6), so reverse-mode AD must agree to ~1e-8; we allow rtol 1e-6.
  The float32 AD gradient, from the same initial state, carries float32 rounding
  (~1e-7 relative per operation) through 6 steps of the dynamics and the solver;
  measured against float32 central differences it agrees to ~1e-4 relative, so we
  require rtol 1e-3 against the float64 reference.
  """
  steps = 6

  def problem(state0=None):
    env = apg.make_differentiable(envs.make("playground/CartpoleBalance"))
    if state0 is None:
      state0 = jax.jit(env.reset)(jax.random.PRNGKey(1))
      # Moving, and away from exact rest, where MJX's line search has 0/0 (see
      # apg.masked_env_gradients).
      qvel = state0.data.qvel + jnp.array([0.3, -0.5])
      state0 = state0.replace(data=state0.data.replace(qvel=qvel))
    actions = jnp.sin(jnp.arange(steps * env.action_size, dtype=state0.data.qvel.dtype) + 1.0)
    return env, state0, 0.5 * actions.reshape(steps, env.action_size)

  eps = 1e-6

  def grad_and_central_differences(f, actions, state0):
    basis = jnp.eye(actions.size, dtype=actions.dtype).reshape((-1,) + actions.shape)
    values = jax.vmap(f, in_axes=(0, None))(
        jnp.concatenate([actions + eps * basis, actions - eps * basis]), state0)
    central = (values[: actions.size] - values[actions.size:]) / (2 * eps)
    return jax.grad(f)(actions, state0), central

  with jax.enable_x64(True):
    env, state64, actions = problem()
    assert state64.data.qpos.dtype == jnp.float64
    grad64, fd = jax.device_get(_call_compiled_quickly(functools.partial(
        grad_and_central_differences, _rollout_objective(env)), actions, state64))
    state64 = jax.device_get(state64)
  assert np.all(np.isfinite(grad64))
  assert np.max(np.abs(grad64)) > 1e-2  # a real dependence, not an all-zero gradient
  np.testing.assert_allclose(grad64.ravel(), fd, rtol=1e-6, atol=1e-9)

  to32 = lambda x: np.asarray(x, np.float32) if np.asarray(x).dtype == np.float64 else x
  env, state32, actions = problem(jax.tree.map(to32, state64))  # the same initial state
  grad32 = np.asarray(_call_compiled_quickly(jax.grad(_rollout_objective(env)), actions, state32))
  assert grad32.dtype == np.float32 and np.all(np.isfinite(grad32))
  np.testing.assert_allclose(grad32.ravel(), fd, rtol=1e-3, atol=1e-5)


@pytest.mark.slow
def test_train_apg_writes_metrics_and_a_loadable_policy(tmp_path):
  """A seconds-long run on PendulumSwingup (no constraint solver: the cheapest model to
  compile); checks the outputs and that load_policy reproduces the trained actions."""
  config = apg.APGConfig(
      env="playground/PendulumSwingup", num_envs=4, horizon_length=4, truncation_length=2,
      num_updates=4, num_evals=3, num_eval_envs=2, episode_length=8, policy_hidden=(8,),
  )
  logdir = str(tmp_path / "run")
  result = apg.train_apg(config, logdir, progress=False)
  records = read_jsonl(os.path.join(logdir, "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 1, 2]
  # 2 chunks x 2 updates x 4 envs x 4 steps = 64 env steps.
  assert [r["env_steps"] for r in records] == [0, 32, 64]
  for key in ("eval/episode_reward", "loss", "grad_norm", "sps", "timing/wall_s",
              "nonfinite/envs_dropped", "nonfinite/skipped_updates"):
    assert key in records[-1], key
  assert records[-1]["eval/episode_length"] == 8.0
  assert int(result.state.update) == 4
  with open(os.path.join(logdir, "checkpoints", "config.json")) as f:
    saved = json.load(f)
  assert saved["algo"] == "apg" and saved["apg"]["env"] == config.env
  assert saved["train_solver"] == {"iterations": 1, "ls_iterations": 8}

  policy = trainer.load_policy(logdir)
  obs = jax.random.normal(jax.random.PRNGKey(0), (5, 3))
  expected = apg.deterministic_action(result.networks, result.state.params,
                                      result.state.obs_stats, obs)
  assert float(jnp.std(expected)) > 0
  np.testing.assert_allclose(policy(obs), expected, rtol=1e-6, atol=1e-7)
  # The same call on the finished run trains nothing and returns its logged history.
  again = apg.train_apg(config, logdir, progress=False, log=lambda _: None)
  assert again.resumed_from == 2 and [h["step"] for h in again.history] == [0, 1, 2]
  with pytest.raises(ValueError,
                     match=r"already holds a train_control.py --algo=apg run \(checkpoints up to step 2\)"):
    apg.train_apg(config, logdir, progress=False, resume=False)
  with pytest.raises(ValueError, match=r"different config \(learning_rate"):
    apg.train_apg(config.replace(learning_rate=0.5), logdir, progress=False)


@pytest.mark.slow
def test_apg_sigterm_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
  """SIGTERM during chunk 1 of 3: the chunk finishes, is checkpointed, `Preempted` is raised;
  the same call then resumes and ends bitwise equal to an uninterrupted run (parameters,
  optimizer state, normaliser and every logged record but the timings)."""
  import signal

  from rljax import metrics as metrics_lib

  config = apg.APGConfig(
      env="playground/PendulumSwingup", num_envs=4, horizon_length=4, truncation_length=2,
      num_updates=6, num_evals=4, num_eval_envs=2, episode_length=8, policy_hidden=(8,),
  )
  ref = apg.train_apg(config, str(tmp_path / "ref"), progress=False)
  logdir = str(tmp_path / "run")
  write = metrics_lib.MetricsWriter.write

  def write_then_sigterm(self, step, record, **kw):
    write(self, step, record, **kw)
    if step == 1:  # the handler only sets a flag; the loop checks it after the checkpoint
      os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write_then_sigterm)
  with pytest.raises(trainer.Preempted, match="checkpointed chunk 1"):
    apg.train_apg(config, logdir, progress=False)
  monkeypatch.setattr(metrics_lib.MetricsWriter, "write", write)
  assert sorted(int(d) for d in os.listdir(os.path.join(logdir, "checkpoints"))
                if d.isdigit()) == [1]
  lines = []
  out = apg.train_apg(config, logdir, progress=False, log=lines.append)
  assert out.resumed_from == 1 and lines == [f"resuming {logdir} after chunk 1 (32 env steps)"]
  for a, b in zip(jax.tree.leaves((out.state.params, out.state.opt_state, out.state.obs_stats,
                                   out.state.key, out.state.update)),
                  jax.tree.leaves((ref.state.params, ref.state.opt_state, ref.state.obs_stats,
                                   ref.state.key, ref.state.update))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("timing/", "sps"))}
                      for r in rs]
  records = read_jsonl(os.path.join(logdir, "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 1, 2, 3]
  assert strip(records) == strip(read_jsonl(os.path.join(str(tmp_path / "ref"), "metrics.jsonl")))


def test_masked_env_gradients_drops_only_nonfinite_envs():
  """Env 1 of 3 has a NaN gradient: the mean is over envs 0 and 2 only."""

  class S:  # a minimal "state" pytree: just an array per env
    pass

  def loss_fn(params, stats, x):  # x: [1] per env
    # d/dp of p * sqrt(x): sqrt(x); env with x = -1 gives NaN.
    loss = jnp.mean(params["p"] * jnp.sqrt(x))
    return loss, (x, jnp.zeros((2, 1, 3)), jnp.zeros((2, 1)))

  params = {"p": jnp.asarray(2.0)}
  x = jnp.asarray([4.0, -1.0, 9.0])
  loss, grads, final, obs, rewards, finite = apg.masked_env_gradients(loss_fn, params, None, x)
  np.testing.assert_array_equal(finite, [True, False, True])
  # mean of sqrt(4) = 2 and sqrt(9) = 3 -> 2.5; loss = p * 2.5 = 5.
  np.testing.assert_allclose(grads["p"], 2.5)
  np.testing.assert_allclose(loss, 5.0)
  np.testing.assert_array_equal(final, x)
  assert obs.shape == (3 * 2, 3) and rewards.shape == (3, 2)


@pytest.mark.slow
def test_apg_learns_cartpole_swingup():
  """APG lifts CartpoleSwingup's return from ~6 (the untrained policy, hanging pole) to
  well above 150 in 300 updates (about 1.5 minutes here, most of it compilation)."""
  config = apg.default_apg_config("playground/CartpoleSwingup").replace(
      num_updates=300, horizon_length=32, num_evals=4, num_eval_envs=8)
  result = apg.train_apg(config, None, progress=False)
  rewards = [h["eval/episode_reward"] for h in result.history]
  assert rewards[0] < 20, rewards
  assert rewards[-1] > 150, rewards
