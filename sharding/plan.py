r"""Memory planner: bytes per device per RLHF role, and the smallest mesh that fits.

    python -m rljax.sharding.plan --model=70b --mesh=1,16,1 --batch=128 --device_memory_gb=80
    python -m rljax.sharding.plan --model=path/to/config.json --critic_model=7b --batch=64 --seq=4096

For each role (:class:`rljax.sharding.placement.Role`) it counts, per device (bytes, GB = 1e9 B):

* params: ``num_params * param_bytes / shards``, shards = ``fsdp * tensor`` (``fsdp_tp``),
  ``fsdp`` (``fsdp``), ``tensor`` (``tp``) or 1 (``dp``);
* grads (trainable roles ACTOR, CRITIC): as params, in the parameter dtype;
* optimizer: Adam's ``mu`` and ``nu``: ``2 * num_params * opt_bytes / shards`` (trainable roles);
* kv_cache (ACTOR, generating): ``2 * L * (B/dp) * S * K * D * param_bytes`` / tensor shards
  (``K`` split over ``tensor`` when it divides);
* activations (trainable roles). rljax's decoder trains without rematerialisation, and XLA
  then keeps every layer's working set for the backward pass. Per token and layer that is
  ``c_E E + c_M M/t`` f32 values, plus ``c_A H/t S`` f32 attention values, plus ``c_V V/t``
  f32 logit values per token for the LM head: ``L (B/dp) S (c_E E + c_M M/t) 4 +
  c_A L (B/dp) (H/t) S^2 4 + c_V (B/dp) S (V/t) 4`` bytes. The constants are fitted
  (non-negative least squares on the relative error) to XLA's ``temp_size_in_bytes`` for the
  gradient of the LM loss on 15 small configs per dtype (L 1-3, E 64-128, M 128-256, H 4-8,
  V 256-1024, 128-512 tokens): f32 ``(10.02, 5.45, 2.20, 1.07)``, mean error 2.5%, worst 12%;
  bf16 ``(10.29, 2.08, 1.42, 1.37)`` (its backward dots are bf16 too,
  ``rljax.models.dots.dot``), mean error 4.8%, 14 of 15 within 15%, worst 17%.
  ``PlanConfig.remat`` instead assumes per-layer rematerialisation, as large runs use (rljax's
  model does not implement it yet): the layer inputs ``L (B/dp) S E`` in the parameter dtype,
  one layer's working set and the logits and their gradient; that variant is not validated.
  Frozen roles (REFERENCE, REWARD) hold one forward layer's working set and their logits/scores.

The static terms (params, grads, optimizer, KV cache) and the activation term (without remat)
are checked against XLA's ``compiled.memory_analysis()`` in ``tests/test_plan.py``, within 15%.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence

from rljax.models.llm import LMConfig
from rljax.sharding.mesh import MeshError, parse_mesh_flag
from rljax.sharding.rules import Preset, as_preset

GB = 1e9
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}

# Size presets: Llama-2 (7b, 13b, 70b) and Llama-3 8b shapes. ``tiny`` is for tests.
# (vocab, hidden, intermediate, layers, heads, kv_heads)
SIZE_PRESETS: Mapping[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (256, 64, 128, 2, 4, 2),
    "1b": (32000, 2048, 5632, 22, 32, 4),     # TinyLlama-1.1B
    "7b": (32000, 4096, 11008, 32, 32, 32),
    "8b": (128256, 4096, 14336, 32, 32, 8),
    "13b": (32000, 5120, 13824, 40, 40, 40),
    "70b": (32000, 8192, 28672, 80, 64, 8),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
  """The numbers the planner needs from a decoder LM (``rljax.models.llm.LMConfig``)."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  num_params: int

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if getattr(self, f.name) <= 0:
        raise ValueError(f"{f.name} must be > 0, got {getattr(self, f.name)}")


