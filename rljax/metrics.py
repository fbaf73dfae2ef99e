"""Metric writers for both trainers: console progress bar, JSONL, TensorBoard, plots.

``MetricsWriter`` fans one ``write(step, metrics)`` out to

* ``<logdir>/metrics.jsonl``: one JSON object per log step (``{"step": ..., ...}``);
* TensorBoard event files in ``<logdir>`` (tensorboardX);
* a ``tqdm`` progress bar with rate and ETA on the console;
* optionally a Weights & Biases run (`init_wandb`: offline, in ``<logdir>/wandb``).

``plot_learning_curve`` turns the JSONL into ``learning_curve.png`` with matplotlib.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.runtime import is_primary


def _to_float(x: Any) -> float:
  return float(np.asarray(x))


class MetricsWriter:
  """Writes scalar metrics to JSONL, TensorBoard and a console progress bar.

  Args:
    logdir: the run's directory (created if missing).
    total: the progress bar's total (e.g. ``num_timesteps``); ``None`` disables it.
    unit: the progress bar's unit (``"steps"``).
    console_keys: metrics shown beside the bar.
    tensorboard: write TensorBoard event files.
    wandb: a Weights & Biases run to mirror every record to (``run.log(record)``, the
      record's ``"step"`` included as a metric, so several writers of one run, e.g.
      pre-training then SFT, may restart their step counts); ``None`` (default) uses
      the process's active run (``wandb.run``, e.g. from `init_wandb`) if there is one;
      ``False`` never logs to W&B.
    primary: whether this process writes at all; default ``rljax.runtime.is_primary()``
      (process 0 of a multi-process run). A non-primary writer creates nothing and its
      ``write`` does nothing, so N processes computing the same metrics log them once.

  ``metrics.jsonl`` and the TensorBoard event file are created at the first ``write``: a
  writer that records nothing leaves ``logdir`` as it found it.

  Raises:
    OSError: ``logdir`` cannot be created (here) or written (at the first ``write``).
  """

  def __init__(
      self,
      logdir: str,
      *,
      total: int | None = None,
      unit: str = "steps",
      console_keys: Sequence[str] = (),
      tensorboard: bool = True,
      wandb: Any = None,
      primary: bool | None = None,
  ):
    if primary is None:
      primary = is_primary()
    self.primary = primary
    self.logdir = logdir
    self.jsonl_path = os.path.join(logdir, "metrics.jsonl")
    self._jsonl = self._tb = self._bar = self._wandb = None
    self._console_keys = ()
    self._progress = 0
    if not primary:
      return
    os.makedirs(logdir, exist_ok=True)
    # metrics.jsonl and the event file are opened at the first record, so a writer that records
    # nothing (a re-run of a finished run, a run stopped on bad input) leaves no empty file.
    self._tensorboard = tensorboard
    self._bar = None
    if total is not None:
      from tqdm.auto import tqdm

      self._bar = tqdm(total=total, unit=unit, unit_scale=True, dynamic_ncols=True)
    self._wandb = active_wandb_run() if wandb is None else (wandb or None)
    self._console_keys = tuple(console_keys)
    self._progress = 0

  def write(self, step: int, metrics: Mapping[str, Any], *, progress: int | None = None,
            stage: str | None = None) -> None:
    """Records ``metrics`` at ``step``; ``progress`` (absolute) advances the bar.

    ``stage`` (e.g. ``"sft"``, ``"rm"``, ``"rl"``) goes into the JSONL record after ``step``,
    for runs whose stages each count steps from 1 into one file; TensorBoard and W&B tell
    them apart by the metric names' prefixes (``sft/loss``) and do not get it.
    """
    if not self.primary:
      return
    record = {"step": int(step)}
    if stage is not None:
      record["stage"] = str(stage)
    for k, v in metrics.items():
      f = _to_float(v)
      record[k] = f if math.isfinite(f) else str(f)
    self._open()
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, float):
          self._tb.add_scalar(k, v, global_step=int(step))
    if self._wandb is not None:
      self._wandb.log({k: (float(v) if isinstance(v, str) else v) for k, v in record.items()
                       if k != "stage"})
    if self._bar is not None:
      if progress is not None and progress > self._progress:
        self._bar.update(progress - self._progress)
        self._progress = progress
      shown = {k.split("/")[-1]: f"{record[k]:.4g}" for k in self._console_keys if k in record}
      if shown:
        self._bar.set_postfix(shown, refresh=True)

  def _open(self) -> None:
    """Opens ``metrics.jsonl`` (append) and the TensorBoard writer, once."""
    if self._jsonl is not None:
      return
    self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
    if self._tensorboard:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(logdir=self.logdir, flush_secs=10)

  def close(self) -> None:
    """Closes the progress bar, the TensorBoard writer and ``metrics.jsonl``."""
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
    if self._jsonl is not None:
      self._jsonl.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def active_wandb_run():
  """The process's active ``wandb`` run, or ``None`` (also when wandb was never imported)."""
  wandb = sys.modules.get("wandb")
  return getattr(wandb, "run", None) if wandb is not None else None


