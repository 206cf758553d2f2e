#!/bin/bash
# An EDDIS job: one smb-server per node, then the trainers (srun eddis-train).
# Submit: sbatch eddis_job.sh train.py [args]   (eddis submit writes scripts like this one)
#SBATCH --job-name=resnet
#SBATCH --output=eddis-%j.out
#SBATCH --account=proj42
#SBATCH --partition=a100
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gres=gpu:a100:4
#SBATCH --time=02:00:00
#SBATCH hetjob
#SBATCH --partition=v100
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:v100:8
#SBATCH --time=02:00:00

set -uo pipefail

# What to run: the arguments after the script name (sbatch eddis_job.sh train.py --epochs 3),
# else the command written here.
if [ $# -gt 0 ]; then TRAIN=("$@"); else TRAIN=(train.py --epochs 3); fi

# Settings of every rank and server: EDDIS_* and SMB_* (table in docs/user-guide.md).
export EDDIS_MODE=hybrid
export SMB_MEMORY=8G
export EDDIS_RUN_DIR=${EDDIS_RUN_DIR:-$HOME/.eddis/run/$SLURM_JOB_ID}
SERVER_WAIT=120  # seconds for every smb-server to publish its address

# A misspelt setting or a missing script: say so once, before any server starts.
eddis-train --check -- "${TRAIN[@]}" || exit 2

components=${SLURM_HET_SIZE:-1}
if [ "$components" -gt 1 ]; then
    job_ids=$(for ((g = 0; g < components; g++)); do v=SLURM_JOB_ID_HET_GROUP_$g; echo -n "${!v},"; done)
else
    job_ids=$SLURM_JOB_ID
fi
server_pids=()
trainer_pid=

# SIGTERM the steps with this name (scancel, not kill: srun answers SIGTERM with SIGKILL,
# which would leave the servers' shared memory behind), then wait for their sruns.
step_ids() {
    squeue -h -s -j "${job_ids%,}" -o '%i %j' 2>/dev/null | awk -v n="$1" '$2 == n {print $1}'
}
stop_steps() {
    local name=$1; shift
    local pids=("$@") deadline=$((SECONDS + 30)) pid steps polls=0 gone_at=
    [ ${#pids[@]} -gt 0 ] || return 0
    steps=$(step_ids "$name")
    [ -z "$steps" ] || scancel --signal=TERM $steps 2>/dev/null
    for pid in "${pids[@]}"; do
        while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do
            # srun can miss the end of a hetjob step (Slurm 22.05): once Slurm lists none of
            # these steps any more, give their sruns 3 s and stop waiting for them
            if [ $((++polls % 5)) -eq 0 ] && [ -z "$(step_ids "$name")" ]; then
                gone_at=${gone_at:-$SECONDS}
                [ $((SECONDS - gone_at)) -ge 3 ] && break 2
            fi
            sleep 0.2
        done
    done
    [ -z "$steps" ] || scancel $steps 2>/dev/null  # whatever did not stop in time
    kill -9 "${pids[@]}" 2>/dev/null  # an srun still waiting for a step that has ended
    wait "${pids[@]}" 2>/dev/null
}

# scancel or the time limit: Slurm signals every step itself; wait for them (bounded) and go.
on_signal() {
    echo "eddis_job: $1 received, the trainers and smb-servers are stopping" >&2
    local deadline=$((SECONDS + 30)) pid
    for pid in $trainer_pid "${server_pids[@]}"; do
        while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    done
    exit 143
}
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGINT' INT

eddis-train --create-run-dir "$EDDIS_RUN_DIR" >/dev/null || exit 1
echo "eddis_job: job $SLURM_JOB_ID, $components component(s), run dir $EDDIS_RUN_DIR"

# The fewest CPUs the job holds on one node of a component ("16(x2),8" -> 8).
fewest_cpus() {
    local part fewest=
    for part in ${1//,/ }; do
        part=${part%%(*}
        [[ $part =~ ^[0-9]+$ ]] || continue
        if [ -z "$fewest" ] || [ "$part" -lt "$fewest" ]; then fewest=$part; fi
    done
    echo "${fewest:-1}"
}

# One smb-server per node of every component: a background step beside the trainers.
# It may use every CPU the job holds on its node (it overlaps the trainers): its
# reduction threads (SMB_REDUCE_THREADS) would share one bound CPU otherwise.
# eddis-train --smb-server runs it under a supervisor that names it if it dies or hangs.
servers=0
for ((g = 0; g < components; g++)); do
    if [ "$components" -gt 1 ]; then het=(--het-group=$g); nodes_var=SLURM_JOB_NUM_NODES_HET_GROUP_$g
        cpus_var=SLURM_JOB_CPUS_PER_NODE_HET_GROUP_$g
    else het=(); nodes_var=SLURM_JOB_NUM_NODES; cpus_var=SLURM_JOB_CPUS_PER_NODE; fi
    nodes=${!nodes_var}
    srun "${het[@]}" --job-name=smb-server --overlap --nodes="$nodes" --ntasks="$nodes" \
        --ntasks-per-node=1 --cpus-per-task="$(fewest_cpus "${!cpus_var:-1}")" --gres=none --kill-on-bad-exit=1 \
        bash -c "exec eddis-train --smb-server \$(($servers + SLURM_NODEID))" &
    server_pids+=($!)
    servers=$((servers + nodes))
done

watch=()
for pid in "${server_pids[@]}"; do watch+=(--watch-pid "$pid"); done
if ! eddis-train --wait-servers "$servers" --timeout "$SERVER_WAIT" "${watch[@]}"; then
    stop_steps smb-server "${server_pids[@]}"
    exit 1
fi

# The trainers: one rank per task of every component, one MPI world (pmix).
if [ "$components" -gt 1 ]; then het=(--het-group=$(seq -s, 0 $((components - 1)))); else het=(); fi
srun "${het[@]}" --job-name=eddis-train --mpi=pmix --kill-on-bad-exit=1 eddis-train "${TRAIN[@]}" &
trainer_pid=$!
# srun can miss the end of a step whose ranks have all exited: bound that wait too.
eddis-train --guard-trainers "$trainer_pid" &
guard_pid=$!

status=0
while :; do
    finished=
    wait -n -p finished "$trainer_pid" "${server_pids[@]}"
    status=$?
    [ "$finished" = "$trainer_pid" ] && break
    echo "eddis_job: an smb-server step ended (status $status) during training; stopping the trainers" >&2
    stop_steps eddis-train "$trainer_pid"
    status=1
    break
done
trainer_pid=
kill "$guard_pid" 2>/dev/null
wait "$guard_pid" 2>/dev/null
[ -f "$EDDIS_RUN_DIR/launch/trainers.status" ] && status=$(cat "$EDDIS_RUN_DIR/launch/trainers.status")

stop_steps smb-server "${server_pids[@]}"
if [ "$status" -ne 0 ]; then
    # the report on stderr, the root cause's status on stdout (srun's may be a peer's SIGKILL)
    root_status=$(eddis-train --report --exit-code "$status")
    [[ $root_status =~ ^[0-9]+$ ]] && status=$root_status
fi
eddis-train --retire-run-dir  # the token must not outlive the job
echo "eddis_job: done, status $status"
exit "$status"
