"""The planner's equations (eddis.plan): byte counts against their closed forms, the limits
(one node, one rank a node, an endless link), the bucket pipeline and the batch split.

Pure functions: no processes, no timings measured."""
import itertools

import pytest

from eddis.errors import ConfigError
from eddis.plan import timing, traffic
from eddis.plan.evaluate import evaluate, step_of
from eddis._sync_route import RING_FROM_NODES, auto_route
from eddis.plan.modes import LISTED, MODES, SOLO
from eddis.plan.spec import Bucket, Cluster, Node, Rank, Workload

S_BUCKETS = (16_838_696, 67_108_864, 16_793_600)   # the comm MLP of bench/cluster.py
S = sum(S_BUCKETS)
GBIT = 1e9 / 8   # payload bytes/s of 1 Gbit/s taken whole


def cluster(k, r, rate=40.0, link=GBIT, **rates):
    rates_of = rate if isinstance(rate, (list, tuple)) else [rate] * (k * r)
    nodes = tuple(Node(f"n{j}", tuple(Rank(samples_per_s=rates_of[j * r + m]) for m in range(r)), link, 0.0)
                  for j in range(k))
    return Cluster(nodes=nodes, **rates)


def workload(ready=(0.85, 0.95, 1.0), batch=8, update=0.0, sizes=S_BUCKETS, **kw):
    return Workload(buckets=tuple(Bucket(b, x) for b, x in zip(sizes, ready)), local_batch=batch,
                    update_share=update, **kw)


def per_node_way(mode, cl, wl, **kw):
    return step_of(mode, cl, wl, timing.per_sample_times(cl, wl), **kw).bytes_per_node_way


LAYOUTS = [(k, r) for k in (1, 2, 3, 4, 8) for r in (1, 2, 4)]


@pytest.mark.parametrize("k,r", LAYOUTS)
def test_lockstep_bytes_are_the_closed_forms(k, r):
    cl, wl = cluster(k, r), workload()
    n = k * r
    expected = {
        "eddis-sync": 2 * (k - 1) / k * S,
        "eddis-balanced": 2 * (k - 1) / k * S,
        "eddis-sync-fp16": (k - 1) / k * S,
        "eddis-sync-bf16": (k - 1) / k * S,
        "eddis-sync-mesh": 2 * (k - 1) / k * S,
        "eddis-sync-fp16-mesh": (k - 1) / k * S,
        "eddis-sync-flat": 2 * r * (k - 1) / k * S,
        "eddis-allreduce": 2 * (k - 1) / k * S,
        "ddp": 2 * (n - 1) / n * S if k > 1 else 0.0,
        "ddp-fp16": (n - 1) / n * S if k > 1 else 0.0,
    }
    if r == 1 and k > 1:
        expected.update({"eddis-sync-ring": 2 * (k - 1) / k * S, "eddis-sync-fp16-ring": (k - 1) / k * S})
    for mode, want in expected.items():
        assert per_node_way(mode, cl, wl) == pytest.approx(want, rel=1e-12, abs=1e-6), mode


@pytest.mark.parametrize("k,r", LAYOUTS)
@pytest.mark.parametrize("tau", [1, 4, 10])
def test_elastic_bytes_are_the_closed_forms(k, r, tau):
    cl, wl = cluster(k, r), workload()
    # easgd: every rank a worker; hybrid: one worker (the group) a node; each reads and writes
    # the centre every tau steps, (k-1)/k of it across its own link and 1/k across each other
    assert per_node_way("eddis-easgd", cl, wl, tau=tau) == pytest.approx(2 * r * (k - 1) / k * S / tau)
    assert per_node_way("eddis-hybrid", cl, wl, tau=tau) == pytest.approx(2 * (k - 1) / k * S / tau)


@pytest.mark.parametrize("k,r", [(2, 2), (4, 1), (2, 4), (8, 1)])
def test_the_run_end_adds_the_last_exchange_and_the_centre_reads(k, r):
    cl, wl = cluster(k, r), workload()
    steps = 80
    # hybrid: each group's last exchange (2(k-1)/k S a node), then every rank reads the centre
    # (r (k-1)/k S into a node, as much out of it for the others' reads)
    end = 2 * (k - 1) / k * S + r * (k - 1) / k * S
    assert per_node_way("eddis-hybrid", cl, wl, tau=4, run_steps=steps) == pytest.approx(
        2 * (k - 1) / k * S / 4 + end / steps)
    end = 2 * r * (k - 1) / k * S + r * (k - 1) / k * S
    assert per_node_way("eddis-easgd", cl, wl, tau=4, run_steps=steps) == pytest.approx(
        2 * r * (k - 1) / k * S / 4 + end / steps)


