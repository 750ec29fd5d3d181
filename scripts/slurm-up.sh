#!/usr/bin/env bash
# Starts a single-node Slurm cluster on this machine from the installed
# Debian packages (slurmctld, slurmd, slurm-client, munge), as root and
# without systemd, for `memfit sweep --executor slurm` and tests/it/slurm.rs.
# It installs nothing: `apt-get install slurmctld slurmd slurm-client munge`
# first (.ci/run does).
#
# What it does: a munge key if there is none, munged as the munge user, a
# minimal /etc/slurm/slurm.conf (one node named after this host with its
# CPUs and most of its memory, one default partition `debug`, no cgroups,
# no accounting database), slurmctld and slurmd, then it waits until sinfo
# shows the node idle. Run again, it leaves a cluster that is already up
# alone. It refuses to replace a slurm.conf it did not write.
#
# Logs: /var/log/slurm/{slurmctld,slurmd}.log and /var/log/munge/munged.log.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# written by memfit scripts/slurm-up.sh"
HOST="$(hostname -s)"

say() { echo "slurm-up: $*" >&2; }
die() {
    say "$*"
    for log in /var/log/munge/munged.log /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log; do
        if [ -s "$log" ]; then
            echo "---- last lines of $log" >&2
            tail -n 20 "$log" >&2
        fi
    done
    exit 1
}

[ "$(id -u)" = 0 ] || die "run as root (it starts munged, slurmctld and slurmd)"
for tool in munged munge unmunge slurmctld slurmd sinfo scontrol; do
    command -v "$tool" >/dev/null 2>&1 ||
        die "\`$tool\` is not installed: apt-get install -y slurmctld slurmd slurm-client munge"
done

node_state() { sinfo -h -N -n "$HOST" -o '%t' 2>/dev/null | head -n 1 | tr -d '*~#'; }

# Already up (an earlier run of this script, or the machine's own cluster).
if [ "$(node_state)" = idle ] || [ "$(node_state)" = mix ] || [ "$(node_state)" = alloc ]; then
    say "node $HOST is already up ($(node_state))"
    exit 0
fi

# ---- munge ----------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0700 /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile=/etc/munge/munge.key
    elif command -v create-munge-key >/dev/null 2>&1; then
        create-munge-key -f
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    if command -v runuser >/dev/null 2>&1; then
        runuser -u munge -- munged
    else
        su -s /bin/sh munge -c munged
    fi
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
fi
munge -n | unmunge >/dev/null || die "munged does not answer (munge -n | unmunge fails)"

# ---- slurm.conf -----------------------------------------------------------
if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; not replacing it"
fi
CPUS="$(nproc)"
MEM_MB="$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo)"
install -d -m 0755 /etc/slurm /var/log/slurm /var/spool/slurmctld /var/spool/slurmd
# Loopback addresses: a container's hostname need not resolve.
cat >"$CONF" <<EOF
$MARK: one node, for tests.
ClusterName=memfit
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# No cgroups: processes are tracked through /proc, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# No accounting database: finished jobs are read from slurmctld (scontrol)
# for MinJobAge seconds, and each is appended to a text file.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
MinJobAge=600
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

# ---- daemons --------------------------------------------------------------
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if running /run/slurmctld.pid; then
    scontrol reconfigure || true
else
    slurmctld
fi
running /run/slurmd.pid || slurmd

for _ in $(seq 120); do
    case "$(node_state)" in
        idle | mix | alloc)
            say "node $HOST is up: $(sinfo -h -N -n "$HOST" -o '%N %t %c CPUs %m MB, partition %P')"
            exit 0
            ;;
        down | drain | drng | fail)
            scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true
            ;;
    esac
    sleep 0.5
done
die "node $HOST did not become idle within 60 s (sinfo: $(sinfo -h -N 2>&1 | head -n 3))"
