"""A stand-in for a training script under experiments/slurm/*.sbatch (tests/test_distributed_slurm.py).

Prints ``READY <task>``; on SIGTERM prints ``TERM <task>`` and exits 75, as the trainers do after
checkpointing; otherwise exits 0 after 120 s. Arguments (the template's ``--logdir`` ...) are
ignored. Plain Python: the test is about the template's signal path, not about training.
"""

import os
import signal
import sys
import time

TASK = os.environ.get("SLURM_PROCID", "?")


def _on_term(signum, frame):
  del signum, frame
  print(f"TERM {TASK}", flush=True)
  sys.exit(75)


signal.signal(signal.SIGTERM, _on_term)
print(f"READY {TASK}", flush=True)
time.sleep(120)