def test_one_rank_a_node_moves_the_rings_bytes():
    for k in (2, 4, 8, 16):
        cl, wl = cluster(k, 1), workload()
        assert per_node_way("eddis-sync", cl, wl) == pytest.approx(per_node_way("ddp", cl, wl))


@pytest.mark.parametrize("ranks", [(1, 3), (2, 2, 4), (4, 1, 1, 2)])
def test_every_byte_out_of_a_node_goes_into_another(ranks):
    nodes = tuple(Node(f"n{j}", (Rank(samples_per_s=40.0),) * r, GBIT, 0.0) for j, r in enumerate(ranks))
    cl, wl = Cluster(nodes=nodes), workload()
    per_sample = timing.per_sample_times(cl, wl)
    for mode in LISTED + ["eddis-sync-mesh", "eddis-sync-fp16-mesh"]:
        pairs = step_of(mode, cl, wl, per_sample, tau=4, run_steps=50).link_out_in
        assert sum(o for o, _ in pairs) == pytest.approx(sum(i for _, i in pairs)), mode
    # flat sync with unequal nodes: a node of r ranks sends r (k-1)/k W + (n-r)/k W each way
    k, n = len(ranks), sum(ranks)
    flat = step_of("eddis-sync-flat", cl, wl, per_sample).link_out_in
    for (out, into), r in zip(flat, ranks):
        assert out == pytest.approx((r * (k - 1) + n - r) / k * S) and into == pytest.approx(out)


def layout(ranks, latency=0.0):
    return timing.Layout(list(ranks), [GBIT] * len(ranks), [latency] * len(ranks))


def test_sync_takes_the_route_the_reducers_auto_takes():
    assert RING_FROM_NODES == 3
    for ranks, want in [((1,), "hierarchical"), ((1, 1), "hierarchical"), ((1, 1, 1), "ring"),
                        ((1,) * 16, "ring"), ((2, 2), "hierarchical"), ((1, 2, 1), "hierarchical"),
                        ((4,) * 4, "hierarchical"), ((2,) * 16, "hierarchical")]:
        assert auto_route(ranks) == want, ranks
        assert timing.route("sync", layout(ranks)) == {"ring": "smb-ring"}.get(want, want), ranks
    for path in ("hierarchical", "smb-ring", "flat", "ring", "mpi"):
        assert timing.route(path, layout((1, 1, 1))) == path


def test_the_servers_ring_sums_beside_the_link_with_no_server_stage():
    k = 4
    wl = workload(ready=(1.0,), sizes=(S,))
    compute = wl.local_batch / 1e9
    link = 2 * (k - 1) / k * S / GBIT
    free = cluster(k, 1, rate=1e9)
    per_sample = timing.per_sample_times(free, wl)
    for mode in ("eddis-sync", "eddis-sync-ring", "eddis-sync-mesh"):
        assert step_of(mode, free, wl, per_sample).step_s == pytest.approx(compute + link), mode
    # a sum at a tenth of the link's rate: the ring's rank sums (k-1)/k S beside the transfer;
    # the mesh sums on its submit and finish threads and reduces on the servers, one after another
    slow_sum = cluster(k, 1, rate=1e9, reduce_bps=GBIT / 10)
    ring = step_of("eddis-sync", slow_sum, wl, per_sample).step_s
    assert ring == pytest.approx(compute + (k - 1) / k * S / (GBIT / 10))
    mesh = step_of("eddis-sync-mesh", slow_sum, wl, per_sample).step_s
    assert mesh == pytest.approx(compute + S / (GBIT / 10) * (1 + 1 + 1) + link)
    assert step_of("eddis-sync-ring", slow_sum, wl, per_sample).step_s == pytest.approx(ring)


def test_the_servers_ring_is_refused_where_a_node_has_two_ranks():
    cl, wl = cluster(2, 2), workload()
    with pytest.raises(ConfigError, match=r"one rank on each of 2 or more nodes.*\[2, 2\].*eddis-sync"):
        step_of("eddis-sync-ring", cl, wl, timing.per_sample_times(cl, wl))
    with pytest.raises(ConfigError, match="one rank on each"):
        step_of("eddis-sync-ring", cluster(1, 1), wl, timing.per_sample_times(cluster(1, 1), wl))


