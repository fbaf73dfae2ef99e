"""Process-level set-up shared by the experiment scripts: compilation cache, compiler
options, host threads for calls side by side on CPU, user errors."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import sys
import traceback
from typing import Callable

import jax

from rljax.sharding import distributed

DEFAULT_CACHE_DIR = os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")),
    "rljax",
    "jax_compilation_cache",
)


MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def enable_compilation_cache(path: str | None = None) -> str:
  """Turns on JAX's persistent compilation cache in ``path`` (a user cache directory).

  A second run of the same configuration then loads its compiled programs from disk
  instead of compiling them again. Programs that compiled in under 1 s are not stored, unless
  ``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` (JAX's own setting) names another
  threshold in seconds: 0 stores every program, which pays where the same small programs are
  built by many short processes (a test suite). Returns the directory used.

  Raises:
    ValueError: that variable is not a number >= 0.
  """
  path = path or os.environ.get("RLJAX_COMPILATION_CACHE", DEFAULT_CACHE_DIR)
  raw = os.environ.get(MIN_COMPILE_TIME_ENV, "1.0")
  try:
    min_secs = float(raw)
  except ValueError:
    min_secs = -1.0
  if not min_secs >= 0:
    raise ValueError(f"${MIN_COMPILE_TIME_ENV}={raw!r} must be a number of seconds >= 0")
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


# XLA's CPU backend (jaxlib 0.10) hands dot products to YNNPACK fusions by default. MJX physics
# is full of tiny dots (3x3 and 6x6 per body and contact), for which that path costs far more
# than XLA's own emitter, so it is turned off for the control programs (docs/performance.md);
# benchmarks/control_throughput.py measures the physics limit both ways.
_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def _cpu_options_supported() -> bool:
  """Whether the installed XLA knows ``_CPU_OPTIONS`` (compiles a scalar function once)."""
  try:
    jax.jit(lambda x: x + 1, compiler_options=_CPU_OPTIONS).lower(0.0).compile()
  except Exception:  # an XLA without the option: keep its defaults
    return False
  return True


def control_compiler_options(backend: str | None = None) -> dict[str, str]:
  """XLA compiler options for rljax's physics computations: the train chunk (rollout and
  update) and the evaluation.

  ``{"xla_cpu_experimental_ynn_fusion_type": ""}`` on CPU, when the installed XLA knows the
  option; ``{}`` on other backends or if not. Pass the result to
  ``jax.jit(..., compiler_options=...)``. The reset and the networks' initialisation, which
  run once, use `run_once_compiler_options` instead.
  """
  if (backend or jax.default_backend()) != "cpu" or not _cpu_options_supported():
    return {}
  return dict(_CPU_OPTIONS)


def run_once_compiler_options(backend: str | None = None) -> dict[str, int]:
  """XLA compiler options for a computation that runs once per run: the environments' reset
  and the networks' initialisation.

  ``{"xla_backend_optimization_level": 0}`` on CPU (LLVM without optimisation passes), ``{}``
  elsewhere: a program that runs once compiles and runs sooner unoptimised than optimised
  (docs/performance.md). The unoptimised build may differ from an optimised one in
  the last bits (no fused multiply-adds); every run builds it the same way, so runs stay
  bitwise reproducible.
  """
  if (backend or jax.default_backend()) != "cpu":
    return {}
  return {"xla_backend_optimization_level": 0}


def host_threads(n: int, min_per_thread: int, cores: int | None = None) -> int:
  """How many host threads to split ``n`` items (environments, batch rows) over on CPU.

  The largest divisor ``k`` of ``n`` that is at most ``cores`` and leaves each thread at least
  ``min_per_thread`` items (``n // k >= min_per_thread``); 1 if none. ``cores`` defaults to the
  CPUs this process may run on (``os.sched_getaffinity``; ``os.cpu_count()`` where that is not
  known). E.g. ``(256, 32, 2) -> 2``, ``(256, 32, 12) -> 8``, ``(100, 32, 8) -> 2``,
  ``(16, 16, 2) -> 1``.

  Used where one XLA:CPU program does not keep the cores busy and one call per group of items,
  each from its own thread, does (`rljax.control.host_chunks.ThreadedChunk`, the sampler's
  ``batch_threads``).
  """
  if not cores:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return max((k for k in range(1, cores + 1) if n % k == 0 and n // k >= min_per_thread),
             default=1)


def map_on_threads(fn: Callable, items, pool: concurrent.futures.Executor | None = None
                   ) -> list:
  """``[fn(x) for x in items]``, the calls side by side: the first on this thread, each other
  on a thread of ``pool`` (``None``: a pool of ``len(items) - 1`` threads made for this call).

  Each call should wait for its result (``jax.block_until_ready``) inside ``fn``: so called,
  XLA's CPU client runs the calls' programs side by side, while programs called from one thread
  run one after another. Used by `rljax.control.host_chunks.ThreadedChunk` and the sampler's
  batch threads.
  """
  items = list(items)
  if len(items) == 1:
    return [fn(items[0])]
  if pool is None:
    with concurrent.futures.ThreadPoolExecutor(len(items) - 1) as own:
      return map_on_threads(fn, items, own)
  others = [pool.submit(fn, x) for x in items[1:]]
  return [fn(items[0])] + [f.result() for f in others]


def is_primary() -> bool:
  """Whether this process writes the run's logs (process 0; always True with one process).

  In a multi-process run every process computes the same metrics, so only process 0 writes
  ``metrics.jsonl``, TensorBoard events, ``run_info.json`` and the progress bar; all
  processes take part in checkpoint writes (orbax coordinates them).
  """
  return jax.process_index() == 0


def primary_print(*args, **kwargs) -> None:
  """``print`` on process 0 only, so that a multi-process run's console shows each progress
  and summary line once (errors are still printed by every process)."""
  if is_primary():
    print(*args, **kwargs)


def sync_processes(name: str) -> None:
  """A barrier across all processes (``multihost_utils.sync_global_devices``); a no-op with
  one process."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def to_host(tree):
  """``jax.device_get`` that also works for arrays spread over several processes: those are
  all-gathered (``multihost_utils.process_allgather``), so every process gets the whole value.
  Returns numpy leaves. With several processes every process must call it (a collective)."""
  import numpy as np

  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
      from jax.experimental import multihost_utils

      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))

  return jax.tree.map(get, tree)


def configure_logging(verbose: bool = False) -> None:
  """Keeps the console to the progress bar and results.

  Lowers absl's (orbax's) INFO logs and Warp's per-kernel "Module ... load" timers to
  warnings, unless ``verbose``.
  """
  from absl import logging

  logging.set_verbosity(logging.INFO if verbose else logging.WARNING)
  try:
    import warp
  except ImportError:  # Warp ships with MJX; nothing to quieten without it.
    return
  warp.config.log_level = warp.LOG_INFO if verbose else warp.LOG_WARNING


# Errors that mean "the user asked for something invalid": reported in one line.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, KeyError, FileNotFoundError)


def run_main(main: Callable[[], int | None], *, verbose: bool) -> None:
  """Runs ``main``; a user error exits with status 2 and a one-line message.

  With ``verbose`` the traceback is printed too. Another error in a multi-process run first
  waits for the lost-process watchdog (`rljax.sharding.distributed.wait_for_lost_peer`): when
  a peer died, the process exits with status 70 and one line naming it instead of the failed
  collective's traceback.
  """
  try:
    code = main()
  except USER_ERRORS as e:
    if verbose:
      traceback.print_exc()
    msg = e.args[0] if isinstance(e, KeyError) and e.args else e
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)
  except Exception:
    if jax.process_count() > 1:  # a lost peer is named (status 70), not a collective's traceback
      distributed.wait_for_lost_peer()
    raise
  sys.exit(code or 0)
