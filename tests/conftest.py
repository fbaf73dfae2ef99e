"""Session set-up: one persistent JAX compilation cache for the whole test run.

Many tests build the same programs (the tiny control trainer, the tiny LMs, the Playground
environments), in this process, in the other pytest-xdist worker and in subprocesses. With one
cache directory, each program compiles once per run and later builds load it from disk. Results
are unchanged (the cache returns the same executable); tests that count compilations count
in-memory jit cache entries, which the disk cache does not affect. ``RLJAX_COMPILATION_CACHE``
is exported so that the experiment scripts run by subprocess tests use the same directory
(unless a test passes its own ``--compilation_cache_dir``). Every program is stored, however
fast it compiled (``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0``, also exported): the
suite's many short processes build the same small programs (resets, samplers, evaluations)
again and again, and a tiny RLHF script run starts in 10 s instead of 15 s with them cached.
"""

import glob
import os
import tempfile

import pytest

from rljax import runtime

os.environ.setdefault(runtime.MIN_COMPILE_TIME_ENV, "0")
_CACHE = os.environ.setdefault(
    "RLJAX_COMPILATION_CACHE", os.path.join(tempfile.gettempdir(), "rljax-test-compilation-cache"))
runtime.enable_compilation_cache(_CACHE)

HH_RLHF_FILE = "hh-rlhf-harmless-base-test.jsonl.gz"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_hh_rlhf():
  """The HH-RLHF harmless-base test split (2,312 pairs), or None where it is absent.

  Looked for at ``$RLJAX_HH_RLHF``, then ``data/`` in the checkout, then a ``data/`` folder in
  any directory beside the checkout (``<parent>/*/data/``).
  """
  candidates = [os.environ.get("RLJAX_HH_RLHF", ""), os.path.join(_REPO, "data", HH_RLHF_FILE)]
  candidates += sorted(glob.glob(os.path.join(os.path.dirname(_REPO), "*", "data", HH_RLHF_FILE)))
  return next((c for c in candidates if c and os.path.isfile(c)), None)


@pytest.fixture(scope="session")
def hh_rlhf_path():
  """The path of `find_hh_rlhf`'s file; skips the test, naming the file, where it is absent."""
  path = find_hh_rlhf()
  if path is None:
    pytest.skip(f"needs {HH_RLHF_FILE} (HH-RLHF harmless-base test split) in $RLJAX_HH_RLHF, "
                f"{os.path.join(_REPO, 'data')} or a data/ folder beside the checkout")
  return path


# Modules whose tests share an expensive module-scoped fixture (a 2-process training run, an
# 8-device subprocess, a reference training run): under pytest-xdist one worker runs each of these
# modules whole, so the fixture is built once (CI built test_distributed_training's 137-144 s
# fixture on both workers before). xdist's own ``--dist=loadgroup`` cannot do this here: with
# pytest 9 its workers no longer tag test ids with the group, and subprocess tests run
# ``pytest -p no:xdist``, which would reject the option in ``addopts``.
ONE_WORKER_MODULES = frozenset({
    "test_control_reliability.py",
    "test_control_sharded.py",
    "test_distributed_rlhf_script.py",
    "test_distributed_training.py",
    "test_rlhf_reliability.py",
    "test_rlhf_sharded.py",
})


def _scope(nodeid):
  """The xdist work unit of a test id: its module for ``ONE_WORKER_MODULES``, else the test."""
  path = nodeid.split("::", 1)[0]
  return path if os.path.basename(path) in ONE_WORKER_MODULES else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """Replaces xdist's default ``load`` scheduling by one that keeps ``ONE_WORKER_MODULES`` whole.

  Other tests are scheduled one by one, as with ``load``; the whole modules go first (largest
  first), so they do not end the run on one worker. An explicit ``--dist`` other than ``load``
  is left to xdist.
  """
  if config.getvalue("dist") != "load":
    return None
  from xdist.scheduler import LoadScopeScheduling  # pylint: disable=import-outside-toplevel

  class _ModuleGroups(LoadScopeScheduling):

    def _split_scope(self, nodeid):
      return _scope(nodeid)

  return _ModuleGroups(config, log)
