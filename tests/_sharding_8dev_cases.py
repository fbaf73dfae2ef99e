"""8-fake-device sharding tests. Run ONLY in a subprocess by tests/test_sharding.py:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/_sharding_8dev_cases.py

(the rest of the suite runs on 1 device; the flag must be set before jax is imported).
"""

import os

if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
  import pytest
  pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 set before jax is imported",
              allow_module_level=True)

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rljax.models.llm import DecoderLM, LMConfig
from rljax.sharding import collectives, mesh as mesh_lib, rules

TINY_LM = LMConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2)


def test_eight_devices():
  assert jax.device_count() == 8


def test_make_mesh_auto_axes_and_errors():
  m = mesh_lib.make_mesh(mesh_lib.parse_mesh_flag("2,2,2"))
  assert dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
  assert dict(mesh_lib.make_mesh().shape) == {"data": 8, "fsdp": 1, "tensor": 1}
  with pytest.raises(mesh_lib.MeshError, match=r"data=2 x fsdp=2 x tensor=1 = 4 devices, but 8"):
    mesh_lib.make_mesh(mesh_lib.parse_mesh_flag("2,2,1"))
  with pytest.raises(mesh_lib.MeshError, match=r"batch size 12 is not divisible .* data=2 x fsdp=4 = 8"):
    mesh_lib.check_batch_divisible(12, mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=4)))
  sub = mesh_lib.make_mesh(mesh_lib.MeshConfig(fsdp=2), devices=jax.devices()[2:6])
  assert dict(sub.shape) == {"data": 2, "fsdp": 2, "tensor": 1}
  assert set(sub.devices.flat) == set(jax.devices()[2:6])


def _lm_state():
  model = DecoderLM(TINY_LM, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, params, rest


@pytest.mark.parametrize("preset, mesh_flag, expected", [
    # q_kernel [E=32, H=4, D=8]: embed -> fsdp, heads -> tensor
    ("fsdp", "2,4,1", {"q": P("fsdp"), "gate_up": P("fsdp"), "embed": P(None, "fsdp"), "down": P(None, "fsdp")}),
    ("fsdp_tp", "2,2,2", {"q": P("fsdp", "tensor"), "gate_up": P("fsdp", None, "tensor"),
                          "embed": P("tensor", "fsdp"), "down": P("tensor", "fsdp")}),
    ("dp", "8,1,1", {"q": P(), "gate_up": P(), "embed": P(), "down": P()}),
    ("tp", "1,1,8", {"q": P(None, None), "gate_up": P(None, None, "tensor"), "embed": P("tensor"),
                     "down": P("tensor")}),
])
def test_param_shardings_follow_rules(preset, mesh_flag, expected):
  _, params, _ = _lm_state()
  m = mesh_lib.make_mesh(mesh_lib.parse_mesh_flag(mesh_flag))
  sharded = rules.shard(params, m, preset)
  layer = sharded["layers"][0]
  got = {"q": layer["attn"]["q_kernel"][...].sharding.spec,
         "gate_up": layer["mlp"]["gate_up_kernel"][...].sharding.spec,
         "embed": sharded["embed"][...].sharding.spec,
         "down": layer["mlp"]["down_kernel"][...].sharding.spec}
  # tp: heads=4 is not divisible by tensor=8 -> replicated along it (spec_for drops the axis).
  norm = lambda s: P(*[x for x in s]) if any(x is not None for x in s) else P()
  assert {k: norm(v) for k, v in got.items()} == {k: norm(v) for k, v in expected.items()}
  # values unchanged
  np.testing.assert_array_equal(np.asarray(sharded["embed"][...]), np.asarray(params["embed"][...]))


def test_optimizer_state_sharded_like_params():
  _, params, _ = _lm_state()
  m = mesh_lib.make_mesh(mesh_lib.parse_mesh_flag("1,4,2"))
  params = rules.shard(params, m, "fsdp_tp")
  opt = rules.shard(optax.adam(1e-3).init(params), m, "fsdp_tp")
  mu = opt[0].mu
  assert mu["layers"][1]["attn"]["o_kernel"][...].sharding.spec == \
      params["layers"][1]["attn"]["o_kernel"][...].sharding.spec == P("tensor", None, "fsdp")
  assert opt[0].count.sharding.spec == P()
  # per-device bytes: o_kernel [H=4, D=8, E=32] f32 = 4096 B over 8 devices -> 512 B each
  shard = mu["layers"][1]["attn"]["o_kernel"][...].addressable_shards[0].data
  assert shard.nbytes == 4 * 8 * 32 * 4 // 8


def test_sharded_lm_loss_and_grads_equal_one_device_and_no_recompile():
  graphdef, params, rest = _lm_state()
  tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, TINY_LM.vocab_size)

  def loss_fn(p, tok):
    logits = nnx.merge(graphdef, p, rest)(tok)
    lp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(lp, tok[:, 1:, None], -1))

  step = jax.jit(jax.value_and_grad(loss_fn))
  ref_loss, ref_grads = step(params, tokens)
  m = mesh_lib.make_mesh(mesh_lib.parse_mesh_flag("2,2,2"))
  sp = rules.shard(params, m, "fsdp_tp")
  st = jax.device_put(tokens, rules.activation_sharding(("batch", "length"), tokens.shape, m, "fsdp_tp"))
  with rules.use_rules(m, "fsdp_tp"):
    loss, grads = step(sp, st)
    n_compiles = step._cache_size()
    loss2, _ = step(sp, st)
    assert step._cache_size() == n_compiles  # second step does not recompile
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)


