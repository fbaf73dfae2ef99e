"""Disaggregated RLHF across two processes: the trainer here, the sampler on a generator process.

``train_rlhf.py --placement=disaggregated`` started as 2 processes (``--num_processes=2`` with
``--coordinator_address`` and ``--process_id``, or ``srun -n 2`` under SLURM) runs the
trainer on process 0 and the generator on process 1, each a one-process JAX program on its own
devices, joined by `rljax.sharding.link` (the coordination service of JAX's distributed
runtime, and ``jax.experimental.transfer`` for the weights)::

    trainer (process 0)                              generator (process 1)
      SFT, reward model, REFERENCE, REWARD,            waits for the sampler spec
      CRITIC and the update on its devices      -->    graph + SamplingConfig (once)
      per batch: offer the actor weights        -->    pull them device to device, reshard
                 (one device, training copy)           to tp over all its devices
                 + prompts, PRNG key            -->    Sampler.generate
      REFERENCE, REWARD on the rollout          <--    tokens, masks, log_probs_t1 [B, R]

Generation is the only stage that moves: the generator samples exactly what the one-process
disaggregated run's generation devices sample (same mesh shape, layout, prompts and keys), so
the two runs are equal bitwise when the trainer's devices match the one-process training mesh.
With ``max_staleness > 0`` the trainer's generator thread (`rljax.alignment.rollouts`) makes
these requests ahead of the update, so generation on the other process overlaps training.

If the generator process raises, it reports the error before exiting; if it dies, its heartbeat
stops. Either way the trainer's wait for the batch raises
`rljax.alignment.rollouts.GeneratorError` naming the generator and the RL step, within
``peer_timeout_s`` (10 s by default).
"""

from __future__ import annotations

import io
import itertools
import json
import pickle
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from rljax.alignment.rollouts import GeneratorError
from rljax.sampling import Sampler, SampleOutput, SamplingConfig
from rljax.sharding import link as link_lib
from rljax.sharding import mesh as mesh_lib
from rljax.sharding import rules as rules_lib

PEER_NAMES = ("the trainer (process 0)", "the generator (process 1)")
_SPEC = "rljax/generation/spec"
_REQUEST = "rljax/generation/request/"
_OUTPUT = "rljax/generation/output/"


def encode_output(out: SampleOutput) -> bytes:
  """A `SampleOutput` as ``.npz`` bytes (`decode_output` inverts it exactly)."""
  buf = io.BytesIO()
  np.savez(buf, **{k: np.asarray(v) for k, v in out._asdict().items()})
  return buf.getvalue()


def decode_output(data: bytes) -> SampleOutput:
  """The `SampleOutput` of `encode_output`'s bytes."""
  with np.load(io.BytesIO(data)) as z:
    fields = {k: z[k] for k in SampleOutput._fields}
  fields["num_steps"] = int(fields["num_steps"])
  return SampleOutput(**fields)