def test_the_forced_routes_are_planned_only_when_named():
    outcomes = evaluate(cluster(4, 1), workload())
    assert set(outcomes) == {SOLO, *LISTED}
    assert not {"eddis-sync-ring", "eddis-sync-mesh"} & set(outcomes)
    named = evaluate(cluster(4, 1), workload(), modes=["eddis-sync-ring", "eddis-sync-mesh"])
    assert set(named) == {SOLO, "eddis-sync-ring", "eddis-sync-mesh"}


def test_the_closed_forms_themselves():
    assert traffic.hierarchical_phase(4, 100.0) == 75.0
    assert traffic.ring(4, 2, 100.0) == 150.0 and traffic.ring(4, 1, 100.0) == 0.0
    assert traffic.halving_doubling(2, 100.0) == 100.0 and traffic.halving_doubling(1, 100.0) == 0.0
    assert traffic.flat_phases([2, 2], 100.0) == [((100.0, 100.0), (100.0, 100.0))] * 2
    assert traffic.elastic([1.0], 100.0) == [0.0]
    assert traffic.elastic([1.0, 1.0, 1.0, 1.0], 100.0) == [150.0] * 4
    assert traffic.final_model([1], [4], 100.0) == [(0.0, 0.0)]


# ---------------------------------------------------------------- limits
def test_one_node_sends_nothing_and_runs_at_the_ideal_without_costs():
    cl, wl = cluster(1, 4), workload(update=0.2)
    outcomes = evaluate(cl, wl)
    for mode, o in outcomes.items():
        assert o.step.bytes_per_node_way == 0.0, mode
        # nothing costs anything on one node when no rate limits it: every mode is the ideal
        assert o.x_ideal == pytest.approx(1.0), mode


def test_an_endless_link_leaves_the_compute():
    cl, wl = cluster(8, 4, link=1e30), workload(update=0.1)
    for mode, o in evaluate(cl, wl).items():
        assert o.x_ideal == pytest.approx(1.0, rel=1e-9), mode


def test_a_link_bound_step_is_its_bytes_over_the_rate():
    # compute far below the transfer, one bucket at the end of the backward: the put and the get
    # phase of the hierarchy follow each other, 2(k-1)/k S in all
    k, r = 4, 2
    cl, wl = cluster(k, r, rate=1e9), workload(ready=(1.0,), sizes=(S,))
    per_sample = timing.per_sample_times(cl, wl)
    compute = wl.local_batch / 1e9
    sync = step_of("eddis-sync", cl, wl, per_sample)
    assert sync.step_s == pytest.approx(compute + 2 * (k - 1) / k * S / GBIT)
    ring = step_of("ddp", cl, wl, per_sample)
    n = k * r
    assert ring.step_s == pytest.approx(compute + 2 * (n - 1) / n * S / GBIT)
    assert sync.link_busy == pytest.approx(1.0, rel=1e-6)


def test_a_collectives_probed_rate_caps_its_path_only():
    # mpi_gbs and ring_gbs: what each collective carries a node and way in its own pattern
    k, r = 4, 2
    capped = cluster(k, r, rate=1e9, mpi_bps=GBIT / 2, ring_bps=GBIT / 4)
    wl = workload(ready=(1.0,), sizes=(S,))
    per_sample = timing.per_sample_times(capped, wl)
    compute, n = wl.local_batch / 1e9, k * r
    assert step_of("eddis-allreduce", capped, wl, per_sample).step_s == pytest.approx(
        compute + 2 * (k - 1) / k * S / (GBIT / 2))
    assert step_of("ddp", capped, wl, per_sample).step_s == pytest.approx(compute + 2 * (n - 1) / n * S / (GBIT / 4))
    assert step_of("eddis-sync", capped, wl, per_sample).step_s == pytest.approx(compute + 2 * (k - 1) / k * S / GBIT)
    # a cap above the link's rate is no cap
    fast = cluster(k, r, rate=1e9, mpi_bps=10 * GBIT, ring_bps=10 * GBIT)
    plain = cluster(k, r, rate=1e9)
    for mode in ("eddis-allreduce", "ddp"):
        assert step_of(mode, fast, wl, per_sample).step_s == pytest.approx(step_of(mode, plain, wl, per_sample).step_s)


