"""Elastic runs (EDDIS_ELASTIC=1, modes easgd and hybrid) in the launcher.

A lost rank must not end the job: its supervisor records the loss and exits 0
(so that neither ``srun`` nor ``mpirun`` takes the step for failed and kills
it), the other supervisors do not stop their trainers, ``srun`` runs with
``--kill-on-bad-exit=0`` and ``mpirun`` with the two ORTE parameters that
otherwise abort the job when a process exits non-zero or without
``MPI_Finalize`` (the lost trainer never finalizes). A Slurm job with more than
one rank on a node starts its trainers under ``mpirun`` (:mod:`.mpirun_step`):
Slurm's PMIx plugin cancels an ``srun --mpi=pmix`` step when one of two ranks on
a node is lost. The survivors train on
(``eddis.core.elastic``); at the end the launcher says the run finished
degraded and names every lost rank.

Why exit status 0 for a degraded run: the job did what it was asked to, all
EDDIS_TOTAL_ITERATIONS iterations and the final model written by a survivor,
so Slurm's COMPLETED, ``afterok`` dependencies and the requeue logic (which
takes a non-zero status for a failure to recover from) are right; the loss
is in the job's output ("finished degraded: ...") and in the records under
``<run dir>/launch/``. A run in which no rank finished fails as before.

A node lost as a whole takes the supervisors with it, so its rank and its smb-server
leave a start record and no record of their end: that is how the report finds the lost
node ("node n2 was lost: rank 1 and its smb-server 1"). The survivors train on when the
training state is mirrored (EDDIS_ELASTIC_MIRROR, :mod:`eddis.smb.mirror`); the servers'
step then runs with ``--kill-on-bad-exit=0`` too, so that the lost server's task does not
take the other servers down.

The launcher may not import the core, so it reads the settings registry: the
run is elastic when EDDIS_ELASTIC is set and EDDIS_MODE is not a mode whose
ranks step together (unset counts as elastic here: the optimizer may be given
``mode="easgd"``; the core refuses elastic sync itself).
"""
import time
from pathlib import Path

from .. import settings
from ..errors import ConfigError
from .report import (LAUNCH_DIR, describe_exit, finished_ranks, launches, read_records, root_cause,
                     server_records, who)

ELASTIC_MODES = ("easgd", "hybrid")
# The ORTE parameters of Open MPI 4 that stop a job when one process ends badly.
MPIRUN_OPTIONS = ("--mca", "orte_abort_on_non_zero_status", "0",
                  "--mca", "orte_allowed_exit_without_sync", "1")


def elastic_run(env=None):
    """Whether this launch is elastic; a ConfigError for EDDIS_ELASTIC with a lockstep mode."""
    if not settings.get("EDDIS_ELASTIC", env):
        return False
    mode = (settings.environ(env).get("EDDIS_MODE") or "").lower()
    if mode and mode not in ELASTIC_MODES:
        raise ConfigError(f"EDDIS_ELASTIC=1 is for modes easgd and hybrid, not EDDIS_MODE={mode}: its "
                          "ranks step together and restart from the last checkpoint instead "
                          "(EDDIS_MAX_RESTARTS). Unset EDDIS_ELASTIC, or use easgd or hybrid.")
    return True


def survives_server_loss(env=None):
    """Whether the run trains on without a lost smb-server: elastic, with the state mirrored."""
    return elastic_run(env) and bool(settings.get("EDDIS_ELASTIC_MIRROR", env))


def vanished(run_dir):
    """The rank and smb-server start records of the newest launch that have no record of
    their end: their supervisors died with them (a lost node). Read once the attempt's
    servers were stopped, so that a server still running is no case of it."""
    every = launches(run_dir)
    ranks = []
    if every:
        ended = every[-1].exited_ranks()
        ranks = [r for r in read_records(every[-1].ranks) if r.get("rank") not in ended]
    records = server_records(run_dir)
    ended = {r.get("server") for r in read_records(records.exits)}
    return ranks, [s for s in read_records(records.ranks) if s.get("server") not in ended]


def lost_without_record(ranks, servers):
    """What happened to the vanished ranks and servers, in words, one part per host:
    'node n2 was lost: rank 1 and its smb-server 1'."""
    parts = []
    for host in sorted({r.get("host") for r in ranks} | {s.get("host") for s in servers}, key=str):
        mine = sorted(r["rank"] for r in ranks if r.get("host") == host)
        theirs = sorted(s["server"] for s in servers if s.get("host") == host)
        named = (f"rank {', '.join(map(str, mine))}" if mine else "") + (" and " if mine and theirs else "") + \
            (f"its smb-server {', '.join(map(str, theirs))}" if theirs else "")
        if theirs:
            parts.append(f"node {host} was lost: {named}")
        else:
            parts.append(f"{named} on host {host} was lost with its supervisor (no record of its end)")
    return parts


def lost(record):
    """What happened to a lost rank, in words: 'rank 2 on host n1 was lost (was killed by ...)'."""
    how = "hung and was killed" if record.get("why") == "hung" else \
        describe_exit(record.get("code"), record.get("signal"))
    stamp = time.strftime("%H:%M:%S", time.localtime(record.get("time", 0)))
    return f"{who(record)} was lost ({how}) at {stamp}"


def degraded_report(failures, exits, vanished_ranks=(), vanished_servers=()):
    """The line(s) of a degraded finish, or None when no rank finished (then it is a failure).

    ``failures``: the failure records of the launch (every one a lost rank, elastic);
    ``exits``: its exit records; ``vanished_*``: the start records of the ranks and servers
    that left no record of their end (:func:`vanished`)."""
    finished = finished_ranks(exits)
    ranks = [f for f in failures if "server" not in f]
    if not finished or len(ranks) != len(failures) or not (ranks or vanished_ranks or vanished_servers):
        return None
    ranks = sorted(ranks, key=lambda r: r.get("time", 0.0))
    parts = [lost(r) for r in ranks] + lost_without_record(vanished_ranks, vanished_servers)
    return (f"eddis-train: finished degraded: {'; '.join(parts)}; "
            f"rank {', '.join(map(str, finished))} finished the training")


def elastic_status(run_dir, status, out):
    """The job's status after an elastic launch that ended with ``status`` and its smb-servers
    after it (so that a server without a record of its end was lost):
    0 for a degraded finish, which it prints on ``out``; else at least 1 when a rank or server failed (the lost ranks' supervisors exit 0,
    so a launch in which every rank was lost can end with 0), for the caller's root-cause
    report; else ``status``."""
    _, failures, exits = root_cause(run_dir)
    ranks, servers = vanished(run_dir)
    line = degraded_report(failures, exits, ranks, servers) if failures or ranks or servers else None
    if line is not None:
        print(f"{line}\n  records: {Path(run_dir) / LAUNCH_DIR}", file=out, flush=True)
        return 0
    return (status or 1) if failures else status
