"""Multi-process training worker for tests/test_distributed_training.py.

    python tests/_dist_train_worker.py --logdir=D                          # 1 process: reference
    python tests/_dist_train_worker.py --logdir=D --coordinator_address=127.0.0.1:PORT \
        --num_processes=2 --process_id=i                                   # each of 2 processes

Each run does, on a mesh over every process's devices:

1. control: one compiled PPO chunk of the control trainer (environments split over ``data``),
   then the trainer's evaluation of the trained policy (as `train` calls it);
2. RLHF: one PPO step of the RLHF trainer (colocated placement, ``fsdp`` rules);
3. checkpoint: with 2 processes, the control train state (parameters, optimizer state, the
   data-sharded environment state) is saved to ``<logdir>/ckpt`` by both processes and its
   values to ``<logdir>/saved.npz`` by process 0; with 1 process, that checkpoint is restored
   on a 1-device mesh and compared with ``saved.npz`` (waiting for it: the test starts the
   1-process run beside the 2-process one).

Prints one line ``RESULT <json>``.
"""

import dataclasses
import json
import os
import time

from absl import app, flags

from rljax.sharding import distributed

distributed.define_flags()
_LOGDIR = flags.DEFINE_string("logdir", None, "Shared directory for the checkpoint.")
_WAIT = flags.DEFINE_integer("wait_s", 600, "1 process: seconds to wait for the 2-process save.")


def _digest(tree):
  """Every leaf as a host float64 array (all-gathered across processes)."""
  import jax
  import numpy as np

  from rljax.runtime import to_host

  return [np.asarray(x, np.float64) for x in jax.tree.leaves(to_host(tree))]


def control(mesh):
  import jax
  import numpy as np

  from rljax.control import trainer
  from rljax.control.config import ControlConfig

  config = ControlConfig().replace(
      env="playground/CartpoleBalance", num_timesteps=4 * 4, num_envs=4, unroll_length=4,
      num_minibatches=2, num_epochs=1, num_evals=2, num_eval_envs=2, episode_length=20,
      policy_hidden=(8,), value_hidden=(8,))
  tr, params = trainer.make_trainer(config, mesh=mesh)
  ts, env_state = tr.init(params)
  ts, env_state, metrics = tr.train_chunk(ts, env_state)
  leaves = _digest(ts.params)
  ev = jax.device_get(tr.evaluate(ts.params, ts.obs_stats, jax.random.PRNGKey(7)))
  out = dict(params=[float(np.sum(x)) for x in leaves],
             loss=float(np.asarray(jax.device_get(metrics["loss"]))),
             eval={k: float(np.asarray(v)) for k, v in ev.items()},
             obs_spec=str(env_state.obs.sharding.spec) if mesh is not None else None)
  # --eval_video's callback on the trained state: every process calls it (the policy is
  # gathered), process 0 alone renders; the episode's return matches the 1-process run's.
  from rljax.control import eval_video

  on_eval = eval_video.eval_video_callback(config, os.path.join(_LOGDIR.value, "video",
                                                                str(jax.process_count())),
                                           formats=("gif",), height=32, width=32)
  video = on_eval(1, ts, {"env_steps": 16})
  out["video"] = None if video is None else dict(
      paths=[os.path.basename(p) for p in video.paths],
      reward=float(np.asarray(video.episode_rewards).sum()))
  return tr, ts, env_state, out


def rlhf_step(mesh):
  import numpy as np
  from flax import nnx

  from rljax import ppo
  from rljax.alignment import pipeline, rlhf
  from rljax.envs.text import arithmetic
  from rljax.models.llm import DecoderLM
  from rljax.sharding import placement as pl

  tok = arithmetic.CharTokenizer()
  texts = arithmetic.AdditionTask(max_operand=20).prompts(32, seed=1)
  config = rlhf.RLHFConfig(algo="ppo", prompts_per_step=4, max_new_tokens=3, actor_lr=1e-3,
                           ppo=ppo.PPOConfig(num_epochs=1, num_minibatches=2))
  model = DecoderLM(pipeline.tiny_lm_config(tok.vocab_size, hidden_size=16, num_layers=1,
                                            num_heads=2, num_kv_heads=1), rngs=nnx.Rngs(0))
  placement = None if mesh is None else pl.Placement.colocated(mesh, train_preset="fsdp")
  tr = rlhf.RLHFTrainer(config, actor=model, tokenizer=tok, prompts=[tok.encode(t) for t in texts],
                        prompt_texts=texts, reward_fn=arithmetic.addition_reward,
                        placement=placement)
  rec = tr.step()
  return dict(params=[float(np.sum(x)) for x in _digest(tr.state.ppo_state.params)],
              metrics={k: v for k, v in rec.items() if not k.startswith("timing/")})


def main(argv):
  del argv
  distributed.initialize_from_flags()
  import jax
  import numpy as np

  from rljax import checkpoint as ckpt
  from rljax.control import trainer as control_trainer
  from rljax.sharding import mesh as mesh_lib

  multi = jax.process_count() > 1
  mesh = mesh_lib.make_mesh() if multi else None
  tr, ts, env_state, out = control(mesh)
  out["rlhf"] = rlhf_step(mesh)
  out["process"] = [jax.process_index(), jax.process_count(), jax.device_count()]
  path = os.path.join(_LOGDIR.value, "ckpt")
  items = (tr.checkpoint_items(1, (ts, env_state)))
  if multi:  # save from both processes
    manager = ckpt.make_manager(path)
    ckpt.save(manager, 1, *items)
    manager.close()
    if jax.process_index() == 0:  # what load_policy reads beside the checkpoints
      ckpt.write_json_atomic(os.path.join(ckpt.checkpoint_dir(path), ckpt.CONFIG_FILE),
                             {"network": dataclasses.asdict(tr.networks.config)})
    saved = _digest(items)
    if jax.process_index() == 0:
      tmp = os.path.join(_LOGDIR.value, "saved.tmp.npz")
      np.savez(tmp, *saved)
      os.replace(tmp, os.path.join(_LOGDIR.value, "saved.npz"))  # also says: the save is done
  else:  # restore on one device (another process count and mesh shape) and compare
    deadline = time.time() + _WAIT.value  # the 2-process run may still be going
    while not os.path.exists(os.path.join(_LOGDIR.value, "saved.npz")):
      if time.time() > deadline:
        raise TimeoutError(f"no 2-process checkpoint in {_LOGDIR.value} after {_WAIT.value} s")
      time.sleep(0.5)
    manager = ckpt.make_manager(path)
    step, policy, train_item = ckpt.restore(manager, *items)
    manager.close()
    restored = _digest((policy, train_item))
    with np.load(os.path.join(_LOGDIR.value, "saved.npz")) as f:
      saved = [f[f"arr_{i}"] for i in range(len(f.files))]
    # load_params (load_policy, export, render) on this 1-device process, from the folder
    # alone, without a template of the 2-process shardings.
    _, params, stats = control_trainer.load_params(path)
    from flax import nnx

    loaded = _digest({"params": nnx.to_pure_dict(params), "obs_stats": stats._asdict()})
    out["restore"] = dict(
        step=step, num_leaves=[len(saved), len(restored)],
        max_diff=max(float(np.max(np.abs(a - b))) if a.size else 0.0
                     for a, b in zip(saved, restored)),
        shapes_equal=all(a.shape == b.shape for a, b in zip(saved, restored)),
        policy_leaves=len(loaded),
        policy_max_diff=max(float(np.max(np.abs(a - b))) for a, b in zip(saved, loaded)))
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  app.run(main)
