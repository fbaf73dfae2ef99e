"""Two JAX programs joined by the coordination service of JAX's distributed runtime.

`jax.distributed.initialize` joins N processes into one SPMD program: every process runs every
computation, and ``jax.process_count() == N``. A disaggregated RLHF run needs the opposite: a
trainer and a generator that each run their own programs on their own devices, at their own
pace, and only exchange messages and weights. :func:`connect` gives each of the two processes
the same coordination service (``jax.distributed``'s service and client: process 0 serves it)
without joining their devices, so each stays a one-process JAX program
(``jax.process_count() == 1``) and :class:`Link` carries:

* control messages and small arrays through the service's key-value store (`Link.put`,
  `Link.get`);
* device arrays through ``jax.experimental.transfer`` servers (`Link.transfer_server`), device
  to device without the host.

Each side beats a heartbeat every ``beat_s`` seconds; `Link.get` raises `LinkError`, naming the
peer, when the peer's heartbeat stops for ``peer_timeout_s`` or it reported a failure.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import jax

from rljax.sharding import distributed

_BEAT = "rljax/link/beat/"
_FAILED = "rljax/link/failed/"
_POLL_S = 0.25


class LinkError(RuntimeError):
  """The peer process stopped beating, reported a failure, or a message did not come in time."""


def _host_of(address: str) -> str:
  return address.rsplit(":", 1)[0].strip("[]")


def local_address(coordinator_address: str) -> str:
  """The address this host's transfer server binds to: the loopback when the coordinator is
  local (``127.0.0.1``, ``localhost``), else this host's address."""
  host = _host_of(coordinator_address)
  if host in ("127.0.0.1", "localhost", "::1"):
    return "127.0.0.1"
  return socket.gethostbyname(socket.gethostname())


@dataclasses.dataclass
class Link:
  """This process's end of a two-process link (make it with :func:`connect`).

  Attributes:
    process_id: 0 (serves the coordination service) or 1.
    peer_name: how errors name the other process, e.g. ``"the generator (process 1)"``.
    coordinator_address: ``host:port`` of the service.
    peer_timeout_s: seconds without the peer's heartbeat before `get` raises `LinkError`.
  """

  client: object
  service: object | None
  process_id: int
  coordinator_address: str
  peer_name: str
  peer_timeout_s: float
  beat_s: float = 0.5
  _stop: threading.Event = dataclasses.field(default_factory=threading.Event)
  _thread: threading.Thread | None = None

  @property
  def peer_id(self) -> int:
    return 1 - self.process_id

  def start_heartbeat(self) -> None:
    """Starts the daemon thread that bumps this process's heartbeat counter."""
    def beat():
      count = 0
      while not self._stop.wait(self.beat_s):
        count += 1
        try:
          self.client.key_value_set(f"{_BEAT}{self.process_id}", str(count),
                                    allow_overwrite=True)
        except Exception:  # the service is gone: the peer's get() reports it
          return
    self._thread = threading.Thread(target=beat, name="rljax-link-heartbeat", daemon=True)
    self._thread.start()

  def put(self, key: str, value: bytes) -> None:
    """Stores ``value`` under ``key`` (each key is written once)."""
    self.client.key_value_set_bytes(key, value)

  def fail(self, message: str) -> None:
    """Tells the peer this process failed (its `get` raises `LinkError` with ``message``)."""
    try:
      self.client.key_value_set(f"{_FAILED}{self.process_id}", message[:2000],
                                allow_overwrite=True)
    except Exception:  # pragma: no cover - the service is already gone
      pass

  def get(self, key: str, *, what: str, timeout_s: float | None = None) -> bytes:
    """The value under ``key``, waiting for it while the peer beats.

    Args:
      key: written by the peer with `put`.
      what: what is awaited, for the error (e.g. ``"the rollout of RL step 3"``).
      timeout_s: give up after this long even while the peer beats (None: never).

    Raises:
      LinkError: the peer reported a failure, its heartbeat stopped for ``peer_timeout_s``,
        the service is unreachable, or ``timeout_s`` passed; the message names the peer and
        ``what``.
    """
    start = last_change = time.monotonic()
    last_beat = None
    while True:
      try:
        return self.client.blocking_key_value_get_bytes(key, int(_POLL_S * 1000))
      except Exception as e:  # not there yet (DEADLINE_EXCEEDED) or the service is gone
        if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
          raise LinkError(f"{self.peer_name} is unreachable while waiting for {what}: "
                          f"{type(e).__name__}: {str(e)[:300]}") from e
      failed = self._try_get(f"{_FAILED}{self.peer_id}")
      if failed is not None:
        raise LinkError(f"{self.peer_name} failed while this process waited for {what}: "
                        f"{failed}")
      now = time.monotonic()
      beat = self._try_get(f"{_BEAT}{self.peer_id}")
      if beat != last_beat:
        last_beat, last_change = beat, now
      elif now - last_change > self.peer_timeout_s:
        raise LinkError(f"{self.peer_name} stopped (no heartbeat for {now - last_change:.1f} s; "
                        f"timeout {self.peer_timeout_s:g} s) while this process waited for "
                        f"{what}")
      if timeout_s is not None and now - start > timeout_s:
        raise LinkError(f"{self.peer_name} did not send {what} within {timeout_s:g} s")

  def _try_get(self, key: str) -> str | None:
    try:
      return self.client.key_value_try_get(key)
    except Exception:
      return None

  def transfer_server(self):
    """A ``jax.experimental.transfer`` server on this host's devices (for `pull` / `offer`)."""
    from jax.experimental import transfer

    host = local_address(self.coordinator_address)
    return transfer.start_transfer_server(jax.local_devices()[0].client, f"{host}:0",
                                          [f"{host}:0"])

  def close(self) -> None:
    """Stops the heartbeat and disconnects (process 0 also stops the service)."""
    self._stop.set()
    try:
      self.client.shutdown()
    except Exception:
      pass
    if self.service is not None:
      self.service.shutdown()


