"""The planner's model against the figures bench/cluster.py recorded (docs/benchmarks-cluster.md).

Recorded measurements, not new ones: nothing here times anything. The bytes a step puts
on each node's link do not depend on the machine's load, so the model must give them
within the headers' share (about 1 %; 3 % allowed, 5 % for the elastic modes, whose
runs' end is a few exchanges). Samples/s do depend on it; the model's *ratios* between
contenders of one configuration, from inputs that were recorded too (the solo ideal, the
link rate a timeline measured), must fall within 10 % of the range the runs gave.
"""
import json
from pathlib import Path

import pytest

from eddis.core.layout.buckets import BucketPlan
from eddis.plan import emulated
from eddis.plan.spec import Bucket, Cluster, Workload

# bench/cluster.py's comm MLP: its buckets as EDDIS cuts them (16.8, 67.1, 16.8 MB)
MLP_SHAPES = [("l1.w", (4096, 1024)), ("l1.b", (4096,)), ("l2.w", (4096, 4096)), ("l2.b", (4096,)),
              ("l3.w", (1024, 4096)), ("l3.b", (1024,)), ("l4.w", (10, 1024)), ("l4.b", (10,))]


def mlp(ready=(0.86, 0.93, 1.0), update=0.0, batch=8):
    plan = BucketPlan(MLP_SHAPES)
    return Workload(buckets=tuple(Bucket(b.nbytes, x) for b, x in zip(plan.buckets, ready)),
                    local_batch=batch, update_share=update, name="comm MLP")


def test_the_mlp_is_the_benchs():
    assert mlp().gradient_bytes == 100_741_160                 # S = 100.7 MB in every table
    assert [round(b.nbytes / 1e6, 1) for b in mlp().buckets] == [16.8, 67.1, 16.8]


# (layout, contender, tau, measured steps, recorded bytes/step/node/way over S, where)
RECORDED_BYTES = [
    ("2x2", "ddp", 4, 80, 1.50, "12-05 runs N-AA"),
    ("2x2", "ddp-fp16", 4, 80, 0.75, "12-05 runs N, O"),
    ("2x2", "eddis-allreduce", 4, 80, 1.00, "12-04 CNN/LSTM, 100.9 MB on 12-01"),
    ("2x2", "eddis-sync", 4, 80, 1.008, "12-01: 101.5 MB; 101.0 MB on 12-04"),
    ("2x2", "eddis-sync-fp16", 4, 80, 0.50, "12-05 runs N, O"),
    ("2x2", "eddis-sync-bf16", 4, 80, 0.50, "12-04 CNN/LSTM"),
    ("2x2", "eddis-sync-flat", 4, 80, 2.02, "12-01: 203.1 MB; 2.00 on 12-04"),
    ("2x2", "eddis-balanced", 4, 80, 1.00, "12-04 CNN/LSTM"),
    ("2x2", "eddis-easgd", 4, 80, 0.55, "12-01; 12-04 run B; 0.54 with the CNN"),
    ("2x2", "eddis-hybrid", 4, 80, 0.28, "12-05 runs O-AA"),
    ("2x2", "eddis-hybrid", 2, 80, 0.53, "12-04, EDDIS_EASGD_TAU=2"),
    ("2x2", "eddis-hybrid", 4, 60, 0.29, "12-05 run Z, 10gbit"),
    ("2x2", "eddis-hybrid-balanced", 4, 60, 0.29, "12-05 run Z, 10gbit"),
    ("4x1", "ddp", 4, 100, 1.50, "12-04, 4 x 1"),
    ("4x1", "horovod", 4, 100, 1.50, "12-04, 4 x 1"),
    ("4x1", "eddis-sync", 4, 100, 1.50, "12-04, 4 x 1"),
    ("4x1", "eddis-sync-ring", 4, 80, 1.50, "12-07: 151.5 MB, the ring"),
    ("4x1", "eddis-hybrid", 4, 100, 0.41, "12-04, 4 x 1, slowdowns 1111 (0.40 at 1123)"),
    ("4x1", "eddis-balanced", 4, 30, 1.50, "12-03, 4 x 1, 10gbit"),
    ("4x1", "eddis-hybrid", 4, 30, 0.46, "12-03, 4 x 1, 10gbit"),
    ("2x1", "ddp", 4, 15, 1.00, "12-01 scaling"),
    ("2x1", "eddis-sync", 4, 15, 1.01, "12-01 scaling"),
    ("8x1", "ddp", 4, 15, 1.75, "12-01 scaling"),
    ("8x1", "eddis-sync", 4, 15, 1.76, "12-01 scaling"),
    ("2x4", "ddp", 4, 15, 1.75, "12-01 scaling"),
    ("2x4", "eddis-sync", 4, 15, 1.01, "12-01 scaling"),
]


