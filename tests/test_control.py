"""The control trainer: config errors, determinism, checkpoints and end-to-end learning."""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from brax import envs as brax_envs
from flax import nnx

from rljax import checkpoint as ckpt
from rljax import envs, running_stats, runtime
from rljax.control import checkpointing, learner, trainer
from rljax.control.config import ConfigError, ControlConfig, default_config
from rljax.models import mlp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "experiments", "train_control.py")

# A run small enough to compile and train in seconds.
TINY = dict(
    env="playground/CartpoleBalance", num_timesteps=4 * 16 * 8, num_envs=16, unroll_length=8,
    num_minibatches=2, num_epochs=2, num_evals=3, num_eval_envs=4, episode_length=50,
    policy_hidden=(8,), value_hidden=(8,),
)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_envs=0), "num_envs must be a positive integer, got 0"),
        (dict(num_envs=-4), "num_envs must be a positive integer, got -4"),
        (dict(num_envs=16, batch_size=48, num_minibatches=5),
         r"the batch of 48 segments \(batch_size=48\) is not divisible by num_minibatches=5\.$"),
        (dict(num_envs=16, num_minibatches=5),  # batch_size=0: the batch is num_envs
         r"the batch of 16 segments \(num_envs=16, as batch_size=0\) is not divisible by "
         r"num_minibatches=5\.$"),
        (dict(num_envs=16, batch_size=40), "batch_size=40 must be a multiple of num_envs=16"),
        (dict(num_envs=16, batch_size=48, num_minibatches=4, num_microbatches=5),
         r"a minibatch of 12 segments is not divisible by num_microbatches=5: 48 segments a batch "
         r"\(batch_size=48\) over num_minibatches=4\.$"),
        (dict(num_microbatches=0), "num_microbatches must be >= 1, got 0"),
        (dict(learning_rate=0.0), "learning_rate must be > 0, got 0.0"),
        (dict(init_std=0.001), r"init_std must be > 0.001 \(the policy's min_std\), got 0.001"),
        (dict(policy_init_scale=-1.0), "policy_init_scale must be > 0, got -1.0"),
        (dict(overlap_value_update=True, max_grad_norm=1.0),
         r"overlap_value_update needs max_grad_norm=None .* got max_grad_norm=1.0"),
        (dict(gae_per_minibatch=True, overlap_value_update=True),
         r"gae_per_minibatch needs overlap_value_update=False .* got overlap_value_update=True\.$"),
        (dict(env_threads=-1), "env_threads must be a non-negative integer, got -1"),
        (dict(num_envs=96, env_threads=5),
         r"env_threads=5 must divide num_envs=96 \(each thread steps num_envs / env_threads "
         r"environments\)\.$"),
        (dict(env_threads=2, overlap_value_update=True),
         r"env_threads=2 needs overlap_value_update=False .* got overlap_value_update=True\.$"),
        (dict(gae_per_minibatch=True, num_microbatches=2),
         r"gae_per_minibatch needs num_microbatches=1 .* got num_microbatches=2"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
  with pytest.raises(ConfigError, match=match):
    ControlConfig().replace(**kwargs)


@pytest.mark.parametrize("kwargs, fields", [
    (dict(num_envs=16, batch_size=48, num_minibatches=5), ("batch_size", "num_minibatches")),
    (dict(num_envs=16, num_minibatches=5), ("num_envs", "batch_size", "num_minibatches")),
    (dict(num_envs=16, batch_size=40), ("batch_size", "num_envs")),
    (dict(num_envs=16, num_minibatches=4, num_microbatches=3),
     ("num_microbatches", "num_envs", "batch_size", "num_minibatches")),
    (dict(overlap_value_update=True, max_grad_norm=1.0), ("max_grad_norm",)),
    (dict(gae_per_minibatch=True, overlap_value_update=True), ("overlap_value_update",)),
    (dict(gae_per_minibatch=True, num_microbatches=2), ("num_microbatches",)),
    (dict(num_envs=96, env_threads=5), ("env_threads", "num_envs")),
    (dict(env_threads=2, overlap_value_update=True), ("env_threads", "overlap_value_update")),
    (dict(num_envs=0), ()),  # quotes no name=value
])
def test_config_error_names_the_fields_it_quotes(kwargs, fields):
  """`ConfigError.fields` lists the ``name=value`` fields of its message, in the message's order
  (train_control.py names those no flag set as the environment's defaults)."""
  with pytest.raises(ConfigError) as info:
    ControlConfig().replace(**kwargs)
  assert info.value.fields == fields
  message = str(info.value)
  for name in fields:
    assert f"{name}=" in message, (name, message)
  assert [message.index(f"{n}=") for n in fields] == sorted(
      message.index(f"{n}=") for n in fields)


@pytest.mark.parametrize("flags, message", [
    (["--noresume"], "already holds a train_control.py run (checkpoints up to step 3); run the "
                     "command without --noresume to resume it (the default; a finished run then "
                     "trains nothing), or use a new --logdir (its checkpoints are left "
                     "untouched)."),
    (["--num_envs=128"], "holds a run with a different config (num_envs: saved 256, now 128)"),
])
@pytest.mark.slow
def test_script_refuses_a_run_it_cannot_resume_and_leaves_it_as_it_was(flags, message, tmp_path):
  """--noresume on a run, or another config: exit 2 before run_info.json is rewritten."""
  logdir = tmp_path / "run"
  (logdir / "checkpoints" / "3").mkdir(parents=True)
  config = default_config("playground/CartpoleBalance")
  (logdir / "checkpoints" / "config.json").write_text(
      json.dumps({"control": json.loads(config.to_json())}))
  (logdir / "run_info.json").write_text('{"argv": ["the first command"]}')
  before = {p: p.read_bytes() for p in logdir.rglob("*") if p.is_file()}
  out = subprocess.run([sys.executable, SCRIPT, f"--logdir={logdir}", *flags],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr
  assert message in out.stderr.strip().splitlines()[-1], out.stderr
  assert {p: p.read_bytes() for p in logdir.rglob("*") if p.is_file()} == before


def test_script_says_num_evals_1_acts_as_2(tmp_path):
  # With a bad --mesh after it, so that nothing trains: the note comes before any run.
  out = subprocess.run([sys.executable, SCRIPT, f"--logdir={tmp_path}/run", "--num_evals=1",
                        "--mesh=2,1,1"], capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr
  assert out.stdout == ("note: num_evals=1 acts as 2, as Brax's does: one evaluation before "
                        "training and one after it\n")


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--num_envs=0"], "num_envs must be a positive integer, got 0"),
        # Values the flags did not set are named as the environment's defaults.
        (["--num_envs=16", "--num_minibatches=3"],
         "error: the batch of 16 segments (num_envs=16, as batch_size=0) is not divisible by "
         "num_minibatches=3. Not set by a flag: batch_size=0 (playground/CartpoleBalance's "
         "default).\n"),
        (["--num_microbatches=3"],
         "error: a minibatch of 64 segments is not divisible by num_microbatches=3: 256 segments a "
         "batch (num_envs=256, as batch_size=0) over num_minibatches=4. Not set by a flag: "
         "num_envs=256, batch_size=0, num_minibatches=4 (playground/CartpoleBalance's defaults).\n"),
        (["--env=playground/CartpoleBalanse"], "Did you mean: playground/CartpoleBalance"),
        # Menagerie-backed (no checkout here or in CI): one line saying how to point at one.
        (["--env=playground/Go1JoystickFlatTerrain"], "set $MUJOCO_MENAGERIE_PATH=PATH (or pass "
                                                     "--menagerie_path=PATH"),
        (["--env=playground/Go1JoystickFlatTerrain", "--menagerie_path=/nonexistent/menagerie"],
         "menagerie_path '/nonexistent/menagerie' does not exist"),
        (["--env=playground/Go1JoystickFlatTerrain", f"--menagerie_path={REPO}"],  # not Menagerie
         f"{REPO} lacks the MuJoCo Menagerie files playground/Go1JoystickFlatTerrain needs"),
        (["--learning_rate=-1"], "learning_rate must be > 0, got -1.0"),
        (["--env_threads=3"],
         "error: env_threads=3 must divide num_envs=256 (each thread steps num_envs / env_threads "
         "environments). Not set by a flag: num_envs=256 (playground/CartpoleBalance's default).\n"),
        (["--mesh=2,1,1"], "mesh data=2 x fsdp=1 x tensor=1 = 2 devices, but 1 device is available"),
        (["--sharding_rules=foo"], "unknown sharding rules preset 'foo'"),
    ],
)
@pytest.mark.slow
def test_script_rejects_bad_flags_before_compiling(flags, match, tmp_path):
  out = subprocess.run(
      [sys.executable, SCRIPT, f"--logdir={tmp_path}/run", *flags],
      capture_output=True, text=True, timeout=120,
  )
  assert out.returncode == 2, out.stderr
  assert match in out.stderr
  assert "Traceback" not in out.stderr
  assert not os.path.exists(tmp_path / "run")  # nothing written, nothing compiled


@pytest.mark.slow
def test_show_config_prints_the_env_defaults_with_the_flags_and_writes_nothing(tmp_path):
  """--show_config prints the bundled defaults of --env with the flags applied, exits 0, and
  neither writes the logdir nor compiles."""
  out = subprocess.run(
      [sys.executable, SCRIPT, "--env=brax/ant", "--num_envs=128", "--show_config",
       f"--logdir={tmp_path}/run"], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  shown = ControlConfig.from_json(out.stdout)
  assert shown == default_config("brax/ant").replace(num_envs=128)
  assert (shown.num_timesteps, shown.learning_rate, shown.gamma) == (6_000_000, 3e-4, 0.97)
  # 128 envs x 16 steps = 2,048 env steps an iteration; ceil(6e6 / 2,048) = 2,930 iterations
  # over 9 chunks (10 evaluations) -> ceil(2,930 / 9) = 326 a chunk: 9 x 326 x 2,048 steps.
  assert out.stderr.strip().splitlines()[-1] == (
      "schedule: 9 chunks x 326 iterations x 2,048 env steps (128 segments of 16 steps) = "
      "6,008,832 env steps (num_timesteps=6,000,000 rounded up to whole chunks), 10 evaluations")
  assert not os.path.exists(tmp_path / "run")


def _leaves(params):
  return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_resume_check_treats_fields_added_later_as_their_defaults(tmp_path):
  # A run started before init_std / policy_init_scale / obs_stats_before_update existed saved
  # a config without them; it trained with their defaults then, so it resumes with those,
  # and only with those.
  saved = json.loads(ControlConfig().replace(**TINY).to_json())
  for k in ("init_std", "policy_init_scale", "obs_stats_before_update"):
    del saved[k]
  os.makedirs(os.path.join(ckpt.checkpoint_dir(str(tmp_path)), "1"))  # a saved chunk
  ckpt.write_json_atomic(os.path.join(ckpt.checkpoint_dir(str(tmp_path)), ckpt.CONFIG_FILE),
                         {"control": saved})
  assert ckpt.check_logdir(str(tmp_path), checkpointing.saved_run(ControlConfig().replace(**TINY)), resume=True) == 1
  with pytest.raises(ValueError, match=r"different config \(policy_init_scale: not saved, so "
                                      r"the default 0.01, now 1.0\)"):
    ckpt.check_logdir(str(tmp_path), checkpointing.saved_run(ControlConfig().replace(**TINY, policy_init_scale=1.0)), resume=True)
  # The implied values are the generic defaults the run had, not today's per-env defaults:
  # an old brax/ant run (trained with 1.0 / 0.01) is refused under ant's new defaults.
  ant = default_config("brax/ant").replace(**{k: v for k, v in TINY.items() if k != "env"})
  with pytest.raises(ValueError, match=r"init_std: not saved, so the default 1.0, now 0.694"):
    ckpt.check_logdir(str(tmp_path), checkpointing.saved_run(ant), resume=True)
  with pytest.raises(ValueError, match=r"different config \(seed: saved 0, now 1\)"):
    ckpt.check_logdir(str(tmp_path), checkpointing.saved_run(ControlConfig().replace(**TINY, seed=1)), resume=True)
  with pytest.raises(ValueError, match=r"obs_stats_before_update: not saved, so the default "
                                      r"False, now True"):
    ckpt.check_logdir(str(tmp_path), checkpointing.saved_run(ControlConfig().replace(**TINY, obs_stats_before_update=True)),
                         resume=True)


def test_make_networks_uses_the_policy_initialisation():
  env = envs.make(TINY["env"])
  for init_std, scale in ((1.0, 0.01), (mlp.BRAX_INIT_STD, 1.0)):
    config = ControlConfig().replace(**TINY, init_std=init_std, policy_init_scale=scale)
    networks, params = trainer.make_networks(config, env, jax.random.PRNGKey(0))
    assert networks.config.init_std == init_std and networks.config.policy_init_scale == scale
    model = nnx.merge(networks.graphdef, params)
    _, std = model.policy_params(jnp.zeros((1, networks.config.observation_size)))
    # Zero observations reach the output layer as its bias (0) plus activations of the
    # hidden layer's zero bias, i.e. raw = 0 exactly: std = init_std.
    np.testing.assert_allclose(std, init_std, rtol=1e-5)


def test_make_networks_initialises_as_nnx_does_op_by_op():
  """`make_networks` initialises the actor-critic in one compiled (unoptimised) program; the
  parameters are bitwise the ones NNX's initialisers give run eagerly, op by op. With
  ``key=None`` it returns the graph definition alone."""
  env = envs.make(TINY["env"])
  config = ControlConfig(env=TINY["env"], policy_init_scale=1.0)  # Brax's network sizes
  key = jax.random.PRNGKey(3)
  networks, params = trainer.make_networks(config, env, key)
  eager_graph, eager = nnx.split(mlp.ActorCritic(networks.config, rngs=nnx.Rngs(params=key)),
                                 nnx.Param)
  assert networks.graphdef == eager_graph
  chex.assert_trees_all_equal(params, eager)
  graph_only, none = trainer.make_networks(config, env, None)
  assert none is None and graph_only == networks


@pytest.mark.slow
def test_same_seed_gives_bitwise_equal_parameters():
  config = ControlConfig().replace(**TINY)
  a = trainer.train(config, None, progress=False)
  b = trainer.train(config, None, progress=False)
  for x, y in zip(_leaves(a.train_state.params), _leaves(b.train_state.params)):
    np.testing.assert_array_equal(x, y)
  assert [h["eval/episode_reward"] for h in a.history] == [h["eval/episode_reward"] for h in b.history]
  c = trainer.train(config.replace(seed=1), None, progress=False)
  assert any(not np.array_equal(x, y) for x, y in
             zip(_leaves(a.train_state.params), _leaves(c.train_state.params)))
  # The rollout's log-probs and the update's recomputation agree exactly, so the
  # first minibatch of every update has ratio exactly 1.
  assert all(h["ratio_first"] == 1.0 for h in a.history[1:])


@pytest.mark.slow
def test_logdir_outputs_and_load_policy(tmp_path):
  config = ControlConfig().replace(**TINY)
  logdir = str(tmp_path / "run")
  result = trainer.train(config, logdir, progress=False)
  for name in ("metrics.jsonl", "learning_curve.png", "checkpoints/config.json"):
    assert os.path.exists(os.path.join(logdir, name)), name
  from rljax.metrics import read_jsonl

  records = read_jsonl(os.path.join(logdir, "metrics.jsonl"))
  assert len(records) == config.num_evals
  for key in ("step", "env_steps", "sps", "eval/episode_reward", "pg_loss", "vf_loss",
              "timing/train_s"):
    assert key in records[-1], key
  assert records[-1]["env_steps"] == result.history[-1]["env_steps"] > 0
  walls = [r["timing/wall_s"] for r in records]  # every record, the step-0 evaluation included
  assert 0 < walls[0] and all(a < b for a, b in zip(walls, walls[1:])), walls
  # One compiled train chunk and one compiled evaluation serve the whole run.
  assert result.num_compiled == 2
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(logdir))

  policy = trainer.load_policy(logdir)
  obs = jax.random.normal(jax.random.PRNGKey(0), (5, 5))
  ts = result.train_state
  tr, _ = trainer.make_trainer(config)
  loc, _ = trainer.policy_apply(tr.networks, ts.params, running_stats.normalize(ts.obs_stats, obs))
  np.testing.assert_allclose(policy(obs), jnp.tanh(loc), rtol=1e-6, atol=1e-7)
  # A width-1 batch would broadcast against the [5] normaliser: refused, naming the shapes.
  for bad in (jnp.ones((5, 1)), jnp.ones((5, 6)), jnp.ones(())):
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 5\]"):
      policy(bad)
  # Sampling: the key is required (not a silent fall-back to the mean action), and the
  # action is tanh of a draw around loc.
  sampling = trainer.load_policy(logdir, deterministic=False)
  with pytest.raises(ValueError, match=r"the policy samples, so call it with a PRNG key"):
    sampling(obs)
  a1, a2 = (sampling(obs, jax.random.PRNGKey(k)) for k in (1, 2))
  np.testing.assert_array_equal(a1, sampling(obs, jax.random.PRNGKey(1)))
  assert not np.allclose(a1, a2) and not np.allclose(a1, jnp.tanh(loc))
  # An earlier kept step loads; one not kept is refused, naming the kept ones.
  from rljax import checkpoint as ckpt

  kept = sorted(int(d) for d in os.listdir(os.path.join(logdir, "checkpoints")) if d.isdigit())
  assert kept == [1, 2]
  assert not np.allclose(trainer.load_policy(logdir, step=1)(obs), policy(obs))
  with pytest.raises(FileNotFoundError, match=r"No checkpoint of step 7 under .*; it holds "
                                              r"steps 1, 2 \(runs keep the newest"):
    trainer.load_policy(logdir, step=7)
  with pytest.raises(FileNotFoundError, match=r"No checkpoint of step 0 .* holds steps 1, 2"):
    ckpt.read_items(logdir, step=0)
  # The config beside the checkpoints gets a plain file's mode (not mkstemp's 0600).

  mode = os.stat(os.path.join(logdir, "checkpoints/config.json")).st_mode & 0o777
  assert mode == 0o666 & ~ckpt.current_umask()