@pytest.mark.parametrize("k", [2, 4])
def test_latency_counts_per_message_round(k):
    slow = tuple(Node(f"n{j}", (Rank(samples_per_s=1e9),), 1e30, 1e-3) for j in range(k))
    cl, wl = Cluster(nodes=slow), workload(ready=(1.0,), sizes=(S,))
    per_sample = timing.per_sample_times(cl, wl)
    compute = wl.local_batch / 1e9
    # the mesh: put and get, each a request and its answer
    assert step_of("eddis-sync-mesh", cl, wl, per_sample).step_s == pytest.approx(compute + 4e-3)
    # rings (DDP's, and sync's through the servers, auto's from 3 nodes): 2(n-1) steps of one hop
    assert step_of("ddp", cl, wl, per_sample).step_s == pytest.approx(compute + 2 * (k - 1) * 1e-3)
    sync = 4e-3 if k < RING_FROM_NODES else 2 * (k - 1) * 1e-3
    assert step_of("eddis-sync", cl, wl, per_sample).step_s == pytest.approx(compute + sync)


def test_early_buckets_hide_behind_the_backward_pass():
    # the first bucket's transfer fits in the backward time left after it is ready
    cl = cluster(2, 2, rate=4.0)              # 8 samples at 4/s: 2 s of compute
    early = workload(ready=(0.1, 1.0), sizes=(50_000_000, 1_000))
    late = workload(ready=(1.0, 1.0), sizes=(50_000_000, 1_000))
    per_sample = timing.per_sample_times(cl, early)
    hidden = step_of("eddis-sync", cl, early, per_sample).step_s
    exposed = step_of("eddis-sync", cl, late, per_sample).step_s
    assert hidden == pytest.approx(2.0 + 2 * 0.5 * 1_000 / GBIT)
    assert exposed == pytest.approx(2.0 + 2 * 0.5 * 50_001_000 / GBIT)


def test_the_update_follows_bucket_by_bucket_in_eddis_and_after_all_in_ddp():
    cl = cluster(2, 1, rate=4.0, link=1e30)
    wl = workload(ready=(1.0,), sizes=(S,), update=0.25)   # 2 s a step: 1.5 s compute, 0.5 s update
    per_sample = timing.per_sample_times(cl, wl)
    assert step_of("eddis-sync", cl, wl, per_sample).step_s == pytest.approx(2.0)
    assert step_of("ddp", cl, wl, per_sample).step_s == pytest.approx(2.0)
    # with the link: DDP updates after the whole gradient, EDDIS each bucket once it is back
    cl = cluster(2, 1, rate=4.0)
    two = workload(ready=(1.0, 1.0), sizes=(S / 2, S / 2), update=0.1)   # 1.8 s compute, 0.2 s update
    per_sample = timing.per_sample_times(cl, two)
    link = S / GBIT   # 2 (k-1)/k S at k=2, either mode (one rank a node)
    assert step_of("ddp", cl, two, per_sample).step_s == pytest.approx(1.8 + link + 0.2)
    # EDDIS: the first half's update (0.1 s) runs while the second half is on the link
    assert step_of("eddis-sync", cl, two, per_sample).step_s == pytest.approx(1.8 + link + 0.1)


def test_pipeline_is_first_come_first_served_per_resource():
    stages = [[("a", 1.0), ("b", 2.0)], [("a", 1.0), ("b", 2.0)], [("b", 0.5)]]
    # bucket 0: a 0-1, b 1-3; bucket 1: a 1-2, b 3-5; bucket 2 ready at 0: b 0-0.5
    assert timing.pipeline([0.0, 0.0, 0.0], stages) == [3.0, 5.0, 0.5]
    # ready later than the resource is free: starts when ready
    assert timing.pipeline([10.0], [[("a", 1.0)]]) == [11.0]


# ---------------------------------------------------------------- speeds and the batch split
def test_split_batch_is_the_best_whole_sample_split():
    # bench/cluster.py's {1,1,2,3} at a global batch of 32 (docs/benchmarks-cluster.md: 11,11,6,4)
    per_sample = [1.0, 1.0, 2.0, 3.0]
    split = timing.split_batch(32, per_sample)
    assert sum(split) == 32 and max(b * c for b, c in zip(split, per_sample)) == 12.0
    for per_sample, total in (([1.0, 1.5, 2.5], 11), ([0.3, 0.7], 9), ([1.0, 1.0, 1.0, 4.0], 13)):
        split = timing.split_batch(total, per_sample)
        best = min(max(b * c for b, c in zip(combo, per_sample))
                   for combo in itertools.product(range(1, total + 1), repeat=len(per_sample))
                   if sum(combo) == total)
        assert sum(split) == total and min(split) >= 1
        assert max(b * c for b, c in zip(split, per_sample)) == pytest.approx(best)
    with pytest.raises(ConfigError, match="at least one sample|a sample"):
        timing.split_batch(3, [1.0] * 4)