@pytest.mark.parametrize("layout,contender,tau,steps,recorded,where", RECORDED_BYTES,
                         ids=[f"{r[0]}-{r[1]}-tau{r[2]}-{r[3]}steps" for r in RECORDED_BYTES])
def test_bytes_per_step_as_recorded(layout, contender, tau, steps, recorded, where):
    nodes, per_node = map(int, layout.split("x"))
    config = {"link": "1gbit", "nodes": nodes, "ranks_per_node": per_node, "slowdowns": "1"}
    cluster = emulated.bench_cluster(config, 1 / 40.0)
    workload = mlp()
    step = emulated.predict(contender, cluster, workload, tau=tau, run_steps=steps)
    predicted = step.bytes_per_node_way / workload.gradient_bytes
    elastic = "easgd" in contender or "hybrid" in contender
    assert predicted == pytest.approx(recorded, rel=0.05 if elastic else 0.03), where


# ---------------------------------------------------------------- ratios of samples/s
# Inputs, each as recorded: a rank alone on 1gbit 2 x 2 ran 40 samples/s (run P: solo 159.9
# for 4 ranks, 2026-12-05); a timeline of sync (12-05 01:56 UTC) put its transfers at 110 MB/s
# on the link's 119.6 MB/s of TCP payload and the first of the three buckets ready 183 ms
# into the step, the last about 30 ms later. The update's share of a solo step was not
# recorded: the ratios are checked with none and with a fifth of the step. Sync's ring
# through the servers (one rank a node) kept its links 0.96 busy while it had bytes to move
# (4 x 1, 12-07, four runs): 0.96 x 119.6 MB/s.
EDDIS_LINK = Cluster(nodes=(), put_bps=0.110e9, get_bps=0.110e9, smb_ring_bps=0.96 * 119.6e6)


def ratio(config, a, b, cpu_s, device_ms, workload, base, steps):
    def rate(contender):
        cluster = emulated.contender_cluster(contender, config, cpu_s, device_ms, base)
        return emulated.predict(contender, cluster, workload, run_steps=steps).samples_per_s

    return rate(a) / rate(b)


def within(value, low, high, slack=0.10):
    return low * (1 - slack) <= value <= high * (1 + slack)


@pytest.mark.parametrize("update", [0.0, 0.2])
@pytest.mark.parametrize("layout,a,b,low,high,where", [
    ("2x2", "eddis-sync", "ddp", 1.31, 1.35, "12-05 runs N, O, P, T, X, Y, AA"),
    ("2x2", "eddis-sync-fp16", "ddp-fp16", 1.19, 1.26, "12-04 late runs J-L, 12-05 runs N, O"),
    ("4x1", "eddis-sync", "ddp", 1.01, 1.04, "12-07 14:38-15:35, auto: the ring, four runs"),
    ("4x1", "eddis-sync-mesh", "ddp", 0.97, 0.97, "12-07 14:26-15:07, three runs"),
    ("8x1", "eddis-sync", "ddp", 0.95, 0.97, "12-07 14:46-15:40, the ring, three runs"),
    ("8x1", "eddis-sync-mesh", "ddp", 0.89, 0.90, "12-07 14:46, 15:23"),
])
def test_ratios_at_1gbit_as_recorded(update, layout, a, b, low, high, where):
    nodes, per_node = map(int, layout.split("x"))
    config = {"link": "1gbit", "nodes": nodes, "ranks_per_node": per_node, "slowdowns": "1"}
    value = ratio(config, a, b, 1 / 40.0, 0.0, mlp(update=update), EDDIS_LINK, 80)
    assert within(value, low, high), f"{a} / {b}: model {value:.2f}, recorded {low}-{high} ({where})"


