"""Helpers for tests that start several local processes (jax.distributed on 127.0.0.1)."""

import os
import socket


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now (for the coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def subprocess_env(*, cpu: bool = True) -> dict[str, str]:
  """This environment without ``SLURM_*`` variables and ``XLA_FLAGS`` (no fake devices), with
  ``JAX_PLATFORMS=cpu`` when ``cpu``."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "XLA_FLAGS"}
  if cpu:
    env["JAX_PLATFORMS"] = "cpu"
  return env


def wait_all(procs, timeout: float = 600) -> list[tuple[str, str]]:
  """``(stdout, stderr)`` of every process (``text=True`` pipes) once all have exited with
  status 0; kills any still running on a timeout or failure."""
  try:
    outs = [p.communicate(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, out[-2000:] + err[-3000:]
  return outs
