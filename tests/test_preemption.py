"""SIGTERM before a trainer's own handler (rljax/preemption.py): the experiment scripts that
SLURM's templates run exit 75 (requeued) instead of Python's default 143."""

import os
import signal
import subprocess
import sys
import time

import pytest

from rljax import preemption

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", ["train_control.py", "train_rlhf.py", "train_sft.py",
                                    "train_reward_model.py"])
def test_sigterm_during_imports_exits_75(script, tmp_path):
  """A SIGTERM in the script's first second (its imports, before the trainer's handler) exits
  75 at once, with one line and nothing written."""
  logdir = str(tmp_path / "run")
  proc = subprocess.Popen([sys.executable, os.path.join(REPO, "experiments", script),
                           f"--logdir={logdir}"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  time.sleep(1.0)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=60)
  assert proc.returncode == preemption.EXIT_PREEMPTED == 75, stderr[-3000:]
  assert stderr.strip().splitlines()[-1] == preemption.EARLY_SIGTERM_MESSAGE, stderr[-3000:]
  assert not os.path.exists(logdir)


def test_a_second_sigterm_after_the_trainers_flag_took_one_says_so():
  """The scripts' early handler is put back when a trainer's flag exits, except after the flag
  took a SIGTERM: then another SIGTERM (while the run exits, its state saved) gets its own
  handler, whose message does not claim that there was nothing to save."""
  from rljax import checkpoint as ckpt

  before = signal.signal(signal.SIGTERM, preemption._exit_preempted)  # the scripts' first line
  try:
    with ckpt.SigtermFlag():
      pass
    assert signal.getsignal(signal.SIGTERM) is preemption._exit_preempted
    with ckpt.SigtermFlag() as flag:
      os.kill(os.getpid(), signal.SIGTERM)
    assert flag.received and signal.getsignal(signal.SIGTERM) is preemption._exit_again
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with ckpt.SigtermFlag() as flag:  # a handler other than the early one is restored as it was
      os.kill(os.getpid(), signal.SIGTERM)
    assert flag.received and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
  finally:
    signal.signal(signal.SIGTERM, before)