@pytest.mark.parametrize("a,b,low,high,where", [
    ("eddis-balanced", "ddp", 1.84, 1.89, "12-03 to 12-05 runs D, M, Q, W, Z"),
    ("eddis-hybrid", "ddp", 1.87, 1.92, "runs M, Q, U, Z"),
    ("eddis-hybrid-balanced", "ddp", 1.96, 2.01, "runs W, Z"),
    ("eddis-balanced", "solo", 0.85, 0.87, "x ideal, runs M, Q, W, Z"),
    ("eddis-hybrid-balanced", "solo", 0.90, 0.91, "x ideal, runs W, Z"),
])
def test_ratios_with_unequal_speeds_as_recorded(a, b, low, high, where):
    # 10gbit, 2 x 2, slowdowns {1,1,2,3} on the simulated device (200 ms a sample at factor 1),
    # 60 global batches; the ideal was 13.4 samples/s in each of those runs. The device's sleep
    # comes before the backward pass, so every bucket is ready at its end.
    config = {"link": "10gbit", "nodes": 2, "ranks_per_node": 2, "slowdowns": "1123"}
    cpu = emulated.solo_cpu_seconds(13.4, [1, 1, 2, 3], 200.0)
    value = ratio(config, a, b, cpu, 200.0, mlp(ready=(0.98, 0.99, 1.0)), Cluster(nodes=()), 60)
    assert within(value, low, high), f"{a} / {b}: model {value:.2f}, recorded {low}-{high} ({where})"


# ---------------------------------------------------------------- a run's records, validated
# bench/cluster.py --json of 2026-12-06 08:42-08:51 UTC (1gbit, 4 x 1, comm MLP, alone;
# load 0.39 at the start, 4.41 at the end): what bench/plan_validate.py reads
RUN_4X1 = [{"contender": c, "samples_per_s": s, "cross_node_bytes_per_step": b, "gradient_bytes": 100741160,
            "link_bytes_per_s": 119638833.6,
            "config": {"link": "1gbit", "nodes": 4, "ranks_per_node": 1, "slowdowns": "1111", "model": "comm",
                       "local_batch": 8}}
           for c, s, b in [("ddp", 21.44, 151480676.5), ("eddis-sync", 19.13, 151465556.0),
                           ("eddis-allreduce", 11.25, 151388151.2), ("solo", 166.10, 22.8)]]


def test_a_runs_records_are_validated_with_the_inputs_of_that_run():
    rows, unsolved = emulated.validate(RUN_4X1 + [dict(RUN_4X1[0], config=dict(RUN_4X1[0]["config"], nodes=8))],
                                       lambda config: mlp())
    assert [r["contender"] for r in rows] == ["ddp", "eddis-sync", "eddis-allreduce"]
    assert unsolved == [dict(RUN_4X1[0]["config"], nodes=8)]   # no solo ran for it: left out, named
    for row in rows:
        b = row["bytes_per_step_over_S"]
        assert b["predicted"] == pytest.approx(b["measured"], rel=0.01)
    s = {r["contender"]: r["samples_per_s"] for r in rows}
    # the ring's step is the link's: the model within 15 % of the run (issue 42's bound)
    assert s["ddp"]["predicted"] == pytest.approx(s["ddp"]["measured"], rel=0.15)


