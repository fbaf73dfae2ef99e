"""Multi-process start-up: ``jax.distributed.initialize()`` for SLURM, explicit flags, or 1 process.

Every experiment script runs unchanged on 1 process or N::

    from rljax.sharding import distributed
    distributed.define_flags()                    # at module level, next to the other absl flags
    ...
    def main(argv):
      distributed.initialize_from_flags()         # first thing, before any other jax call

How :func:`initialize` decides:

1. explicit ``coordinator_address`` / ``num_processes`` / ``process_id`` (flags
   ``--coordinator_address=host:port --num_processes=N --process_id=i``): used as given;
2. otherwise under SLURM with more than one task (``SLURM_NTASKS > 1``): JAX's own cluster
   detection (coordinator = first node of the allocation, port ``SLURM_JOB_ID % 4096 + 61440``).
   If ``JAX_COORDINATOR_BIND_ADDRESS`` is unset the coordinator binds to all interfaces;
3. otherwise: a single process; nothing is called.

``heartbeat_timeout_s`` (flag ``--heartbeat_timeout_s``; JAX's default is 100 s): when a process
dies, the coordination service notices its missing heartbeats after about this long and every
other process is terminated by JAX with an error naming the lost task (``/job:jax_worker/task:<id>``).
Use ~10 s in tests and on preemptible clusters.
"""

from __future__ import annotations

import dataclasses
import os

import jax

_FLAGS: dict = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
  """Arguments of :func:`initialize`.

  Attributes:
    coordinator_address: ``host:port`` of process 0's coordination service, or ``None``.
    num_processes: total processes, or ``None`` (SLURM / single process).
    process_id: this process's index in ``[0, num_processes)``, or ``None``.
    heartbeat_timeout_s: seconds without a heartbeat before a process is declared dead; ``None``
      keeps JAX's 100 s.
    initialization_timeout_s: seconds to wait for all processes to connect.
  """

  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  heartbeat_timeout_s: int | None = None
  initialization_timeout_s: int = 300

  def __post_init__(self):
    explicit = (self.coordinator_address, self.num_processes, self.process_id)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
      raise ValueError(
          "give all of coordinator_address, num_processes and process_id, or none; got "
          f"coordinator_address={self.coordinator_address!r}, num_processes={self.num_processes!r}, "
          f"process_id={self.process_id!r}")
    if self.num_processes is not None:
      if self.num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
      if not 0 <= self.process_id < self.num_processes:
        raise ValueError(
            f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
    if self.heartbeat_timeout_s is not None and self.heartbeat_timeout_s < 1:
      raise ValueError(f"heartbeat_timeout_s must be >= 1, got {self.heartbeat_timeout_s}")
    if self.initialization_timeout_s < 1:
      raise ValueError(f"initialization_timeout_s must be >= 1, got {self.initialization_timeout_s}")


def under_slurm() -> bool:
  """True inside a SLURM job step with more than one task."""
  return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def initialize(config: DistributedConfig | None = None) -> bool:
  """Starts JAX's multi-process runtime if this is a multi-process run.

  Must run before any other JAX call that touches devices. Afterwards ``jax.devices()`` lists
  every process's devices and ``rljax.sharding.mesh.make_mesh`` spans them all.

  Returns:
    True if ``jax.distributed.initialize`` was called, False for a single-process run.

  Raises:
    ValueError: for an incomplete explicit configuration (see :class:`DistributedConfig`).
    RuntimeError: from JAX if the processes cannot connect within ``initialization_timeout_s``.
  """
  config = config or DistributedConfig()
  kwargs = {"initialization_timeout": config.initialization_timeout_s}
  if config.heartbeat_timeout_s is not None:
    kwargs["heartbeat_timeout_seconds"] = config.heartbeat_timeout_s
  if config.num_processes is not None:
    if config.num_processes == 1:
      return False
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address, num_processes=config.num_processes,
        process_id=config.process_id, **kwargs)
    return True
  if under_slurm():
    jax.distributed.initialize(**kwargs)  # JAX detects SLURM itself
    return True
  return False


def define_flags() -> None:
  """Defines ``--coordinator_address``, ``--num_processes``, ``--process_id`` and
  ``--heartbeat_timeout_s`` absl flags (idempotent)."""
  from absl import flags

  if _FLAGS:
    return
  _FLAGS["coordinator_address"] = flags.DEFINE_string(
      "coordinator_address", None, "host:port of process 0 (multi-process runs without SLURM).")
  _FLAGS["num_processes"] = flags.DEFINE_integer(
      "num_processes", None, "Number of processes (multi-process runs without SLURM).")
  _FLAGS["process_id"] = flags.DEFINE_integer(
      "process_id", None, "This process's index (multi-process runs without SLURM).")
  _FLAGS["heartbeat_timeout_s"] = flags.DEFINE_integer(
      "heartbeat_timeout_s", None, "Seconds before a silent process is declared dead (JAX: 100).")


def initialize_from_flags() -> bool:
  """:func:`initialize` with the flags of :func:`define_flags` (call after absl parsed them)."""
  if not _FLAGS:
    raise RuntimeError("call rljax.sharding.distributed.define_flags() at module level first")
  return initialize(DistributedConfig(**{k: f.value for k, f in _FLAGS.items()}))
