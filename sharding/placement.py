"""Where each RLHF role lives: meshes, rules presets, resharding, and host offload.

A :class:`Placement` maps each :class:`Role` to a :class:`RolePlacement` (a mesh plus a rules
preset plus whether to keep it in host memory between uses), and names the actor's generation
layout. Two constructors cover the usual set-ups:

* :meth:`Placement.colocated`: every role on one mesh; the actor trains in ``fsdp`` and is
  resharded to ``tp`` (or ``dp``) on the same devices for generation.
* :meth:`Placement.disaggregated`: generation on the first ``num_generate`` devices, training
  (all four roles) on the rest, e.g. 2 + 6 of 8. The actor's weights are copied across after
  every update by :func:`reshard`, so the generator always uses the latest weights.

**Host offload.** Frozen roles (REFERENCE, REWARD) may stay in host memory between uses
(:func:`offload` / :func:`onload`, memory kind ``'pinned_host'``). Backends: GPU and TPU place
``pinned_host`` arrays in page-locked host RAM and free device memory. The CPU backend (jax 0.10)
also lists a ``pinned_host`` memory and honours the memory kind (``arr.sharding.memory_kind ==
'pinned_host'``), but device and host memory are the same RAM, so offload on CPU saves nothing: it
only exercises the code path. Where a backend has no ``pinned_host`` memory, :func:`offload` is a
no-op that returns the tree unchanged (see :func:`host_memory_kind`). Multi-process CPU runs work
too (tests/test_distributed_rlhf_script.py offloads on 2 processes).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from rljax.sharding import rules as rules_lib
from rljax.sharding.mesh import MeshConfig, MeshError, make_mesh
from rljax.sharding.rules import Preset


class Role(enum.Enum):
  """The four models of RLHF PPO."""

  ACTOR = "actor"
  CRITIC = "critic"
  REWARD = "reward"
  REFERENCE = "reference"


FROZEN_ROLES: frozenset[Role] = frozenset({Role.REWARD, Role.REFERENCE})


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolePlacement:
  """A mesh, the rules preset of the arrays on it, and whether they rest in host memory.

  Attributes:
    mesh: a mesh from :func:`rljax.sharding.mesh.make_mesh`.
    preset: rules preset (``Preset`` or its flag spelling).
    offload: keep the role's params in ``pinned_host`` memory between uses (frozen roles only).
  """

  mesh: jax.sharding.Mesh
  preset: Preset = Preset.FSDP
  offload: bool = False

  def __post_init__(self):
    object.__setattr__(self, "preset", rules_lib.as_preset(self.preset))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
  """Role -> placement, plus the actor's generation placement.

  Attributes:
    roles: one :class:`RolePlacement` per :class:`Role` (all four required).
    generation: where and how the actor generates.
    remote_generator: a sampler on another process that generates instead of ``generation``
      (``rljax.alignment.remote_generation.RemoteSampler``; None: generation here).

  Raises:
    ValueError: if a role is missing, a key is not a ``Role``, or a trainable role is offloaded.
  """

  roles: Mapping[Role, RolePlacement]
  generation: RolePlacement
  remote_generator: Any = None

  def __post_init__(self):
    bad = [k for k in self.roles if not isinstance(k, Role)]
    if bad:
      raise ValueError(f"placement keys must be Role members, got {bad!r}")
    missing = [r.name for r in Role if r not in self.roles]
    if missing:
      raise ValueError(f"placement is missing roles {missing}")
    for role, rp in self.roles.items():
      if rp.offload and role not in FROZEN_ROLES:
        raise ValueError(f"only frozen roles (REWARD, REFERENCE) can be offloaded, got {role.name}")

  def __getitem__(self, role: Role) -> RolePlacement:
    return self.roles[role]

  @property
  def disaggregated(self) -> bool:
    train = set(self.roles[Role.ACTOR].mesh.devices.flat)
    return not train & set(self.generation.mesh.devices.flat)

  @classmethod
  def colocated(cls, mesh: jax.sharding.Mesh, *, train_preset: Preset | str = Preset.FSDP,
                generate_preset: Preset | str = Preset.TP, offload_frozen: bool = False) -> "Placement":
    """All roles on ``mesh``; the actor generates in ``generate_preset`` on the same devices."""
    roles = {r: RolePlacement(mesh=mesh, preset=train_preset,
                              offload=offload_frozen and r in FROZEN_ROLES) for r in Role}
    return cls(roles=roles, generation=RolePlacement(mesh=mesh, preset=generate_preset))

  @classmethod
  def disaggregated_split(cls, *, num_generate: int, devices: Sequence[jax.Device] | None = None,
                          train_mesh: MeshConfig | None = None,
                          generate_mesh: MeshConfig | None = None,
                          train_preset: Preset | str = Preset.FSDP,
                          generate_preset: Preset | str = Preset.TP,
                          offload_frozen: bool = False) -> "Placement":
    """Generation on ``devices[:num_generate]``, the four roles' training on the rest.

    Args:
      num_generate: devices for generation, in ``[1, len(devices))``.
      devices: default ``jax.devices()``.
      train_mesh: default ``MeshConfig(data=1, fsdp=-)``: all training devices on ``fsdp``.
      generate_mesh: default all generation devices on ``tensor``.

    Raises:
      MeshError: naming the numbers if the split leaves no devices for one side or a mesh
        does not fit its devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not 0 < num_generate < len(devices):
      raise MeshError(f"num_generate must be in [1, {len(devices)}), got {num_generate} "
                      f"(of {len(devices)} devices)")
    gen, train = devices[:num_generate], devices[num_generate:]
    tm = make_mesh(train_mesh or MeshConfig(data=1, fsdp=len(train)), devices=train)
    gm = make_mesh(generate_mesh or MeshConfig(data=1, tensor=len(gen)), devices=gen)
    roles = {r: RolePlacement(mesh=tm, preset=train_preset,
                              offload=offload_frozen and r in FROZEN_ROLES) for r in Role}
    return cls(roles=roles, generation=RolePlacement(mesh=gm, preset=generate_preset))


