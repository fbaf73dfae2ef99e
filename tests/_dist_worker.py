"""A multi-process worker for tests/test_distributed.py and tests/slurm/.

    python tests/_dist_worker.py --coordinator_address=127.0.0.1:PORT --num_processes=2 --process_id=i
    srun -n2 python tests/_dist_worker.py          # SLURM: detected

Runs a data-parallel MLP SGD step (shard_map, rljax.sharding.collectives) over all processes'
devices, 3 steps, and prints one line ``RESULT <process_id> <loss> <sum of w1>`` that the test
compares with the 1-process run. ``--hang_after_init`` waits in a collective loop (fault test).
"""

import sys
import time

from absl import app, flags

from rljax.sharding import distributed

distributed.define_flags()
_LOGDIR = flags.DEFINE_string("logdir", None, "Accepted like train_control.py's; unused.")
_HANG = flags.DEFINE_bool("hang_after_init", False, "Loop on cross-process steps (fault test).")
_SIGTERM_AT = flags.DEFINE_integer(
    "sigterm_at_step", None, "Process 0 sends itself SIGTERM before this step of a 20-step loop "
    "that asks SigtermFlag.any_process() after every step; prints 'STOPPED <process> <steps>'.")


def main(argv):
  del argv
  distributed.initialize_from_flags()
  import jax
  import jax.numpy as jnp
  import numpy as np

  from rljax.sharding import collectives, mesh as mesh_lib

  mesh = mesh_lib.make_mesh()
  k = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(k[0], (3, 16)) * 0.5, "b1": jnp.zeros(16),
            "w2": jax.random.normal(k[1], (16, 2)) * 0.5, "b2": jnp.zeros(2)}
  x = np.asarray(jax.random.normal(k[2], (16, 3)))
  y = np.asarray(jax.random.normal(k[3], (16, 2)))
  from jax.sharding import NamedSharding, PartitionSpec as P
  rep = NamedSharding(mesh, P())
  bsh = NamedSharding(mesh, P(mesh_lib.BATCH_AXES))
  params = jax.device_put(params, rep) if jax.process_count() == 1 else \
      jax.tree.map(lambda a: jax.make_array_from_process_local_data(rep, np.asarray(a)), params)

  def global_array(a):  # every process holds the full host batch; each puts its own rows
    return jax.make_array_from_callback(a.shape, bsh, lambda idx: a[idx])

  batch = {"x": global_array(x), "y": global_array(y)}
  step = collectives.make_dp_sgd_step(collectives.mlp_per_example_loss, mesh, learning_rate=0.1)
  for _ in range(3):
    params, loss = step(params, batch)
  w1 = float(np.asarray(params["w1"].addressable_data(0)).sum())
  print(f"RESULT {jax.process_index()} {jax.process_count()} {jax.device_count()} "
        f"{float(np.asarray(loss.addressable_data(0))):.7f} {w1:.7f}", flush=True)
  if _SIGTERM_AT.value is not None:
    import os
    import signal

    from rljax import checkpoint as ckpt

    with ckpt.SigtermFlag() as flag:
      for i in range(1, 21):
        if i == _SIGTERM_AT.value and jax.process_index() == 0:
          os.kill(os.getpid(), signal.SIGTERM)  # process 1 gets none
        params, loss = step(params, batch)
        loss.block_until_ready()
        if flag.any_process():
          break
    print(f"STOPPED {jax.process_index()} {i} {int(flag.received)}", flush=True)
  if _HANG.value:
    t0 = time.time()
    while time.time() - t0 < 120:
      params, loss = step(params, batch)
      loss.block_until_ready()
      time.sleep(0.2)
    print("hang loop finished without noticing the lost process", file=sys.stderr)
    return 4


if __name__ == "__main__":
  from rljax import runtime

  app.run(lambda argv: runtime.run_main(lambda: main(argv), verbose=False))