def model_shape(model: str) -> ModelShape:
  """``ModelShape`` from a size preset name (:data:`SIZE_PRESETS`) or a Hugging Face
  ``config.json`` path (Llama/Qwen2).

  Raises:
    ValueError: naming the string if it is neither a preset nor an existing file.
  """
  if model in SIZE_PRESETS:
    v, e, m, l, h, k = SIZE_PRESETS[model]
    cfg = LMConfig(vocab_size=v, hidden_size=e, intermediate_size=m, num_layers=l, num_heads=h,
                   num_kv_heads=k)
  elif os.path.isfile(model):
    with open(model) as f:
      cfg = LMConfig.from_hf_config(json.load(f))
  else:
    raise ValueError(f"model {model!r} is neither a size preset {sorted(SIZE_PRESETS)} "
                     "nor a config.json file")
  return shape_of(cfg)


def shape_of(cfg) -> ModelShape:
  """``ModelShape`` of an ``rljax.models.llm.LMConfig``."""
  return ModelShape(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                    intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
                    num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    num_params=cfg.num_params())


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
  """Everything a plan depends on.

  Attributes:
    param_dtype: dtype of parameters, gradients, activations and the KV cache.
    opt_dtype: dtype of Adam's two moment estimates.
    batch: global sequences per step (prompts x samples for generation).
    seq: sequence length in tokens (prompt + response); also the KV-cache slots.
    preset: sharding rules of every role (``fsdp`` shards params over ``fsdp``; ...).
    trainable: roles with gradients and optimizer state (by name: ``'actor'``, ``'critic'``).
    generating: roles that hold a KV cache (``'actor'``).
    remat: assume per-layer rematerialisation of the trainable roles' activations (not what
      rljax runs today; see the module docstring).
  """

  param_dtype: str = "bfloat16"
  opt_dtype: str = "float32"
  batch: int = 8
  seq: int = 2048
  preset: Preset = Preset.FSDP
  trainable: tuple[str, ...] = ("actor", "critic")
  generating: tuple[str, ...] = ("actor",)
  remat: bool = False

  def __post_init__(self):
    for name in ("param_dtype", "opt_dtype"):
      if getattr(self, name) not in _DTYPE_BYTES:
        raise ValueError(f"{name} must be one of {sorted(_DTYPE_BYTES)}, got {getattr(self, name)!r}")
    if self.batch <= 0 or self.seq <= 0:
      raise ValueError(f"batch and seq must be > 0, got batch={self.batch} seq={self.seq}")
    object.__setattr__(self, "preset", as_preset(self.preset))


@dataclasses.dataclass(frozen=True)
class RoleBytes:
  """Bytes per device of one role."""

  params: float
  grads: float
  optimizer: float
  kv_cache: float
  activations: float

  @property
  def total(self) -> float:
    return self.params + self.grads + self.optimizer + self.kv_cache + self.activations


# Activation constants without remat, per parameter dtype (f32 values per token and layer, see
# the module docstring): (E, M, attention, logits).
_ACT_CONSTANTS = {"float32": (10.02, 5.45, 2.20, 1.07), "bfloat16": (10.29, 2.08, 1.42, 1.37)}


def _shards(preset: Preset, fsdp: int, tensor: int) -> int:
  return {Preset.FSDP: fsdp, Preset.FSDP_TP: fsdp * tensor, Preset.DP: 1, Preset.TP: tensor}[preset]


