#!/usr/bin/env bash
# up.sh STATE_DIR — bring up a one-node (or two-node) Slurm 22.05 cluster (Debian 12 packages)
# with munge auth, slurmdbd+MariaDB accounting (real sacct), and fake GPUs.
# Idempotent: re-running with the same STATE_DIR starts only what is not running.
# Everything (config, keys, sockets, pids, logs, DB) lives under STATE_DIR.
# Tunables (env): SLURM_NODE_CPUS=8 SLURM_FAKE_GPUS=4 SLURM_NODE_MEM_MB=16000
#   SLURM_WITH_DBD=1 (0 = no slurmdbd/MariaDB; sacct then only works as `sacct -c`)
#   SLURM_PORT_BASE=6817 (ctld=BASE, slurmd=BASE+1, dbd=BASE+2, mariadb=BASE+3)
#   SLURM_PARTITION=debug
#   SLURM_DEV_NODES=1 (2 = two nodes n1, n2 on this host, each slurmd in its own UTS namespace with its own
#   port BASE+3+K and SLURM_FAKE_GPUS fake GPUs; `debug` and `short` stay on n1 alone, so a one-node test
#   sees what it sees on the one-node layout, and partition `multi` spans both: see README.md)
# With slurmdbd, limits are enforced as on a real cluster (AccountingStorageEnforce=associations,limits,qos):
# the user gets an association (account `lab`) with QOS `normal` (default, no limits) and `limited`
# (MaxSubmitJobsPerUser=3, MaxTRESPerUser=gres/gpu=2); partition `short` (MaxTime=10 min) shares the node.
# Jobs asking `--qos limited` or `-p short` meet the limits that strand jobs (tests/test_cluster_limits.py).
set -euo pipefail
STATE=${1:?usage: up.sh STATE_DIR}
mkdir -p "$STATE"; STATE=$(cd "$STATE" && pwd)
CPUS=${SLURM_NODE_CPUS:-8}; GPUS=${SLURM_FAKE_GPUS:-4}; MEM=${SLURM_NODE_MEM_MB:-16000}
WITH_DBD=${SLURM_WITH_DBD:-1}; BASE=${SLURM_PORT_BASE:-6817}; PART=${SLURM_PARTITION:-debug}
CTLD_PORT=$BASE; SLURMD_PORT=$((BASE+1)); DBD_PORT=$((BASE+2)); DB_PORT=$((BASE+3))
NODES=${SLURM_DEV_NODES:-1}
case "$NODES" in 1|2) ;; *) echo "SLURM_DEV_NODES must be 1 or 2, not '$NODES'" >&2; exit 2;; esac
log() { echo "[dev-cluster up $(date +%T)] $*" >&2; }

