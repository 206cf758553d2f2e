"""``bench/cluster.py``'s configurations as planner inputs, and its records beside the model.

A configuration of the bench (``{"link", "nodes", "ranks_per_node", "slowdowns",
"model", "local_batch"}``, as its ``--json`` records hold it) becomes a
:class:`~.spec.Cluster`: rank r's seconds a sample are the calibrated CPU time plus
``slowdowns[r] x device_ms`` (the bench's simulated device sleeps that long a sample),
its node's link the configuration's rate, and the SMB, reduce and cast rates those of a
calibrated ``base`` cluster. A contender's name is a mode of :mod:`.modes`, with the
bench's suffixes: ``-overlap``/``-nooverlap`` force the elastic exchange in the
background or not, ``horovod`` moves what MPI's allreduce moves.

The emulated cluster's ranks share one host's cores (``host_cores`` in a configuration).
The solo run measures each rank's CPU time under the mean load of ranks that drift
apart; a lockstep step starts every rank's forward at the same instant, and ranks of one
speed their backward too, so there those phases meet the whole crowd at once
(:func:`lockstep_cpu_seconds`). A cluster of GPU servers has no such term.
"""
from dataclasses import replace

from .evaluate import step_of
from .modes import MODES
from .spec import TCP_PAYLOAD_SHARE, Cluster, Node, Rank, parse_rate
from .timing import per_sample_times


def solo_cpu_seconds(solo_samples_per_s, factors, device_ms=0.0):
    """The CPU seconds a sample (beside the simulated device) that make the ranks' solo rates
    add up to a measured ideal: sum_i 1 / (c + f_i D) = solo (bisection)."""
    low, high = 0.0, 10.0
    for _ in range(200):
        mid = (low + high) / 2
        if sum(1 / (mid + f * device_ms / 1000) for f in factors) > solo_samples_per_s:
            low = mid
        else:
            high = mid
    return low


# the backward pass costs about twice the forward (two products a layer against one)
FORWARD_SHARE = 1 / 3
# the cores of the machine every recorded run so far was taken on (records from before
# the bench wrote ``host_cores``)
RECORDED_HOST_CORES = 2


def lockstep_cpu_seconds(solo_cpu, factors, device_ms, host_cores):
    """Every rank's CPU seconds a sample in a lockstep step, from the solo run's ``solo_cpu``.

    A phase that k ranks run at once on ``host_cores`` cores is ``max(1, k / cores)`` times
    its time alone. In the solo run the ranks drift apart and keep ``sum_i c / (c + f_i D)``
    cores busy on average; in a lockstep step all N start the forward together and the ranks
    of one slowdown factor start the backward together (after the same sleep)."""
    def crowd(k):
        return max(1.0, k / host_cores)

    device_s = device_ms / 1000.0
    busy = sum(solo_cpu / (solo_cpu + f * device_s) for f in factors) if solo_cpu > 0 else 0.0
    alone = solo_cpu / crowd(busy)
    return [alone * (FORWARD_SHARE * crowd(len(factors))
                     + (1 - FORWARD_SHARE) * crowd(sum(1 for g in factors if g == f)))
            for f in factors]


def rank_factors(config):
    """Every rank's slowdown factor, in rank order: the configuration's digits, repeated."""
    digits = [float(c) for c in str(config.get("slowdowns", "1"))]
    return [digits[r % len(digits)] for r in range(int(config["nodes"]) * int(config["ranks_per_node"]))]


def bench_cluster(config, cpu_s_per_sample, device_ms=0.0, base=None):
    """The cluster of one bench configuration (see the module docstring); ``cpu_s_per_sample``
    one figure for every rank or one a rank."""
    nodes, per_node = int(config["nodes"]), int(config["ranks_per_node"])
    factors = rank_factors(config)
    cpu = ([float(cpu_s_per_sample)] * len(factors) if isinstance(cpu_s_per_sample, (int, float))
           else list(cpu_s_per_sample))
    link = parse_rate(config["link"], "the configuration's link") * TCP_PAYLOAD_SHARE / 8
    built = []
    for j in range(nodes):
        ranks = []
        for m in range(per_node):
            f = factors[j * per_node + m]
            c = cpu[j * per_node + m]
            ranks.append(Rank(samples_per_s=1.0 / (c + f * device_ms / 1000.0), kind=f"x{f:g}"))
        built.append(Node(f"n{j + 1}", tuple(ranks), link, 0.0))
    base = base or Cluster(nodes=())
    return replace(base, nodes=tuple(built), source=f"bench/cluster.py {config}")


