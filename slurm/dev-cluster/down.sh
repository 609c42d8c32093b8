#!/usr/bin/env bash
# down.sh STATE_DIR — stop the daemons that up.sh started in STATE_DIR,
# by the PIDs in their pid files only (never by name). Cancels this cluster's jobs first
# so no slurmstepd/job processes outlive slurmd.
set -uo pipefail
STATE=$(cd "${1:?usage: down.sh STATE_DIR}" && pwd) || exit 1
export SLURM_CONF="$STATE/etc/slurm.conf"
log() { echo "[dev-cluster down $(date +%T)] $*" >&2; }

running() {  # running PID NAME : alive, not a zombie, and still the program we started
  [ -r "/proc/$1/stat" ] && [ "$(cut -d' ' -f3 "/proc/$1/stat")" != Z ] && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ]
}
stop() {  # stop PIDFILE NAME
  local f=$1 name=$2 p; p=$(cat "$f" 2>/dev/null) || return 0; [ -n "$p" ] || return 0
  if running "$p" "$name"; then
    kill -TERM "$p"
    local end=$((SECONDS + 20)); while running "$p" "$name" && [ $SECONDS -lt $end ]; do sleep 0.1; done
    if running "$p" "$name"; then log "$name ($p) ignored SIGTERM; SIGKILL"; kill -KILL "$p"; fi
    log "stopped $name ($p)"
  fi
  rm -f "$f"
}

if [ -f "$STATE/run/slurmctld.pid" ] && running "$(cat "$STATE/run/slurmctld.pid")" slurmctld; then
  scancel --user="$(id -un)" 2>/dev/null || true     # this cluster's jobs only (SLURM_CONF)
  end=$((SECONDS + 15))
  while [ -n "$(squeue -h -t running,completing -o %i 2>/dev/null)" ] && [ $SECONDS -lt $end ]; do sleep 0.2; done
fi
stop "$STATE/run/slurmd.pid"     slurmd
for f in "$STATE"/run/slurmd-*.pid; do [ -e "$f" ] && stop "$f" slurmd; done   # the two-node layout's
stop "$STATE/run/slurmctld.pid"  slurmctld
stop "$STATE/run/slurmdbd.pid"   slurmdbd
stop "$STATE/db/mysqld.pid"      mariadbd
stop "$STATE/munge/munged.pid"   munged