def init_wandb(logdir: str, config: Mapping[str, Any] | None = None, *,
               project: str = "rljax", name: str | None = None):
  """Starts an offline Weights & Biases run in ``<logdir>/wandb/offline-run-*``.

  Nothing is sent over the network; ``wandb sync <logdir>/wandb/offline-run-*`` uploads
  the run later. Console capture and system-metrics sampling are off (they would wrap
  the progress bar and take CPU from training). `MetricsWriter` s created afterwards
  mirror their records to this run; call ``run.finish()`` at the end (`rljax.run_info.start_run`
  does so at exit).

  Args:
    logdir: the run's directory (created if missing).
    config: the run's settings (JSON-ready values), shown as the W&B run's config.
    project: W&B project name.
    name: run name; default the basename of ``logdir``.

  Returns:
    The ``wandb`` run object.

  Raises:
    ValueError: the ``wandb`` package is not installed (``pip install 'rljax[wandb]'``).
  """
  try:
    import wandb
  except ImportError:
    raise ValueError(
        "--wandb needs the wandb package: pip install 'rljax[wandb]' (or pip install wandb)."
    ) from None
  os.makedirs(logdir, exist_ok=True)
  return wandb.init(
      mode="offline", dir=logdir, project=project,
      name=name or os.path.basename(os.path.normpath(logdir)), config=dict(config or {}),
      settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
  )


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """Reads a ``metrics.jsonl`` file into a list of dicts."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_learning_curve(
    jsonl_path: str,
    out_path: str,
    *,
    x: str = "env_steps",
    y: Sequence[str] = ("eval/episode_reward",),
    title: str | None = None,
) -> str:
  """Plots ``y`` against ``x`` from a metrics JSONL file to a PNG; returns ``out_path``.

  Raises:
    ValueError: if no record holds both ``x`` and any of ``y``.
  """
  # The object-oriented API, not pyplot: no global backend switch (a notebook keeps its
  # inline backend) and no figure registry to leak.
  from matplotlib.figure import Figure

  records = read_jsonl(jsonl_path)
  fig = Figure(figsize=(6, 4))
  ax = fig.subplots()
  plotted = False
  for key in y:
    pts = [(r[x], r[key]) for r in records if x in r and isinstance(r.get(key), (int, float))]
    if pts:
      xs, ys = zip(*pts)
      ax.plot(xs, ys, marker="o", label=key)
      plotted = True
  if not plotted:
    raise ValueError(f"{jsonl_path} has no records with {x!r} and any of {list(y)}.")
  ax.set_xlabel(x)
  ax.set_ylabel(", ".join(y))
  ax.grid(alpha=0.3)
  ax.legend()
  if title:
    ax.set_title(title)
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  return out_path
