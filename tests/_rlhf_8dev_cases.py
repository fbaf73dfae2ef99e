"""The sharded RLHF PPO step on 8 fake CPU devices. Run ONLY in a subprocess by
tests/test_rlhf_sharded.py (XLA_FLAGS must be set before jax is imported):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_rlhf_8dev_cases.py

Prints one line ``RESULT <json>`` with the comparisons the test asserts on.
"""

import dataclasses
import json
import os
import sys

if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
  sys.exit("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 set before jax is imported")

import jax
import numpy as np
from flax import nnx

from rljax import ppo, sampling
from rljax.alignment import modeling, pipeline, rlhf
from rljax.envs.text import arithmetic
from rljax.models.llm import DecoderLM
from rljax.sharding import mesh as mesh_lib, placement as pl

TOK = arithmetic.CharTokenizer()
TEXTS = arithmetic.AdditionTask(max_operand=20).prompts(64, seed=1)
PROMPTS = [TOK.encode(p) for p in TEXTS]
# 24 rows: divisible by the 8 data shards (colocated 2 x 4) and the 6 (disaggregated 3 x 2).
CONFIG = rlhf.RLHFConfig(algo="ppo", prompts_per_step=24, max_new_tokens=4, actor_lr=1e-3,
                         ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=2, value_clip_eps=0.2))


def trainer(placement=None, config=CONFIG):
  model = DecoderLM(pipeline.tiny_lm_config(TOK.vocab_size, hidden_size=32, num_layers=1),
                    rngs=nnx.Rngs(0))
  return rlhf.RLHFTrainer(config, actor=model, tokenizer=TOK, prompts=PROMPTS, prompt_texts=TEXTS,
                          reward_fn=arithmetic.addition_reward, placement=placement)


def max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def spec(x):
  if not hasattr(x.sharding, "spec"):  # SingleDeviceSharding
    return None
  return [list(s) if isinstance(s, tuple) else s for s in x.sharding.spec]


def cache_sizes(tr):
  return [tr._update_fn._cache_size(), tr._ref_fn._cache_size(), tr._critic_fn._cache_size(),
          tr.sampler._prefill._cache_size(), tr.sampler._decode._cache_size()]


def segmented_vs_one_loop(tr):
  """The trainer's sampler (one decode loop at R = 4) against a sampler of the same weights, in
  the generation layout, that decodes in 2 segments (caches of P + 2 and P + 4 slots):
  ``[token mismatches, max |log-prob difference|]``."""
  model = nnx.merge(tr.sampler.graphdef, tr.sampler.params)  # the generation-layout weights
  seg = sampling.Sampler(model, dataclasses.replace(tr.sampler.config, decode_segments=2))
  a, b = (s.generate(PROMPTS[:24], key=jax.random.key(3)) for s in (tr.sampler, seg))
  return [int(np.sum(a.tokens != b.tokens)),
          float(np.max(np.abs(a.log_probs_t1 - b.log_probs_t1)))]


def run(tr, ref_rec, ref_params):
  rec = tr.step()
  sizes = cache_sizes(tr)
  params = jax.tree.map(np.asarray, tr.state.ppo_state.params)
  actor = tr.state.ppo_state.params["actor"]
  layer = actor["layers"][0]
  mu = tr.state.ppo_state.opt_state.inner_states["actor"].inner_state[1][0].mu["actor"]
  # After resharding, the generator's log-probs (generation layout) equal the trainer's.
  gen = tr.generation_params()
  b = tr.last_batch
  args = (b["prompt_tokens"], b["prompt_mask"], b["response_tokens"], b["mask"])
  lp = lambda p: np.asarray(jax.jit(lambda q, *a: modeling.policy_outputs(
      tr.graphdefs[rlhf.Role.ACTOR], q, *a)[0])(p, *args))
  gen_vs_train = float(np.max(np.abs(lp(gen) - lp(actor))))
  specs = dict(q=spec(layer["attn"]["q_kernel"][...]), embed=spec(actor["embed"][...]),
               mu_embed=spec(mu["embed"][...]), gen_q=spec(gen["layers"][0]["attn"]["q_kernel"][...]))
  devices = (len(actor["embed"][...].sharding.device_set), len(gen["embed"][...].sharding.device_set))
  segmented = segmented_vs_one_loop(tr)
  rec2 = tr.step()  # donates the actor's params above
  keys = [k for k in ref_rec if not k.startswith("timing/")]
  return dict(
      param_diff=max_diff(params, ref_params),
      metric_diff={k: abs(rec[k] - ref_rec[k]) for k in keys},
      reshard_s=rec["timing/reshard"],
      specs=specs, train_devices=devices[0], gen_devices=devices[1],
      gen_vs_train_logp=gen_vs_train, segmented=segmented,
      drift=rec["logprob_drift"], drift2=rec2["logprob_drift"],
      compiles_after_1=sizes, compiles_after_2=cache_sizes(tr))


