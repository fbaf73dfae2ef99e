#!/usr/bin/env bash
# Copied from the local-cluster recipe into rljax so the project does not need /work/shared.
# Stop the local cluster started by slurm_up.sh: cancel jobs, stop daemons by the
# PIDs in their pidfiles, remove state, restore /etc/hosts if NNODES>1 changed it.
S=${SLURM_DIR:-/tmp/rljax-slurm}
export SLURM_CONF="$S/slurm.conf"
scancel --full --user=root 2>/dev/null || true
stop() {  # stop <pidfile> <name>
  [ -s "$1" ] || return 0
  local pid; pid=$(cat "$1")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    echo "stopped $2 (pid $pid)"
  fi
  rm -f "$1"
}
for f in "$S"/run/slurmd*.pid; do [ -e "$f" ] && stop "$f" "$(basename "$f" .pid)"; done
stop "$S/run/slurmctld.pid" slurmctld
stop /run/munge/munged.pid munged
rm -rf "${S:?}/state" "${S:?}/spool" "${S:?}/run"
if [ -f "$S/hosts.orig" ]; then cp "$S/hosts.orig" /etc/hosts && rm -f "$S/hosts.orig" && echo "restored /etc/hosts"; fi
true
