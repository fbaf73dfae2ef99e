"""Where the alignment pipelines run: the RLHF placement from the scripts' flags, and the mesh
layout of a one-model trainer (SFT, reward model): sharded state, data-parallel batches.

The RLHF trainer places four roles with :class:`rljax.sharding.placement.Placement`; SFT and
reward-model training have one model, so they take a :class:`TrainLayout`: a mesh and a rules
preset. Parameters and optimizer state are sharded by the preset's rules
(:func:`rljax.sharding.rules.shard`) and every batch ``[B, ...]`` is split over the data axes
(``data`` x ``fsdp``), so jit's partitioner computes the gradient of the global batch (equal to
the one-device gradient up to float reassociation). Works unchanged with several processes:
every process builds the same host batch and contributes its own rows.

`make_placement` turns ``--mesh``, ``--sharding_rules`` and ``--placement`` into the RLHF
placement, `train_layout` gives its actor's layout to SFT and the reward model, and
`check_placement` checks the batches against the data axes before anything compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from rljax.alignment.rlhf_config import RLHFConfig
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


# ---- device placement from the scripts' --mesh / --sharding_rules / --placement flags ----------

PLACEMENTS = ("colocated", "disaggregated")


def make_placement(mesh: str | None = None, sharding_rules: str = "fsdp",
                   placement: str = "colocated", *, offload_frozen: bool = False,
                   remote_generator=None) -> placement_lib.Placement | None:
  """The RLHF :class:`~rljax.sharding.placement.Placement` the scripts' flags describe.

  Args:
    mesh: ``--mesh=D,F,T`` (``data,fsdp,tensor``). ``colocated``: the mesh over all devices
      (default: all on ``data``). ``disaggregated``: the *training* mesh; the devices it leaves
      generate, laid out on ``tensor`` (default: the largest power of two of devices that
      leaves at least a quarter of them, and at least one, to generate trains on ``fsdp``, so
      that power-of-two batches divide it: 8 devices train on 4 and generate on 4, 16 on 8
      and 8, 2 on 1 and 1; the rest generate).
    sharding_rules: the training preset (``fsdp``, ``fsdp_tp``, ``dp``; :mod:`rljax.sharding.rules`).
      The actor generates in ``tp`` (tensor-parallel, no fsdp all-gathers per decoded token).
    placement: ``colocated`` (all roles on one mesh) or ``disaggregated``.
    offload_frozen: keep the frozen roles (REFERENCE, REWARD) in host memory (``pinned_host``)
      between uses (:func:`rljax.sharding.placement.offload`; on CPU the same RAM).
    remote_generator: with ``disaggregated``, a sampler on another process
      (`rljax.alignment.remote_generation.RemoteSampler`): every device of this process
      trains (``mesh``, default all on ``fsdp``) and the actor generates there.

  Returns:
    ``None`` for a colocated run on one device without ``mesh`` or offload (the plain
    single-device path).

  Raises:
    ValueError: an unknown preset or placement (naming it).
    rljax.sharding.mesh.MeshError: a mesh that does not fit the devices (naming both numbers),
      or a disaggregated run with fewer than 2 devices or no device left for generation.
  """
  preset = rules_lib.as_preset(sharding_rules)
  if placement not in PLACEMENTS:
    raise ValueError(f"--placement must be one of {list(PLACEMENTS)}, got {placement!r}")
  cfg = mesh_lib.parse_mesh_flag(mesh)
  n = jax.device_count()
  if remote_generator is not None:  # generation on another process: all devices here train
    if placement != "disaggregated":
      raise ValueError(f"a remote generator needs --placement=disaggregated, got {placement!r}")
    train = mesh_lib.make_mesh(cfg if mesh is not None else mesh_lib.MeshConfig(data=1, fsdp=n))
    base = placement_lib.Placement.colocated(train, train_preset=preset,
                                             offload_frozen=offload_frozen)
    return dataclasses.replace(base, remote_generator=remote_generator)
  if placement == "colocated":
    if mesh is None and n == 1 and not offload_frozen:
      return None
    return placement_lib.Placement.colocated(mesh_lib.make_mesh(cfg), train_preset=preset,
                                             offload_frozen=offload_frozen)
  if n < 2:
    raise mesh_lib.MeshError(f"--placement=disaggregated needs >= 2 devices, got {n}")
  if mesh is None:  # the largest power of two that leaves at least a quarter to generate
    num_train = 1 << (n - max(1, n // 4)).bit_length() - 1
    cfg = mesh_lib.MeshConfig(data=1, fsdp=num_train)
  elif cfg.data == -1:
    raise mesh_lib.MeshError(
        f"with --placement=disaggregated, --mesh is the training mesh and needs an explicit data "
        f"size, got {mesh!r}")
  num_train = cfg.data * cfg.fsdp * cfg.tensor
  if num_train >= n:
    raise mesh_lib.MeshError(
        f"--placement=disaggregated: the training mesh data={cfg.data} x fsdp={cfg.fsdp} x "
        f"tensor={cfg.tensor} = {num_train} devices leaves none of the {n} devices for generation")
  if n % (n - num_train):
    divisors = [d for d in range(1, n) if n % d == 0]
    raise mesh_lib.MeshError(
        f"--placement=disaggregated: the training mesh of {num_train} devices leaves "
        f"{n - num_train} of the {n} devices to generate; the generation mesh must divide the "
        f"{n} devices (leave {', '.join(map(str, divisors))})")
  return placement_lib.Placement.disaggregated_split(num_generate=n - num_train, train_mesh=cfg,
                                                     train_preset=preset,
                                                     offload_frozen=offload_frozen)


def train_layout(placement) -> TrainLayout | None:
  """The SFT / reward-model layout of a placement: the actor's training mesh and preset."""
  return None if placement is None else TrainLayout.of(placement[placement_lib.Role.ACTOR])


def check_placement(placement, *, rl: RLHFConfig | None = None,
                    batch_sizes: dict[str, int] | None = None) -> None:
  """Checks, before anything compiles, that the batches split over the training data axes.

  Args:
    placement: from :func:`make_placement` (``None``: nothing to check).
    rl: its ``prompts_per_step * group_size`` is checked.
    batch_sizes: more ``{name: rows}`` to check (SFT batch, reward-model rows).

  Raises:
    rljax.sharding.mesh.MeshError: naming the batch, its size and the data axes' sizes.
  """
  layout = train_layout(placement)
  if layout is None:
    return
  sizes = dict(batch_sizes or {})
  if rl is not None:
    sizes["prompts_per_step * group_size"] = rl.batch_size
  for what, size in sizes.items():
    layout.check_batch(size, what=what)
