"""Exit status 75 for a SIGTERM that comes before a trainer's own handler is installed.

SLURM sends SIGTERM before it preempts a job; the sbatch scripts (``experiments/slurm/``)
requeue a job whose command exited with :data:`EXIT_PREEMPTED`. A trainer installs its own
handler (:class:`rljax.checkpoint.SigtermFlag`: finish the step, checkpoint, exit 75) only once it
runs; before that (the script's imports, several seconds, and its input checks) Python's default
would kill the process with 143, which is not requeued. The experiment scripts therefore call
:func:`exit_on_early_sigterm` on their first line. This module imports the standard library only,
so that call comes before JAX is imported.
"""

from __future__ import annotations

import os
import signal
import sys

# Exit status of a run stopped by SIGTERM (SLURM preemption): EX_TEMPFAIL from sysexits.h,
# "try again later". Shared by the control and RLHF scripts (``rljax.checkpoint`` re-exports it).
EXIT_PREEMPTED = 75



class Preempted(Exception):
  """Raised by the host loop (`rljax.loop.run`) after a SIGTERM: the current step (a control
  chunk, an RL step) finished and was checkpointed; or, ``during_start_up``, the signal came
  before training and ``step`` is the newest checkpoint (0: none), from which the same command
  resumes. The scripts print it and exit with :data:`EXIT_PREEMPTED`.

  Attributes:
    step: the step checkpointed (or resumed from); ``chunk`` is the same number.
  """

  def __init__(self, step: int, logdir: str, *, unit: str = "step",
               during_start_up: bool = False):
    if during_start_up:
      where = f"checkpoint {step}" if step else "the start"
      msg = (f"preempted by SIGTERM during start-up, before training; nothing new to "
             f"checkpoint: the run resumes from {where} in {logdir}")
    else:
      msg = f"preempted by SIGTERM; checkpointed {unit} {step} in {logdir}"
    super().__init__(msg)
    self.step = self.chunk = step


EARLY_SIGTERM_MESSAGE = (f"preempted by SIGTERM outside the trainer (nothing new to save); "
                         f"exiting with status {EXIT_PREEMPTED}")


def _exit_preempted(signum, frame) -> None:
  """Prints :data:`EARLY_SIGTERM_MESSAGE` to stderr and exits with :data:`EXIT_PREEMPTED`."""
  del signum, frame
  print(EARLY_SIGTERM_MESSAGE, file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  # os._exit, not sys.exit: a handler's SystemExit raised inside a callback (e.g. JAX's gc
  # callback during imports) is printed and ignored. Nothing is open that needs closing here.
  os._exit(EXIT_PREEMPTED)


def _exit_again(signum, frame) -> None:
  """A SIGTERM after the trainer's own handler took one (the run is already stopping): exits
  with :data:`EXIT_PREEMPTED` at once, saying so."""
  del signum, frame
  print(f"another SIGTERM while exiting after the first; exiting with status {EXIT_PREEMPTED}",
        file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(EXIT_PREEMPTED)


def handler_after(previous, received: bool):
  """The SIGTERM handler a trainer's flag (:class:`rljax.checkpoint.SigtermFlag`) restores when
  it exits: ``previous``; but where that is this module's early handler and the flag took a
  SIGTERM (the run is stopping, its state saved), one whose message says that a second SIGTERM
  came while exiting, not that there was nothing to save."""
  return _exit_again if received and previous is _exit_preempted else previous


def exit_on_early_sigterm() -> None:
  """Makes SIGTERM exit the process at once with status 75 and a one-line message.

  For a script's first line (``if __name__ == "__main__"``): a trainer's
  :class:`rljax.checkpoint.SigtermFlag` replaces this handler while it trains and puts it back
  afterwards. Nothing is saved by this handler: a run stopped here resumes from its last
  checkpoint, or starts again, when the command runs again.

  Raises:
    ValueError: from ``signal.signal`` when called outside the main thread.
  """
  signal.signal(signal.SIGTERM, _exit_preempted)
