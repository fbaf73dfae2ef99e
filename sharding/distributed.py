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
Use ~10 s in tests and on preemptible clusters. With it set, :func:`initialize` also starts an
rljax watchdog (:func:`start_watchdog`) that notices first (after half the timeout) and exits with
:data:`EXIT_LOST_PROCESS` and one line naming the lost process::

    rljax.sharding.distributed: lost process 1 of 2 (no heartbeat for 2.6 s; timeout 2.5 s); ...
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import time

import jax

_FLAGS: dict = {}
_WATCHDOG: dict = {}  # the running watchdog thread, for wait_for_lost_peer

# Exit status of a process whose peer was lost (EX_SOFTWARE from sysexits.h).
EXIT_LOST_PROCESS = 70
# Exit status of a process whose peers did not all connect in time (EX_UNAVAILABLE).
EXIT_NOT_CONNECTED = 69
# JAX's own connect deadline is this much later than rljax's, so rljax's message comes first.
_JAX_DEADLINE_MARGIN_S = 10
_HEARTBEAT_DIR = "rljax/heartbeat/"
_DONE_DIR = "rljax/done/"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
  """Arguments of :func:`initialize`.

  Attributes:
    coordinator_address: ``host:port`` of process 0's coordination service, or ``None``.
    num_processes: total processes, or ``None`` (SLURM / single process).
    process_id: this process's index in ``[0, num_processes)``, or ``None``.
    heartbeat_timeout_s: seconds without a heartbeat before a process is declared dead; ``None``
      keeps JAX's 100 s.
    initialization_timeout_s: seconds to wait for all processes to connect; then the process
      exits with `EXIT_NOT_CONNECTED` (69) and one line (see :func:`initialize`).
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
    if self.coordinator_address is not None:
      _check_address(self.coordinator_address)
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


def _check_address(address: str) -> None:
  """``host:port`` with a port in 1..65535 (JAX's own parsing fails with an IndexError or a
  crash on anything else)."""
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
    raise ValueError(f"coordinator_address must be host:port with a port in 1..65535 "
                     f"(e.g. 10.0.0.1:1234), got {address!r}")


def under_slurm() -> bool:
  """True inside a SLURM job step with more than one task."""
  return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


_CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _serialize_cpu_collectives() -> None:
  """Adds ``--xla_cpu_enable_concurrency_optimized_scheduler=false`` to ``XLA_FLAGS`` (read when
  the backend starts, so before any device use; CPU only, GPU/TPU ignore it).

  With XLA CPU's concurrency-optimised scheduler, 2-process RLHF runs on 127.0.0.1 (jax 0.10,
  gloo collectives) hung in the PPO update in 2 of 3 tries, both processes waiting in a
  collective; with the flag, 10 of 10 tries finished (3 with host offload). A user's own
  setting of the flag wins.
  """
  current = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_enable_concurrency_optimized_scheduler" not in current:
    os.environ["XLA_FLAGS"] = f"{current} {_CPU_SCHEDULER_FLAG}".strip()


def _say_connecting(who: str, config: DistributedConfig) -> None:
  """JAX waits silently for the other processes (and then aborts the process), so say so."""
  print(f"rljax.sharding.distributed: {who}; waiting up to {config.initialization_timeout_s} s "
        f"for all processes (--initialization_timeout_s)", file=sys.stderr, flush=True)


def _connect(who: str, hint: str, config: DistributedConfig, connect, *, exit_fn=os._exit
             ) -> None:
  """Runs ``connect()`` (``jax.distributed.initialize``); ends the process if it is not done
  within ``config.initialization_timeout_s``.

  JAX 0.10 on CPU answers its own connect deadline with a fatal C++ check ("the JAX distributed
  service detected fatal errors ... another task died") and SIGABRT (status 134), which names
  neither the timeout nor the likely mistake. So JAX's deadline is set
  ``_JAX_DEADLINE_MARGIN_S`` later, and a timer prints one line at rljax's deadline, naming this
  process, the wait and ``hint`` (what to check), and exits with `EXIT_NOT_CONNECTED` (69).
  """
  done = threading.Event()
  lock = threading.Lock()

  def expire():
    with lock:
      if done.is_set():
        return
      print(f"rljax.sharding.distributed: {who}: not all processes connected within "
            f"{config.initialization_timeout_s} s (--initialization_timeout_s); {hint}; exiting "
            f"with status {EXIT_NOT_CONNECTED}", file=sys.stderr, flush=True)
      exit_fn(EXIT_NOT_CONNECTED)

  timer = threading.Timer(config.initialization_timeout_s, expire)
  timer.daemon = True
  timer.start()
  try:
    connect()
  finally:
    with lock:
      done.set()
    timer.cancel()


def initialize(config: DistributedConfig | None = None) -> bool:
  """Starts JAX's multi-process runtime if this is a multi-process run.

  Must run before any other JAX call that touches devices. Afterwards ``jax.devices()`` lists
  every process's devices and ``rljax.sharding.mesh.make_mesh`` spans them all.

  Returns:
    True if ``jax.distributed.initialize`` was called, False for a single-process run.

  Raises:
    ValueError: for an incomplete explicit configuration (see :class:`DistributedConfig`).

  If the processes have not all connected within ``initialization_timeout_s``, the process
  prints one line (``rljax.sharding.distributed: process 0 of 2 ...: not all processes
  connected within 300 s ...``, with what to check) and exits with `EXIT_NOT_CONNECTED` (69),
  before JAX's own deadline (which, on CPU with jax 0.10, aborts with status 134).
  """
  config = config or DistributedConfig()
  if config.num_processes == 1 or (config.num_processes is None and not under_slurm()):
    return False
  _serialize_cpu_collectives()
  kwargs = {"initialization_timeout": config.initialization_timeout_s + _JAX_DEADLINE_MARGIN_S}
  if config.heartbeat_timeout_s is not None:
    kwargs["heartbeat_timeout_seconds"] = config.heartbeat_timeout_s
  if config.num_processes is not None:
    if config.num_processes == 1:
      return False
    who = (f"process {config.process_id} of {config.num_processes} (coordinator "
           f"{config.coordinator_address})")
    _say_connecting(f"process {config.process_id} of {config.num_processes} connecting to "
                    f"{config.coordinator_address}", config)
    _connect(who, f"start all {config.num_processes} processes with the same "
             f"--coordinator_address and --num_processes and each with its own --process_id in "
             f"[0, {config.num_processes}); process 0 serves the coordinator", config,
             lambda: jax.distributed.initialize(
                 coordinator_address=config.coordinator_address,
                 num_processes=config.num_processes, process_id=config.process_id, **kwargs))
  elif under_slurm():
    who = (f"SLURM task {os.environ.get('SLURM_PROCID', '?')} of "
           f"{os.environ.get('SLURM_NTASKS', '?')}")
    _say_connecting(f"{who} connecting (JAX's SLURM detection)", config)
    _connect(who, "check that every task of the step started (srun) and that the first node "
             "of the allocation is reachable from the others", config,
             lambda: jax.distributed.initialize(**kwargs))  # JAX detects SLURM itself
  else:
    return False
  if config.heartbeat_timeout_s is not None:
    start_watchdog(timeout_s=max(1.0, config.heartbeat_timeout_s / 2))
  return True


def start_watchdog(*, timeout_s: float, interval_s: float | None = None,
                   exit_fn=os._exit) -> threading.Thread:
  """Starts a daemon thread that exits this process when a peer process is lost.

  Every ``interval_s`` (default ``min(1, timeout_s / 4)``) each process bumps its own counter in
  the coordination service's key-value store and reads the others'. A process whose counter has
  not changed for ``timeout_s`` seconds (measured on this process's clock, so hosts' clocks need
  not agree), or an unreachable coordinator (process 0), counts as lost unless it exited normally
  (an ``atexit`` hook marks that, then waits up to ``timeout_s`` for every peer to mark it too,
  so a peer whose death ended this process's main thread through a failed collective is still
  named). Then one line naming the lost process ids is written to stderr
  and ``exit_fn(EXIT_LOST_PROCESS)`` is called (``os._exit``: the collectives in flight would
  otherwise wait on the dead peer until JAX's own heartbeat timeout).

  Call after ``jax.distributed.initialize``; :func:`initialize` does when
  ``heartbeat_timeout_s`` is set.

  Raises:
    RuntimeError: if ``jax.distributed`` is not initialized.
    ValueError: ``timeout_s`` or ``interval_s`` not > 0.
  """
  from jax._src import distributed as jax_distributed

  state = jax_distributed.global_state
  client = state.client
  if client is None:
    raise RuntimeError("start_watchdog: call jax.distributed.initialize() first")
  if not timeout_s > 0 or (interval_s is not None and not interval_s > 0):
    raise ValueError(f"timeout_s and interval_s must be > 0, got {timeout_s}, {interval_s}")
  interval_s = interval_s or min(1.0, timeout_s / 4)
  pid, n = int(state.process_id), int(state.num_processes)
  stop = threading.Event()
  seen = {j: (None, time.monotonic()) for j in range(n) if j != pid}  # counter, since when
  done: dict[int, str] = {}

  def lost(ids, why):
    print(f"rljax.sharding.distributed: lost process {', '.join(map(str, ids))} of {n} ({why}); "
          f"process {pid} exits with status {EXIT_LOST_PROCESS}", file=sys.stderr, flush=True)
    exit_fn(EXIT_LOST_PROCESS)

  def ids_of(entries):
    return {int(k.rstrip("/").rsplit("/", 1)[-1]): v for k, v in entries}

  def loop():
    count = 0
    while not stop.wait(interval_s):
      count += 1
      try:
        client.key_value_set(f"{_HEARTBEAT_DIR}{pid}", str(count), allow_overwrite=True)
        beats = ids_of(client.key_value_dir_get(_HEARTBEAT_DIR))
        done.update(ids_of(client.key_value_dir_get(_DONE_DIR)))
      except Exception as e:
        if stop.is_set():
          return
        if pid != 0:
          lost([0], f"the coordinator is unreachable: {type(e).__name__}: {str(e)[:200]}")
          return
        # The coordinator's own service is failing (it does once it has noticed a dead
        # task, or after a collective with it failed): judge by the last beats seen.
        beats = None
      now = time.monotonic()
      silent = []
      for j, (value, since) in list(seen.items()):
        if beats is not None and beats.get(j) != value:
          seen[j] = (beats.get(j), now)
        elif j not in done and now - since > timeout_s:
          silent.append((j, now - since))
      if silent and not stop.is_set():
        lost([j for j, _ in silent],
             f"no heartbeat for {max(t for _, t in silent):.1f} s; timeout {timeout_s:g} s")
        return

  def at_exit():
    # A dead peer often shows first as a failed collective that ends the main thread; JAX's
    # shutdown barrier would then wait for its own heartbeat timeout and abort without naming
    # it. So mark this process done, then wait until every peer has marked itself done too;
    # the loop names a peer that stays silent meanwhile (and exits this process). A beat
    # seen late does not count as alive: it may have been written just before the peer died.
    try:
      client.key_value_set(f"{_DONE_DIR}{pid}", "1", allow_overwrite=True)
    except Exception:  # pragma: no cover - the coordinator is already gone
      pass
    deadline = time.monotonic() + timeout_s + 3 * interval_s
    while time.monotonic() < deadline and thread.is_alive():
      if all(j in done for j in seen):
        break
      time.sleep(interval_s / 2)
    stop.set()

  thread = threading.Thread(target=loop, name="rljax-distributed-watchdog", daemon=True)
  thread.start()
  atexit.register(at_exit)  # runs before JAX's own atexit shutdown (registered earlier)
  _WATCHDOG.update(thread=thread, wait_s=timeout_s + 3 * interval_s)
  return thread


def wait_for_lost_peer() -> None:
  """After this process's main thread failed: lets the watchdog (if running) judge first.

  A dead peer usually shows first as a failed collective in the main thread (e.g. gloo's
  "Connection reset by peer"). Called before that error is reported, this waits up to the
  watchdog's timeout: if a peer is lost, the watchdog prints its one line and exits the
  process (status 70) from here, and the collective's traceback is never printed; otherwise
  (an error of this process's own) it returns and the error is reported as usual. Without a
  watchdog it returns at once.
  """
  thread = _WATCHDOG.get("thread")
  if thread is not None and thread.is_alive():
    thread.join(timeout=_WATCHDOG["wait_s"])


def define_flags() -> None:
  """Defines ``--coordinator_address``, ``--num_processes``, ``--process_id``,
  ``--heartbeat_timeout_s`` and ``--initialization_timeout_s`` absl flags (idempotent)."""
  from absl import flags

  # The flags belong to the calling script (absl then lists them in the script's --help).
  flags.disclaim_key_flags()

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
  _FLAGS["initialization_timeout_s"] = flags.DEFINE_integer(
      "initialization_timeout_s", 300, "Seconds to wait for all processes to connect at the "
      "start; then the process exits with status 69 and a line saying what to check.")


def config_from_flags() -> DistributedConfig:
  """The :class:`DistributedConfig` of the flags of :func:`define_flags`."""
  if not _FLAGS:
    raise RuntimeError("call rljax.sharding.distributed.define_flags() at module level first")
  return DistributedConfig(**{k: f.value for k, f in _FLAGS.items()})


def num_processes_of(config: DistributedConfig) -> int:
  """How many processes ``config`` (or SLURM, without explicit values) describes."""
  if config.num_processes is not None:
    return config.num_processes
  return int(os.environ.get("SLURM_NTASKS", "1")) if under_slurm() else 1


def initialize_from_flags() -> bool:
  """:func:`initialize` with the flags of :func:`define_flags` (call after absl parsed them)."""
  return initialize(config_from_flags())