@pytest.mark.slow
def test_script_runs_and_fills_compilation_cache(tmp_path):
  flags = [f"--{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
           for k, v in TINY.items()]
  cache = tmp_path / "cache"
  out = subprocess.run(
      [sys.executable, SCRIPT, f"--logdir={tmp_path}/run", f"--compilation_cache_dir={cache}",
       "--noprogress", *flags],
      capture_output=True, text=True, timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "final eval episode reward" in out.stdout
  assert os.listdir(cache), "the persistent compilation cache stayed empty"
  assert os.path.exists(tmp_path / "run" / "learning_curve.png")


@pytest.mark.slow
def test_cartpole_balance_learns():
  """A short CartpoleBalance run must clearly beat the untrained policy.

  An untrained (near-zero-action) policy scores about 200-370 on this task (the
  first evaluation below); 500 needs the pole held up and the cart centred for
  most of the 1000-step episode, which random or passive policies never do.
  """
  # The default's length (4M steps), in two chunks. The policy learns to balance in a jump
  # after 2.3-3.2M steps, so a shorter run is not a test of learning: at 2M steps an AMD EPYC
  # Zen 1 read 366 -> 300 -> 906, but a Zen 4 (AVX-512, other float rounding) 366 -> 280 -> 279.
  config = default_config("playground/CartpoleBalance").replace(num_evals=3)
  result = trainer.train(config, None, progress=False)
  first, last = result.history[0]["eval/episode_reward"], result.history[-1]["eval/episode_reward"]
  assert first < 400
  assert last >= 500, [h["eval/episode_reward"] for h in result.history]


@pytest.mark.slow
def test_bootstrap_values_skip_the_second_value_pass_only_when_exact():
  """``V(s'_t)``: the cheap branch (``values[:, t+1]``) equals the full pass on ``final_obs``.

  CartpoleBalance never terminates and episodes here last 50 steps, so in an 8-step unroll
  from reset ``final_obs[:, t] == obs[:, t + 1]``: both branches must agree. A truncation
  before the last step must switch to the full pass, whose value at that step is
  ``V(final_obs)``, not the value of the reset state that follows it.
  """
  t, params = trainer.make_trainer(ControlConfig().replace(**TINY))
  ts, env_state = t.init(params)
  ts = ts._replace(obs_stats=running_stats.update(ts.obs_stats, env_state.obs))
  _, data = jax.jit(t.rollout.unroll)(ts.params, ts.obs_stats, env_state, jax.random.PRNGKey(3))
  data = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), data)  # [B, T, ...]
  np.testing.assert_array_equal(data["final_obs"][:, :-1], data["obs"][:, 1:])
  obs_n = running_stats.normalize(ts.obs_stats, data["obs"])
  values = trainer.value_apply(t.networks, ts.params, obs_n)
  full = trainer.value_apply(
      t.networks, ts.params, running_stats.normalize(ts.obs_stats, data["final_obs"]))
  boot = jax.jit(functools.partial(learner.bootstrap_values, t.networks))(ts.params, ts.obs_stats, data["final_obs"],
                                      data["truncation"], values)
  np.testing.assert_allclose(boot, full, rtol=1e-6, atol=1e-6)
  # A truncation at step 2 whose pre-reset observation differs from the next obs.
  moved = data["final_obs"].at[:, 2].add(1.0)
  boot = jax.jit(functools.partial(learner.bootstrap_values, t.networks))(ts.params, ts.obs_stats, moved,
                                      data["truncation"].at[:, 2].set(True), values)
  expected = trainer.value_apply(
      t.networks, ts.params, running_stats.normalize(ts.obs_stats, moved))
  np.testing.assert_allclose(boot, expected, rtol=1e-6, atol=1e-6)
  assert not np.allclose(boot[:, 2], values[:, 3])