def _mlp_problem():
  k = jax.random.split(jax.random.key(0), 6)
  params = {"w1": jax.random.normal(k[0], (3, 16)) * 0.5, "b1": jnp.zeros(16),
            "w2": jax.random.normal(k[1], (16, 2)) * 0.5, "b2": jnp.zeros(2)}
  batch = {"x": jax.random.normal(k[2], (32, 3)), "y": jax.random.normal(k[3], (32, 2))}
  return params, batch


@pytest.mark.parametrize("mesh_flag", ["8,1,1", "2,4,1", "4,1,2"])
def test_shard_map_grad_equals_one_device_and_naive_pmean_is_n_times(mesh_flag):
  params, batch = _mlp_problem()
  m = mesh_lib.make_mesh(mesh_lib.parse_mesh_flag(mesh_flag))
  n = m.shape["data"] * m.shape["fsdp"]

  def global_loss(p):
    return jnp.mean(collectives.mlp_per_example_loss(p, batch))

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(global_loss))(params)
  loss, grads = collectives.make_dp_grad(collectives.mlp_per_example_loss, m)(params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for key in params:
    np.testing.assert_allclose(grads[key], ref_grads[key], rtol=1e-5, atol=1e-7)
  _, naive = collectives.make_dp_grad(collectives.mlp_per_example_loss, m, naive_pmean=True)(params, batch)
  for key in params:  # the pmap-era idiom is off by exactly the number of batch shards
    np.testing.assert_allclose(naive[key], n * ref_grads[key], rtol=1e-5, atol=1e-6)
  assert not np.allclose(naive["w1"], ref_grads["w1"], rtol=0.1)


def test_shard_map_sgd_trajectory_equals_jit():
  params, batch = _mlp_problem()
  m = mesh_lib.make_mesh()
  step = collectives.make_dp_sgd_step(collectives.mlp_per_example_loss, m, learning_rate=0.1)

  @jax.jit
  def ref_step(p):
    loss, g = jax.value_and_grad(lambda q: jnp.mean(collectives.mlp_per_example_loss(q, batch)))(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

  p1, p2 = params, params
  for _ in range(5):
    p1, l1 = step(p1, batch)
    p2, l2 = ref_step(p2)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
  for key in params:
    np.testing.assert_allclose(p1[key], p2[key], rtol=1e-5, atol=1e-6)
  with pytest.raises(mesh_lib.MeshError, match="batch size 12 is not divisible"):
    step(params, jax.tree.map(lambda a: a[:12], batch))


# ---- placement, resharding, offload --------------------------------------------------------

from rljax.models.llm import sequence_log_probs  # noqa: E402
from rljax.sharding import placement as pl  # noqa: E402

PLACE_LM = LMConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4,
                    num_kv_heads=2)


def _logps(graphdef, params, rest, tokens, mask):
  return jax.jit(lambda p: sequence_log_probs(nnx.merge(graphdef, p, rest), tokens, mask))(params)


@pytest.mark.parametrize("kind", ["colocated", "disaggregated"])
def test_reshard_generator_logps_equal_trainer_logps(kind):
  model = DecoderLM(PLACE_LM, rngs=nnx.Rngs(3))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if kind == "colocated":
    p = pl.Placement.colocated(mesh_lib.make_mesh(mesh_lib.parse_mesh_flag("1,4,2")),
                               train_preset="fsdp_tp", generate_preset="tp")
    assert not p.disaggregated
  else:
    p = pl.Placement.disaggregated_split(num_generate=2)
    assert p.disaggregated
    assert p.generation.mesh.devices.size == 2 and p[pl.Role.ACTOR].mesh.devices.size == 6
  train = rules.shard(params, p[pl.Role.ACTOR].mesh, p[pl.Role.ACTOR].preset)
  # one "update": the generator must see the new weights
  train = jax.tree.map(lambda a: a * 1.01, train)
  metrics = {}
  gen = pl.reshard(train, to=p.generation, metrics=metrics)
  assert metrics["timing/reshard"] > 0
  q = gen["layers"][0]["attn"]["q_kernel"][...]
  assert set(q.sharding.device_set) == set(p.generation.mesh.devices.flat)
  assert q.sharding.spec == P(None, "tensor")            # heads over tensor in the tp layout
  tokens = jax.random.randint(jax.random.key(2), (4, 7), 0, 64)
  mask = jnp.ones((4, 7), jnp.int32).at[0, 5:].set(0)
  lp_train = _logps(graphdef, train, rest, tokens, mask)
  lp_gen = _logps(graphdef, gen, rest, tokens, mask)
  np.testing.assert_allclose(np.asarray(lp_gen), np.asarray(lp_train), rtol=1e-5, atol=1e-5)


def test_offload_frozen_roles_to_pinned_host_and_back():
  m = mesh_lib.make_mesh(mesh_lib.parse_mesh_flag("1,8,1"))
  p = pl.Placement.colocated(m, offload_frozen=True)
  assert p[pl.Role.REFERENCE].offload and not p[pl.Role.ACTOR].offload
  assert pl.host_memory_kind(m) == "pinned_host"   # the CPU backend lists pinned_host
  _, params, _ = _lm_state()
  host = pl.offload(params, p[pl.Role.REFERENCE])
  e = host["embed"][...]
  assert e.sharding.memory_kind == "pinned_host" and e.sharding.spec == P(None, "fsdp")
  back = pl.onload(host, p[pl.Role.REFERENCE])
  assert back["embed"][...].sharding.memory_kind == "device"
  np.testing.assert_array_equal(np.asarray(back["embed"][...]), np.asarray(params["embed"][...]))
  with pytest.raises(ValueError, match="only frozen roles .* got ACTOR"):
    pl.Placement(roles={r: pl.RolePlacement(mesh=m, offload=r is pl.Role.ACTOR) for r in pl.Role},
                 generation=pl.RolePlacement(mesh=m))
  with pytest.raises(mesh_lib.MeshError, match=r"num_generate must be in \[1, 8\), got 8"):
    pl.Placement.disaggregated_split(num_generate=8)
