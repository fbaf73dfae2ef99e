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