@pytest.mark.slow
@pytest.mark.parametrize("before", [True, False])
def test_observation_statistics_update_before_or_after_the_ppo_update(before, monkeypatch):
  """``obs_stats_before_update=True`` (Brax's order) folds the rollout into the
  normaliser before the update: in the first iteration, from empty statistics, the update's
  batch holds the rollout's observations standardised by their own mean and population std
  (numpy, float64), clipped to +-5. ``False`` normalises the batch with the statistics from
  before the rollout (empty: the identity, clipped). Either way the iteration ends with the
  rollout's statistics, and the two orders train different parameters. The first
  minibatch's ratios are exactly 1 only in the default order (the rollout's log-probabilities
  were taken under the old statistics)."""
  t, params = trainer.make_trainer(ControlConfig().replace(**TINY, obs_stats_before_update=before))
  ts, env_state = t.init(params)
  update = learner.ppo.ppo_update

  def recording_update(state, batch, key, **kw):
    new_state, metrics = update(state, batch, key, **kw)
    return new_state, dict(metrics, seen_obs=batch["obs"])

  monkeypatch.setattr(learner.ppo, "ppo_update", recording_update)
  (new_ts, _), m = jax.jit(t.iteration)((ts, env_state), None)
  _, key_roll, _ = jax.random.split(ts.key, 3)
  _, data = jax.jit(t.rollout.collect)(ts.params, ts.obs_stats, env_state, key_roll)
  obs = np.asarray(data["obs"], np.float64)  # [N, T, obs]
  flat = obs.reshape(-1, obs.shape[-1])
  mean, std = flat.mean(0), flat.std(0)
  assert np.all(std > 1e-4)  # every feature moves, so the standardisation is a real check
  expected = np.clip((obs - mean) / std, -5, 5) if before else np.clip(obs, -5, 5)
  # float32 statistics: the pole's cosine (about -1, std 2e-4 here) standardises to ~1e-3.
  np.testing.assert_allclose(m["seen_obs"], expected, rtol=1e-3, atol=2e-3)
  assert not np.allclose(expected, np.clip(obs, -5, 5) if before else np.clip((obs - mean) / std, -5, 5),
                         atol=1e-2)
  assert int(new_ts.skipped_updates) == 0
  assert (float(m["ratio_first"]) == 1.0) == (not before), float(m["ratio_first"])
  np.testing.assert_allclose(new_ts.obs_stats.count, flat.shape[0])
  np.testing.assert_allclose(new_ts.obs_stats.mean, mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new_ts.obs_stats.m2, flat.var(0) * flat.shape[0], rtol=1e-4, atol=1e-5)
  # The other order, from the same state, trains other parameters.
  other, _ = trainer.make_trainer(ControlConfig().replace(**TINY, obs_stats_before_update=not before))
  (other_ts, _), _ = jax.jit(other.iteration)((ts, env_state), None)
  gaps = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), new_ts.params, other_ts.params)
  assert max(jax.tree.leaves(gaps)) > 1e-4
  chex.assert_trees_all_close(other_ts.obs_stats, new_ts.obs_stats, rtol=1e-6, atol=1e-6)


