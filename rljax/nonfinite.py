"""The non-finite guard every trainer uses: a non-finite value never reaches the parameters.

Inside the compiled update a trainer computes one ``[]`` bool, ``apply``: every reward and
observation of the batch is finite and no minibatch step met a non-finite loss or gradient
(`rljax.ppo.ppo_update` skips those steps and counts them in ``nonfinite_steps``). Then
`keep_where` selects, leaf by leaf, the new state where ``apply`` holds and the old one
elsewhere, so a skipped update leaves parameters, optimizer state and normaliser bit for bit
as they were, with no host round trip.

On the host the trainer's `Policy` decides what a skipped update does: ``"skip"`` warns and
goes on, ``"halt"`` checkpoints the (still finite) state and stops with `NonFiniteHalt`, which
the scripts turn into exit status `EXIT_NONFINITE`. The host loop (`rljax.loop.run`) applies it
through a `Watch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# Exit status of a run stopped by a non-finite value with ``nonfinite="halt"``.
EXIT_NONFINITE = 3

POLICIES = ("skip", "halt")


class NonFiniteHalt(RuntimeError):
  """Raised with ``nonfinite="halt"`` after the last good state was checkpointed; the scripts
  exit with :data:`EXIT_NONFINITE`."""


def check_policy(value: str, error: type[Exception] = ValueError) -> str:
  """``value`` if it is one of `POLICIES`.

  Raises:
    error: "nonfinite must be 'skip' or 'halt', got ..." naming the value.
  """
  if value not in POLICIES:
    raise error(f"nonfinite must be 'skip' or 'halt', got {value!r}.")
  return value


def all_finite(*trees: Any) -> jax.Array:
  """``[]`` bool: every element of every floating leaf of ``trees`` is finite."""
  leaves = [x for t in trees for x in jax.tree.leaves(t)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
  ok = jnp.asarray(True)
  for x in leaves:
    ok = ok & jnp.all(jnp.isfinite(x))
  return ok


def keep_where(apply: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where the ``[]`` bool ``apply`` holds, else ``old``, leaf by leaf (same trees)."""
  return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)


class Watch(NamedTuple):
  """What the host loop needs to apply a trainer's non-finite policy after each step.

  Attributes:
    policy: ``"skip"`` or ``"halt"``.
    skipped: ``state -> int``, the updates skipped since the run began.
    describe: ``(step, state, record, before, now) -> str``, the message for the updates
      skipped at ``step`` (``now - before`` of them; ``record`` is the step's), naming the
      step and the quantity.
    warn: where a skip is reported under ``"skip"``; None where the step reports it itself
      (`rljax.alignment.rlhf.RLHFTrainer.step`).
  """

  policy: str
  skipped: Callable[[Any], int]
  describe: Callable[[int, Any, dict[str, Any], int, int], str]
  warn: Callable[[str], None] | None = None