def reshard(tree: Any, *, to: RolePlacement, metrics: dict | None = None) -> Any:
  """Copies ``tree`` (NNX param ``State`` or any pytree) into the layout of ``to``.

  Works within one mesh (``fsdp`` -> ``tp``) and across device sets (disaggregated: training
  devices -> generation devices). Blocks until the copy is done so that the time is honest.

  Args:
    metrics: if given, ``metrics['timing/reshard']`` is set to the wall time in seconds.

  Returns:
    The tree with every array sharded by ``to.preset``'s rules on ``to.mesh`` (device memory).
  """
  t0 = time.perf_counter()
  out = rules_lib.shard(tree, to.mesh, to.preset)
  jax.block_until_ready(out)
  if metrics is not None:
    metrics["timing/reshard"] = time.perf_counter() - t0
  return out


def host_memory_kind(mesh: jax.sharding.Mesh) -> str | None:
  """``'pinned_host'`` if the mesh's devices have that memory, else ``None``."""
  dev = mesh.devices.flat[0]
  try:
    kinds = {m.kind for m in dev.addressable_memories()}
  except Exception:  # pragma: no cover - backends without the memories API
    return None
  return "pinned_host" if "pinned_host" in kinds else None


def offload(tree: Any, placement: RolePlacement) -> Any:
  """Moves ``tree`` to host memory (``pinned_host``) in ``placement``'s sharding; a no-op (same
  tree) when the backend has no ``pinned_host`` memory."""
  kind = host_memory_kind(placement.mesh)
  if kind is None:
    return tree
  return rules_lib.shard(tree, placement.mesh, placement.preset, memory_kind=kind)


def onload(tree: Any, placement: RolePlacement) -> Any:
  """Brings ``tree`` back to device memory in ``placement``'s sharding."""
  return rules_lib.shard(tree, placement.mesh, placement.preset, memory_kind="device")
