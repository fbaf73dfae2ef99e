"""Mesh layout of a one-model trainer (SFT, reward model): sharded state, data-parallel batches.

The RLHF trainer places four roles with :class:`rljax.sharding.placement.Placement`; SFT and
reward-model training have one model, so they take a :class:`TrainLayout`: a mesh and a rules
preset. Parameters and optimizer state are sharded by the preset's rules
(:func:`rljax.sharding.rules.shard`) and every batch ``[B, ...]`` is split over the data axes
(``data`` x ``fsdp``), so jit's partitioner computes the gradient of the global batch (equal to
the one-device gradient up to float reassociation). Works unchanged with several processes:
every process builds the same host batch and contributes its own rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from rljax.sharding import mesh as mesh_lib
from rljax.sharding import placement as placement_lib
from rljax.sharding import rules as rules_lib
from rljax.sharding.rules import Preset


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainLayout:
  """A mesh and the rules preset a one-model trainer shards by.

  Attributes:
    mesh: from :func:`rljax.sharding.mesh.make_mesh`.
    preset: :class:`rljax.sharding.rules.Preset` or its flag spelling (``fsdp``, ``fsdp_tp``,
      ``dp``, ``tp``).

  Raises:
    ValueError: an unknown preset (naming it).
  """

  mesh: jax.sharding.Mesh
  preset: Preset = Preset.FSDP

  def __post_init__(self):
    object.__setattr__(self, "preset", rules_lib.as_preset(self.preset))

  @classmethod
  def of(cls, role: placement_lib.RolePlacement) -> "TrainLayout":
    """The layout of an RLHF role's placement (e.g. the actor's, for SFT before RL)."""
    return cls(mesh=role.mesh, preset=role.preset)

  def check_batch(self, batch_size: int, *, what: str = "batch_size") -> None:
    """Raises ``MeshError`` naming ``batch_size`` and the data axes if they do not divide it."""
    mesh_lib.check_batch_divisible(batch_size, self.mesh, what=what)

  def shard(self, tree: Any) -> Any:
    """Params (NNX ``State``) or optimizer state sharded by the preset's rules."""
    return rules_lib.shard(tree, self.mesh, self.preset)

  def put_batch(self, batch: Any) -> Any:
    """Host arrays ``[B, ...]`` (a pytree) as global arrays with rows split over the data axes.

    Raises:
      MeshError: ``B`` not divisible by the data axes (naming the numbers).
    """

    def put(x):
      host = np.asarray(x)
      self.check_batch(host.shape[0], what="batch rows")
      names = ("batch",) + (None,) * (host.ndim - 1)
      sharding = rules_lib.activation_sharding(names, host.shape, self.mesh, self.preset)
      return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, batch)
