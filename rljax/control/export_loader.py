"""Runs a policy exported by ``rljax.control.export``, with nothing but ``jax`` installed.

This file is standalone: it imports only the Python standard library, ``numpy`` and
``jax`` (which needs ``flatbuffers`` to deserialize), never rljax, flax or brax. Copy
it next to the exported folder on a robot's computer::

    import export_loader
    policy = export_loader.load("export/")     # folder with policy.jaxexport + manifest.json
    action = policy(obs)                       # obs [D] -> [A], or [B, D] -> [B, A]
    policy.manifest["observation_size"]

Actions are deterministic, ``tanh(loc)`` in ``[-1, 1]``, float32; the observation
normaliser is inside the artifact, so pass raw observations.
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np
from jax import export as jax_export

ARTIFACT_FILE = "policy.jaxexport"
MANIFEST_FILE = "manifest.json"
FORMAT = "rljax.policy_export"
SUPPORTED_FORMAT_VERSIONS = (1,)


class ExportFormatError(ValueError):
  """The folder is not a readable rljax policy export (the message says why)."""


def read_manifest(path: str) -> dict:
  """Reads and checks ``<path>/manifest.json`` (``path`` may also be the manifest itself).

  Raises:
    FileNotFoundError: no manifest at ``path``.
    ExportFormatError: not an rljax export, or a format version this loader does not know.
  """
  manifest_path = path if path.endswith(".json") else os.path.join(path, MANIFEST_FILE)
  if not os.path.exists(manifest_path):
    raise FileNotFoundError(f"No {MANIFEST_FILE} at {manifest_path!r}; is it an rljax policy export?")
  with open(manifest_path, encoding="utf-8") as f:
    manifest = json.load(f)
  if manifest.get("format") != FORMAT:
    raise ExportFormatError(f"{manifest_path!r} has format {manifest.get('format')!r}, not {FORMAT!r}.")
  if manifest.get("format_version") not in SUPPORTED_FORMAT_VERSIONS:
    raise ExportFormatError(
        f"{manifest_path!r} has format_version {manifest.get('format_version')!r}; this loader "
        f"reads {SUPPORTED_FORMAT_VERSIONS}. Use the export_loader.py of the rljax that wrote it."
    )
  return manifest


class ExportedPolicy:
  """A loaded policy: ``policy(obs)`` -> actions, plus its ``manifest``.

  ``obs`` is ``[D]`` (one observation; returns ``[A]``) or ``[B, D]`` (returns
  ``[B, A]``; any ``B`` if the export is batch-polymorphic, else the exported ``B``).
  Inputs are converted to the manifest's observation dtype (float32). Outputs are
  ``jax.Array``; ``np.asarray(policy(obs))`` gives host memory.

  Raises (on call):
    ValueError: an observation of the wrong shape, naming expected and given shapes.
  """

  def __init__(self, exported: jax_export.Exported, manifest: dict):
    self.exported = exported
    self.manifest = manifest
    self.observation_size = int(manifest["observation_size"])
    self.action_size = int(manifest["action_size"])
    self.batch_size = manifest.get("batch_size")
    self._dtype = np.dtype(manifest["observation_dtype"])
    self._batched = jax.jit(exported.call)
    self._single = jax.jit(lambda obs: exported.call(obs[None])[0])

  def __call__(self, obs):
    obs = np.asarray(obs, dtype=self._dtype)
    if obs.ndim == 1 and obs.shape[0] == self.observation_size and self.batch_size in (None, 1):
      return self._single(obs)
    if obs.ndim == 2 and obs.shape[1] == self.observation_size and (
        self.batch_size is None or obs.shape[0] == self.batch_size
    ):
      return self._batched(obs)
    batch = "B" if self.batch_size is None else str(self.batch_size)
    raise ValueError(
        f"observation shape {obs.shape} does not fit this policy: expected "
        f"[{self.observation_size}] or [{batch}, {self.observation_size}]."
    )


def load(path: str, *, verify_checksum: bool = True) -> ExportedPolicy:
  """Loads the export in folder ``path`` (``policy.jaxexport`` + ``manifest.json``).

  Args:
    path: the export folder.
    verify_checksum: compare the artifact's sha256 with the manifest's.

  Returns:
    `ExportedPolicy`.

  Raises:
    FileNotFoundError: missing manifest or artifact.
    ExportFormatError: unknown format, checksum mismatch, or a platform list that does
      not include this machine's JAX backend.
  """
  manifest = read_manifest(path)
  folder = os.path.dirname(path) if path.endswith(".json") else path
  artifact_path = os.path.join(folder, manifest.get("artifact", ARTIFACT_FILE))
  with open(artifact_path, "rb") as f:
    data = f.read()
  if verify_checksum and hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
    raise ExportFormatError(f"{artifact_path!r} does not match the sha256 in its manifest.")
  exported = jax_export.deserialize(bytearray(data))
  backend = jax.default_backend()
  wanted = {"gpu": ("cuda", "rocm")}.get(backend, (backend,))
  if not any(p in exported.platforms for p in wanted):
    raise ExportFormatError(
        f"this policy was exported for platforms {list(exported.platforms)}, and this "
        f"machine's JAX backend is {backend!r}; re-export with that platform."
    )
  return ExportedPolicy(exported, manifest)


__all__ = ["ExportFormatError", "ExportedPolicy", "load", "read_manifest"]
