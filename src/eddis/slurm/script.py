"""The sbatch script of an EDDIS job, as text, from typed options.

:func:`render_job_script` is pure: the same options give the same text (a golden
file test holds it). Its keyword-only parameters are the valid options; anything
else raises :class:`~eddis.errors.ConfigError` listing them. ``eddis submit``
fills the options from ``--gpus`` and Slurm's partitions; ``scripts/eddis_job.sh``
is this function's output for an a100 + v100 hetjob, for users to copy and edit.

The job body, in order: check the settings and the training script (once, before
anything starts); create the run directory and token; start one
``smb-server`` per node of every het component as a background step
(``srun --overlap``, named ``smb-server``); wait until all have published (a
timeout and a dead server step both fail the job with a clear message); run
``srun --het-group=0,...,K-1 --mpi=pmix --kill-on-bad-exit=1 eddis-train ...``;
stop the servers with SIGTERM (``scancel --signal=TERM`` of their steps, so they
free their shared memory); print the root-cause report when the trainers
failed; exit with the root cause's status (else the trainers').

Each server runs under ``eddis-train --smb-server I``, which names it as the root
cause when it dies or hangs (``EDDIS_LIVENESS_TIMEOUT``) and stops the ranks.
"""
import functools
import inspect
import shlex
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ..errors import ConfigError


@dataclass(frozen=True)
class JobComponent:
    """One partition of the job (one hetjob component): nodes, ranks and GPUs per node."""

    partition: str
    nodes: int
    tasks_per_node: int
    gpu_type: Optional[str] = None
    gpus_per_node: int = 0

    def sbatch_lines(self, time):
        lines = [f"#SBATCH --partition={self.partition}",
                 f"#SBATCH --nodes={self.nodes}",
                 f"#SBATCH --ntasks-per-node={self.tasks_per_node}"]
        if self.gpus_per_node:
            gres = f"gpu:{self.gpu_type}:{self.gpus_per_node}" if self.gpu_type else f"gpu:{self.gpus_per_node}"
            lines.append(f"#SBATCH --gres={gres}")
        lines.append(f"#SBATCH --time={time}")
        return lines


def keyword_options(func):
    """Accept only the function's keyword-only parameters; name the valid ones otherwise."""
    params = inspect.signature(func).parameters
    valid = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    required = [n for n in valid if params[n].default is inspect.Parameter.empty]

    @functools.wraps(func)
    def wrapper(*args, **options):
        if args:
            raise ConfigError(f"{func.__name__}() takes keyword options only; valid options: {', '.join(valid)}")
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ConfigError(f"{func.__name__}(): unknown option{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(unknown)}; valid options: {', '.join(valid)}")
        missing = [n for n in required if n not in options]
        if missing:
            raise ConfigError(f"{func.__name__}(): missing option {', '.join(missing)}; "
                              f"valid options: {', '.join(valid)}")
        return func(**options)

    wrapper.valid_options = tuple(valid)
    return wrapper


JOB_BODY = r'''
set -uo pipefail

# What to run: the arguments after the script name (sbatch eddis_job.sh train.py --epochs 3),
# else the command written here.
if [ $# -gt 0 ]; then TRAIN=("$@"); else TRAIN=(@COMMAND@); fi

# Settings of every rank and server: EDDIS_* and SMB_* (table in docs/user-guide.md).
@EXPORTS@export EDDIS_RUN_DIR=${EDDIS_RUN_DIR:-$HOME/.eddis/run/$SLURM_JOB_ID}
SERVER_WAIT=@SERVER_WAIT@  # seconds for every smb-server to publish its address

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
'''


@keyword_options
def render_job_script(*, components: Sequence[JobComponent], command: Sequence[str] = ("train.py",),
                      job_name: str = "eddis", time: str = "01:00:00", output: str = "eddis-%j.out",
                      account: Optional[str] = None, mode: Optional[str] = None,
                      settings: Optional[Mapping[str, str]] = None, server_wait: int = 120,
                      comment: Optional[str] = None) -> str:
    """The sbatch script text: one #SBATCH block per component (hetjob when several)."""
    components = list(components)
    if not components:
        raise ConfigError("render_job_script(): components is empty; give one JobComponent per partition")
    for c in components:
        if not isinstance(c, JobComponent):
            raise ConfigError(f"render_job_script(): components must be JobComponent, got {c!r}")
        if c.nodes < 1 or c.tasks_per_node < 1:
            raise ConfigError(f"component {c.partition}: nodes and tasks_per_node must be >= 1")
    if not command:
        raise ConfigError("render_job_script(): command is empty; give the training script, e.g. ('train.py',)")
    exports = dict(settings or {})
    if mode is not None:
        exports["EDDIS_MODE"] = mode
    for name in exports:
        if not name.startswith(("EDDIS_", "SMB_")):
            raise ConfigError(f"setting {name}: only EDDIS_* and SMB_* settings go into the job script")

    head = ["#!/bin/bash"]
    head += [f"# {line}" if line else "#" for line in (comment or "").splitlines()]
    head += ["# An EDDIS job: one smb-server per node, then the trainers (srun eddis-train).",
             "# Submit: sbatch eddis_job.sh train.py [args]   (eddis submit writes scripts like this one)",
             f"#SBATCH --job-name={job_name}",
             f"#SBATCH --output={output}"]
    if account:
        head.append(f"#SBATCH --account={account}")
    for i, component in enumerate(components):
        if i:
            head.append("#SBATCH hetjob")
        head += component.sbatch_lines(time)
    export_lines = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in sorted(exports.items()))
    body = (JOB_BODY.replace("@COMMAND@", " ".join(shlex.quote(str(a)) for a in command))
            .replace("@EXPORTS@", export_lines)
            .replace("@SERVER_WAIT@", str(int(server_wait))))
    return "\n".join(head) + "\n" + body


def example_components():
    """The a100 + v100 hetjob of scripts/eddis_job.sh (2 nodes' worth of the dev cluster)."""
    return [JobComponent("a100", nodes=1, tasks_per_node=2, gpu_type="a100", gpus_per_node=2),
            JobComponent("v100", nodes=1, tasks_per_node=2, gpu_type="v100", gpus_per_node=2)]


def example_job_script():
    return render_job_script(
        components=example_components(), command=("train.py",),
        comment="Copy and edit: one #SBATCH block per GPU partition, separated by '#SBATCH hetjob'.\n"
                "Generated by eddis.slurm.script.example_job_script(); tests keep them equal.")
