"""Logical axis names shared by every rljax network, and the activation annotation helper.

Model code never names mesh axes. It names what an array dimension *means* with the constants
below; the sharding layer (``rljax.sharding``) owns the one rules table that maps each logical
name to a mesh axis (``'data'``, ``'fsdp'``, ``'tensor'``) or to nothing.

Parameters carry their names as ``nnx.Variable`` metadata (``out_sharding``), so
``nnx.get_partition_spec(state)`` under ``flax.core.spmd.logical_axis_rules(rules)`` gives a
``PartitionSpec`` tree. Activations are annotated with :func:`constrain`, which is the identity
unless both logical rules and a mesh are active, so every model runs unchanged on one CPU device.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax.core import spmd as flax_spmd

# The logical axis names. Use the constants, not string literals, in model code.
VOCAB = "vocab"          # vocabulary entries (embedding rows, logits)
EMBED = "embed"          # the residual stream / hidden size
HEADS = "heads"          # query heads
KV_HEADS = "kv_heads"    # key/value heads (grouped-query attention)
HEAD_DIM = "head_dim"    # the feature dimension inside one head
MLP = "mlp"              # the feed-forward hidden size
BATCH = "batch"          # sequences in a batch
LENGTH = "length"        # token positions (sequence length, KV-cache slots)

ALL_AXES: tuple[str, ...] = (VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, BATCH, LENGTH)

LogicalAxes = tuple[str | None, ...]


def _current_mesh():
  """The mesh of the enclosing ``jax.sharding.use_mesh``/``set_mesh`` context, or ``None``."""
  try:
    mesh = jax.sharding.get_abstract_mesh()
  except Exception:  # pragma: no cover - very old jax
    return None
  if mesh is None or not mesh.shape_tuple:
    return None
  return mesh


def logical_to_mesh(names: Sequence[str | None]) -> jax.sharding.PartitionSpec:
  """Maps logical names to a ``PartitionSpec`` with the active ``logical_axis_rules``.

  Names without a rule map to ``None`` (replicated).
  """
  rules = dict(flax_spmd.get_logical_axis_rules())
  return jax.sharding.PartitionSpec(*(rules.get(n) if n is not None else None for n in names))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Annotates activation ``x`` with one logical name per dimension.

  Outside a mesh context (``jax.set_mesh``), or with no logical rules set, this returns ``x``
  unchanged (no sharding op is emitted), which keeps single-device CPU runs free of them. Inside
  one it emits ``with_sharding_constraint`` (``Auto`` mesh axes) or ``reshard`` (``Explicit``).

  Raises:
    ValueError: if ``len(names) != x.ndim``.
  """
  if len(names) != x.ndim:
    raise ValueError(
        f"constrain: {len(names)} axis names {tuple(names)} for an array of rank {x.ndim}")
  if not flax_spmd.get_logical_axis_rules():
    return x
  mesh = _current_mesh()
  if mesh is None:
    return x
  spec = logical_to_mesh(names)
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return jax.sharding.reshard(x, spec)  # explicit-sharding meshes: a constraint is a reshard
  return jax.lax.with_sharding_constraint(x, spec)
