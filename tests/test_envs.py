"""The environment registry: names, errors, and parity with the libraries' own wrappers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import envs


def test_list_envs_covers_brax_and_playground():
  names = envs.list_envs()
  for name in ("brax/ant", "brax/humanoid", "brax/hopper", "playground/CartpoleBalance",
               "playground/CheetahRun", "playground/Go1JoystickFlatTerrain"):
    assert name in names


@pytest.mark.parametrize(
    "bad, suggestion",
    [
        ("playground/CartpoleBalanse", "playground/CartpoleBalance"),
        ("CheetahRun", "playground/CheetahRun"),
        ("brax/ants", "brax/ant"),
    ],
)
def test_unknown_name_lists_close_matches(bad, suggestion):
  with pytest.raises(envs.UnknownEnvError) as e:
    envs.make(bad)
  assert repr(bad) in str(e.value)
  assert suggestion in str(e.value)


def test_menagerie_env_fails_with_instructions(tmp_path, monkeypatch):
  monkeypatch.delenv(envs.MENAGERIE_ENV_VAR, raising=False)
  from mujoco_playground._src import mjx_env

  monkeypatch.setattr(mjx_env, "MENAGERIE_PATH", mjx_env.epath.Path(tmp_path / "absent"))
  with pytest.raises(envs.MenagerieNotFoundError, match="MUJOCO_MENAGERIE_PATH"):
    envs.make("playground/Go1JoystickFlatTerrain")
  with pytest.raises(envs.MenagerieNotFoundError, match="does not exist"):
    envs.make("playground/Go1JoystickFlatTerrain", menagerie_path=str(tmp_path / "nope"))
  # A folder that is not a Menagerie checkout: named, with the file MuJoCo missed.
  with pytest.raises(envs.MenagerieNotFoundError,
                     match=r"lacks the MuJoCo Menagerie files playground/Go1JoystickFlatTerrain "
                           r"needs \(.*unitree_go1/"):
    envs.check_assets("playground/Go1JoystickFlatTerrain", menagerie_path=str(tmp_path))


@pytest.mark.slow
def test_truncation_keeps_final_obs_and_matches_playground_wrappers():
  """Our chain equals Playground's own `wrap_for_brax_training`, plus final_obs."""
  from mujoco_playground._src import wrapper as pg_wrapper

  env = envs.make("playground/CartpoleBalance")
  ours = envs.wrap_for_training(env, episode_length=5)
  theirs = pg_wrapper.wrap_for_brax_training(env, episode_length=5)
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  actions = jax.random.uniform(jax.random.PRNGKey(4), (7, 4, env.action_size), minval=-1, maxval=1)

  @jax.jit
  def roll(keys, actions):
    def body(carry, a):
      s1, s2 = carry
      s1, s2 = ours.step(s1, a), theirs.step(s2, a)
      return (s1, s2), (s1.obs, s2.obs, s1.reward, s2.reward, s1.done, s1.info["truncation"],
                        s1.info[envs.FINAL_OBS_KEY])
    return jax.lax.scan(body, (ours.reset(keys), theirs.reset(keys)), actions)[1]

  obs1, obs2, r1, r2, done, trunc, final = roll(keys, actions)
  np.testing.assert_array_equal(obs1, obs2)
  np.testing.assert_array_equal(r1, r2)
  # Step index 4 is the 5th step: the time limit. Auto-reset restores the first obs,
  # while final_obs keeps the pre-reset one.
  np.testing.assert_array_equal(done[4], 1.0)
  np.testing.assert_array_equal(trunc[4], 1.0)
  assert np.all(done[:4] == 0)
  first = jax.jit(ours.reset)(keys).obs
  np.testing.assert_array_equal(obs1[4], first)
  assert not np.allclose(final[4], first)
  # Outside resets final_obs equals obs.
  np.testing.assert_array_equal(final[:4], obs1[:4])