class RemoteSampler:
  """The trainer's end: generates on the generator process.

  Args:
    link: process 0's `rljax.sharding.link.Link`.

  Call `start` once with the actor's graph, then `generate` per batch (from one thread at a
  time) and `close` at the end (it tells the generator to exit).
  """

  def __init__(self, link: link_lib.Link):
    self.link = link
    self._server = link.transfer_server()
    self._count = itertools.count()
    self._started = False

  def start(self, graphdef, sampling: SamplingConfig, abstract_params) -> None:
    """Sends the sampler spec: the actor's NNX graph, ``sampling`` and the parameter shapes."""
    if self._started:
      return
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract_params)
    self.link.put(_SPEC, pickle.dumps(dict(graphdef=graphdef, sampling=sampling,
                                           abstract=abstract, address=self._server.address())))
    self._started = True

  def generate(self, params, prompt_ids: Sequence[Sequence[int]], key: jax.Array, *,
               step: int) -> tuple[SampleOutput, float]:
    """Samples ``prompt_ids`` with the actor weights ``params`` on the generator.

    Args:
      params: the actor's ``nnx.State`` (any layout on this process's devices).
      prompt_ids: ``B`` prompts (token-id lists).
      key: the PRNG key of `rljax.sampling.Sampler.generate`.
      step: the RL step this batch trains (1-based), for errors.

    Returns:
      ``(output, seconds)``: the generator's `SampleOutput` and the seconds spent staging the
      weights on one device for the transfer (``timing/reshard``).

    Raises:
      GeneratorError: the generator failed or stopped (naming it and ``step``).
    """
    n = next(self._count)
    t = time.perf_counter()
    staged = jax.device_put(params, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    leaves = jax.block_until_ready(jax.tree.leaves(staged))
    stage_s = time.perf_counter() - t
    self._server.await_pull(n + 1, leaves)
    request = dict(uuid=n + 1, step=step, prompt_ids=[list(map(int, p)) for p in prompt_ids],
                   key=np.asarray(jax.random.key_data(key)).tolist())
    self.link.put(f"{_REQUEST}{n}", json.dumps(request).encode())
    try:
      data = self.link.get(f"{_OUTPUT}{n}", what=f"the rollout of RL step {step}")
    except link_lib.LinkError as e:
      raise GeneratorError(f"the generator failed on the batch of RL step {step}: {e}") from e
    return decode_output(data), stage_s

  def close(self) -> None:
    """Tells the generator to exit (it finishes the request in hand first)."""
    try:
      self.link.put(f"{_REQUEST}{next(self._count)}", json.dumps({"stop": True}).encode())
    except Exception:  # pragma: no cover - the generator is already gone
      pass


def serve(link: link_lib.Link, *, log: Callable[[str], None] = print,
          wait_for_spec_s: float | None = None) -> int:
  """The generator process's loop: samples every batch the trainer asks for; returns the
  number of batches when the trainer says stop.

  It lays the actor out in the ``tp`` preset over all its local devices (mesh
  ``data=1, tensor=N``), as the one-process disaggregated run's generation devices do.

  Raises:
    rljax.sharding.link.LinkError: the trainer stopped or failed (naming it). Any error of its
      own is reported to the trainer (`Link.fail`) and re-raised.
  """
  spec = pickle.loads(link.get(_SPEC, what="the sampler spec (sent when the RL stage starts)",
                               timeout_s=wait_for_spec_s))
  devices = jax.local_devices()
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, tensor=len(devices)), devices=devices)
  server = link.transfer_server()
  conn = server.connect(spec["address"])
  leaves, treedef = jax.tree.flatten(spec["abstract"])
  one = jax.sharding.SingleDeviceSharding(devices[0])
  pull_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one) for a in leaves]
  log(f"generator: sampling on {len(devices)} device(s) (tp over tensor={len(devices)}) for "
      f"the trainer at {link.coordinator_address}")
  sampler: Sampler | None = None
  step = 0
  for n in itertools.count():
    request = json.loads(link.get(f"{_REQUEST}{n}", what=f"request {n} (the next batch)"))
    if request.get("stop"):
      log(f"generator: {n} batches sampled; the trainer finished")
      return n
    step = request["step"]
    try:
      params = jax.tree.unflatten(treedef, conn.pull(request["uuid"], pull_specs))
      params = rules_lib.shard(params, mesh, rules_lib.Preset.TP)
      if sampler is None:
        sampler = Sampler(nnx.merge(spec["graphdef"], params), spec["sampling"])
      sampler.update_params(params)
      out = sampler.generate(request["prompt_ids"],
                             key=jax.random.wrap_key_data(np.asarray(request["key"], np.uint32)))
      link.put(f"{_OUTPUT}{n}", encode_output(out))
    except Exception as e:
      link.fail(f"{type(e).__name__}: {str(e)[:500]} (on the batch of RL step {step})")
      raise
  raise AssertionError("unreachable")  # pragma: no cover

