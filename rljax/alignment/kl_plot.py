"""``<logdir>/kl.png``: an RL run's KL to the reference per step, its target and ``beta``."""

from __future__ import annotations

import os

from rljax import kl as kl_lib
from rljax.alignment import rlhf_config
from rljax.metrics import read_jsonl


def write_kl_plot(jsonl_path: str, path: str, config: rlhf_config.RLHFConfig) -> str | None:
  """Draws the RL records' ``kl`` (nats per response) and ``kl_coef`` (``beta``, right axis)
  against the step, with ``config.kl_target`` as a dashed line where a controller aims at it
  and the band ``[target / 1.5, 1.5 * target]`` shaded. Returns ``path``, or None (nothing
  written) when ``jsonl_path`` is missing or holds no RL record with a ``kl``."""
  if not os.path.exists(jsonl_path):
    return None
  recs = [r for r in read_jsonl(jsonl_path) if r.get("stage") == "rl" and "kl" in r]
  if not recs:
    return None
  # The object-oriented API: no global backend switch, no figure registry to leak.
  from matplotlib.figure import Figure

  fig = Figure(figsize=(7, 3.6))
  ax = fig.subplots()
  steps = [r["step"] for r in recs]
  ax.plot(steps, [r["kl"] for r in recs], color="tab:blue", label="kl (nats per response)")
  controlled = config.kl_controller is not kl_lib.KLControl.FIXED
  if controlled:
    t = config.kl_target
    ax.axhline(t, color="tab:blue", ls="--", lw=1, label=f"target {t:g}")
    ax.axhspan(t / 1.5, 1.5 * t, color="tab:blue", alpha=0.08, label="target / 1.5 .. 1.5 x")
  ax.set_xlabel("RL step")
  ax.set_ylabel("kl")
  ax.grid(alpha=0.3)
  beta = ax.twinx()
  beta.plot(steps, [r.get("kl_coef", float("nan")) for r in recs], color="tab:orange",
            label="beta (kl_coef)")
  beta.set_ylabel("beta")
  lines = ax.get_legend_handles_labels()
  more = beta.get_legend_handles_labels()
  ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
  ax.set_title(f"KL to the reference, {config.kl_controller.value} controller")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path
