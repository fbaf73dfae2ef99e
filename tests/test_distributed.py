"""rljax.sharding.distributed: 2 local processes on 127.0.0.1, and the lost-process fault."""

import os
import subprocess
import sys
import time

import pytest
from _multiprocess import free_port, subprocess_env

from rljax.sharding import distributed

WORKER = os.path.join(os.path.dirname(__file__), "_dist_worker.py")


def _result(out: str) -> list[str]:
  line = [l for l in out.splitlines() if l.startswith("RESULT ")]
  assert line, out[-3000:]
  return line[-1].split()


def test_config_validation_names_values():
  with pytest.raises(ValueError, match="give all of .* num_processes=2, process_id=None"):
    distributed.DistributedConfig(coordinator_address="127.0.0.1:1234", num_processes=2)
  with pytest.raises(ValueError, match=r"process_id must be in \[0, 2\), got 2"):
    distributed.DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=2)
  for bad in ("localhost", "127.0.0.1:abc", ":1234", "h:0", "h:70000"):
    with pytest.raises(ValueError, match=f"coordinator_address must be host:port .* got '{bad}'"):
      distributed.DistributedConfig(coordinator_address=bad, num_processes=2, process_id=0)
  distributed.DistributedConfig(coordinator_address="[::1]:1234", num_processes=2, process_id=0)
  with pytest.raises(ValueError, match="heartbeat_timeout_s must be >= 1, got 0"):
    distributed.DistributedConfig(heartbeat_timeout_s=0)
  assert distributed.initialize(distributed.DistributedConfig(
      coordinator_address="h:1", num_processes=1, process_id=0)) is False


def test_connect_deadline_exits_69_with_one_line(capsys):
  """rljax's connect deadline (distributed._connect): a connect still running at the deadline
  prints one line naming the process and what to check, then exits 69; one that finishes in
  time cancels it."""
  import types

  config = types.SimpleNamespace(initialization_timeout_s=0.2)
  codes = []
  distributed._connect("process 0 of 2", "check X", config, lambda: time.sleep(1.0),
                       exit_fn=codes.append)
  assert codes == [distributed.EXIT_NOT_CONNECTED] == [69]
  err = capsys.readouterr().err
  assert err == ("rljax.sharding.distributed: process 0 of 2: not all processes connected within "
                 "0.2 s (--initialization_timeout_s); check X; exiting with status 69\n"), err
  codes.clear()
  distributed._connect("process 0 of 2", "check X", config, lambda: None, exit_fn=codes.append)
  time.sleep(0.4)
  assert codes == [] and capsys.readouterr().err == ""


def test_missing_peer_exits_69_naming_the_flags_not_134():
  """Process 0 of 2 started alone: at --initialization_timeout_s it exits 69 with rljax's line,
  before JAX's own deadline would abort it (SIGABRT, status 134, "another task died")."""
  port = free_port()
  out = subprocess.run(
      [sys.executable, WORKER, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
       "--process_id=0", "--initialization_timeout_s=2"],
      capture_output=True, text=True, timeout=120, env=subprocess_env(cpu=False))
  assert out.returncode == distributed.EXIT_NOT_CONNECTED, (out.returncode, out.stderr[-3000:])
  last = out.stderr.strip().splitlines()[-1]
  assert last == (
      f"rljax.sharding.distributed: process 0 of 2 (coordinator 127.0.0.1:{port}): not all "
      f"processes connected within 2 s (--initialization_timeout_s); start all 2 processes with "
      f"the same --coordinator_address and --num_processes and each with its own --process_id "
      f"in [0, 2); process 0 serves the coordinator; exiting with status 69"), out.stderr[-3000:]
  assert "Check failure" not in out.stderr and "Fatal Python error" not in out.stderr


@pytest.mark.slow
def test_two_processes_equal_one_process():
  one = subprocess.run([sys.executable, WORKER], capture_output=True, text=True, timeout=120, env=subprocess_env(cpu=False))
  assert one.returncode == 0, one.stderr[-3000:]
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, WORKER, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
       f"--process_id={i}", "--heartbeat_timeout_s=10"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(cpu=False)) for i in range(2)]
  outs = [p.communicate(timeout=180) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  r1 = _result(one.stdout)
  for i, (out, _) in enumerate(outs):
    r = _result(out)
    assert (r[1], r[2], r[3]) == (str(i), "2", "2")      # process i of 2, 2 global devices
    # same global batch, same loss and params as the 1-process run (3 SGD steps)
    assert abs(float(r[4]) - float(r1[4])) < 1e-5 and abs(float(r[5]) - float(r1[5])) < 1e-5


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_step():
  """SIGTERM reaching only process 0 (at step 3): `SigtermFlag.any_process` tells both, so both
  leave the loop after step 3 (the trainers then checkpoint that step and exit 75 together);
  reading its own flag, process 1 would run on alone into the next step's collective."""
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, WORKER, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
       f"--process_id={i}", "--heartbeat_timeout_s=10", "--sigterm_at_step=3"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(cpu=False))
      for i in range(2)]
  outs = [p.communicate(timeout=180) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  stopped = [l for out, _ in outs for l in out.splitlines() if l.startswith("STOPPED")]
  assert stopped == ["STOPPED 0 3 1", "STOPPED 1 3 0"], stopped


@pytest.mark.slow
def test_killed_process_makes_the_other_exit_within_20s():
  port = free_port()
  args = [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", "--heartbeat_timeout_s=5",
          "--hang_after_init"]
  p0 = subprocess.Popen([sys.executable, WORKER, *args, "--process_id=0"], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, env=subprocess_env(cpu=False))
  p1 = subprocess.Popen([sys.executable, WORKER, *args, "--process_id=1"], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, env=subprocess_env(cpu=False))
  try:
    deadline = time.time() + 120
    for line in p1.stdout:  # wait until both run cross-process steps
      if line.startswith("RESULT") or time.time() > deadline:
        break
    assert time.time() < deadline, "workers did not start"
    time.sleep(1.0)
    p1.kill()
    t0 = time.time()
    out, _ = p0.communicate(timeout=30)
    elapsed = time.time() - t0
  finally:
    for p in (p0, p1):
      if p.poll() is None:
        p.kill()
  assert p0.returncode != 0
  assert elapsed < 20, elapsed
  # rljax's watchdog (half the heartbeat timeout) names the lost process before JAX's
  # coordination service ("Task 1 heartbeat timeout") or a failed collective does.
  assert "rljax.sharding.distributed: lost process 1 of 2" in out, out[-3000:]
  assert p0.returncode == distributed.EXIT_LOST_PROCESS, (p0.returncode, out[-3000:])
  # The failed collective's error is not dumped before that line (runtime.run_main waits for
  # the watchdog's verdict).
  assert "Traceback" not in out, out[-3000:]
