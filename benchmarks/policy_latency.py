r"""Per-action latency of an exported policy at batch 1 on this machine's CPU.

    python benchmarks/policy_latency.py --out=/tmp/policy_latency.json

For each network below it builds the actor-critic (random weights, non-trivial
observation statistics), exports it with ``rljax.control.export.export_policy``
(batch-polymorphic, platforms cpu+cuda), loads it back with the standalone
``rljax/control/export_loader.py`` and times, call by call, what a robot's control loop
does: ``np.asarray(policy(obs))`` for one float32 observation (host in, host out:
argument transfer, dispatch, the compiled MLP, result transfer). For reference it also
times the in-process jitted function (``make_inference_fn``, what ``load_policy``
runs) the same way.

Networks: ``default`` is ``ControlConfig``'s policy MLP (32x4, swish) on CartpoleBalance's
sizes (5 -> 1); ``default-ant`` the same MLP on Brax ant's sizes (27 -> 8);
``cartpole-bundled`` the bundled CartpoleBalance config's 64x2 MLP. The target is a
p99 below 1 ms for the default MLP.

Flags: ``--iters`` (timed calls per measurement), ``--warmup`` (untimed calls before them) and
``--out`` (the JSON file).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from rljax import running_stats
from rljax.control import export, export_loader, trainer
from rljax.control.config import ControlConfig, default_config
from rljax.models import mlp

_OUT = flags.DEFINE_string("out", None, "Write the JSON result here.")
_ITERS = flags.DEFINE_integer("iters", 5000, "Timed calls per measurement.")
_WARMUP = flags.DEFINE_integer("warmup", 500, "Untimed calls before timing.")


def networks_to_measure() -> dict[str, tuple[int, int, tuple[int, ...], str]]:
  """name -> (observation size, action size, policy hidden sizes, activation)."""
  base = ControlConfig()
  bundled = default_config("playground/CartpoleBalance")
  return {
      "default": (5, 1, base.policy_hidden, base.activation),
      "default-ant": (27, 8, base.policy_hidden, base.activation),
      "cartpole-bundled": (5, 1, bundled.policy_hidden, bundled.activation),
  }


def build_policy(obs_size: int, act_size: int, hidden: tuple[int, ...], activation: str, seed: int = 0):
  """Random actor-critic parameters and normaliser statistics: ``(networks, params, stats)``."""
  config = mlp.ActorCriticConfig(observation_size=obs_size, action_size=act_size,
                                 policy_hidden=hidden, value_hidden=(8,), activation=activation)
  graphdef, params = nnx.split(mlp.ActorCritic(config, rngs=nnx.Rngs(params=seed)), nnx.Param)
  data = 2.0 * jax.random.normal(jax.random.PRNGKey(seed + 1), (256, obs_size)) + 0.5
  stats = running_stats.update(running_stats.init(obs_size), data)
  return trainer.Networks(graphdef, config), params, stats


def time_calls(fn, obs: np.ndarray, *, iters: int, warmup: int) -> np.ndarray:
  """Seconds per call of ``np.asarray(fn(obs))``, ``[iters]`` float64."""
  for _ in range(warmup):
    np.asarray(fn(obs))
  out = np.empty(iters)
  clock = time.perf_counter_ns
  for i in range(iters):
    t0 = clock()
    np.asarray(fn(obs))
    out[i] = clock() - t0
  return out * 1e-9


def summarize(seconds: np.ndarray) -> dict[str, float]:
  us = seconds * 1e6
  return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
          "mean_us": float(us.mean()), "max_us": float(us.max()), "n": int(us.size)}


def main(argv):
  del argv
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, (obs_size, act_size, hidden, activation) in networks_to_measure().items():
      networks, params, stats = build_policy(obs_size, act_size, hidden, activation)
      out_dir = os.path.join(tmp, name)
      export.export_policy(networks, params, stats, out_dir)
      exported = export_loader.load(out_dir)
      in_process = jax.jit(export.make_inference_fn(networks, params, stats))
      obs = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (obs_size,)), np.float32)
      np.testing.assert_allclose(np.asarray(exported(obs)), np.asarray(in_process(obs[None]))[0],
                                 atol=1e-6)
      for path, fn, x in (
          ("exported, obs [D]", exported, obs),
          ("exported, obs [1, D]", exported, obs[None]),
          ("in-process jit, obs [1, D]", in_process, obs[None]),
      ):
        s = summarize(time_calls(fn, x, iters=_ITERS.value, warmup=_WARMUP.value))
        rows.append(dict(network=name, obs_size=obs_size, action_size=act_size,
                         policy_hidden=list(hidden), activation=activation, path=path, **s))

  print(f"{'network':<17} {'sizes':<7} {'hidden':<14} {'path':<27} {'p50 us':>8} {'p99 us':>8} {'max us':>9}")
  for r in rows:
    sizes = f"{r['obs_size']}->{r['action_size']}"
    hidden = "x".join(map(str, r["policy_hidden"]))
    print(f"{r['network']:<17} {sizes:<7} {hidden:<14} {r['path']:<27} "
          f"{r['p50_us']:>8.1f} {r['p99_us']:>8.1f} {r['max_us']:>9.1f}")
  default = next(r for r in rows if r["network"] == "default" and r["path"] == "exported, obs [D]")
  verdict = "meets" if default["p99_us"] < 1000 else "MISSES"
  print(f"default MLP, exported, batch 1: p99 {default['p99_us']:.1f} us ({verdict} the 1 ms target)")
  result = {
      "benchmark": "policy_latency",
      "rows": rows,
      "target_p99_us": 1000.0,
      "default_exported_p99_us": default["p99_us"],
      "machine": {"platform": platform.platform(), "processor": platform.processor(),
                  "cpu_count": os.cpu_count(), "jax_backend": jax.default_backend(),
                  "load_average": list(os.getloadavg())},
      "versions": {"jax": jax.__version__},
      "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
