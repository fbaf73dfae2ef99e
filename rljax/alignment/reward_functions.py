"""Reward functions named on the command line, and the prompt files they score.

``train_rlhf.py --reward_fn=package.module:function --prompts=FILE.jsonl`` trains against a
program instead of a reward model, as verifiable-reward recipes do (math checkers, unit tests,
format checks). The function is called on the host once per RL step with the batch's decoded
responses and, for each other column of the prompt file, the batch's values of that column::

    def fn(responses: list[str], **fields) -> list[float]    # fields: {"answer": [...], ...}

:class:`ColumnReward` adapts such a function to the trainer's ``reward_fn(Samples) -> [B]``
(`rljax.alignment.rlhf.RewardFn`) and checks what it returns: a function that raises, returns
another number of values than responses, or a non-finite value stops the run with a
:class:`RewardFunctionError` naming the function, the RL step and the row.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rljax.envs.text import data as text_data

ColumnFn = Callable[..., Sequence[float]]


class RewardFunctionError(ValueError):
  """A reward function that cannot be loaded, raised, or returned values the trainer cannot
  use; the message names the function (and, when scoring, the RL step and the row)."""


def load_function(spec: str) -> ColumnFn:
  """Imports the function ``spec`` names: ``package.module:function`` (importable from
  ``sys.path``, which holds the running script's folder) or ``path/to/file.py:function``.

  Raises:
    RewardFunctionError: a spec without ``:``, a module that cannot be imported (its error
      named), no such attribute, or an attribute that is not callable.
  """
  module_name, sep, attr = spec.rpartition(":")
  if not sep or not module_name or not attr:
    raise RewardFunctionError(
        f"--reward_fn {spec!r}: expected package.module:function or path/to/file.py:function")
  try:
    if module_name.endswith(".py"):
      if not os.path.isfile(module_name):
        raise FileNotFoundError(f"no such file {module_name!r}")
      # One module per file and process, as `import` keeps one per name: the script's check
      # and the pipeline then load the same function without running the file twice.
      name = f"rljax_reward_{abs(hash(os.path.abspath(module_name)))}"
      module = sys.modules.get(name)
      if module is None:
        module_spec = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        sys.modules[name] = module  # only once it ran: a failed import is retried
    else:
      module = importlib.import_module(module_name)
  except Exception as e:  # any import-time failure of the user's module is named
    raise RewardFunctionError(f"--reward_fn {spec!r}: cannot import {module_name!r}: "
                              f"{type(e).__name__}: {e}") from None
  fn = getattr(module, attr, None)
  if fn is None:
    raise RewardFunctionError(f"--reward_fn {spec!r}: module {module_name!r} has no {attr!r}")
  if not callable(fn):
    raise RewardFunctionError(f"--reward_fn {spec!r}: {attr!r} is a {type(fn).__name__}, "
                              f"not a function")
  return fn


@dataclasses.dataclass(frozen=True)
class PromptFile:
  """A prompt file's rows: ``prompts`` (``N`` strings) and ``fields``, every other column as a
  list of ``N`` values (JSON values as read; ``None`` where a row lacks the column)."""

  prompts: list[str]
  fields: dict[str, list[Any]]


def load_prompt_file(path: str | os.PathLike) -> PromptFile:
  """Reads a JSONL(.gz) prompt file: one object per line with a string ``prompt`` and any other
  columns (e.g. ``answer``). Byte-order marks, Windows line endings and gzip are read as
  `rljax.envs.text.data.read_jsonl` reads them.

  Raises:
    FileNotFoundError: no such file.
    rljax.envs.text.data.DataError: ``"{path}:{line}: ..."`` for a line without a string
      ``prompt`` or broken JSON; an empty file.
  """
  path = os.fspath(path)
  rows = []
  for lineno, obj in text_data.read_jsonl(path):
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
      found = "missing" if prompt is None else f"a {type(prompt).__name__}"
      raise text_data.DataError(f"{path}:{lineno}: 'prompt' must be a string, it is {found} "
                                f"(keys present: {sorted(obj)})")
    rows.append(obj)
  if not rows:
    raise text_data.DataError(f"{path}: empty prompt file (no prompts)")
  columns = sorted({k for r in rows for k in r} - {"prompt"})
  return PromptFile([r["prompt"] for r in rows], {c: [r.get(c) for r in rows] for c in columns})


def function_name(fn: Callable) -> str:
  """``module:qualname`` of ``fn``, for messages."""
  module = getattr(fn, "__module__", None) or "?"
  return f"{module}:{getattr(fn, '__qualname__', repr(fn))}"


class ColumnReward:
  """``fn(responses, **fields) -> [B]`` as a trainer reward ``reward_fn(Samples) -> [B]`` f32.

  Each call passes ``samples.response_text`` and, for every column of ``fields``, the values of
  the batch's prompt rows (``samples.prompt_index``), one list per column.

  Args:
    fn: the user's function.
    fields: the prompt file's other columns (`PromptFile.fields`), indexed by prompt row.
    name: how messages name ``fn`` (default: ``module:qualname``).

  Raises (on call):
    RewardFunctionError: ``fn`` raised (its exception named), returned something that is not
      ``B`` numbers, or a non-finite number (the first such row and its prompt named).
  """

  def __init__(self, fn: ColumnFn, fields: dict[str, list[Any]] | None = None,
               name: str | None = None):
    self.fn = fn
    self.fields = dict(fields or {})
    self.name = name or function_name(fn)

  def __call__(self, samples) -> np.ndarray:
    rows = list(samples.prompt_index)
    b = len(samples.response_text)
    if self.fields and len(rows) != b:
      raise ValueError(f"Samples.prompt_index has {len(rows)} rows for {b} responses")
    kwargs = {k: [col[i] for i in rows] for k, col in self.fields.items()}
    where = f"reward function {self.name} at RL step {samples.step}"
    try:
      out = self.fn(list(samples.response_text), **kwargs)
    except Exception as e:  # the user's code: named, with its own message
      raise RewardFunctionError(f"{where} raised {type(e).__name__}: {e}") from e
    try:
      scores = np.asarray(out, dtype=np.float64)
    except (TypeError, ValueError):
      raise RewardFunctionError(f"{where} returned {type(out).__name__} {_short(out)}; expected "
                                f"a list of {b} floats, one per response") from None
    if scores.shape != (b,):
      raise RewardFunctionError(f"{where} returned {_count(scores)} for {b} responses; "
                                f"expected a list of {b} floats, one per response")
    bad = np.flatnonzero(~np.isfinite(scores))
    if bad.size:
      row = int(bad[0])
      raise RewardFunctionError(
          f"{where} returned {scores[row]} for row {row} (prompt {samples.prompt_text[row]!r}, "
          f"response {samples.response_text[row]!r}); rewards must be finite")
    return scores.astype(np.float32)


def _count(scores) -> str:
  if scores.ndim == 1:
    return f"{scores.shape[0]} value{'s' if scores.shape[0] != 1 else ''}"
  return f"an array of shape {scores.shape}"


def _short(x, limit: int = 60) -> str:
  text = repr(x)
  return text if len(text) <= limit else text[:limit - 3] + "..."


__all__ = ["ColumnReward", "PromptFile", "RewardFunctionError", "function_name",
           "load_function", "load_prompt_file"]