def role_bytes(role: str, shape: ModelShape, mesh: tuple[int, int, int], cfg: PlanConfig) -> RoleBytes:
  """Per-device bytes of ``role`` (``'actor'``, ``'critic'``, ``'reference'``, ``'reward'``) for
  a model of ``shape`` on a mesh ``(data, fsdp, tensor)``. Float bytes (fractional allowed)."""
  data, fsdp, tensor = mesh
  pb, ob = _DTYPE_BYTES[cfg.param_dtype], _DTYPE_BYTES[cfg.opt_dtype]
  uses_tensor = cfg.preset in (Preset.FSDP_TP, Preset.TP)
  t = tensor if uses_tensor else 1
  shards = _shards(cfg.preset, fsdp, tensor)
  n = shape.num_params
  params = n * pb / shards
  trainable = role in cfg.trainable
  grads = params if trainable else 0.0
  optimizer = 2 * n * ob / shards if trainable else 0.0
  b = cfg.batch / (data * fsdp)  # sequences per device
  s, e, m, l = cfg.seq, shape.hidden_size, shape.intermediate_size, shape.num_layers
  kv = 0.0
  if role in cfg.generating:
    k = shape.num_kv_heads
    kt = t if k % t == 0 else 1
    kv = 2 * l * b * s * k * shape.head_dim * pb / kt
  vocab_out = shape.vocab_size / t * 4 * b * s if role in ("actor", "reference") else 0.0
  layer_ws = b * s * (6 * e + 3 * m / t) * pb + b * (shape.num_heads / t) * s * s * 4
  if trainable and cfg.remat:
    act = l * b * s * e * pb + layer_ws + 2 * vocab_out
  elif trainable:  # every layer's working set kept for the backward pass (fitted to XLA)
    c_e, c_m, c_attn, c_logits = _ACT_CONSTANTS.get(cfg.param_dtype, _ACT_CONSTANTS["float32"])
    act = (l * b * s * (c_e * e + c_m * m / t) * 4
           + c_attn * l * b * (shape.num_heads / t) * s * s * 4 + c_logits * vocab_out)
  else:
    act = layer_ws + vocab_out
  return RoleBytes(params=params, grads=grads, optimizer=optimizer, kv_cache=kv, activations=act)


def check_mesh(models: Mapping[str, ModelShape], mesh: tuple[int, int, int],
               cfg: PlanConfig) -> None:
  """Refuses a mesh the trainer would refuse: one whose ``data x fsdp`` does not divide the
  batch (each device holds whole sequences), or, with a preset that uses ``tensor``, whose
  ``tensor`` does not divide a model's attention heads or MLP width.

  Raises:
    ValueError: naming the sizes.
  """
  data, fsdp, tensor = mesh
  if cfg.batch % (data * fsdp):
    raise ValueError(
        f"batch {cfg.batch} is not divisible by data x fsdp = {data * fsdp}: the trainer gives "
        f"each of those devices whole sequences (raise --batch to a multiple of {data * fsdp}, "
        f"or use fewer data x fsdp devices and more tensor)")
  if cfg.preset in (Preset.FSDP_TP, Preset.TP):
    for role, shape in models.items():
      for name in ("num_heads", "intermediate_size"):
        if getattr(shape, name) % tensor:
          raise ValueError(f"tensor={tensor} does not divide the {role} model's {name} "
                           f"{getattr(shape, name)}")


def plan(models: Mapping[str, ModelShape], mesh: tuple[int, int, int], cfg: PlanConfig
         ) -> dict[str, RoleBytes]:
  """Per-device bytes of every role in ``models`` (role name -> shape), all on one mesh."""
  return {role: role_bytes(role, shape, mesh, cfg) for role, shape in models.items()}