def _compiles_of(caplog, names: str, run):
  """Runs ``run()`` with JAX's compile log on; returns its result and the sorted names of the
  jitted functions matching the regex ``names`` that XLA compiled meanwhile."""
  import logging
  import re

  caplog.clear()
  jax.config.update("jax_log_compiles", True)
  try:
    with caplog.at_level(logging.WARNING, logger="jax"):
      result = run()
  finally:
    jax.config.update("jax_log_compiles", False)
  return result, sorted(m.group(1) for r in caplog.records
                        if (m := re.match(rf"Compiling jit\(({names})\)", r.getMessage())))


def _assert_same_ppo_run(a, b, *, iterations: int, grad_norm_lower_bound: bool = False):
  """Two `trainer.train` results of one config and seed, whose chunks ran as different
  programs, are the same PPO run up to float rounding: parameters, optimizer state and
  normaliser close, key and counters equal, every logged metric but the timings close, and
  the eval reward moved. With ``grad_norm_lower_bound`` b's ``grad_norm`` is instead within
  [0.9, 1] of a's (`OverlappedChunk` logs the root-sum-square of its two networks' norms)."""
  assert int(b.train_state.iteration) == int(a.train_state.iteration) == iterations
  chex.assert_trees_all_close(b.train_state.params, a.train_state.params, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(b.train_state.opt_state, a.train_state.opt_state, atol=1e-5, rtol=1e-4)
  chex.assert_trees_all_close(b.train_state.obs_stats, a.train_state.obs_stats, atol=1e-4, rtol=1e-4)
  chex.assert_trees_all_equal(b.train_state.key, a.train_state.key)
  assert int(b.train_state.skipped_updates) == int(a.train_state.skipped_updates) == 0
  for ra, rb in zip(a.history, b.history, strict=True):
    assert set(ra) == set(rb)
    for k in ra:
      if k.startswith("timing/") or k == "sps":
        continue
      if k == "grad_norm" and grad_norm_lower_bound:
        assert 0.9 * ra[k] <= rb[k] <= ra[k] * (1 + 1e-5), (ra["step"], ra[k], rb[k])
      else:
        np.testing.assert_allclose(rb[k], ra[k], rtol=1e-3, atol=1e-5, err_msg=k)
  assert a.history[-1]["eval/episode_reward"] != a.history[0]["eval/episode_reward"]


def test_train_chunk_compiles_once_from_abstract_shapes(caplog):
  """The train chunk and the evaluation are compiled ahead of time from
  ``Trainer.abstract_state`` (while the environments reset): the run's calls reuse those
  executables, so XLA compiles each once."""
  _, compiled = _compiles_of(caplog, "chunk|run",
                             lambda: trainer.train(ControlConfig().replace(**TINY), None, progress=False))
  assert compiled == ["chunk", "run"], compiled
  tr, params = trainer.make_trainer(ControlConfig().replace(**TINY))
  abstract, tree_a = jax.tree.flatten(tr.abstract_state(params))
  concrete, tree_c = jax.tree.flatten(tr.init(params))
  assert tree_a == tree_c
  assert [(x.shape, x.dtype) for x in abstract] == [(x.shape, x.dtype) for x in concrete]


@pytest.mark.slow
@pytest.mark.parametrize("env", ["playground/CheetahRun", "brax/ant"])
def test_chunk_state_types_are_a_fixed_point(env):
  """The train chunk's outputs have the avals (weak types included) of its inputs, so the
  executable compiled from `Trainer.abstract_state` serves every call. CheetahRun's reset
  state and ant's stepped state hold weakly typed leaves; before `_strong_types` the
  second chunk compiled again (18-30 s)."""
  config = ControlConfig().replace(**dict(TINY, env=env, episode_length=1000))
  tr, params = trainer.make_trainer(config)
  state = tr.abstract_state(params)
  out = jax.eval_shape(tr.train_chunk, *state)[:2]
  avals = lambda t: [(x.shape, x.dtype, x.weak_type) for x in jax.tree.leaves(t)]
  assert avals(out) == avals(state)
  assert not any(w for _, _, w in avals(state))


@pytest.mark.slow
def test_overlapped_evaluation_equals_sequential(tmp_path):
  """Evaluating chunk k on a second thread while chunk k + 1 trains changes no value: every
  record's evaluation and training metrics, the checkpoints and the final state equal a
  run that evaluates between chunks. In both, the first record is the initial state's."""
  config = ControlConfig().replace(**TINY)
  runs = {}
  for overlap in (True, False):
    logdir = str(tmp_path / f"overlap_{overlap}")
    runs[overlap] = (trainer.train(config, logdir, progress=False, overlap_eval=overlap), logdir)
  (a, dir_a), (b, dir_b) = runs[True], runs[False]
  assert [h["step"] for h in a.history] == [0, 1, 2]
  for ra, rb in zip(a.history, b.history, strict=True):
    assert set(ra) == set(rb)
    for k in ra:
      if not k.startswith("timing/") and k != "sps":
        assert ra[k] == rb[k], (ra["step"], k)
  chex.assert_trees_all_equal(a.train_state, b.train_state)
  for step in (1, 2):
    pa = trainer.load_params(dir_a, step=step)
    pb = trainer.load_params(dir_b, step=step)
    chex.assert_trees_all_equal(pa[1:], pb[1:])
  with open(os.path.join(dir_a, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [0, 1, 2]
  # Either way the record before training is the evaluation of the initial state (with
  # overlap it runs on a copy while chunk 1 trains, as the chunk donates its inputs).
  tr, params = trainer.make_trainer(config)
  ts, _ = tr.init(params)
  eval_key = jax.random.fold_in(jax.random.PRNGKey(config.seed + 10_000), 0)
  first = jax.device_get(tr.evaluate(ts.params, ts.obs_stats, eval_key))
  for run in (a, b):
    assert run.history[0]["eval/episode_reward"] == float(first["eval/episode_reward"])
    assert run.history[0]["eval/episode_reward"] != run.history[1]["eval/episode_reward"]


@pytest.mark.slow
@pytest.mark.parametrize("one_device_mesh", [False, True])
def test_overlapped_value_update_equals_one_program_chunk(one_device_mesh, caplog):
  """`OverlappedChunk` (the value update on a second thread beside the next rollout) trains
  the one-program chunk's PPO: over two chunks of 4 iterations the parameters, optimizer
  state, normaliser, key and counters agree to float rounding, and so do the metrics
  (``grad_norm`` is the root-sum-square of the two networks' mean norms, a lower bound of
  the joint one). XLA compiles each of its four programs and the evaluation once, ahead of
  time (the calls reuse those executables: weak types and placements match)."""

  config = ControlConfig().replace(**dict(TINY, batch_size=32, num_timesteps=2 * 4 * 32 * 8, lr_schedule="linear"))
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",)) if one_device_mesh else None
  a = trainer.train(config, None, progress=False, mesh=mesh)
  b, compiled = _compiles_of(caplog, r"_ov_\w+|run", lambda: trainer.train(
      config.replace(overlap_value_update=True), None, progress=False, mesh=mesh))
  assert compiled == ["_ov_finish", "_ov_policy_step", "_ov_rollout", "_ov_value_step", "run"]
  assert b.num_compiled == 5
  _assert_same_ppo_run(a, b, iterations=8, grad_norm_lower_bound=True)
  # With a mesh of several devices the chunk stays one program (the envs are split instead).
  tr, _ = trainer.make_trainer(config.replace(overlap_value_update=True))
  assert tr.overlaps_value_update and isinstance(tr.train_chunk, trainer.OverlappedChunk)
  two_devices = types.SimpleNamespace(devices=np.empty((2,), object))
  assert not dataclasses.replace(tr, mesh=two_devices).overlaps_value_update


@pytest.mark.slow
@pytest.mark.parametrize("one_device_mesh", [False, True])
def test_env_threads_train_the_one_program_chunk(one_device_mesh, caplog):
  """`ThreadedChunk` (each iteration's rollout as one program per group of the environments,
  each called from its own thread, then one update program) trains the one-program chunk's
  PPO. Its rollout programs give the one-program rollout's data bit for bit on CartpoleBalance
  (whose physics gives the same bits at any batch size): each group draws its rows of the
  all-environment action noise, and with two unrolls an iteration (batch_size = 2 x num_envs)
  the groups' segments are ordered as in the one-program batch. Over two chunks of 4
  iterations the parameters, optimizer state, normaliser and metrics then agree to float
  rounding (the update's reductions are compiled in another program), the key and counters
  exactly, and a second threaded run is the first bit for bit. XLA compiles each of its four
  programs and the evaluation once, ahead of time."""

  config = ControlConfig().replace(**dict(TINY, batch_size=32, num_timesteps=2 * 4 * 32 * 8, lr_schedule="linear"))
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",)) if one_device_mesh else None
  tr, params = trainer.make_trainer(config.replace(env_threads=2), mesh=mesh)
  assert tr.env_threads == 2 and isinstance(tr.train_chunk, trainer.ThreadedChunk)
  chunk = tr.train_chunk
  ts, env_state = tr.init(params)
  _, key_roll, _ = jax.random.split(ts.key, 3)
  whole = jax.jit(tr.rollout.unrolls, compiler_options=runtime.control_compiler_options())(
      ts.params, ts.obs_stats, env_state, key_roll)
  groups = [chunk._rollout(ts.params, ts.obs_stats, g, ts.key, np.int32(i))
            for i, g in enumerate(chunk._split(env_state))]
  chex.assert_trees_all_equal(
      jax.tree.map(lambda *xs: jnp.concatenate(xs), *[g for g, _ in groups]), whole[0])
  chex.assert_trees_all_equal(
      jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=2), *[d for _, d in groups]), whole[1])

  a = trainer.train(config.replace(env_threads=1), None, progress=False, mesh=mesh)
  b, compiled = _compiles_of(caplog, r"_split_groups|_group_rollout|_learn_groups|_join|run",
                             lambda: trainer.train(config.replace(env_threads=2), None,
                                                   progress=False, mesh=mesh))
  assert compiled == ["_group_rollout", "_join", "_learn_groups", "_split_groups", "run"]
  assert b.num_compiled == 5 and a.num_compiled == 2
  _assert_same_ppo_run(a, b, iterations=8)
  # The threads change no result: the same seed gives the same run bit for bit.
  again = trainer.train(config.replace(env_threads=2), None, progress=False, mesh=mesh)
  chex.assert_trees_all_equal(again.train_state, b.train_state)


def test_env_threads_chosen_for_the_machine(monkeypatch):
  """``env_threads=0`` resolves to the most threads up to the usable cores that divide
  ``num_envs`` with at least 32 environments each, on CPU with one device and one process;
  else 1. A set value stands, but more than one thread on several devices is refused."""
  from rljax.control.config import resolve_env_threads

  c = ControlConfig(num_envs=256)
  assert [resolve_env_threads(c, cores=n) for n in (1, 2, 3, 12, 64)] == [1, 2, 2, 8, 8]
  assert resolve_env_threads(c.replace(num_envs=100, num_minibatches=4), cores=8) == 2  # 50 each
  assert resolve_env_threads(c.replace(num_envs=48), cores=2) == 1  # 24 each: too few
  assert resolve_env_threads(c.replace(env_threads=4), cores=1) == 4  # as set
  assert resolve_env_threads(c.replace(overlap_value_update=True), cores=2) == 1
  two_devices = types.SimpleNamespace(devices=np.empty((2,), object))
  assert resolve_env_threads(c, two_devices, cores=2) == 1
  assert resolve_env_threads(c.replace(env_threads=1), two_devices) == 1
  with pytest.raises(ConfigError, match=r"^env_threads=2 needs one device in one process; this "
                     r"run has a mesh of 2 devices, which step their own environments side by "
                     r"side \(use env_threads=0 or 1\)\.$") as info:
    resolve_env_threads(c.replace(env_threads=2), two_devices)
  assert info.value.fields == ("env_threads",)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert resolve_env_threads(c, cores=2) == 1


@pytest.mark.slow
def test_microbatches_train_the_same_policy():
  """``num_microbatches=4`` (each minibatch of 16 segments x 8 steps as 4 parts) trains the
  one-part run's PPO, in the one-program chunk and with the value update overlapped: after 4
  iterations the parameters and the last losses agree to float rounding."""
  config = ControlConfig().replace(**dict(TINY, batch_size=32, num_timesteps=4 * 32 * 8, num_evals=2))
  runs = {(g, overlap): trainer.train(
      config.replace(num_microbatches=g, overlap_value_update=overlap), None, progress=False)
          for g, overlap in ((1, False), (4, False), (4, True))}
  a = runs[1, False]
  assert int(a.train_state.iteration) == 4
  for key in ((4, False), (4, True)):
    b = runs[key]
    assert int(b.train_state.iteration) == 4
    chex.assert_trees_all_close(b.train_state.params, a.train_state.params, atol=1e-5, rtol=1e-5)
    for k in ("pg_loss", "vf_loss", "entropy", "approx_kl"):
      np.testing.assert_allclose(b.history[-1][k], a.history[-1][k], rtol=1e-3, atol=1e-5,
                                 err_msg=f"{key} {k}")
  moved = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a.train_state.params,
                       trainer.make_trainer(config)[1])
  assert max(jax.tree.leaves(moved)) > 1e-3  # it trained


