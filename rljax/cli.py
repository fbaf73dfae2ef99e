"""Command-line conventions shared by the experiment scripts and the benchmarks (absl flags).

Every script names the same thing the same way (docs/architecture.md lists the names), and an
old spelling stays accepted for one release: `run` (the scripts' ``app.run``) rewrites it to the
current one and prints a warning (`rewrite_deprecated`). The compilation-cache and video-size
flags are defined here once for every script that takes them.

This module imports absl and the standard library only, so scripts define their flags before
JAX is imported (a bad flag exits in about a second).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from absl import app, flags

# The flags defined here belong to the calling script, so absl lists them in its --help.
flags.disclaim_key_flags()

def rewrite_deprecated(argv: Sequence[str], aliases: Mapping[str, str],
                       stream: TextIO | None = None) -> list[str]:
  """``argv`` with each old flag spelling replaced by its current one.

  Args:
    argv: the command line, program name first.
    aliases: old spelling -> current spelling, both with their dashes, e.g.
      ``{"--lr": "--pretrain_lr", "--batch-sizes": "--batch_sizes", "--no-bf16": "--nobf16"}``.
      An old spelling is replaced both as ``--old=value`` and as ``--old`` (its value, if any,
      then follows as the next argument, which absl accepts too).
    stream: where the notes go (default: ``sys.stderr``); one per old spelling used.

  Returns:
    The rewritten command line. Arguments after ``--`` are left as they are.
  """
  stream = sys.stderr if stream is None else stream
  out, warned = list(argv[:1]), set()
  for i, arg in enumerate(argv[1:], start=1):
    if arg == "--":
      out.extend(argv[i:])
      break
    name, eq, value = arg.partition("=")
    new = aliases.get(name)
    if new is None:
      out.append(arg)
      continue
    if name not in warned:
      warned.add(name)
      print(f"warning: {name} is deprecated and will be removed in the next release; "
            f"use {new}", file=stream, flush=True)
    out.append(new + eq + value)
  return out


def run(main: Callable[[list[str]], object], aliases: Mapping[str, str] | None = None) -> None:
  """``absl.app.run(main)`` on ``sys.argv`` with the old spellings in ``aliases`` rewritten
  (`rewrite_deprecated`)."""
  app.run(main, argv=rewrite_deprecated(sys.argv, aliases or {}))


@dataclasses.dataclass(frozen=True)
class CompilationCacheFlags:
  """``--compilation_cache`` (default on) and ``--compilation_cache_dir``."""

  enabled: flags.FlagHolder
  directory: flags.FlagHolder

  def apply(self) -> str | None:
    """Turns on JAX's persistent compilation cache as the flags say; returns its directory
    (None when ``--nocompilation_cache``)."""
    if not self.enabled.value:
      return None
    from rljax import runtime  # imports JAX: only once the flags are parsed

    return runtime.enable_compilation_cache(self.directory.value)


def define_compilation_cache_flags() -> CompilationCacheFlags:
  """Defines ``--compilation_cache`` and ``--compilation_cache_dir`` (call once per script)."""
  return CompilationCacheFlags(
      enabled=flags.DEFINE_bool(
          "compilation_cache", True, "Use JAX's persistent compilation cache, so that a second "
          "run of the same configuration skips most compilation."),
      directory=flags.DEFINE_string(
          "compilation_cache_dir", None,
          "Compilation cache directory (default $RLJAX_COMPILATION_CACHE or "
          "~/.cache/rljax/jax_compilation_cache)."))


def define_video_size_flag() -> flags.FlagHolder:
  """``--video_size=HEIGHT,WIDTH`` (pixels per environment, default 240,320), as the training and
  the rendering scripts take it; read it with `video_size`."""
  return flags.DEFINE_list("video_size", ["240", "320"],
                           "Video height,width in pixels per environment (even for MP4).")


def video_size(holder: flags.FlagHolder) -> tuple[int, int]:
  """``(height, width)`` of a `define_video_size_flag` flag.

  Raises:
    ValueError: not two integers, naming the value.
  """
  try:
    height, width = (int(v) for v in holder.value)
  except ValueError:
    raise ValueError(f"--video_size must be two integers HEIGHT,WIDTH, got "
                     f"{','.join(holder.value)!r}.") from None
  return height, width