def sft_parity(mesh):
  """Two SFT steps in the fsdp layout (rljax.alignment.layout) equal two on one device."""
  from rljax.alignment import layout as layout_lib, sft

  examples = [(TOK.encode(p), TOK.encode(str(sum(map(int, p[:-1].split("+")))),
                                         add_special_tokens=False) + [TOK.EOS]) for p in TEXTS]
  cfg = sft.SFTConfig(num_steps=2, batch_size=16, learning_rate=1e-2, log_every=1)
  res = []
  for layout in (None, layout_lib.TrainLayout(mesh=mesh, preset="fsdp")):
    model = DecoderLM(pipeline.tiny_lm_config(TOK.vocab_size, hidden_size=32, num_layers=1),
                      rngs=nnx.Rngs(0))
    model, state, hist = sft.train_sft(model, examples, cfg, pad_id=TOK.PAD, layout=layout)
    res.append((jax.tree.map(np.asarray, state.params), [h["sft/loss"] for h in hist],
                spec(state.params["embed"][...])))
  return dict(param_diff=max_diff(res[0][0], res[1][0]),
              loss_diff=max(abs(a - b) for a, b in zip(res[0][1], res[1][1])), embed_spec=res[1][2])


def rm_parity(mesh):
  """Two reward-model steps in the fsdp layout equal two on one device (chosen: the right sum)."""
  from rljax.alignment import layout as layout_lib, reward_model as rm_lib

  pairs = []
  for p in TEXTS[:16]:
    a, b = map(int, p[:-1].split("+"))
    pairs.append((TOK.encode(p), TOK.encode(str(a + b), add_special_tokens=False) + [TOK.EOS],
                  TOK.encode(str(a + b + 1), add_special_tokens=False) + [TOK.EOS]))
  cfg = rm_lib.RewardModelConfig(num_steps=2, batch_size=8, learning_rate=1e-2, log_every=1)
  res = []
  for layout in (None, layout_lib.TrainLayout(mesh=mesh, preset="fsdp")):
    model = DecoderLM(pipeline.tiny_lm_config(TOK.vocab_size, hidden_size=32, num_layers=1),
                      rngs=nnx.Rngs(0))
    _, state, hist = rm_lib.train_reward_model(model, pairs, cfg, pad_id=TOK.PAD, layout=layout)
    params = jax.tree.map(np.asarray, state.params)
    # The reward head's bias cancels in r_chosen - r_rejected: its exact gradient is 0, so its
    # value is rounding noise that Adam scales up to ~learning_rate per step. Compared apart.
    bias = float(np.max(np.abs(params["reward_head"]["bias"][...])))
    params["reward_head"]["bias"] = nnx.Param(np.zeros_like(params["reward_head"]["bias"][...]))
    res.append((params, [h["rm/loss"] for h in hist], bias))
  return dict(param_diff=max_diff(res[0][0], res[1][0]),
              loss_diff=max(abs(a - b) for a, b in zip(res[0][1], res[1][1])),
              bias=[res[0][2], res[1][2]], lr=cfg.learning_rate)


def async_disaggregated(dis):
  """Disaggregated placement, max_staleness=1 against 0: with frozen weights (lr under f32
  resolution) the same tokens and metrics; with learning, the lag of each step."""
  frozen = dict(actor_lr=1e-30, critic_lr=1e-30)
  runs = {}
  for s in (0, 1):
    tr = trainer(dis, config=dataclasses.replace(CONFIG, max_staleness=s, num_steps=2, **frozen))
    recs = [tr.step() for _ in range(2)]
    runs[s] = recs, np.asarray(tr.last_batch["response_tokens"])
    tr.close()
  (r0, t0), (r1, t1) = runs[0], runs[1]
  keys = [k for k in r0[0] if not k.startswith(("timing/", "rollout/"))]
  learning = trainer(dis, config=dataclasses.replace(CONFIG, max_staleness=1, num_steps=3))
  lags = [learning.step()["rollout/policy_lag_max"] for _ in range(3)]
  learning.close()
  return dict(tokens_equal=bool(np.array_equal(t0, t1)),
              metric_diff={k: abs(r0[i][k] - r1[i][k]) for i in range(2) for k in keys},
              lags=lags)


def main():
  assert jax.device_count() == 8
  one = trainer()
  ref_rec = one.step()
  ref_params = jax.tree.map(np.asarray, one.state.ppo_state.params)
  out = {}
  mesh = mesh_lib.make_mesh(mesh_lib.parse_mesh_flag("2,4,1"))
  out["colocated"] = run(trainer(pl.Placement.colocated(mesh, train_preset="fsdp")), ref_rec,
                         ref_params)
  dis = pl.Placement.disaggregated_split(num_generate=2,
                                         train_mesh=mesh_lib.MeshConfig(data=3, fsdp=2))
  out["disaggregated"] = run(trainer(dis), ref_rec, ref_params)
  out["async_disaggregated"] = async_disaggregated(dis)
  out["sft"] = sft_parity(mesh)
  out["rm"] = rm_parity(mesh)
  try:
    trainer(pl.Placement.colocated(mesh), config=CONFIG.__class__(
        **{**CONFIG.__dict__, "prompts_per_step": 12}))
    out["batch_error"] = None
  except mesh_lib.MeshError as e:
    out["batch_error"] = str(e)
  try:  # a training mesh that leaves 5 of 8 devices to generate
    pipeline.make_placement("1,3,1", placement="disaggregated")
    out["generation_mesh_error"] = None
  except mesh_lib.MeshError as e:
    out["generation_mesh_error"] = str(e)
  remote = pipeline.make_placement(None, placement="disaggregated", remote_generator="remote")
  out["remote_placement"] = dict(
      train_mesh=dict(remote[pl.Role.ACTOR].mesh.shape), remote=remote.remote_generator)
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