def smallest_mesh(models: Mapping[str, ModelShape], cfg: PlanConfig, *, device_memory_gb: float,
                  tensor: int = 1, headroom: float = 0.9, max_devices: int = 65536
                  ) -> tuple[tuple[int, int, int], float] | None:
  """The smallest power-of-two device count ``N`` whose mesh ``(1, N/tensor, tensor)`` holds all
  roles colocated within ``headroom * device_memory_gb``. Only meshes that :func:`check_mesh`
  accepts count (``N/tensor`` divides the batch). Returns ``((data, fsdp, tensor), bytes per
  device)`` or ``None`` if none up to ``max_devices`` fits (e.g. ``dp`` never shards params, or
  the batch has too few sequences to spread over enough devices).

  Raises:
    ValueError: ``device_memory_gb`` not > 0; ``tensor`` not dividing the models (see
      :func:`check_mesh`).
  """
  if not device_memory_gb > 0:
    raise ValueError(f"device_memory_gb must be > 0, got {device_memory_gb}")
  n = tensor
  while n <= max_devices:
    mesh = (1, n // tensor, tensor)
    if cfg.batch % (n // tensor):
      return None  # larger meshes do not divide the batch either (powers of two)
    check_mesh(models, mesh, cfg)
    total = sum(r.total for r in plan(models, mesh, cfg).values())
    if total <= headroom * device_memory_gb * GB:
      return mesh, total
    n *= 2
  return None


def format_table(rows: Mapping[str, RoleBytes], mesh: tuple[int, int, int]) -> str:
  """A plain-text table, GB (1e9 bytes) per device."""
  head = (f"mesh data={mesh[0]} fsdp={mesh[1]} tensor={mesh[2]} ({math.prod(mesh)} devices), "
          "GB per device\n")
  cols = ("params", "grads", "optimizer", "kv_cache", "activations", "total")
  lines = [f"{'role':<10}" + "".join(f"{c:>12}" for c in cols)]
  tot = [0.0] * len(cols)
  for role, r in rows.items():
    vals = [r.params, r.grads, r.optimizer, r.kv_cache, r.activations, r.total]
    tot = [a + b for a, b in zip(tot, vals)]
    lines.append(f"{role:<10}" + "".join(f"{v / GB:>12.2f}" for v in vals))
  lines.append(f"{'all':<10}" + "".join(f"{v / GB:>12.2f}" for v in tot))
  return head + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """Command line (argparse, so it runs without absl flags state): prints the table and the
  smallest mesh. Exit status 0, or 2 on bad input (one-line message)."""
  import argparse
  import sys

  ap = argparse.ArgumentParser(prog="python -m rljax.sharding.plan", description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="7b", help="actor size preset or HF config.json")
  for role in ("critic", "reference", "reward"):
    ap.add_argument(f"--{role}_model", default=None,
                    help=f"{role} model (default: same as --model; 'none' drops the role)")
  ap.add_argument("--mesh", default=None, help="D,F,T; default: the smallest mesh that fits")
  ap.add_argument("--sharding_rules", default="fsdp", help="fsdp | fsdp_tp | dp | tp")
  ap.add_argument("--param_dtype", default="bfloat16")
  ap.add_argument("--opt_dtype", default="float32")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--device_memory_gb", type=float, default=80.0)
  ap.add_argument("--remat", action="store_true",
                  help="assume per-layer rematerialisation (not implemented by rljax's model yet)")
  args = ap.parse_args(argv)
  try:
    actor = model_shape(args.model)
    models = {"actor": actor}
    for role in ("critic", "reference", "reward"):
      name = getattr(args, f"{role}_model")
      if name != "none":
        models[role] = model_shape(name) if name else actor
    cfg = PlanConfig(param_dtype=args.param_dtype, opt_dtype=args.opt_dtype, batch=args.batch,
                     seq=args.seq, preset=args.sharding_rules, remat=args.remat)
    if not args.device_memory_gb > 0:
      raise ValueError(f"--device_memory_gb must be > 0, got {args.device_memory_gb:g}")
    tensor = 1
    if args.mesh:
      mc = parse_mesh_flag(args.mesh)
      if mc.data == -1:
        raise MeshError("--mesh for the planner needs an explicit data size")
      mesh = (mc.data, mc.fsdp, mc.tensor)
      tensor = mc.tensor
      check_mesh(models, mesh, cfg)
      print(format_table(plan(models, mesh, cfg), mesh))
    weights = sum(m.num_params for m in models.values()) * _DTYPE_BYTES[cfg.param_dtype]
    print(f"\nweights alone: {weights / GB:.0f} GB = {weights / (args.device_memory_gb * GB):.1f} "
          f"devices of {args.device_memory_gb:g} GB")
    best = smallest_mesh(models, cfg, device_memory_gb=args.device_memory_gb, tensor=tensor)
    if best is None:
      print(f"no mesh (1, N/{tensor}, {tensor}) up to 65536 devices whose data x fsdp divides "
            f"--batch={cfg.batch} fits {args.device_memory_gb:g} GB per device with rules "
            f"{cfg.preset.value}; raise --batch, or shard over tensor too "
            f"(--sharding_rules=fsdp_tp --mesh=1,F,T)")
    else:
      mesh, total = best
      print(f"smallest mesh that fits {args.device_memory_gb:g} GB devices (90% usable): "
            f"--mesh={mesh[0]},{mesh[1]},{mesh[2]} ({math.prod(mesh)} devices, "
            f"{total / GB:.1f} GB per device)")
      print(format_table(plan(models, mesh, cfg), mesh))
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
