r"""Asynchronous RLHF: RL steps per second of ``max_staleness=1`` against ``0``, same seeds.

    python benchmarks/async_rlhf.py --out=/tmp/async_rlhf.json
    python benchmarks/async_rlhf.py --pipelines=embedded --seeds=0 --num_steps=60   # quick

For each pipeline (the embedded default of ``train_rlhf.py``, and the HH-RLHF preference
pipeline of ``train_rlhf.py --preference_data``) and each seed, the whole pipeline runs twice
in this process with identical settings except ``max_staleness`` (0: generate, score, train in
turn; 1: the next batch is generated on the generator thread while this one trains). Reported
per pipeline:

* ``speedup_vs_sync``: the synchronous run's mean RL step time over the asynchronous one's
  (steps after the first, which compiles), the mean over seeds;
* ``ideal_speedup``: the bound of a perfect overlap, the synchronous step time over
  ``max(generation + scoring, critic + update)``, measured in the synchronous runs;
* ``fraction_of_ideal``: ``(speedup - 1) / (ideal - 1)``;
* ``hidden_generation_fraction``: the share of the asynchronous runs' generation time that
  overlapped an update (``timing/overlap / timing/generation``, capped at 1);
* ``sync_rollout_cores`` and ``sync_update_cores``: the CPU cores each phase keeps busy in the
  synchronous runs (``timing/rollout_cores``, ``timing/update_cores``: process CPU time over
  wall time), i.e. how much room the other phase has to run beside it;
* ``reward_sync_mean``/``_std`` and ``reward_async_mean``/``_std``: the mean reward of the last
  10 steps over seeds (``std``: seed-to-seed), and both reward curves per seed.

The preference pipeline needs the HH-RLHF file (``--preference_data``; default: ``data/`` in the
checkout or ``$RLJAX_HH_RLHF``); without it that pipeline is skipped with a note.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np
from absl import app, flags

_OUT = flags.DEFINE_string("out", None, "Write the JSON result here.")
_PIPELINES = flags.DEFINE_list("pipelines", ["embedded", "preference"],
                               "Pipelines to run: embedded, preference.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (each runs sync and async).")
_NUM_STEPS = flags.DEFINE_integer("num_steps", None, "RL steps per run (default: the pipeline's).",
                                  lower_bound=2)
_STALENESS = flags.DEFINE_integer("max_staleness", 1, "The asynchronous runs' max_staleness.",
                                  lower_bound=1)
_DATA = flags.DEFINE_string("preference_data", None, "The HH-RLHF preference file (JSONL, .gz).")


def _hh_path() -> str | None:
  candidates = [_DATA.value, os.environ.get("RLJAX_HH_RLHF"),
                os.path.join(os.path.dirname(__file__), "..", "data",
                             "hh-rlhf-harmless-base-test.jsonl.gz")]
  return next((p for p in candidates if p and os.path.exists(p)), None)


def _run(pipeline_name: str, seed: int, staleness: int, data: str | None) -> dict:
  from rljax.alignment import pipeline

  quiet = lambda *_: None  # noqa: E731
  if pipeline_name == "embedded":
    rl = pipeline.default_rl_config("ppo", seed=seed, max_staleness=staleness)
    if _NUM_STEPS.value:
      rl = dataclasses.replace(rl, num_steps=_NUM_STEPS.value)
    summary = pipeline.run_embedded(pipeline.EmbeddedConfig(rl=rl, seed=seed), log=quiet)
  else:
    base = pipeline.preference_defaults(None)
    rl = dataclasses.replace(base.rl, seed=seed, max_staleness=staleness,
                             **({"num_steps": _NUM_STEPS.value} if _NUM_STEPS.value else {}))
    summary = pipeline.run_preference(data, dataclasses.replace(base, rl=rl, seed=seed),
                                      log=quiet)
  hist = summary["history"][1:]  # the first step compiles
  mean = lambda k: float(np.mean([h.get(k, 0.0) for h in hist]))  # noqa: E731
  return dict(
      step_s=mean("timing/step"),
      generation_s=mean("timing/generation") + mean("timing/reference") + mean("timing/reward")
      + mean("timing/reshard"),
      update_s=mean("timing/critic") + mean("timing/update"),
      overlap_s=mean("timing/overlap"), raw_generation_s=mean("timing/generation"),
      rollout_cores=mean("timing/rollout_cores"), update_cores=mean("timing/update_cores"),
      reward_last=float(summary["reward_last"]),
      reward_curve=[round(float(h["reward/mean"]), 4) for h in summary["history"]],
      policy_lag_max=max(h["rollout/policy_lag_max"] for h in summary["history"]),
      wall_s=float(summary["wall_s"]))


def _pipeline_result(name: str, seeds: list[int], data: str | None) -> dict:
  runs = {0: [], _STALENESS.value: []}
  for seed in seeds:
    for s in runs:
      t = time.perf_counter()
      runs[s].append(_run(name, seed, s, data))
      print(f"{name} seed {seed} max_staleness {s}: step {runs[s][-1]['step_s']:.4f}s "
            f"reward_last {runs[s][-1]['reward_last']:.3f} ({time.perf_counter() - t:.0f}s)",
            flush=True)
  sync, asyn = runs[0], runs[_STALENESS.value]
  speedups = [s["step_s"] / a["step_s"] for s, a in zip(sync, asyn)]
  ideal = [s["step_s"] / max(s["generation_s"], s["update_s"]) for s in sync]
  speedup, ideal_speedup = statistics.mean(speedups), statistics.mean(ideal)
  std = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
  return dict(
      pipeline=name, seeds=seeds, max_staleness=_STALENESS.value,
      speedup_vs_sync=speedup, speedups=speedups, ideal_speedup=ideal_speedup,
      fraction_of_ideal=(speedup - 1) / (ideal_speedup - 1) if ideal_speedup > 1 else None,
      hidden_generation_fraction=statistics.mean(
          min(a["overlap_s"] / a["raw_generation_s"], 1.0) if a["raw_generation_s"] else 0.0
          for a in asyn),
      sync_step_s=statistics.mean(s["step_s"] for s in sync),
      async_step_s=statistics.mean(a["step_s"] for a in asyn),
      sync_generation_s=statistics.mean(s["generation_s"] for s in sync),
      sync_update_s=statistics.mean(s["update_s"] for s in sync),
      sync_rollout_cores=statistics.mean(s["rollout_cores"] for s in sync),
      sync_update_cores=statistics.mean(s["update_cores"] for s in sync),
      reward_sync_mean=statistics.mean(s["reward_last"] for s in sync),
      reward_sync_std=std([s["reward_last"] for s in sync]),
      reward_async_mean=statistics.mean(a["reward_last"] for a in asyn),
      reward_async_std=std([a["reward_last"] for a in asyn]),
      policy_lag_max=max(a["policy_lag_max"] for a in asyn),
      reward_curves_sync=[s["reward_curve"] for s in sync],
      reward_curves_async=[a["reward_curve"] for a in asyn])


def _cpu() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def main(argv):
  del argv
  import jax

  seeds = [int(s) for s in _SEEDS.value]
  data = _hh_path()
  results, notes = [], []
  for name in _PIPELINES.value:
    if name not in ("embedded", "preference"):
      raise app.UsageError(f"--pipelines: unknown pipeline {name!r} (embedded, preference)")
    if name == "preference" and data is None:
      notes.append("preference skipped: no HH-RLHF file (--preference_data or $RLJAX_HH_RLHF)")
      print(notes[-1])
      continue
    results.append(_pipeline_result(name, seeds, data))
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
  except OSError:
    commit = ""
  out = dict(results=results, notes=notes, date=time.strftime("%Y-%m-%d"), commit=commit,
             cpu=_cpu(), cores=os.cpu_count(), device=str(jax.devices()[0]),
             loadavg=os.getloadavg())
  for r in results:
    print(f"{r['pipeline']}: speedup {r['speedup_vs_sync']:.3f}x (ideal {r['ideal_speedup']:.3f}x)"
          f", reward sync {r['reward_sync_mean']:.3f}+-{r['reward_sync_std']:.3f} async "
          f"{r['reward_async_mean']:.3f}+-{r['reward_async_std']:.3f}")
  if _OUT.value:
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