def test_a_probe_gives_its_path_the_rate_it_measured_and_the_model_repeats_the_probe():
    # probe-mpi of a 4 x 1 run: 1.5 S a node and way in 2.5 s a reduction (made-up figures of
    # the bench's record format); MPI's rows take that rate, the ring keeps the link's
    probe = dict(RUN_4X1[0], contender="probe-mpi", samples_per_s=32 / 2.5, global_batch=32,
                 cross_node_bytes_per_step=1.5 * 100741160)
    assert emulated.probe_rate(probe) == pytest.approx(1.5 * 100741160 / 2.5)
    base = emulated.calibrated_base([probe], 119.6e6)
    assert (base.mpi_bps, base.ring_bps, base.put_bps) == (pytest.approx(1.5 * 100741160 / 2.5), None, 119.6e6)
    rows, _ = emulated.validate(RUN_4X1 + [probe], lambda config: mlp(ready=(1.0, 1.0, 1.0)))
    assert [r["contender"] for r in rows] == ["ddp", "eddis-sync", "eddis-allreduce"]   # no row for a probe
    s = {r["contender"]: r["samples_per_s"]["predicted"] for r in rows}
    # every bucket at the end of the backward: the step is the compute, then the probe's reduction
    cpu = emulated.solo_cpu_seconds(166.10, [1.0] * 4)
    assert 32 / s["eddis-allreduce"] == pytest.approx(8 * cpu + 2.5, rel=1e-6)
    assert 32 / s["ddp"] < 8 * cpu + 2.5 * 0.6


def test_the_servers_ring_probe_gives_sync_at_one_rank_a_node_its_rate():
    # probe-smbring of the 4 x 1 run: 1.5 S a node and way in 2.0 s (made-up figures); at 4 x 1
    # sync takes that ring (auto), so with every bucket at the end of the backward its step is
    # the compute, then the probe's reduction; the mesh keeps the put and get rates
    probe = dict(RUN_4X1[0], contender="probe-smbring", samples_per_s=32 / 2.0, global_batch=32,
                 cross_node_bytes_per_step=1.5 * 100741160)
    base = emulated.calibrated_base([probe], 119.6e6)
    assert (base.smb_ring_bps, base.put_bps, base.get_bps) == (pytest.approx(1.5 * 100741160 / 2.0),
                                                               119.6e6, 119.6e6)
    mesh = dict(RUN_4X1[1], contender="eddis-sync-mesh")
    rows, _ = emulated.validate(RUN_4X1 + [mesh, probe], lambda config: mlp(ready=(1.0, 1.0, 1.0)))
    s = {r["contender"]: r["samples_per_s"]["predicted"] for r in rows}
    cpu = emulated.solo_cpu_seconds(166.10, [1.0] * 4)
    assert 32 / s["eddis-sync"] == pytest.approx(8 * cpu + 2.0, rel=1e-6)
    assert 32 / s["eddis-sync-mesh"] > 8 * cpu + 1.5 * 100741160 / 119.6e6


def test_records_from_before_the_bench_wrote_its_defaults_match_those_that_did():
    probe = dict(RUN_4X1[0], contender="probe-mpi", samples_per_s=32 / 2.5, global_batch=32,
                 cross_node_bytes_per_step=1.5 * 100741160,
                 config=dict(RUN_4X1[0]["config"], device_ms=0.0, steps=80))
    rows, unsolved = emulated.validate(RUN_4X1 + [probe], lambda config: mlp())
    assert unsolved == [] and len(rows) == 3
    allreduce = next(r for r in rows if r["contender"] == "eddis-allreduce")
    assert allreduce["samples_per_s"]["predicted"] < 32 / 2.5


# ---------------------------------------------------------------- ranks that share the host's cores
@pytest.mark.parametrize("n,cores", [(4, 2), (8, 2), (8, 16), (1, 2)])
def test_ranks_busy_all_the_time_are_as_crowded_in_lockstep_as_alone(n, cores):
    # no simulated device: every rank computes all the time in both runs
    assert emulated.lockstep_cpu_seconds(0.1, [1.0] * n, 0.0, cores) == pytest.approx([0.1] * n)