def contender_mode(contender):
    """(mode name, overlap or None) of a bench contender."""
    if contender == "horovod":
        return "eddis-allreduce", None
    for suffix, overlap in (("-nooverlap", False), ("-overlap", True)):
        if contender.endswith(suffix):
            return contender[:-len(suffix)], overlap
    return contender, None


def contender_cluster(contender, config, solo_cpu, device_ms=0.0, base=None):
    """The cluster a contender meets: lockstep ones with their ranks' CPU phases crowded
    together (:func:`lockstep_cpu_seconds`), the solo run's figure for the others."""
    cpu = solo_cpu
    if contender != "solo" and not MODES[contender_mode(contender)[0]].elastic:
        cpu = lockstep_cpu_seconds(solo_cpu, rank_factors(config), device_ms,
                                   int(config.get("host_cores", RECORDED_HOST_CORES)))
    return bench_cluster(config, cpu, device_ms, base)


def predict(contender, cluster, workload, tau=4, run_steps=None):
    """The model's Step for a bench contender on ``cluster`` (``solo``: the ideal)."""
    from .timing import solo

    per_sample = per_sample_times(cluster, workload)
    if contender == "solo":
        return solo(cluster, workload, per_sample)
    mode, overlap = contender_mode(contender)
    return step_of(MODES[mode], cluster, workload, per_sample, tau, overlap, run_steps)


# bench/cluster.py's probe contenders: one path's reduction alone, and the cluster rates it
# calibrates, applied in this order (probe-allreduce, EDDIS's own allreduce mode, after and so
# over probe-mpi, MPI's from the main thread)
PROBE_RATES = {"probe-ring": ("ring_bps",), "probe-mpi": ("mpi_bps",), "probe-allreduce": ("mpi_bps",),
               "probe-sync": ("put_bps", "get_bps"), "probe-smbring": ("smb_ring_bps",)}


def probe_rate(record):
    """What a probe record's path carried a node and way, bytes/s: its bytes a reduction
    over the time of one (its "samples/s" is a global batch a reduction)."""
    return record["cross_node_bytes_per_step"] * record["samples_per_s"] / record["global_batch"]


def calibrated_base(config_records, link_bytes_per_s):
    """The SMB and collective rates of one configuration: each path's probe where it ran
    (:data:`PROBE_RATES`), else SMB's put and get at the link rate the run measured (over
    TCP the socket transport moves at most what the link carries) and no cap on MPI's and
    the ring's."""
    rates = {"put_bps": link_bytes_per_s, "get_bps": link_bytes_per_s}
    probes = sorted((r for r in config_records if r["contender"] in PROBE_RATES),
                    key=lambda r: list(PROBE_RATES).index(r["contender"]))
    for record in probes:
        for name in PROBE_RATES[record["contender"]]:
            rates[name] = probe_rate(record)
    return Cluster(nodes=(), **rates)


def validate(records, workload_of, tau=4):
    """bench/cluster.py ``--json`` records beside the model, the model's inputs taken from the
    same run: each rank's CPU seconds a sample from its configuration's ``solo`` record
    (:func:`solo_cpu_seconds`), the paths' rates from its probes (:func:`calibrated_base`),
    the buckets from ``workload_of(config)``. Returns (rows, configurations without a solo
    record)."""
    def key(config):   # records from before the bench wrote them ran at its defaults
        return tuple(sorted({"device_ms": 0.0, "steps": 80, "host_cores": RECORDED_HOST_CORES,
                             **config}.items()))

    by_config = {}
    for r in records:
        by_config.setdefault(key(r["config"]), []).append(r)
    solos = {key(r["config"]): r for r in records if r["contender"] == "solo"}
    rows, unsolved = [], []
    for record in records:
        config = record["config"]
        if record["contender"] == "solo" or record["contender"] in PROBE_RATES:
            continue
        solo = solos.get(key(config))
        if solo is None:
            unsolved.append(config)
            continue
        device_ms = float(config.get("device_ms", 0.0))
        cpu = solo_cpu_seconds(solo["samples_per_s"], rank_factors(config), device_ms)
        base = calibrated_base(by_config[key(config)], record.get("link_bytes_per_s"))
        cluster = contender_cluster(record["contender"], config, cpu, device_ms, base)
        workload = workload_of(config)
        step = predict(record["contender"], cluster, workload, tau, int(config.get("steps", 80)))
        S = record["gradient_bytes"]
        rows.append({"config": config, "contender": record["contender"],
                     "samples_per_s": {"measured": record["samples_per_s"], "predicted": step.samples_per_s},
                     "bytes_per_step_over_S": {"measured": record["cross_node_bytes_per_step"] / S,
                                               "predicted": step.bytes_per_node_way / workload.gradient_bytes}})
    return rows, unsolved
