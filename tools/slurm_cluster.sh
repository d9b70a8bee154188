#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for vime's multi-node tests.
#
#   bash tools/slurm_cluster.sh up       # start munged, slurmctld, slurmd -N vime-n1 / vime-n2
#   bash tools/slurm_cluster.sh status   # sinfo
#   bash tools/slurm_cluster.sh down     # stop the daemons this script started (by pid)
#   bash tools/slurm_cluster.sh env      # print `export SLURM_CONF=...` for sbatch/srun/squeue
#
# Debian's slurm-wlm 22.05 is built with multiple-slurmd support: each fake node is one `slurmd -N`
# with NodeHostname=localhost and a loopback address of its own (NodeAddr 127.0.0.2, 127.0.0.3), so
# every listener and every job's traffic stays on loopback. Everything (config, state, spool, logs,
# munge socket and pid files) lives in $VIME_SLURM_DIR (default /tmp/vime-slurm) and the daemons use
# their own ports; a system-wide Slurm or munge is neither used nor touched. `up` is idempotent.
# Needs root (slurmd runs jobs as their user) and `apt-get install slurm-wlm munge` (scripts/setup.sh
# installs them when it runs as root).
set -euo pipefail

DIR=${VIME_SLURM_DIR:-/tmp/vime-slurm}
CTLD_PORT=${VIME_SLURM_CTLD_PORT:-26817}
NODE_PORT_BASE=${VIME_SLURM_NODE_PORT_BASE:-26818}
NODES=(vime-n1 vime-n2)
NODE_ADDRS=(127.0.0.2 127.0.0.3)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
MUNGE_SOCKET=$DIR/munge/munge.socket

export SLURM_CONF=$DIR/slurm.conf

# PIDFILE NAME: the pid in PIDFILE runs and is NAME (a pid left from an earlier boot may be reused).
alive() {
  local pid
  [ -f "$1" ] || return 1
  pid=$(cat "$1")
  [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ]
}

write_config() {
  mkdir -p "$DIR"/{state,log,spool} "$DIR/munge"
  chown munge:munge "$DIR/munge"
  chmod 0755 "$DIR/munge"
  local tmp=$DIR/slurm.conf.tmp
  cat > "$tmp" <<EOF
# Written by tools/slurm_cluster.sh: a two-node test cluster on one machine (loopback only).
ClusterName=vime-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=300
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
EOF
  local i
  for i in "${!NODES[@]}"; do
    echo "NodeName=${NODES[$i]} NodeHostname=localhost NodeAddr=${NODE_ADDRS[$i]} Port=$((NODE_PORT_BASE + i)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN" >> "$tmp"
  done
  echo "PartitionName=vime Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" >> "$tmp"
  mv "$tmp" "$SLURM_CONF"
}

wait_for_nodes() {
  local deadline=$(( $(date +%s) + 60 )) state
  while :; do
    state=$(sinfo -h -N -o '%N %t' 2>/dev/null || true)
    if [ -n "$state" ] && ! grep -qvE ' (idle|mix|alloc)$' <<< "$state"; then
      echo "slurm_cluster: up ($SLURM_CONF):"; sed 's/^/  /' <<< "$state"
      return 0
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "slurm_cluster: nodes not ready after 60 s: ${state:-no answer from slurmctld}" >&2
      echo "slurm_cluster: logs in $DIR/log" >&2
      return 1
    fi
    sleep 1
  done
}

up() {
  for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || {
      echo "slurm_cluster: $tool not found; run 'apt-get install slurm-wlm munge' (as root)" >&2
      exit 1
    }
  done
  [ "$(id -u)" = 0 ] || { echo "slurm_cluster: needs root (slurmd runs jobs as their user)" >&2; exit 1; }
  write_config
  if ! alive "$DIR/munge/munged.pid" munged; then
    runuser -u munge -- munged --socket="$MUNGE_SOCKET" --pid-file="$DIR/munge/munged.pid" \
      --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
  fi
  if ! alive "$DIR/slurmctld.pid" slurmctld; then
    slurmctld -f "$SLURM_CONF"
  fi
  local node
  for node in "${NODES[@]}"; do
    alive "$DIR/slurmd-$node.pid" slurmd || slurmd -f "$SLURM_CONF" -N "$node"
  done
  # A node left DOWN by an earlier run's abrupt stop comes back.
  scontrol update nodename="$(IFS=,; echo "${NODES[*]}")" state=resume 2>/dev/null || true
  wait_for_nodes
}

stop_pidfile() {  # PIDFILE NAME
  local pidfile=$1 pid
  alive "$pidfile" "$2" || { rm -f "$pidfile"; return 0; }
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

down() {
  local node
  for node in "${NODES[@]}"; do stop_pidfile "$DIR/slurmd-$node.pid" slurmd; done
  stop_pidfile "$DIR/slurmctld.pid" slurmctld
  stop_pidfile "$DIR/munge/munged.pid" munged
  echo "slurm_cluster: down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) sinfo ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
