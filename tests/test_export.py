"""Policy export: exported == in-process actions, a loader that needs only jax, manifest."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rljax
from rljax import running_stats
from rljax.control import export, export_loader, trainer
from rljax.control.config import ControlConfig
from rljax.models import mlp

# The same seconds-long run as tests/test_control.py's TINY.
TINY = dict(
    env="playground/CartpoleBalance", num_timesteps=4 * 16 * 8, num_envs=16, unroll_length=8,
    num_minibatches=2, num_epochs=2, num_evals=3, num_eval_envs=4, episode_length=50,
    policy_hidden=(8,), value_hidden=(8,),
)
OBS_SIZE, ACT_SIZE = 5, 1  # CartpoleBalance


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  logdir = str(tmp_path_factory.mktemp("export") / "run")
  trainer.train(ControlConfig().replace(**TINY), logdir, progress=False)
  return logdir


@pytest.fixture(scope="module")
def obs():
  # Observations well outside the normaliser's range too, so clipping is exercised.
  return np.asarray(3.0 * jax.random.normal(jax.random.PRNGKey(0), (7, OBS_SIZE)), np.float32)


def test_exported_actions_equal_load_policy(run, obs, tmp_path):
  result = export.export_from_logdir(run, str(tmp_path / "exp"))
  policy = export_loader.load(result.out_dir)
  expected = np.asarray(trainer.load_policy(run)(jnp.asarray(obs)))
  assert expected.shape == (7, ACT_SIZE)
  assert np.all(np.abs(expected) <= 1.0) and np.std(expected) > 0  # a real, varying policy
  np.testing.assert_allclose(np.asarray(policy(obs)), expected, rtol=0, atol=1e-6)
  # Batch-polymorphic: batch 1, batch 3 and one unbatched observation.
  np.testing.assert_allclose(np.asarray(policy(obs[:1])), expected[:1], rtol=0, atol=1e-6)
  np.testing.assert_allclose(np.asarray(policy(obs[2:5])), expected[2:5], rtol=0, atol=1e-6)
  single = np.asarray(policy(obs[4]))
  assert single.shape == (ACT_SIZE,)
  np.testing.assert_allclose(single, expected[4], rtol=0, atol=1e-6)


def test_manifest(run, tmp_path):
  result = export.export_from_logdir(run, str(tmp_path / "exp"))
  with open(result.manifest_path) as f:
    m = json.load(f)
  assert m["format"] == "rljax.policy_export" and m["format_version"] == 1
  assert (m["observation_size"], m["action_size"]) == (OBS_SIZE, ACT_SIZE)
  assert (m["observation_dtype"], m["action_dtype"]) == ("float32", "float32")
  assert m["batch_polymorphic"] is True and m["batch_size"] is None
  assert m["platforms"] == ["cpu", "cuda"]
  assert m["versions"]["jax"] == jax.__version__
  assert m["versions"]["rljax"] == rljax.__version__
  assert m["versions"]["flax"] is not None
  assert m["metadata"]["env"] == TINY["env"]
  assert m["metadata"]["step"] == TINY["num_evals"] - 1  # one checkpoint per chunk
  assert m["metadata"]["network"]["policy_hidden"] == [8]


@pytest.mark.slow
def test_loader_runs_with_only_jax(run, obs, tmp_path):
  """The loader file, copied elsewhere, runs where rljax, flax, brax... cannot be imported."""
  result = export.export_from_logdir(run, str(tmp_path / "exp"))
  robot = tmp_path / "robot"
  robot.mkdir()
  shutil.copy(export_loader.__file__, robot / "export_loader.py")
  np.save(robot / "obs.npy", obs)
  script = textwrap.dedent(f"""
      import sys
      BLOCKED = ("rljax", "flax", "brax", "mujoco", "mujoco_playground", "optax", "orbax")

      class Blocker:
        def find_spec(self, name, path=None, target=None):
          if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {{name}}")
          return None

      sys.meta_path.insert(0, Blocker())
      import numpy as np
      import export_loader
      policy = export_loader.load({result.out_dir!r})
      np.save("actions.npy", np.asarray(policy(np.load("obs.npy"))))
      leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
      assert not leaked, leaked
      print("ok", export_loader.__file__)
  """)
  env = dict(os.environ, PYTHONPATH=str(robot))
  out = subprocess.run([sys.executable, "-c", script], cwd=robot, capture_output=True,
                       text=True, timeout=120, env=env)
  assert out.returncode == 0, out.stderr
  assert str(robot / "export_loader.py") in out.stdout  # the copy, not the package
  expected = np.asarray(trainer.load_policy(run)(jnp.asarray(obs)))
  np.testing.assert_allclose(np.load(robot / "actions.npy"), expected, rtol=0, atol=1e-6)


def test_fixed_batch_export_and_errors(run, tmp_path):
  result = export.export_from_logdir(run, str(tmp_path / "b2"), batch_size=2, platforms=("cpu",))
  assert result.manifest["batch_size"] == 2 and not result.manifest["batch_polymorphic"]
  policy = export_loader.load(result.out_dir)
  assert np.asarray(policy(np.zeros((2, OBS_SIZE)))).shape == (2, ACT_SIZE)
  with pytest.raises(ValueError, match=r"observation shape \(3, 5\) does not fit this policy: "
                                       r"expected \[5\] or \[2, 5\]"):
    policy(np.zeros((3, OBS_SIZE)))
  with pytest.raises(ValueError, match=r"observation shape \(4,\)"):
    policy(np.zeros((4,)))
  # A corrupted artifact is refused before JAX reads it.
  with open(result.artifact_path, "ab") as f:
    f.write(b"\0")
  with pytest.raises(export_loader.ExportFormatError, match="does not match the sha256"):
    export_loader.load(result.out_dir)
  with pytest.raises(FileNotFoundError, match="is it an rljax policy export"):
    export_loader.load(str(tmp_path))
  with pytest.raises(export.ExportError, match="batch_size must be >= 1 or None"):
    export.export_inference_fn(lambda x: x, OBS_SIZE, batch_size=0)
  # An RLHF run's folder is named as such (it was a bare KeyError: 'network').
  rlhf_run = tmp_path / "rlhf"
  (rlhf_run / "checkpoints" / "3").mkdir(parents=True)
  (rlhf_run / "checkpoints" / "config.json").write_text('{"rlhf_embedded": {}}')
  for load in (trainer.load_policy, lambda d: export.export_from_logdir(d, str(tmp_path / "x"))):
    with pytest.raises(ValueError, match=r"is not a control run: its checkpoints/config.json "
                                         r"has \['rlhf_embedded'\]"):
      load(str(rlhf_run))


def test_export_policy_in_memory_matches_inference_fn(tmp_path):
  """An untrained default-size MLP with non-trivial normaliser statistics."""
  config = ControlConfig(env="playground/CartpoleBalance")
  net_config = mlp.ActorCriticConfig(
      observation_size=OBS_SIZE, action_size=ACT_SIZE, policy_hidden=config.policy_hidden,
      value_hidden=(4,), init_std=1.0,
  )
  model = mlp.ActorCritic(net_config, rngs=nnx.Rngs(params=1))
  graphdef, params = nnx.split(model, nnx.Param)
  # Make the policy output large enough to see: scale the last layer up.
  params["policy"]["out"]["kernel"][...] = params["policy"]["out"]["kernel"][...] * 300.0
  networks = trainer.Networks(graphdef, net_config)
  data = jax.random.normal(jax.random.PRNGKey(2), (64, OBS_SIZE)) * 2.0 + 1.0
  stats = running_stats.update(running_stats.init(OBS_SIZE), data)
  result = export.export_policy(networks, params, stats, str(tmp_path / "mem"), env="none")
  policy = export_loader.load(result.out_dir)
  obs = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (9, OBS_SIZE)), np.float32)
  expected = np.asarray(jax.jit(export.make_inference_fn(networks, params, stats))(obs))
  assert np.std(expected) > 0.05
  np.testing.assert_allclose(np.asarray(policy(obs)), expected, rtol=0, atol=1e-6)
  assert result.manifest["metadata"]["network"]["policy_hidden"] == [32, 32, 32, 32]