@pytest.mark.slow
def test_gae_per_minibatch_in_one_minibatch_equals_gae_before_the_update():
  """``gae_per_minibatch`` computes GAE in each minibatch's loss with the value network as
  that SGD step finds it. With one epoch of one minibatch that is the network the rollout
  left, so a chunk of 8 iterations (episodes of 50 steps truncate inside the 7th 8-step
  segment, so both bootstrap branches run) trains the default chunk's parameters to float
  rounding, without the value pass over the batch. With two epochs the second uses the
  updated value network, and the parameters differ."""
  base = dict(TINY, num_minibatches=1, num_epochs=1, num_timesteps=8 * 16 * 8, num_evals=2)
  out = {}
  for gae in (False, True):
    t, params = trainer.make_trainer(ControlConfig().replace(**base, gae_per_minibatch=gae))
    assert t.iterations_per_chunk == 8
    start = jax.tree.map(np.asarray, params)
    out[gae] = t.train_chunk(*t.init(params))  # donates its input
  (a, _, ma), (b, _, mb) = out[False], out[True]
  chex.assert_trees_all_close(b.params, a.params, atol=1e-5, rtol=1e-5)
  for k in ("pg_loss", "vf_loss", "entropy", "approx_kl"):
    np.testing.assert_allclose(mb[k], ma[k], rtol=1e-4, atol=1e-6, err_msg=k)
  assert float(mb["ratio_first"]) == 1.0
  moved = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a.params, start)
  assert max(jax.tree.leaves(moved)) > 1e-3  # it trained
  # Two epochs at a high learning rate: the second epoch's advantages come from the value
  # network the first one trained, and one iteration already trains other parameters.
  two = dict(base, num_epochs=2, learning_rate=3e-2)
  new = {}
  for gae in (False, True):
    t, params = trainer.make_trainer(ControlConfig().replace(**two, gae_per_minibatch=gae))
    (new[gae], _), _ = jax.jit(t.iteration)(t.init(params), None)
  gaps = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), new[True].params,
                      new[False].params)
  assert max(jax.tree.leaves(gaps)) > 1e-3
  # The update's batch holds no values then: the chunk makes no value pass of its own.
  ts, env_state = t.init(params)
  _, data = jax.jit(t.rollout.collect)(ts.params, ts.obs_stats, env_state, jax.random.PRNGKey(0))
  batch, _, _ = learner.make_batch(t.config, t.networks, ts.params, ts.obs_stats, data)
  assert not {"values", "advantages", "returns"} & set(batch)


