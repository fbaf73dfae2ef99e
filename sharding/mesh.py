"""Device meshes with the axes ``('data', 'fsdp', 'tensor')``, and the checks run before compiling.

Every rljax mesh has the same three axes, in this order:

* ``data``: pure data parallelism. Each group holds a full copy of whatever the rules do not shard.
* ``fsdp``: fully sharded data parallelism (ZeRO-3). The batch is split over it too; parameters,
  gradients and optimizer state are sharded over it by the ``fsdp`` rules.
* ``tensor``: tensor (model) parallelism (Megatron). Heads, MLP and vocabulary are split over it.

A mesh is described by a :class:`MeshConfig` (``--mesh=D,F,T`` on the command line, parsed by
:func:`parse_mesh_flag`) and built by :func:`make_mesh` over all processes' devices
(``jax.devices()``, which after ``jax.distributed.initialize()`` spans every host).

The axes are ``AxisType.Auto``: in JAX 0.10 ``jax.make_mesh`` defaults to ``Explicit``, under which
``with_sharding_constraint`` becomes a ``reshard`` and sharded parameters make flax/optax code fail
(the sharding of a value becomes part of its type). ``Auto`` leaves the propagation to GSPMD.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np

DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
MESH_AXES: tuple[str, str, str] = (DATA, FSDP, TENSOR)
# The batch dimension is split over both data-like axes; see rljax.sharding.rules.
BATCH_AXES: tuple[str, str] = (DATA, FSDP)


class MeshError(ValueError):
  """A mesh that does not fit the devices, or a batch the data axes do not divide."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """Sizes of the ``data``, ``fsdp`` and ``tensor`` mesh axes.

  Attributes:
    data: size of the ``data`` axis, or ``-1`` for "every device the other two axes leave"
      (the default puts all devices on ``data``).
    fsdp: size of the ``fsdp`` axis, >= 1.
    tensor: size of the ``tensor`` axis, >= 1.
  """

  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def __post_init__(self):
    for name in ("data", "fsdp", "tensor"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise MeshError(f"mesh axis {name!r} must be an int, got {v!r}")
      if v < 1 and not (name == "data" and v == -1):
        raise MeshError(f"mesh axis {name!r} must be >= 1 (or -1 for data), got {v}")

  def shape(self, num_devices: int, *, cpu_hint: bool = False) -> tuple[int, int, int]:
    """``(data, fsdp, tensor)`` for ``num_devices`` devices, ``-1`` resolved.

    ``cpu_hint``: the devices are all of a CPU process's, so a mesh larger than them is told
    the XLA flag that makes more host devices.

    Raises:
      MeshError: if the product of the sizes is not ``num_devices`` (message names both).
    """
    rest = self.fsdp * self.tensor
    if self.data == -1:
      if num_devices % rest:
        raise MeshError(
            f"mesh fsdp={self.fsdp} x tensor={self.tensor} = {rest} does not divide the "
            f"{num_devices} devices")
      return (num_devices // rest, self.fsdp, self.tensor)
    size = self.data * rest
    if size != num_devices:
      hint = ""
      if size > num_devices and cpu_hint:
        hint = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={size} (set before "
                f"Python starts) makes {size} host devices")
      raise MeshError(
          f"mesh data={self.data} x fsdp={self.fsdp} x tensor={self.tensor} = {size} devices, "
          f"but {num_devices} {'device is' if num_devices == 1 else 'devices are'} available"
          f"{hint}")
    return (self.data, self.fsdp, self.tensor)


def parse_mesh_flag(flag: str | None) -> MeshConfig:
  """Parses ``--mesh=D,F,T`` (``data,fsdp,tensor`` sizes). ``None`` or ``''``: all on ``data``.

  ``D`` may be ``-1`` (all remaining devices). Examples: ``"8,1,1"``, ``"1,4,2"``, ``"-1,2,1"``.

  Raises:
    MeshError: if the flag is not three comma-separated integers, or a size is invalid.
  """
  if flag is None or not flag.strip():
    return MeshConfig()
  parts = [p.strip() for p in flag.split(",")]
  try:
    values = [int(p) for p in parts]
  except ValueError:
    raise MeshError(f"--mesh must be three comma-separated integers D,F,T, got {flag!r}") from None
  if len(values) != 3:
    raise MeshError(f"--mesh must have 3 sizes (data,fsdp,tensor), got {len(values)} in {flag!r}")
  return MeshConfig(data=values[0], fsdp=values[1], tensor=values[2])


def make_mesh(config: MeshConfig | None = None, *,
              devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """Builds a ``Mesh`` with axes ``('data', 'fsdp', 'tensor')``, all ``AxisType.Auto``.

  Args:
    config: the axis sizes; ``None`` puts every device on ``data``.
    devices: the devices to lay out (a disaggregated placement passes a subset); default
      ``jax.devices()``, i.e. every device of every process.

  Returns:
    A ``jax.sharding.Mesh`` of shape ``(data, fsdp, tensor)``. ``tensor`` is the fastest-varying
    axis, so tensor-parallel groups are neighbouring devices (one host / NVLink domain).

  Raises:
    MeshError: if the sizes do not multiply to the number of devices. Raised before compiling.
  """
  config = config or MeshConfig()
  devices = list(jax.devices() if devices is None else devices)
  all_devices = devices == list(jax.devices())
  # The XLA-flag hint fits only a mesh over every device of a CPU run (a disaggregated subset
  # would need more devices than the mesh alone).
  shape = config.shape(len(devices), cpu_hint=all_devices and devices[0].platform == "cpu")
  auto = (jax.sharding.AxisType.Auto,) * 3
  if all_devices:
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
  # A subset (disaggregated roles): lay the given devices out in the given order.
  return jax.sharding.Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES,
                           axis_types=auto)


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
  """Number of batch shards: ``data * fsdp`` (the batch is split over both)."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.shape)


def check_batch_divisible(batch_size: int, mesh: jax.sharding.Mesh, *, what: str = "batch size") -> int:
  """Checks ``batch_size`` splits evenly over the data axes; returns the per-shard size.

  Raises:
    MeshError: naming ``batch_size``, the data axes' sizes and their product.
  """
  n = data_parallel_size(mesh)
  if batch_size <= 0 or batch_size % n:
    raise MeshError(
        f"{what} {batch_size} is not divisible by the data axes data={mesh.shape.get(DATA, 1)} x "
        f"fsdp={mesh.shape.get(FSDP, 1)} = {n}")
  return batch_size // n