def test_sync_waits_for_the_slowest_and_balanced_sync_does_not():
    rates = [10.0, 10.0, 5.0, 10.0 / 3]
    cl, wl = cluster(2, 2, rate=rates, link=1e30), workload(batch=8)
    out = evaluate(cl, wl, ["eddis-sync", "eddis-balanced", "eddis-hybrid", "eddis-hybrid-balanced"])
    slowest = 8 / min(rates)
    assert out["eddis-sync"].step.step_s == pytest.approx(slowest)
    balanced = out["eddis-balanced"]
    assert sum(balanced.step.batches) == 32 and balanced.step.step_s == pytest.approx(1.2)
    # whole samples cap it under the ideal: 32 / 1.2 s against the sum of the rates
    assert balanced.x_ideal == pytest.approx((32 / 1.2) / sum(rates))
    # hybrid groups are the nodes: {10, 10} and {5, 3.3}; balanced inside the second group
    assert out["eddis-hybrid-balanced"].step.batches[2:] == [10, 6]
    assert out["eddis-hybrid-balanced"].step.samples_per_s > out["eddis-hybrid"].step.samples_per_s


def test_elastic_exchanges_hide_in_the_background_until_the_link_is_full():
    wl = workload()
    cl = cluster(2, 2, rate=40.0, link=1e30)
    per_sample = timing.per_sample_times(cl, wl)
    ideal = sum(1 / c for c in per_sample)
    # an endless link: easgd is the ideal whether in the background or not
    assert step_of("eddis-easgd", cl, wl, per_sample, tau=4).samples_per_s == pytest.approx(ideal)
    cl = cluster(2, 2, rate=40.0)
    per_sample = timing.per_sample_times(cl, wl)
    background = step_of("eddis-hybrid", cl, wl, per_sample, tau=4, overlap=True)
    inline = step_of("eddis-hybrid", cl, wl, per_sample, tau=4, overlap=False)
    exchange = timing.exchange_seconds(cl, 0, wl, 2)
    assert exchange == pytest.approx(2 * 0.5 * S / GBIT)
    group_step = 8 / 40.0
    assert inline.samples_per_s == pytest.approx(2 * 16 / (group_step + exchange / 4))
    # in the background each step carries a quarter of the exchange: here more than the
    # step's compute, so the link bounds the step; and at tau 1000 it hides entirely
    assert background.samples_per_s == pytest.approx(2 * 16 / max(group_step, exchange / 4))
    free = step_of("eddis-hybrid", cl, wl, per_sample, tau=1000, overlap=True)
    assert free.samples_per_s == pytest.approx(ideal)


def test_elastic_workers_ask_no_link_for_more_than_it_carries():
    wl = workload()
    cl = cluster(4, 4, rate=1e6)   # compute for nothing: only the links bound easgd
    per_sample = timing.per_sample_times(cl, wl)
    step = step_of("eddis-easgd", cl, wl, per_sample, tau=4)
    assert step.details["link_bound"] and step.link_busy == pytest.approx(1.0)
    # at the link's capacity a global batch takes its bytes over the rate
    assert step.step_s == pytest.approx(step.bytes_per_node_way / GBIT)


def test_compression_halves_the_wire_and_casts_cost_time():
    cl = cluster(2, 2, link=1e30, cast_bps=1e9)
    wl = workload(ready=(1.0, 1.0, 1.0))
    per_sample = timing.per_sample_times(cl, wl)
    plain = step_of("ddp", cl, wl, per_sample).step_s
    half = step_of("ddp-fp16", cl, wl, per_sample).step_s
    # compress on the submit thread, decompress on the finish thread, the buckets pipelined:
    # the finish thread's last cast ends s0 + 2 s1 + s2 after the backward (s1 the largest)
    s0, s1, s2 = (b / 1e9 for b in S_BUCKETS)
    assert half - plain == pytest.approx(s0 + 2 * s1 + s2)


def test_speed_needs_compute_per_sample():
    nodes = (Node("n1", (Rank(speed=2.0, kind="a100"), Rank(speed=1.0, kind="v100")), GBIT, 0.0),)
    cl = Cluster(nodes=nodes)
    with pytest.raises(ConfigError, match="compute_s_per_sample"):
        timing.per_sample_times(cl, workload())
    assert timing.per_sample_times(cl, workload(compute_s_per_sample=0.01)) == [0.005, 0.01]