def test_physics_compiles_without_ynn_fusions():
  """On CPU the train chunk and the evaluation are compiled with
  `runtime.control_compiler_options`: no dot goes to a YNNPACK fusion (31% faster chunks on
  CheetahRun, 15% on ant), while a plain jit of the same XLA still makes them."""
  from rljax import runtime

  assert runtime.control_compiler_options("gpu") == {}
  x = jnp.ones((64, 64))
  if "__ynn_fusion" not in jax.jit(lambda a: a @ a).lower(x).compile().as_text():
    # The pinned jaxlib (0.10) makes these fusions; another XLA may not, and then there is
    # nothing for the option to turn off and nothing here to check.
    pytest.skip("this XLA sends no dot to a YNNPACK fusion by default")
  assert runtime.control_compiler_options() == {"xla_cpu_experimental_ynn_fusion_type": ""}
  tr, params = trainer.make_trainer(ControlConfig().replace(**TINY))
  ts, env_state = tr.abstract_state(params)
  chunk_hlo = tr.train_chunk.lower(ts, env_state).compile().as_text()
  eval_hlo = tr.evaluate.lower(ts.params, ts.obs_stats, jax.random.PRNGKey(0)).compile().as_text()
  assert " dot(" in chunk_hlo
  assert "__ynn_fusion" not in chunk_hlo and "__ynn_fusion" not in eval_hlo