def test_lockstep_phases_meet_the_whole_crowd_that_the_solo_run_spread_out():
    # 8 ranks each busy 1/8 of the time alone (1 core of 2 in all): no crowding alone; in a
    # lockstep step forward and backward each meet all 8 on 2 cores
    cpu = 0.025
    assert emulated.lockstep_cpu_seconds(cpu, [1.0] * 8, 175.0, 2) == pytest.approx([4 * cpu] * 8)
    # speeds 1, 1, 2, 3: the forward meets all 4 ranks; a backward only those of its speed,
    # which 2 cores serve without crowding
    slow = emulated.lockstep_cpu_seconds(cpu, [1.0, 1.0, 2.0, 3.0], 200.0, 2)
    assert slow == pytest.approx([cpu * (1 / 3 * 2 + 2 / 3)] * 4)


def test_only_lockstep_contenders_meet_the_crowd():
    config = {"link": "10gbit", "nodes": 8, "ranks_per_node": 1, "slowdowns": "1", "host_cores": 2}
    rates = {c: emulated.contender_cluster(c, config, 0.025, 175.0).ranks[0].samples_per_s
             for c in ("solo", "eddis-easgd", "eddis-hybrid-overlap", "ddp", "eddis-sync", "horovod")}
    assert rates["solo"] == rates["eddis-easgd"] == rates["eddis-hybrid-overlap"] == pytest.approx(1 / 0.2)
    assert rates["ddp"] == rates["eddis-sync"] == rates["horovod"] == pytest.approx(1 / 0.275)


# ---------------------------------------------------------------- issue 42's eight configurations
# bench/cluster.py --json records of 2026-12-06 (docs/benchmarks-cluster.md, "The planner beside
# the bench": dates, loads, commands), the fields validate() reads; the probes are in them. The
# held-out two ran after the model's last change (the lockstep crowd term) was committed.
GOLDEN = Path(__file__).parent / "golden"
VALIDATION = GOLDEN / "plan_validation_2026-12-06.json"
HELD_OUT = GOLDEN / "plan_validation_heldout_2026-12-06.json"


@pytest.mark.parametrize("path,count,rows_expected", [(VALIDATION, 8, 21), (HELD_OUT, 2, 5)],
                         ids=["the-eight", "held-out"])
def test_the_recorded_configurations_stay_as_close_as_they_were(path, count, rows_expected):
    records = json.loads(path.read_text())
    rows, unsolved = emulated.validate(records, lambda config: mlp())
    assert unsolved == [] and len(rows) == rows_expected
    configs = {}
    for row in rows:
        b, s = row["bytes_per_step_over_S"], row["samples_per_s"]
        assert b["predicted"] == pytest.approx(b["measured"], rel=0.05), row
        entry = configs.setdefault(json.dumps(row["config"], sort_keys=True), {"inside": True, "m": {}, "p": {}})
        entry["inside"] &= abs(s["predicted"] / s["measured"] - 1) <= 0.15
        entry["m"][row["contender"]], entry["p"][row["contender"]] = s["measured"], s["predicted"]
    assert len(configs) == count
    # what the model gives since the lockstep ranks' crowded CPU phases are in it: every
    # configuration within 15 % (issue 42 asks 7 of 8; 6 of 8 without that term, and 1 of the
    # held-out 2); a change must not lose one
    assert sum(e["inside"] for e in configs.values()) == count
    # the pick: the contender predicted fastest measured within 10 % of the fastest, everywhere
    for name, e in configs.items():
        pick = max(e["p"], key=e["p"].get)
        assert e["m"][pick] >= 0.9 * max(e["m"].values()), (name, pick, e)


def test_the_projection_stays_under_its_ideal_and_at_the_speed_mix_on_infiniband():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import plan_projection

    rows = list(plan_projection.rows())
    assert len(rows) == len(plan_projection.MODELS) * len(plan_projection.LINKS) * \
        len(plan_projection.GPUS_A_NODE) * len(plan_projection.NODES)
    mix = {name: (m["a100"] + m["v100"]) / (2 * m["v100"]) for name, m in plan_projection.MODELS.items()}
    for r in rows:
        ideal = r["x_ring"]["solo"]
        assert all(x <= ideal * (1 + 1e-9) for x in r["x_ring"].values()), r
        if r["link"] != "10gbit":   # the ring runs at the V100s' pace, give or take its transfer
            assert ideal == pytest.approx(mix[r["model"]], rel=0.03), r
