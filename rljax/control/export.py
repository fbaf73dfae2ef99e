"""Policy export for on-robot inference: a serialized ``jax.export`` artifact + JSON manifest.

The exported function is the deterministic inference path of a trained control policy,
observation normaliser included::

    obs [B, D] float32 -> clip((obs - mean) / std, -5, 5) -> policy MLP -> loc [B, A]
                       -> action = tanh(loc) [B, A] float32 in [-1, 1]

It is lowered once with `jax.export` (StableHLO with the parameters embedded as
constants; see https://docs.jax.dev/en/latest/export/export.html) for the CPU and CUDA
platforms, with a *symbolic* batch dimension ``B`` by default, and written as::

    <out_dir>/policy.jaxexport   bytes of ``jax.export.Exported.serialize()``
    <out_dir>/manifest.json      sizes, dtypes, batch, platforms, versions, sha256

`rljax.control.export_loader` runs the artifact with nothing but ``jax`` installed;
that one file can be copied to a robot's computer.

Compatibility: JAX deserializes artifacts made by older JAX versions for at least six
months (the calling-convention window recorded in the manifest); the loader checks the
manifest's format version and the artifact's checksum before calling JAX.

Serialization needs the ``flatbuffers`` package (a dependency of ``jax.export``'s
serializer, not installed by ``jax[cpu]`` alone).

Example::

    from rljax.control import export
    out = export.export_from_logdir("runs/cartpole")          # -> runs/cartpole/export
    # on the robot, with only jax:
    import export_loader
    policy = export_loader.load(out)
    action = policy(obs)                                       # [A] or [B, A]
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import export as jax_export

import rljax
from rljax import checkpoint as ckpt
from rljax import running_stats
from rljax.control.networks import policy_apply
from rljax.control.policy import load_policy

Array = jax.Array

ARTIFACT_FILE = "policy.jaxexport"
MANIFEST_FILE = "manifest.json"
FORMAT = "rljax.policy_export"
FORMAT_VERSION = 1
DEFAULT_PLATFORMS = ("cpu", "cuda")
_BATCH_SYMBOL = "batch"


class ExportError(ValueError):
  """Bad export settings; the message names the value."""


def make_inference_fn(networks, params, obs_stats: running_stats.RunningStats) -> Callable:
  """The deterministic policy as a pure function of observations only.

  Args:
    networks: ``rljax.control.networks.Networks`` (graph definition and sizes).
    params: the actor-critic's ``nnx.State`` of ``nnx.Param``.
    obs_stats: the observation normaliser's statistics.

  Returns:
    ``fn(obs [..., D] float32) -> actions [..., A] float32``, ``tanh(loc)``; the same
    computation as ``load_policy(..., deterministic=True)``. ``params`` and
    ``obs_stats`` are closed over (they become constants of an export).
  """
  def fn(obs: Array) -> Array:
    loc, _ = policy_apply(networks, params, running_stats.normalize(obs_stats, obs))
    return jnp.tanh(loc)

  return fn


def export_inference_fn(
    fn: Callable[[Array], Array],
    observation_size: int,
    *,
    batch_size: int | None = None,
    platforms: Sequence[str] = DEFAULT_PLATFORMS,
    dtype=jnp.float32,
) -> jax_export.Exported:
  """Lowers ``fn(obs [B, D]) -> actions [B, A]`` with ``jax.export``.

  Args:
    fn: a jittable function of one observation batch.
    observation_size: ``D``.
    batch_size: a fixed ``B``, or ``None`` for a symbolic (polymorphic) batch
      dimension, so one artifact serves any batch size.
    platforms: lowering platforms, e.g. ``("cpu",)`` or ``("cpu", "cuda")``. Lowering
      for CUDA works on a machine without a GPU.
    dtype: observation dtype.

  Returns:
    The ``jax.export.Exported``.

  Raises:
    ExportError: non-positive sizes or no platforms.
  """
  if observation_size < 1:
    raise ExportError(f"observation_size must be >= 1, got {observation_size}.")
  if batch_size is not None and batch_size < 1:
    raise ExportError(f"batch_size must be >= 1 or None (polymorphic), got {batch_size}.")
  platforms = tuple(platforms)
  if not platforms:
    raise ExportError("platforms must name at least one platform, got ().")
  if batch_size is None:
    (batch,) = jax_export.symbolic_shape(_BATCH_SYMBOL)
  else:
    batch = batch_size
  spec = jax.ShapeDtypeStruct((batch, observation_size), dtype)
  return jax_export.export(jax.jit(fn), platforms=platforms)(spec)


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def build_manifest(exported: jax_export.Exported, serialized: bytes, **metadata: Any) -> dict:
  """The JSON manifest describing ``exported`` (sizes, dtypes, batch, versions, sha256).

  Args:
    exported: the lowered policy; one input ``[B, D]`` and one output ``[B, A]``.
    serialized: its serialized bytes (for the checksum).
    **metadata: extra JSON-able entries (e.g. ``env``, ``step``), stored under
      ``"metadata"``.

  Raises:
    ExportError: if ``exported`` does not have exactly one 2-D input and output.
    TypeError: metadata that JSON cannot encode.
  """
  if len(exported.in_avals) != 1 or len(exported.out_avals) != 1:
    raise ExportError(
        f"the exported policy must take one observation array and return one action "
        f"array, got {len(exported.in_avals)} inputs and {len(exported.out_avals)} outputs."
    )
  (obs_aval,), (act_aval,) = exported.in_avals, exported.out_avals
  if obs_aval.ndim != 2 or act_aval.ndim != 2:
    raise ExportError(f"expected [B, D] -> [B, A], got {obs_aval.shape} -> {act_aval.shape}.")
  batch = obs_aval.shape[0]
  polymorphic = jax_export.is_symbolic_dim(batch)
  return {
      "format": FORMAT,
      "format_version": FORMAT_VERSION,
      "artifact": ARTIFACT_FILE,
      "sha256": hashlib.sha256(bytes(serialized)).hexdigest(),
      "observation_size": int(obs_aval.shape[1]),
      "action_size": int(act_aval.shape[1]),
      "observation_dtype": str(obs_aval.dtype),
      "action_dtype": str(act_aval.dtype),
      "batch_size": None if polymorphic else int(batch),
      "batch_polymorphic": bool(polymorphic),
      "action_range": [-1.0, 1.0],
      "deterministic": True,
      "platforms": list(exported.platforms),
      "calling_convention_version": int(exported.calling_convention_version),
      "versions": {
          "jax": jax.__version__,
          "jaxlib": _version("jaxlib"),
          "flax": _version("flax"),
          "rljax": rljax.__version__,
          "python": platform.python_version(),
      },
      "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "metadata": json.loads(json.dumps(metadata)),  # as it reads back from the file
  }


@dataclasses.dataclass(frozen=True)
class ExportResult:
  """Where an export went: ``out_dir``, its artifact and manifest paths, the manifest."""

  out_dir: str
  artifact_path: str
  manifest_path: str
  manifest: dict


def write_export(exported: jax_export.Exported, out_dir: str, **metadata: Any) -> ExportResult:
  """Serializes ``exported`` to ``out_dir/policy.jaxexport`` and writes the manifest.

  The manifest is written last (atomically), so a folder with a manifest always has
  the artifact it describes.

  Raises:
    OSError: if ``out_dir`` cannot be written.
  """
  os.makedirs(out_dir, exist_ok=True)
  serialized = bytes(exported.serialize())
  artifact_path = os.path.join(out_dir, ARTIFACT_FILE)
  tmp = artifact_path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(serialized)
  os.replace(tmp, artifact_path)
  manifest = build_manifest(exported, serialized, **metadata)
  manifest_path = os.path.join(out_dir, MANIFEST_FILE)
  ckpt.write_json_atomic(manifest_path, manifest)
  return ExportResult(out_dir, artifact_path, manifest_path, manifest)


def export_policy(
    networks,
    params,
    obs_stats: running_stats.RunningStats,
    out_dir: str,
    *,
    batch_size: int | None = None,
    platforms: Sequence[str] = DEFAULT_PLATFORMS,
    **metadata: Any,
) -> ExportResult:
  """Exports an in-memory policy (e.g. ``TrainResult.train_state``) to ``out_dir``.

  Args:
    networks: ``rljax.control.networks.Networks``.
    params: actor-critic parameters (``nnx.State``).
    obs_stats: observation normaliser statistics.
    out_dir: output folder (created).
    batch_size: fixed batch, or ``None`` for a polymorphic batch dimension.
    platforms: lowering platforms.
    **metadata: stored in the manifest under ``"metadata"``.

  Returns:
    `ExportResult`.
  """
  fn = make_inference_fn(networks, params, obs_stats)
  exported = export_inference_fn(
      fn, networks.config.observation_size, batch_size=batch_size, platforms=platforms
  )
  metadata.setdefault("network", dataclasses.asdict(networks.config))
  return write_export(exported, out_dir, **metadata)


def export_from_logdir(
    logdir: str,
    out_dir: str | None = None,
    *,
    step: int | None = None,
    batch_size: int | None = None,
    platforms: Sequence[str] = DEFAULT_PLATFORMS,
) -> ExportResult:
  """Exports the policy saved under ``<logdir>/checkpoints`` (PPO or APG runs).

  It exports exactly the function ``rljax.control.policy.load_policy(logdir)``
  returns (deterministic action), so exported and in-process actions agree.

  Args:
    logdir: a run folder written by ``trainer.train`` or ``apg.train_apg``.
    out_dir: output folder; default ``<logdir>/export``.
    step: checkpoint step; default the latest.
    batch_size: fixed batch, or ``None`` for a polymorphic batch dimension.
    platforms: lowering platforms.

  Returns:
    `ExportResult`.

  Raises:
    FileNotFoundError: no checkpoint or config under ``logdir``.
  """
  saved = ckpt.read_config(logdir)
  policy = load_policy(logdir, step=step, deterministic=True)
  observation_size = int(saved["network"]["observation_size"])
  exported = export_inference_fn(
      lambda obs: policy(obs), observation_size, batch_size=batch_size, platforms=platforms
  )
  run_config = saved.get("control") or saved.get("apg") or {}
  metadata = {
      "env": run_config.get("env"),
      "algo": saved.get("algo", "ppo"),
      "step": step if step is not None else ckpt.newest_step(logdir),
      "logdir": os.path.abspath(logdir),
      "network": saved["network"],
  }
  return write_export(exported, out_dir or os.path.join(logdir, "export"), **metadata)


__all__ = [
    "ARTIFACT_FILE",
    "DEFAULT_PLATFORMS",
    "ExportError",
    "ExportResult",
    "MANIFEST_FILE",
    "build_manifest",
    "export_from_logdir",
    "export_inference_fn",
    "export_policy",
    "make_inference_fn",
    "write_export",
]
