"""The RLHF PPO step on 8 fake CPU devices (colocated and disaggregated placements) equals the
1-device step. XLA_FLAGS must be set before jax is imported, so the cases run in a subprocess
(tests/_rlhf_8dev_cases.py)."""

import json
import os
import subprocess
import sys

import pytest

CASES = os.path.join(os.path.dirname(__file__), "_rlhf_8dev_cases.py")




@pytest.fixture(scope="module")
def result():  # the 8-device cases (slow: several compilations of a tiny model)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, CASES], capture_output=True, text=True, env=env,
                       timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
  line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
  return json.loads(line[len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["colocated", "disaggregated"])
def test_sharded_step_equals_one_device(result, kind):
  r = result[kind]
  assert r["param_diff"] < 1e-5, r["param_diff"]        # actor and critic after one step
  bad = {k: v for k, v in r["metric_diff"].items() if not v < 1e-5}
  assert not bad, bad
  assert r["reshard_s"] > 0


@pytest.mark.slow
def test_parameter_shardings_follow_the_fsdp_rules(result):
  # fsdp: every weight's embed dimension over the fsdp axis (q_kernel [E, H, D], embed [V, E]),
  # Adam's moments like their parameters.
  c = result["colocated"]
  assert c["specs"]["q"] == ["fsdp"] and c["specs"]["embed"] == [None, "fsdp"]
  assert c["specs"]["mu_embed"] == [None, "fsdp"]
  assert c["train_devices"] == 8 and c["gen_devices"] == 8
  assert c["specs"]["gen_q"] == []                       # tp on a 2,4,1 mesh: replicated
  d = result["disaggregated"]
  assert d["train_devices"] == 6 and d["gen_devices"] == 2
  assert d["specs"]["q"] == ["fsdp"]
  assert d["specs"]["gen_q"] == [None, "tensor"]         # heads over the 2 generation devices


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["colocated", "disaggregated"])
def test_second_step_does_not_recompile(result, kind):
  r = result[kind]
  assert r["compiles_after_2"] == r["compiles_after_1"], r


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["colocated", "disaggregated"])
def test_generator_log_probs_equal_trainer_log_probs(result, kind):
  r = result[kind]
  assert r["gen_vs_train_logp"] < 1e-5
  assert r["drift"] < 1e-5 and r["drift2"] < 1e-5        # sampler (KV cache) vs trainer forward
  # The decode in 2 segments (a cache grown between loops) on the generation layout gives the
  # one-loop decode's tokens and log-probs.
  assert r["segmented"][0] == 0 and r["segmented"][1] < 1e-5, r["segmented"]


@pytest.mark.slow
def test_indivisible_batch_named_before_compiling(result):
  assert "prompts_per_step * group_size 12 is not divisible" in result["batch_error"]
  assert "data=2 x fsdp=4 = 8" in result["batch_error"]


@pytest.mark.slow
def test_sft_in_the_fsdp_layout_equals_one_device(result):
  r = result["sft"]
  assert r["param_diff"] < 1e-5 and r["loss_diff"] < 1e-5, r
  assert r["embed_spec"] == [None, "fsdp"]


@pytest.mark.slow
def test_reward_model_in_the_fsdp_layout_equals_one_device(result):
  r = result["rm"]   # chosen rows and rejected rows both split over the 8 data shards
  assert r["param_diff"] < 1e-5 and r["loss_diff"] < 1e-5, r
  assert max(r["bias"]) <= 2 * r["lr"]     # zero exact gradient: Adam-scaled noise, 2 steps


SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments")


@pytest.mark.parametrize("script, flags, devices, message", [
    ("train_rlhf.py", ["--mesh=2,2,2"], 1,
     "mesh data=2 x fsdp=2 x tensor=2 = 8 devices, but 1 device is available"),
    ("train_rlhf.py", ["--mesh=1,8,1", "--prompts_per_step=12"], 8,
     "prompts_per_step * group_size 12 is not divisible by the data axes data=1 x fsdp=8 = 8"),
    ("train_rlhf.py", ["--placement=disaggregated", "--mesh=2,4,1"], 8,
     "training mesh data=2 x fsdp=4 x tensor=1 = 8 devices leaves none of the 8 devices"),
    ("train_sft.py", ["--sharding_rules=zero"], 1, "unknown sharding rules preset 'zero'"),
])
def test_script_flags_fail_before_compiling(tmp_path, script, flags, devices, message):
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  env.pop("SLURM_JOB_ID", None)
  out = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *flags,
                        f"--logdir={tmp_path}"], capture_output=True, text=True, env=env,
                       timeout=300)
  assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
  assert message in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_async_disaggregated_matches_sync_with_frozen_weights(result):
  # The generator thread samples on its own 2 devices while the update runs on the other 6:
  # with weights that never change the tokens and metrics are the synchronous run's; with
  # learning every step after the first trains a batch one update old.
  r = result["async_disaggregated"]
  assert r["tokens_equal"]
  bad = {k: v for k, v in r["metric_diff"].items() if not v < 1e-5}
  assert not bad, bad
  assert r["lags"] == [0.0, 1.0, 1.0]


@pytest.mark.slow
def test_disaggregated_generation_mesh_must_divide_the_devices(result):
  assert result["generation_mesh_error"] == (
      "--placement=disaggregated: the training mesh of 3 devices leaves 5 of the 8 devices to "
      "generate; the generation mesh must divide the 8 devices (leave 1, 2, 4)")


@pytest.mark.slow
def test_with_a_generator_process_every_device_here_trains(result):
  # Generation runs on the other process (rljax.alignment.remote_generation): the trainer's
  # default mesh takes all of its devices on fsdp.
  assert result["remote_placement"] == dict(
      train_mesh={"data": 1, "fsdp": 8, "tensor": 1}, remote="remote")
