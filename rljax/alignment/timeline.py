"""The RL stage's timeline: when each step generated, scored, trained and synced weights.

`rljax.alignment.rlhf.RLHFTrainer` records ``(stage, step, start, end)`` spans (seconds of
``time.perf_counter``) in ``trainer.timeline``; `write_timeline` draws them as
``<logdir>/timeline.png`` (one row per stage, one bar per step) and `overlap_summary` gives the
totals that ``summary.json`` reports.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

STAGES = ("generate", "score", "train", "sync")
_COLOURS = {"generate": "tab:blue", "score": "tab:orange", "train": "tab:green",
            "sync": "tab:red"}

Span = tuple[str, int, float, float]


def write_timeline(spans: Sequence[Span], path: str, *, title: str = "") -> str | None:
  """Draws ``spans`` to the PNG ``path`` (written atomically); returns it, or None without
  spans. Times are shown from the first span's start; each bar is labelled with its step."""
  spans = [s for s in spans if s[0] in STAGES and s[3] > s[2]]
  if not spans:
    return None
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  t0 = min(s[2] for s in spans)
  width = max(s[3] for s in spans) - t0
  fig, ax = plt.subplots(figsize=(12, 2.6))
  rows = {stage: i for i, stage in enumerate(reversed(STAGES))}
  for stage, step, start, end in spans:
    y = rows[stage]
    ax.barh(y, end - start, left=start - t0, height=0.6, color=_COLOURS[stage],
            edgecolor="black", linewidth=0.3)
    if end - start > 0.03 * width and len(spans) <= 400:
      ax.text(start - t0 + (end - start) / 2, y, str(step), ha="center", va="center",
              fontsize=6, color="white")
  ax.set_yticks(list(rows.values()), list(rows.keys()))
  ax.set_xlabel("seconds since the first step's rollout started")
  ax.set_title(title or "RL steps: generation, scoring, training and weight sync")
  fig.tight_layout()
  tmp = f"{path}.tmp.png"
  fig.savefig(tmp, dpi=110)
  plt.close(fig)
  os.replace(tmp, path)
  return path


def overlap_summary(history: Sequence[dict[str, float]]) -> dict[str, float]:
  """Per-step means of the RL records' phase times (seconds): ``step_generation_s``,
  ``step_update_s`` (critic and update), ``step_sync_s`` (weights to the generator),
  ``step_overlap_s`` (update time during which the generator worked) and ``step_s``; and
  ``overlap_fraction``, the share of generation time hidden behind updates (0 for a
  synchronous run). Empty without records."""
  if not history:
    return {}

  def mean(*keys):
    return float(np.mean([sum(r.get(k, 0.0) for k in keys) for r in history]))

  out = {"step_generation_s": mean("timing/generation"),
         "step_update_s": mean("timing/critic", "timing/update"),
         "step_sync_s": mean("timing/sync") if any("timing/sync" in r for r in history)
         else mean("timing/reshard"),
         "step_overlap_s": mean("timing/overlap"), "step_s": mean("timing/step")}
  gen = out["step_generation_s"]
  out["overlap_fraction"] = min(out["step_overlap_s"] / gen, 1.0) if gen > 0 else 0.0
  return out