class _DiesAtLife(brax_envs.Env):
  """A terminating toy environment: an episode ends (terminates) after ``life`` steps,
  ``life = 3 + (reset key's first word mod 5)`` (3 to 7); reward ``1 + action[0]`` a step."""

  def reset(self, rng):
    life = 3.0 + (rng[0] % 5).astype(jnp.float32)
    zero = jnp.zeros(())
    return brax_envs.State(pipeline_state=jnp.zeros(1), obs=jnp.stack([zero, life]),
                           reward=zero, done=zero, metrics={}, info={})

  def step(self, state, action):
    t = state.obs[0] + 1.0
    life = state.obs[1]
    return state.replace(obs=jnp.stack([t, life]), reward=1.0 + action[0],
                         done=(t >= life).astype(jnp.float32))

  @property
  def observation_size(self):
    return 2

  @property
  def action_size(self):
    return 1

  @property
  def backend(self):
    return "toy"


@pytest.mark.parametrize("num_steps", [20, 5])
def test_evaluation_stops_when_every_episode_has_ended_with_the_same_metrics(num_steps):
  """`run_eval_episodes` steps the environment only until every first episode has ended
  (the policy is called that many times), and its metrics are bitwise a full ``num_steps``
  scan's (Brax's evaluator's loop): EvalWrapper freezes each episode's return at its first
  ``done``. Gold values by hand from the toy's lives; with ``num_steps=5`` the longer episodes
  are truncated at 5."""
  from brax.envs.wrappers import training as brax_training

  eval_env = brax_training.EvalWrapper(envs.wrap_for_training(_DiesAtLife(), episode_length=num_steps))
  reset_keys = jax.random.split(jax.random.PRNGKey(3), 6)
  lives = np.array([3 + int(k[0]) % 5 for k in np.asarray(reset_keys)])
  assert len(set(lives)) > 1 and lives.max() < 20  # episodes of several lengths, all < 20
  step_keys = jax.random.split(jax.random.PRNGKey(4), num_steps)
  calls = []

  def act(obs, k):  # actions in [-0.5, 0.5] from the step's key; counts the steps taken
    jax.debug.callback(lambda: calls.append(1))
    return 0.5 * jax.random.uniform(k, (obs.shape[0], 1), minval=-1.0, maxval=1.0)

  metrics = jax.jit(lambda: trainer.run_eval_episodes(eval_env, reset_keys, act, step_keys))()
  metrics = jax.device_get(metrics)
  lengths = np.minimum(lives, num_steps)
  assert len(calls) == lengths.max()  # 7 (the longest life) or 5 (truncated), not num_steps
  np.testing.assert_allclose(metrics["eval/episode_length"], lengths.mean())

  def full_scan():  # the fixed-length loop
    def step(state, k):
      return eval_env.step(state, act(state.obs, k)), ()
    state, _ = jax.lax.scan(step, eval_env.reset(reset_keys), step_keys)
    return trainer.episode_metrics(state.info["eval_metrics"])

  reference = jax.device_get(jax.jit(full_scan)())
  assert metrics == reference
  # Rewards 1 + a with |a| <= 0.5: each return lies within half its length of the length.
  assert abs(metrics["eval/episode_reward"] - lengths.mean()) <= 0.5 * lengths.mean()
