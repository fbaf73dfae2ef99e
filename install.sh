#!/usr/bin/env bash
# Installs rljax and its test dependencies into .venv.
#
# As root on Debian/Ubuntu it first installs the system packages that rendering (OSMesa, ffmpeg) and the
# multi-host tests use: OSMesa (headless MuJoCo rendering on CPU) and SLURM with munge (the
# local cluster of tests/test_distributed_slurm.py). Elsewhere it prints what to install.
set -euo pipefail
cd "$(dirname "$0")"
# The interpreter: $PYTHON, else python3; rljax needs 3.11 or newer.
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  found=$("$PYTHON" -V 2>/dev/null) || found="not found"
  echo "install.sh: rljax needs Python 3.11 or newer; $PYTHON: $found." \
    "Run PYTHON=/path/to/python3.11 bash install.sh" >&2
  exit 1
fi
SYSTEM_PACKAGES="libosmesa6 ffmpeg slurmctld slurmd slurm-client munge"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "install.sh: apt-get install $SYSTEM_PACKAGES (already installed ones are kept)" >&2
  # Waits up to 5 min for another apt/dpkg (e.g. unattended-upgrades at boot) to finish.
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
    --no-install-recommends $SYSTEM_PACKAGES >/dev/null
else
  echo "install.sh: not root with apt-get; install these yourself if you need them: $SYSTEM_PACKAGES" >&2
fi
"$PYTHON" -m venv .venv
. .venv/bin/activate
# torch first: 2.13.0 is a CPU build here; transformers (a test-only reference) then reuses it.
pip install torch==2.13.0
pip install -e ".[test]"
