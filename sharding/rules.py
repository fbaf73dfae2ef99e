"""The one logical-axis rules table, its presets, and helpers that shard params and optimizer state.

Model code names array dimensions logically (:mod:`rljax.models.axes`). This module maps those
names to the mesh axes of :mod:`rljax.sharding.mesh` with ONE table, whose columns are the presets:

============  ===============  ===============  ===============  ===============
logical       ``fsdp``         ``fsdp_tp``      ``dp``           ``tp``
============  ===============  ===============  ===============  ===============
batch         (data, fsdp)     (data, fsdp)     (data, fsdp)     (data, fsdp)
length        -                -                -                -
embed         fsdp             fsdp             -                -
vocab         -                tensor           -                tensor
heads         -                tensor           -                tensor
kv_heads      -                tensor           -                tensor
head_dim      -                -                -                -
mlp           -                tensor           -                tensor
============  ===============  ===============  ===============  ===============

* ``fsdp``: ZeRO-3 training: every weight matrix is split along its ``embed`` dimension over
  ``fsdp``; XLA all-gathers it for the matmul and reduce-scatters its gradient.
* ``fsdp_tp``: as ``fsdp``, plus Megatron tensor parallelism over ``tensor``.
* ``dp``: parameters replicated; only the batch is split (small models, the control side, and
  data-parallel generation).
* ``tp``: tensor parallel without fsdp: the generation layout (no all-gather per decode step).

Parameters and activations read the same table with one difference: for activations the ``fsdp``
axis is a data axis (it already carries the batch), so it is dropped from every name but ``batch``
(:func:`activation_rules`). A mesh axis that does not divide a dimension is dropped for that array
(it is replicated along it) rather than failing, so tiny test models shard on any mesh;
:func:`spec_for` documents this.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax.models import axes
from rljax.sharding.mesh import DATA, FSDP, TENSOR


class Preset(enum.Enum):
  """Named columns of :data:`RULES`. ``Preset('fsdp')`` parses the ``--sharding_rules`` flag."""

  FSDP = "fsdp"
  FSDP_TP = "fsdp_tp"
  DP = "dp"
  TP = "tp"


MeshAxes = str | tuple[str, ...] | None

_BATCH = (DATA, FSDP)
# The table: logical name -> {preset: mesh axes}. Names missing here are replicated.
RULES: Mapping[str, Mapping[Preset, MeshAxes]] = {
    axes.BATCH: {Preset.FSDP: _BATCH, Preset.FSDP_TP: _BATCH, Preset.DP: _BATCH, Preset.TP: _BATCH},
    axes.LENGTH: {Preset.FSDP: None, Preset.FSDP_TP: None, Preset.DP: None, Preset.TP: None},
    axes.EMBED: {Preset.FSDP: FSDP, Preset.FSDP_TP: FSDP, Preset.DP: None, Preset.TP: None},
    axes.VOCAB: {Preset.FSDP: None, Preset.FSDP_TP: TENSOR, Preset.DP: None, Preset.TP: TENSOR},
    axes.HEADS: {Preset.FSDP: None, Preset.FSDP_TP: TENSOR, Preset.DP: None, Preset.TP: TENSOR},
    axes.KV_HEADS: {Preset.FSDP: None, Preset.FSDP_TP: TENSOR, Preset.DP: None, Preset.TP: TENSOR},
    axes.HEAD_DIM: {Preset.FSDP: None, Preset.FSDP_TP: None, Preset.DP: None, Preset.TP: None},
    axes.MLP: {Preset.FSDP: None, Preset.FSDP_TP: TENSOR, Preset.DP: None, Preset.TP: TENSOR},
}


def as_preset(preset: Preset | str) -> Preset:
  """``Preset`` from an enum member or its flag spelling. Raises ``ValueError`` naming the value."""
  if isinstance(preset, Preset):
    return preset
  try:
    return Preset(preset)
  except ValueError:
    raise ValueError(
        f"unknown sharding rules preset {preset!r}; choose one of {[p.value for p in Preset]}"
    ) from None


def param_rules(preset: Preset | str) -> tuple[tuple[str, MeshAxes], ...]:
  """``(logical, mesh_axes)`` pairs for parameters (flax ``logical_axis_rules`` format)."""
  preset = as_preset(preset)
  return tuple((name, row[preset]) for name, row in RULES.items())


def _without(mesh_axes: MeshAxes, drop: str) -> MeshAxes:
  if mesh_axes is None or mesh_axes == drop:
    return None
  if isinstance(mesh_axes, tuple):
    kept = tuple(a for a in mesh_axes if a != drop)
    return kept or None
  return mesh_axes


def activation_rules(preset: Preset | str) -> tuple[tuple[str, MeshAxes], ...]:
  """``(logical, mesh_axes)`` pairs for activations: as :func:`param_rules`, but ``fsdp`` is a
  data axis, so it only appears under ``batch``. Use with :func:`use_rules` or directly with
  ``flax.core.spmd.logical_axis_rules`` around model calls (see ``rljax.models.axes.constrain``).
  """
  return tuple((name, ax if name == axes.BATCH else _without(ax, FSDP))
               for name, ax in param_rules(preset))


def spec_for(shape: Sequence[int], names: Sequence[str | None], mesh: jax.sharding.Mesh,
             rules: Sequence[tuple[str, MeshAxes]]) -> P:
  """The ``PartitionSpec`` of an array of ``shape`` whose dimensions are named ``names``.

  Mesh axes of size 1, axes already used by an earlier dimension, and axes whose size does not
  divide the dimension are dropped (that dimension is replicated over them), so the result is
  always a valid sharding for ``shape`` on ``mesh``.

  Raises:
    ValueError: if ``len(names) != len(shape)``.
  """
  if len(names) != len(shape):
    raise ValueError(f"{len(names)} logical names {tuple(names)} for an array of shape {tuple(shape)}")
  table = dict(rules)
  used: set[str] = set()
  out = []
  for dim, name in zip(shape, names):
    ax = table.get(name) if name is not None else None
    ax = () if ax is None else ((ax,) if isinstance(ax, str) else tuple(ax))
    kept = []
    size = 1
    for a in ax:
      n = mesh.shape.get(a, 1)
      if a in used or n == 1 or dim % (size * n):
        continue
      kept.append(a)
      size *= n
    used.update(kept)
    out.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def _is_variable(x) -> bool:
  from flax import nnx
  return isinstance(x, nnx.Variable)


def _logical_names(var) -> tuple[str | None, ...] | None:
  meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
  names = meta.get("out_sharding", meta.get("sharding_names", meta.get("sharding")))
  return None if names is None else tuple(names)


def shardings(tree: Any, mesh: jax.sharding.Mesh, preset: Preset | str) -> Any:
  """``NamedSharding``s for every array of ``tree`` by the rules of ``preset``.

  ``tree`` may be an NNX ``State`` (``nnx.state(model, nnx.Param)``), an optax optimizer state
  built from one (Adam's ``mu``/``nu`` keep the ``Param`` wrappers, hence the names), or any
  pytree. ``nnx.Variable`` leaves are sharded by their ``out_sharding`` logical names; every
  other array (step counters, unnamed arrays) is replicated.

  Returns:
    A tree of the same structure with each array replaced by its ``NamedSharding`` (a valid
    ``out_shardings``/``device_put`` argument).
  """
  rules = param_rules(preset)

  def one(x):
    if _is_variable(x):
      names = _logical_names(x)
      value = x.get_value() if hasattr(x, "get_value") else x.value
      shape = getattr(value, "shape", ())
      spec = P() if names is None or len(names) != len(shape) else spec_for(shape, names, mesh, rules)
      return x.replace(NamedSharding(mesh, spec))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, tree, is_leaf=_is_variable)


def partition_specs(tree: Any, mesh: jax.sharding.Mesh, preset: Preset | str) -> Any:
  """As :func:`shardings`, with plain ``PartitionSpec`` leaves (for ``shard_map`` specs, tests)."""
  return jax.tree.map(lambda s: s.spec, shardings(tree, mesh, preset))


def shard(tree: Any, mesh: jax.sharding.Mesh, preset: Preset | str, *,
          memory_kind: str | None = None) -> Any:
  """``jax.device_put`` of ``tree`` onto ``mesh`` by the rules of ``preset``.

  Args:
    tree: params (NNX ``State``), optimizer state, or any pytree of arrays.
    memory_kind: optional ``'device'`` or ``'pinned_host'`` (see :mod:`rljax.sharding.placement`).

  Returns:
    The same tree, every array a global ``jax.Array`` with the rules' sharding.
  """
  s = shardings(tree, mesh, preset)
  if memory_kind is not None:
    s = jax.tree.map(lambda n: n.with_memory_kind(memory_kind), s)
  return jax.device_put(tree, s)


def activation_sharding(names: Sequence[str | None], shape: Sequence[int],
                        mesh: jax.sharding.Mesh, preset: Preset | str) -> NamedSharding:
  """``NamedSharding`` of an activation or input (e.g. tokens ``[B, T]`` named
  ``('batch', 'length')``) by the activation rules of ``preset``."""
  return NamedSharding(mesh, spec_for(shape, names, mesh, activation_rules(preset)))


def use_rules(mesh: jax.sharding.Mesh, preset: Preset | str):
  """Context manager: ``jax.set_mesh(mesh)`` plus the activation rules of ``preset``, so
  ``rljax.models.axes.constrain`` inside model code emits sharding constraints.

  Usage::

    with use_rules(mesh, "fsdp"):
      loss = jitted_step(params, batch)   # trace happens inside the context
  """
  import contextlib

  from flax.core import spmd as flax_spmd

  stack = contextlib.ExitStack()
  stack.enter_context(jax.set_mesh(mesh))
  stack.enter_context(flax_spmd.logical_axis_rules(activation_rules(preset)))
  return stack
