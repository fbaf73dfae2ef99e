"""Session set-up: one persistent JAX compilation cache for the whole test run.

Many tests build the same programs (the tiny control trainer, the tiny LMs, the Playground
environments), in this process, in the other pytest-xdist worker and in subprocesses. With one
cache directory, each program compiles once per run and later builds load it from disk. Results
are unchanged (the cache returns the same executable); tests that count compilations count
in-memory jit cache entries, which the disk cache does not affect. ``RLJAX_COMPILATION_CACHE``
is exported so that the experiment scripts run by subprocess tests use the same directory
(unless a test passes its own ``--compilation_cache_dir``).
"""

import os
import tempfile

from rljax import runtime

_CACHE = os.environ.setdefault(
    "RLJAX_COMPILATION_CACHE", os.path.join(tempfile.gettempdir(), "rljax-test-compilation-cache"))
runtime.enable_compilation_cache(_CACHE)