@pytest.mark.slow
def test_brax_env_matches_brax_training_wrap():
  from brax.envs.wrappers import training as brax_training

  env = envs.make("brax/inverted_pendulum")
  ours = envs.wrap_for_training(env, episode_length=1000, action_repeat=2)
  theirs = brax_training.wrap(env, episode_length=1000, action_repeat=2)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  actions = jnp.full((6, 3, env.action_size), 0.3)

  @jax.jit
  def roll(keys):
    def body(carry, a):
      s1, s2 = carry
      s1, s2 = ours.step(s1, a), theirs.step(s2, a)
      return (s1, s2), (s1.obs - s2.obs, s1.reward - s2.reward)
    return jax.lax.scan(body, (ours.reset(keys), theirs.reset(keys)), actions)[1]

  dobs, drew = roll(keys)
  assert float(jnp.max(jnp.abs(dobs))) == 0.0
  assert float(jnp.max(jnp.abs(drew))) == 0.0


def test_wrap_rejects_bad_episode_length():
  env = envs.make("playground/CartpoleBalance")
  with pytest.raises(ValueError, match="episode_length and action_repeat must be >= 1, got 0, 1"):
    envs.wrap_for_training(env, episode_length=0)


@pytest.mark.slow
def test_trace_once_traces_once_and_steps_identically():
  """`TraceOnce` runs the environment's Python once for ``reset`` whatever the batch size and
  wrapper chain on top (probe, training, evaluation), and once for ``step`` (the evaluation's
  extra keys pass around it); it keeps Playground's auto-reset wrapper and gives the
  trajectories of the unwrapped environment."""
  import functools

  from brax.envs.wrappers import training as brax_training
  from mujoco_playground._src import wrapper as pg_wrapper

  raw = envs.make("playground/CartpoleBalance")
  calls = {"reset": 0, "step": 0}

  class Counting:  # counts how often the environment's Python runs (once per trace)
    def __init__(self, env):
      self.env = env

    def reset(self, rng):
      calls["reset"] += 1
      return self.env.reset(rng)

    def step(self, state, action):
      calls["step"] += 1
      return self.env.step(state, action)

    def __getattr__(self, name):
      return getattr(self.env, name)

  traced = envs.TraceOnce(Counting(raw))
  train = envs.wrap_for_training(traced, episode_length=5)
  assert isinstance(train, pg_wrapper.BraxAutoResetWrapper)
  evaluation = brax_training.EvalWrapper(envs.wrap_for_training(traced, episode_length=5))

  def roll(env, n):
    keys = jax.random.split(jax.random.PRNGKey(3), n)
    actions = jax.random.uniform(jax.random.PRNGKey(4), (7, n, raw.action_size), minval=-1,
                                 maxval=1)
    body = lambda s, a: (lambda s: (s, s.obs))(env.step(s, a))
    return jax.lax.scan(body, env.reset(keys), actions)[1]

  assert jax.eval_shape(traced.reset, jax.random.PRNGKey(0)).obs.shape == (5,)
  obs_train = jax.jit(functools.partial(roll, train, 4))()
  obs_eval = jax.jit(functools.partial(roll, evaluation, 2))()
  # Without TraceOnce: 3 resets and 2 steps (EvalWrapper's "eval_metrics" and "reward" give
  # the evaluation's states their own structure, hence their own trace of step).
  assert calls == {"reset": 1, "step": 1}
  jax.jit(functools.partial(roll, train, 8))()  # another batch size: no new trace
  assert calls == {"reset": 1, "step": 1}
  reference = envs.wrap_for_training(raw, episode_length=5)
  np.testing.assert_array_equal(obs_train, jax.jit(functools.partial(roll, reference, 4))())
  reference_eval = brax_training.EvalWrapper(envs.wrap_for_training(raw, episode_length=5))
  np.testing.assert_array_equal(obs_eval, jax.jit(functools.partial(roll, reference_eval, 2))())


def test_make_returns_one_environment_per_arguments_and_float_width():
  """The cache gives back the same object for the same arguments and a separate one under
  ``jax.enable_x64``, whose MJX model holds float64 arrays (a float32 trainer given it would
  carry float64 physics through its scans)."""
  def float_dtypes(env):
    return {str(x.dtype) for x in jax.tree.leaves(env.mjx_model)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)}

  env = envs.make("playground/PendulumSwingup")
  assert envs.make("playground/PendulumSwingup") is env
  assert envs.traced(env) is envs.traced(env)
  with jax.enable_x64(True):
    env64 = envs.make("playground/PendulumSwingup")
    assert envs.make("playground/PendulumSwingup") is env64
  assert env64 is not env
  assert float_dtypes(env) == {"float32"} and "float64" in float_dtypes(env64)
