"""Open MPI's start-up race under Slurm's PMIx: how often a job loses a rank inside MPI_Init.

    flock /tmp/eddis-bench.lock python bench/mpi_init_race.py [--jobs 300] [--hogs 3] [--slow-rank 2]
                                                              [--try NAME=VALUE[,NAME=VALUE...]]

What it reproduces (Open MPI 4.1.4, Slurm 22.05 mpi/pmix_v4, PMIx 4.2; a core dump
of the victim showed it): a rank leaves ``MPI_Init`` while a peer still waits in
``MPI_Init``'s first PMIx fence, the modex fence (``ompi_mpi_init+1743``, before
ob1's ``add_procs``). The rank's first message (the context-id allreduce of
``eddis.init()``'s ``Comm.Dup``, an ob1 MATCH, tag 0x41) reaches the peer's progress
loop, and the TCP BTL calls ``mca_btl_base_active_message_trigger[0x41].cbfunc``,
still NULL: the peer dies of SIGSEGV at address 0 inside ``MPI_Init``. A rank can
only leave ``MPI_Init`` after its second fence, which the peer has not entered: that
fence let the rank through early.

Each job is ``srun --mpi=pmix`` of 4 ranks on 2 nodes of the running dev cluster
(``make cluster``; SLURM_CONF names it); every rank calls ``eddis.init()`` and
shuts down, with ``faulthandler`` on, so a crash shows its Python stack. One rank
(``--slow-rank``) runs at nice 19 beside ``--hogs`` busy processes at nice 0, so
that it is the last to see the fences' releases: about 1 job in 50 to 100 crashes
then, where a plain loaded node saw about 1 in 250. With ``--try`` the jobs
alternate between the environment as it is (``as-is``) and the same with the
given variables (``tried``), so both see the same load: the way to test a
candidate fix (a Slurm ``SLURM_PMIX_*`` or Open MPI ``OMPI_MCA_*`` setting).

It prints, per contender, the jobs run, the jobs that lost a rank to SIGSEGV (and
of those, inside ``MPI_Init``), the other failures, and the first of each kind's
lines. A benchmark-style check, not a test: it asserts nothing and takes minutes
(about 2 s a job here). Loops are bounded by ``--jobs`` and every job by
``--job-timeout``; the hogs end with it.
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def worker():
    slow = os.environ.get("RACE_SLOW_RANK")
    if slow is not None and slow == os.environ.get("SLURM_PROCID"):
        os.nice(19)
    from eddis.core import lifecycle

    lifecycle.init()
    lifecycle.shutdown()
    return 0


def parse_try(text):
    tried = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name:
            sys.exit(f"bench/mpi_init_race.py: --try takes NAME=VALUE[,NAME=VALUE...], not {item!r}")
        tried[name] = value
    return tried


def contender_envs(tried):
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    envs = {"as-is": env}
    if tried:
        envs["tried"] = dict(env, **tried)
    return envs


def inside_mpi_init(text):
    """faulthandler's stack of the crashed thread ends in the runtime's import of mpi4py.MPI."""
    return "_find_and_load" in text and 'core/comm/runtime.py", line' in text


def run_job(args, env):
    command = ["srun", "--mpi=pmix", "-N2", "-n4", sys.executable, __file__, "--worker"]
    try:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=args.job_timeout)
    except subprocess.TimeoutExpired as exc:
        output = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output or ""
        return "other", f"timed out after {args.job_timeout:g} s\n{output}"
    if done.returncode == 0:
        return "ok", ""
    if "Segmentation fault" in done.stdout or done.returncode in (139, -11):
        return "sigsegv", done.stdout
    return "other", f"exit status {done.returncode}\n{done.stdout}"


def start_hogs(count, seconds):
    spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=300, help="jobs per contender (alternating with --try)")
    p.add_argument("--hogs", type=int, default=3, help="busy processes beside the jobs")
    p.add_argument("--slow-rank", type=int, default=2, help="the rank run at nice 19 (-1: none)")
    p.add_argument("--try", dest="tried", default=None, metavar="NAME=VALUE[,...]",
                   help="a candidate fix: also run every job with these variables set")
    p.add_argument("--job-timeout", type=float, default=120.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker()
    tried = parse_try(args.tried)
    if not os.environ.get("SLURM_CONF"):
        sys.exit("bench/mpi_init_race.py: SLURM_CONF is not set; start the dev cluster (make cluster) "
                 "and export SLURM_CONF=<its directory>/slurm.conf")
    probe = subprocess.run(["sinfo", "-h", "-o", "%D"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=30)
    if probe.returncode != 0:
        sys.exit(f"bench/mpi_init_race.py: sinfo cannot reach the cluster of {os.environ['SLURM_CONF']}: "
                 f"{probe.stdout.strip()} (make cluster)")
    if args.slow_rank >= 0:
        os.environ["RACE_SLOW_RANK"] = str(args.slow_rank)
    envs = contender_envs(tried)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"bench/mpi_init_race.py, {started}, load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, "
          f"{args.jobs} jobs per contender, {args.hogs} hogs, slow rank {args.slow_rank}"
          + (f", tried {tried}" if tried else ""), flush=True)
    counts = {name: {"ok": 0, "sigsegv": 0, "in MPI_Init": 0, "other": 0} for name in envs}
    first = {}
    hogs = start_hogs(args.hogs, args.jobs * len(envs) * args.job_timeout)
    began = time.monotonic()
    try:
        for job in range(1, args.jobs + 1):
            for name, env in envs.items():
                outcome, text = run_job(args, env)
                counts[name][outcome] += 1
                if outcome == "sigsegv" and inside_mpi_init(text):
                    counts[name]["in MPI_Init"] += 1
                if outcome != "ok":
                    print(f"   job {job}: {name}: {outcome}", flush=True)
                    first.setdefault((name, outcome), text)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(f"\n{'contender':10s} {'jobs':>5s} {'sigsegv':>8s} {'in MPI_Init':>12s} {'other':>6s}")
    for name, c in counts.items():
        print(f"{name:10s} {c['ok'] + c['sigsegv'] + c['other']:5d} {c['sigsegv']:8d} {c['in MPI_Init']:12d} "
              f"{c['other']:6d}")
    for (name, outcome), text in first.items():
        lines = [line for line in text.splitlines() if line.strip()][-40:]
        print(f"\nfirst {outcome} of {name}:\n  " + "\n  ".join(lines))
    print(f"\nfinished {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} after "
          f"{time.monotonic() - began:.0f} s, load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
