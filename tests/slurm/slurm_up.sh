#!/usr/bin/env bash
# Copied from the local-cluster recipe into rljax so the project does not need /work/shared.
# Bring up a local Slurm cluster (slurmctld + slurmd [+ munge]) on 127.0.0.1 from scratch,
# as root, without systemd or cgroups. Tested: Debian 12, slurm-wlm 22.05.8, gVisor sandbox.
#   bash slurm_up.sh              1 node "localhost", CPUs=$(nproc), munge auth
#   AUTH=none bash slurm_up.sh    auth/none + cred/none, no munged at all
#   NCPU=8 bash slurm_up.sh       advertise 8 CPUs on a 2-core box (SlurmdParameters=config_overrides)
#                                 -> srun -n8 without --overcommit
#   NNODES=2 bash slurm_up.sh     emulate nodes n1..nN (one slurmd per node, all on 127.0.0.1;
#                                 Debian's build has MULTIPLE_SLURMD=Yes). Appends
#                                 "127.0.0.1 n1 .. nN" to /etc/hosts (jax must resolve n1);
#                                 slurm_down.sh restores /etc/hosts.
# Afterwards:  export SLURM_CONF=$SLURM_DIR/slurm.conf ; sinfo ; srun ... ; sbatch ...
set -euo pipefail
T0=$(date +%s.%N)
S=${SLURM_DIR:-/tmp/rljax-slurm}
AUTH=${AUTH:-munge}
NCPU=${NCPU:-$(nproc)}
NNODES=${NNODES:-1}

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v srun >/dev/null \
   || { [ "$AUTH" = munge ] && ! command -v munged >/dev/null; }; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge >/dev/null
fi
T1=$(date +%s.%N)

mkdir -p "$S"/{state,spool,log,run}
if [ "$AUTH" = munge ]; then
  AUTHLINES=$'AuthType=auth/munge\nCredType=cred/munge'
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge; chmod 755 /run/munge
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged          # daemonizes; pid in /run/munge/munged.pid
  fi
  munge -n | unmunge >/dev/null
else
  AUTHLINES=$'AuthType=auth/none\nCredType=cred/none'
fi

OVERRIDE=""
[ "$NCPU" != "$(nproc)" ] && OVERRIDE="SlurmdParameters=config_overrides"

cat > "$S/slurm.conf" <<EOF
ClusterName=ci
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
$AUTHLINES
CommunicationParameters=NoInAddrAny
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=30
$OVERRIDE
StateSaveLocation=$S/state
SlurmctldPidFile=$S/run/slurmctld.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmctldDebug=info
SlurmdDebug=info
EOF

if [ "$NNODES" = 1 ]; then
  NODES=localhost
  cat >> "$S/slurm.conf" <<EOF
SlurmdSpoolDir=$S/spool
SlurmdPidFile=$S/run/slurmd.pid
SlurmdLogFile=$S/log/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$NCPU State=UNKNOWN
EOF
else
  NODES="n[1-$NNODES]"
  NAMES=$(seq -f 'n%g' -s ' ' 1 "$NNODES")
  [ -f "$S/hosts.orig" ] || cp /etc/hosts "$S/hosts.orig"
  grep -qx "127.0.0.1 $NAMES" /etc/hosts || echo "127.0.0.1 $NAMES" >> /etc/hosts
  cat >> "$S/slurm.conf" <<EOF
SlurmdSpoolDir=$S/spool/%n
SlurmdPidFile=$S/run/slurmd-%n.pid
SlurmdLogFile=$S/log/slurmd-%n.log
NodeName=$NODES NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001-$((17000 + NNODES)) CPUs=$NCPU State=UNKNOWN
EOF
fi
echo "PartitionName=debug Nodes=$NODES Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >> "$S/slurm.conf"
export SLURM_CONF="$S/slurm.conf"

# -c: clear saved state, -i: ignore state errors. Both daemonize (no -D) and write pidfiles.
/usr/sbin/slurmctld -c -i
if [ "$NNODES" = 1 ]; then
  /usr/sbin/slurmd -N localhost
else
  for i in $(seq 1 "$NNODES"); do /usr/sbin/slurmd -N "n$i"; done
fi

nidle() { sinfo -h -N -o '%t' 2>/dev/null | grep -cE '^(idle|mix|alloc)$' || true; }
for _ in $(seq 1 60); do [ "$(nidle)" -ge "$NNODES" ] && break; sleep 0.5; done
[ "$(nidle)" -ge "$NNODES" ] || { echo "nodes not idle"; sinfo -N; tail -20 "$S"/log/*.log; exit 1; }
T2=$(date +%s.%N)
sinfo -N
printf 'slurm_up: install/check %.1fs, daemons up %.1fs (auth=%s nodes=%s cpus/node=%s)\n' \
  "$(echo "$T1-$T0" | bc)" "$(echo "$T2-$T1" | bc)" "$AUTH" "$NODES" "$NCPU"
echo "export SLURM_CONF=$SLURM_CONF"