# ---- 1. packages (only if missing) -------------------------------------------------
PKGS="slurmctld slurmd slurm-client munge"
[ "$WITH_DBD" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
need=0
for b in slurmctld slurmd sbatch munged; do command -v $b >/dev/null || need=1; done
[ "$WITH_DBD" = 1 ] && { command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null || need=1; }
if [ $need = 1 ]; then
  log "installing: $PKGS"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $PKGS >/dev/null
fi

# ---- 2. layout ---------------------------------------------------------------------
HOST=$(hostname -s)
if ! getent hosts "$HOST" >/dev/null; then   # srun/sbatch resolve the own hostname
  log "WARNING: '$HOST' does not resolve; adding it to /etc/hosts"; echo "127.0.0.1 $HOST" >> /etc/hosts
fi
if [ "$NODES" = 1 ]; then
  NODE_NAMES=$HOST
else
  # Debian's slurmd is not built with --enable-multiple-slurmd: two plain daemons on one host both claim
  # node 0 of a two-node step. Each runs in its own UTS namespace as host nK instead
  # (../../shared/notes/two-node-slurm.md); a job's ranks then see their node's name, which must resolve.
  NODE_NAMES="n1 n2"
  HOSTS_MARK="# lora dev cluster: two nodes on this host (slurm/dev-cluster/up.sh)"
  grep -qxF "127.0.0.1 n1 n2 $HOSTS_MARK" /etc/hosts || echo "127.0.0.1 n1 n2 $HOSTS_MARK" >> /etc/hosts
fi
NODE=${NODE_NAMES%% *}   # the node of the one-node partitions
mkdir -p "$STATE"/{etc,log,run,ctld,spool,dev,munge,db}
chmod 755 "$STATE/munge"            # munged: socket dir must be a+x
KEY="$STATE/munge/munge.key"
if [ ! -s "$KEY" ]; then dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none; fi
chmod 400 "$KEY"                     # munged: key owned by the daemon's user, not g/o readable
for i in $(seq 0 $((GPUS-1))); do ln -sfn /dev/null "$STATE/dev/gpu$i"; done  # fake GPU "devices" (must be char devs)
MSOCK="$STATE/munge/munge.sock"

# ---- 3. configs (always rewritten; identical content keeps it idempotent) ----------
OLDSUM=$(cat "$STATE/etc/slurm.conf" "$STATE/etc/gres.conf" 2>/dev/null | md5sum || true)
ACCT="AccountingStorageType=accounting_storage/none"
if [ "$WITH_DBD" = 1 ]; then
  ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MSOCK
AccountingStorageTRES=gres/gpu
AccountingStorageEnforce=associations,limits,qos"
fi
GRESNODE=""; GRESTYPES=""
if [ "$GPUS" -gt 0 ]; then
  GRESNODE="Gres=gpu:$GPUS"; GRESTYPES="GresTypes=gpu"
  for N in $NODE_NAMES; do echo "NodeName=$N Name=gpu File=$STATE/dev/gpu[0-$((GPUS-1))]"; done > "$STATE/etc/gres.conf"
else
  : > "$STATE/etc/gres.conf"
fi
if [ "$NODES" = 1 ]; then
  SLURMD_FILES="SlurmdSpoolDir=$STATE/spool
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmdLogFile=$STATE/log/slurmd.log"
  NODE_LINES="NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM $GRESNODE State=UNKNOWN"
  MULTI=""
else
  SLURMD_FILES="SlurmdSpoolDir=$STATE/spool/%n
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmdLogFile=$STATE/log/slurmd-%n.log"
  NODE_LINES="NodeName=n1 NodeHostname=n1 NodeAddr=127.0.0.1 Port=$((BASE+4)) CPUs=$CPUS RealMemory=$MEM $GRESNODE State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=127.0.0.1 Port=$((BASE+5)) CPUs=$CPUS RealMemory=$MEM $GRESNODE State=UNKNOWN"
  MULTI="PartitionName=multi Nodes=n1,n2 Default=NO MaxTime=INFINITE State=UP"
fi
cat > "$STATE/etc/slurm.conf" <<EOF
ClusterName=testcluster
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MSOCK,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
$SLURMD_FILES
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
$ACCT
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.txt
MailProg=/bin/true
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=0
DependencyParameters=kill_invalid_depend
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=300
KillWait=5
InactiveLimit=0
Waittime=0
$GRESTYPES
$NODE_LINES
PartitionName=$PART Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes=$NODE Default=NO MaxTime=10 State=UP
EOF
[ -z "$MULTI" ] || echo "$MULTI" >> "$STATE/etc/slurm.conf"
export SLURM_CONF="$STATE/etc/slurm.conf"
CHANGED=0; [ "$OLDSUM" = "$(cat "$STATE/etc/slurm.conf" "$STATE/etc/gres.conf" | md5sum)" ] || CHANGED=1
echo "export SLURM_CONF=$SLURM_CONF" > "$STATE/env.sh"
if [ "$WITH_DBD" != 1 ]; then
  # No slurmdbd: plain `sacct` exits 1 ("Slurm accounting storage is disabled") and submitit
  # then never sees CANCELLED/TIMEOUT (job.result() hangs). Shim: read the jobcomp/filetxt log.
  mkdir -p "$STATE/bin"
  printf '#!/bin/sh\nexec /usr/bin/sacct --completion "$@"\n' > "$STATE/bin/sacct"
  chmod +x "$STATE/bin/sacct"
  echo "export PATH=$STATE/bin:\$PATH" >> "$STATE/env.sh"
fi

alive() {  # alive PIDFILE NAME : pid in file runs and is not a zombie (PID 1 here does not reap)
  local p; p=$(cat "$1" 2>/dev/null) || return 1; [ -n "$p" ] || return 1
  [ -r "/proc/$p/stat" ] || return 1
  [ "$(cut -d' ' -f3 "/proc/$p/stat")" != Z ] || return 1
  [ "$(cat /proc/$p/comm)" = "$2" ]
}
waitfor() {  # waitfor SECONDS DESCRIPTION CMD...
  local t=$1 what=$2; shift 2; local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || { log "timeout waiting for $what"; return 1; }; sleep 0.1; done
}

# ---- 4. munged ---------------------------------------------------------------------
if ! alive "$STATE/munge/munged.pid" munged; then
  munged --key-file="$KEY" --socket="$MSOCK" --pid-file="$STATE/munge/munged.pid" \
         --seed-file="$STATE/munge/munged.seed" --log-file="$STATE/log/munged.log" --num-threads=4
fi
waitfor 10 munged bash -c "munge -S '$MSOCK' -n | unmunge -S '$MSOCK'"

# ---- 5. MariaDB + slurmdbd ---------------------------------------------------------
if [ "$WITH_DBD" = 1 ]; then
  cat > "$STATE/db/my.cnf" <<EOF
[mariadbd]
datadir=$STATE/db/data
socket=$STATE/db/mysqld.sock
pid-file=$STATE/db/mysqld.pid
log-error=$STATE/log/mariadb.log
port=$DB_PORT
bind-address=127.0.0.1
user=root
skip-name-resolve
innodb_buffer_pool_size=128M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
EOF
  if [ ! -d "$STATE/db/data/mysql" ]; then
    mariadb-install-db --defaults-file="$STATE/db/my.cnf" --auth-root-authentication-method=normal \
      --skip-test-db > "$STATE/log/mariadb-install.log" 2>&1
  fi
  if ! alive "$STATE/db/mysqld.pid" mariadbd; then
    setsid mariadbd --defaults-file="$STATE/db/my.cnf" </dev/null >>"$STATE/log/mariadb.out" 2>&1 &
  fi
  waitfor 60 mariadb mariadb-admin --socket="$STATE/db/mysqld.sock" ping
  mariadb --socket="$STATE/db/mysqld.sock" -uroot -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
  cat > "$STATE/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MSOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$STATE/etc/slurmdbd.conf"   # slurmdbd refuses a world-readable conf
  if ! alive "$STATE/run/slurmdbd.pid" slurmdbd; then slurmdbd; fi   # finds slurmdbd.conf next to $SLURM_CONF
  waitfor 30 slurmdbd sacctmgr -n list cluster
  sacctmgr -n -P list cluster format=Cluster | grep -qx testcluster || sacctmgr -i add cluster testcluster >/dev/null
fi

# ---- 6. slurmctld + slurmd ---------------------------------------------------------
if ! alive "$STATE/run/slurmctld.pid" slurmctld; then slurmctld -f "$SLURM_CONF"
elif [ $CHANGED = 1 ]; then
  log "config changed while running: scontrol reconfigure (node/port/gres/cred_expire changes need down.sh + up.sh)"
  scontrol reconfigure || true
fi
waitfor 30 slurmctld scontrol ping

# ---- 7. accounts and limits (after slurmctld has registered gres/gpu with slurmdbd) ---------
if [ "$WITH_DBD" = 1 ]; then
  waitfor 30 "gres/gpu in accounting" bash -c "sacctmgr -n -P list tres format=Type,Name | grep -qx 'gres|gpu'"
  # Enforced associations: every user who submits needs one (slurmctld gets them from slurmdbd as made).
  ME=$(id -un)
  sacctmgr -n -P list qos format=Name | grep -qx limited \
    || sacctmgr -i add qos limited MaxSubmitJobsPerUser=3 MaxTRESPerUser=gres/gpu=2 >/dev/null
  sacctmgr -n -P list account format=Account | grep -qx lab \
    || sacctmgr -i add account lab cluster=testcluster >/dev/null
  sacctmgr -n -P list assoc where user="$ME" account=lab format=User | grep -qx "$ME" \
    || sacctmgr -i add user "$ME" account=lab cluster=testcluster qos=normal,limited defaultqos=normal >/dev/null
  # root has an association of account root already (slurmdbd makes it), without `limited`: lab is the default.
  [ "$(sacctmgr -n -P list user "$ME" format=DefaultAccount)" = lab ] \
    || sacctmgr -i modify user where name="$ME" set defaultaccount=lab >/dev/null
fi
LEFTOVERS=0
for N in $NODE_NAMES; do
  if [ "$NODES" = 1 ]; then PIDFILE="$STATE/run/slurmd.pid"; else PIDFILE="$STATE/run/slurmd-$N.pid"; fi
  alive "$PIDFILE" slurmd && continue
  # No slurmd and no slurmstepd: no job of this node can be alive, yet slurmctld recovers the jobs of the
  # cluster's previous life from its state (a stopped machine, a killed session) and believes them
  # running until their time limit, holding the GPUs: seen on CI, where they starved the first tests.
  ps -eo stat=,comm= | awk '$1 !~ /^Z/ && $2 == "slurmstepd" {found=1} END {exit !found}' || LEFTOVERS=1
  if [ "$NODES" = 1 ]; then slurmd -f "$SLURM_CONF"
  else unshare --uts sh -c "hostname $N && exec slurmd -f '$SLURM_CONF' -N $N"; fi
done
for N in $NODE_NAMES; do
  node_ok() { case "$(sinfo -h -n "$N" -o %T)" in idle|mixed|allocated) return 0;; *) return 1;; esac; }
  if ! waitfor 20 "node $N idle" node_ok; then
    log "node state: $(sinfo -h -n "$N" -o '%T %E'); trying resume"
    scontrol update nodename="$N" state=resume || true
    waitfor 20 "node $N idle" node_ok || { tail -20 "$STATE/log/slurmctld.log" "$STATE"/log/slurmd*.log >&2; exit 1; }
  fi
done
if [ $LEFTOVERS = 1 ] && [ -n "$(squeue -h -o %i)" ]; then
  log "cancelling $(squeue -h -o %i | wc -l) job(s) left from the cluster's previous run (their processes ended with it)"
  scancel $(squeue -h -o %i)
  waitfor 60 "the leftover jobs to end" bash -c '[ -z "$(squeue -h -o %i)" ]'
fi
log "cluster up: SLURM_CONF=$SLURM_CONF nodes=${NODE_NAMES// /,} cpus=$CPUS gpus=$GPUS (per node) dbd=$WITH_DBD"
cat "$STATE/env.sh"