def connect(config: distributed.DistributedConfig, *, peer_names: tuple[str, str],
            peer_timeout_s: float = 10.0) -> Link:
  """Joins this process to its peer through a coordination service (process 0 serves it).

  Args:
    config: ``coordinator_address``, ``num_processes`` (must be 2) and ``process_id``, as for
      `rljax.sharding.distributed.initialize`; under SLURM with 2 tasks (and no explicit
      values) they come from the allocation (``SLURM_PROCID``, the first node).
    peer_names: how each process is named in the other's errors, ``(process 0, process 1)``.
    peer_timeout_s: see :class:`Link`.

  Raises:
    ValueError: not a two-process configuration (naming the count).
    LinkError: the peer did not connect within ``config.initialization_timeout_s``.
  """
  from jax._src.lib import _jax

  address, n, pid = resolve(config)
  if n != 2:
    raise ValueError(f"a link joins exactly 2 processes (a trainer and a generator), got {n}")
  service = None
  if pid == 0:
    bind = f"[::]:{address.rsplit(':', 1)[1]}"
    service = _jax.get_distributed_runtime_service(bind, 2, heartbeat_timeout=3600)
  client = _jax.get_distributed_runtime_client(
      address, pid, init_timeout=config.initialization_timeout_s, heartbeat_timeout=3600,
      missed_heartbeat_callback=lambda *args: None, shutdown_on_destruction=False,
      use_compression=True)
  try:
    client.connect()
  except Exception as e:
    if service is not None:
      service.shutdown()
    raise LinkError(f"process {pid} of 2: {peer_names[1 - pid]} did not connect to {address} "
                    f"within {config.initialization_timeout_s} s: {str(e)[:300]}") from e
  link = Link(client=client, service=service, process_id=pid, coordinator_address=address,
              peer_name=peer_names[1 - pid], peer_timeout_s=peer_timeout_s)
  link.start_heartbeat()
  return link


def resolve(config: distributed.DistributedConfig) -> tuple[str, int, int]:
  """``(coordinator_address, num_processes, process_id)`` of explicit values or SLURM's."""
  if config.num_processes is not None:
    return config.coordinator_address, config.num_processes, config.process_id
  from jax._src import clusters

  slurm = clusters.SlurmCluster  # JAX's own SLURM detection (first node, job-id port)
  return (slurm.get_coordinator_address(None, None), slurm.get_process_count(),
          slurm.get_process_id())
