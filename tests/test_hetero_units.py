"""Heterogeneity building blocks, one process: the pure functions (slowdown spec,
claim arithmetic, balanced shares) and, against a real in-process SMB server, the
global learning counter (threads stand in for ranks: each has its own client),
the staleness bound and the EASGD exchange arithmetic."""
import threading
import time

import numpy as np
import pytest

from eddis import smb
from eddis.core.hetero import balance, simulate
from eddis.core.progress import counter as progress
from eddis.core.hetero.easgd import ElasticAverager
from eddis.errors import ConfigError, UsageError


# ---------------------------------------------------------------- simulate
def test_parse_slowdown_ranks_groups_default():
    spec = simulate.parse_slowdown("0:1.0, 1:2.0,g1:3,*:1.5")
    assert spec == {"ranks": {0: 1.0, 1: 2.0}, "groups": {1: 3.0}, "default": 1.5}
    assert simulate.slowdown_factor(spec, rank=1, group=1) == 2.0   # rank beats group
    assert simulate.slowdown_factor(spec, rank=2, group=1) == 3.0   # group beats *
    assert simulate.slowdown_factor(spec, rank=2, group=0) == 1.5
    assert simulate.parse_slowdown(None)["default"] == 1.0
    assert simulate.parse_slowdown("")["ranks"] == {}


@pytest.mark.parametrize("text", ["1", "x:2", "1:fast", "1:0.5", "g:2", "1:inf", "1:nan"])
def test_parse_slowdown_rejects_bad_entries(text):
    with pytest.raises(ConfigError, match="EDDIS_SIMULATE_SLOWDOWN"):
        simulate.parse_slowdown(text)


def test_slowdown_names_unknown_rank():
    with pytest.raises(ConfigError, match="rank"):
        simulate.check_ranks(simulate.parse_slowdown("7:2"), size=4, num_groups=1)
    with pytest.raises(ConfigError, match="g3"):
        simulate.check_ranks(simulate.parse_slowdown("g3:2"), size=4, num_groups=2)


def test_slowdown_sleeps_the_difference():
    slow = simulate.Slowdown(3.0)
    t = time.perf_counter()
    assert slow.stretch(0.02) == pytest.approx(0.04)
    assert time.perf_counter() - t >= 0.04
    assert simulate.Slowdown(1.0).stretch(1.0) == 0.0


def test_from_settings_warns(monkeypatch):
    monkeypatch.setenv("EDDIS_SIMULATE_SLOWDOWN", "1:2.0")
    with pytest.warns(simulate.SimulatedSlowdownWarning, match="testing aid"):
        assert simulate.from_settings(rank=1, group=0, size=2, num_groups=1).factor == 2.0
    assert simulate.from_settings(rank=0, group=0, size=2, num_groups=1).factor == 1.0


# ---------------------------------------------------------------- claim arithmetic
def test_usable_iterations():
    assert progress.usable_iterations(0, 4, 10) == 4
    assert progress.usable_iterations(8, 4, 10) == 2
    assert progress.usable_iterations(10, 4, 10) == 0
    assert progress.usable_iterations(25, 4, 10) == 0
    assert progress.usable_iterations(7, 4, 10, unit=2) == 2   # whole units only
    assert progress.usable_iterations(9, 4, 10, unit=2) == 0


# ---------------------------------------------------------------- balance
def test_balanced_sizes():
    assert balance.balanced_sizes(10, [0.25] * 4) == [3, 3, 2, 2]
    assert sum(balance.balanced_sizes(100, [0.4, 0.4, 0.2])) == 100
    assert balance.balanced_sizes(100, [0.4, 0.4, 0.2]) == [40, 40, 20]
    assert balance.balanced_sizes(4, [1.0, 0.0, 0.0, 0.0]) == [1, 1, 1, 1]   # one each at least
    assert balance.balanced_sizes(8, [0.97, 0.01, 0.01, 0.01]) == [5, 1, 1, 1]
    # the smallest share is rounded like the others, not given a sample first and then its part
    assert balance.balanced_sizes(256, [0.35, 0.35, 0.179, 0.121]) == [90, 89, 46, 31]
    with pytest.raises(ConfigError, match="at least one sample per rank"):
        balance.balanced_sizes(3, [0.25] * 4)


def test_arrival_shares_without_fixed_costs_follow_throughput():
    shares = balance.arrival_shares([10, 10, 10, 5], [1.0, 1.0, 1.0, 1.0], [0.0] * 4, 256)
    assert shares == pytest.approx([2 / 7, 2 / 7, 2 / 7, 1 / 7])
    # a rank without a measurement counts with the others' mean per-sample time
    assert balance.arrival_shares([10, 0], [1.0, 0.0], [0.0, 0.0], 64) == pytest.approx([0.5, 0.5])
    assert balance.arrival_shares([0, 0], [0.0, 0.0], [0.0, 0.0], 64) == pytest.approx([0.5, 0.5])


def test_arrival_shares_level_the_arrival_times():
    per_sample = np.array([0.002, 0.002, 0.004, 0.006])   # {1,1,2,3}
    fixed = np.array([0.002, 0.002, 0.003, 0.008])        # the slow rank's update is slow too
    shares = balance.arrival_shares([100] * 4, per_sample * 100, fixed, 256)
    counts = shares * 256
    arrival = fixed + counts * per_sample
    assert arrival == pytest.approx(np.full(4, arrival[0]))
    assert shares.sum() == pytest.approx(1.0)
    # fewer samples for the slow rank than throughput alone would give it (1/3 of a fast one)
    assert counts[3] < counts[0] / 3


def test_arrival_shares_keep_one_sample_for_a_rank_whose_fixed_cost_outlasts_the_step():
    shares = balance.arrival_shares([100, 100, 100], [0.1, 0.1, 0.1], [0.0, 0.0, 1.0], 64)
    assert shares * 64 == pytest.approx([31.5, 31.5, 1.0])


def test_smooth_shares_moves_gradually_and_ignores_noise():
    old = np.array([0.5, 0.5])
    new = balance.smooth_shares(old, np.array([0.7, 0.3]), 0.5)
    assert new == pytest.approx([0.6, 0.4])
    assert balance.smooth_shares(old, np.array([0.502, 0.498]), 1.0) is old


def test_balancer_schedule_single_process():
    from mpi4py import MPI

    b = balance.Balancer(1, 0, comm=MPI.COMM_SELF, warmup=2, interval=3, smoothing=0.5, global_batch=8)
    assert b.sizes_for(0) == [8]
    assert [b.is_decision_step(s) for s in range(9)] == [False, False, True, False, False, True,
                                                         False, False, True]
    for step in range(6):
        b.record(8, 0.01)
        b.end_step(step)
    assert [h[0] for h in b.history] == [2, 5]
    with pytest.raises(ConfigError, match="keep it constant"):
        b.sizes_for(0, global_batch=16)


# ---------------------------------------------------------------- against a real SMB server
@pytest.fixture
def smb_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    smb.create_run_dir(run_dir)
    server = smb.Server(run_dir, index=0, memory=32 << 20)
    server.start()
    yield run_dir
    server.stop()


def _run_ranks(n, body):
    errors = []

    def wrap(r):
        try:
            body(r)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errors:
        raise errors[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [1, 3])
def test_counter_hands_out_exactly_the_total(smb_run_dir, chunk):
    total, n = 101, 4
    steps, positions = [0] * n, [[] for _ in range(n)]

    def rank(r):
        with smb.Client(run_dir=smb_run_dir) as client:
            ctl = progress.ProgressController(client, total, r, n, chunk=chunk, staleness=-1,
                                              name=f"units.{chunk}")
            while not ctl.should_stop():
                positions[r].append(ctl.global_step())
                steps[r] += 1
                if r == 3:
                    time.sleep(0.001)   # a slow rank
            assert ctl.should_stop()   # stays stopped

    _run_ranks(n, rank)
    assert sum(steps) == total
    assert sorted(p for ps in positions for p in ps) == list(range(total))
    with smb.Client(run_dir=smb_run_dir) as client:
        assert client.counter(f"units.{chunk}.counter").read() == total
    assert steps[3] < max(steps[:3])


@pytest.mark.timeout(60)
def test_unit_of_all_ranks_claims_without_messages_and_checks_the_counter(smb_run_dir):
    """A unit of all ranks (sync) predicts its claims after the first; the leader still
    claims for real, so the counter ends at the total, and it notices a foreign claim."""
    from mpi4py import MPI

    with smb.Client(run_dir=smb_run_dir) as client:
        ctl = progress.ProgressController(client, 10, 0, 1, chunk=3, staleness=-1,
                                          lockstep_comm=MPI.COMM_SELF, name="units.exclusive")
        positions = []
        while not ctl.should_stop():
            positions.append(ctl.global_step())
        assert positions == list(range(10)) and ctl.claims == 5   # 3+3+3+1, then the empty claim
        assert client.counter("units.exclusive.counter").read() == 10

        ctl = progress.ProgressController(client, 10, 0, 1, chunk=2, staleness=-1,
                                          lockstep_comm=MPI.COMM_SELF, name="units.tampered")
        assert not ctl.should_stop() and not ctl.should_stop()
        client.counter("units.tampered.counter").fetch_add(1)   # another user of the counter
        # noticed by the first claim that finds it: the next one, or the one after when the
        # next was made ahead before the foreign claim
        with pytest.raises(progress.ProgressError, match=r"read (3 where .* left it at 2|5 where .* left it at 4)"):
            for _ in range(4):
                ctl.should_stop()


@pytest.mark.timeout(60)
def test_staleness_bound_holds(smb_run_dir):
    total, n, bound = 120, 3, 2
    logs = [None] * n

    def rank(r):
        with smb.Client(run_dir=smb_run_dir) as client:
            ctl = progress.ProgressController(client, total, r, n, staleness=bound, name="units.stale",
                                              record=True)
            while not ctl.should_stop():
                time.sleep(0.004 if r == 0 else 0.0005)   # rank 0 is 8x slower
            logs[r] = ctl.history

    _run_ranks(n, rank)
    violations = staleness_violations(logs, bound)
    assert not violations, violations[:5]
    fast_steps = max(sum(1 for _, e, _ in log if e == "done") for log in logs[1:])
    assert fast_steps > 0


def staleness_violations(logs, bound):
    """Every (rank, step t) that started while another rank had completed fewer than
    t - bound steps and had not finished, from the ranks' recorded histories."""
    done = [sorted(t for t, e, _ in log if e == "done") for log in logs]
    finish = [min([t for t, e, _ in log if e == "finish"] or [float("inf")]) for log in logs]
    bad = []
    for r, log in enumerate(logs):
        for t_ns, event, step in log:
            if event != "start":
                continue
            for q in range(len(logs)):
                if q == r or finish[q] <= t_ns:
                    continue
                completed = sum(1 for d in done[q] if d <= t_ns)
                if completed < step - bound:
                    bad.append((r, step, q, completed))
    return bad


@pytest.mark.timeout(60)
def test_staleness_timeout_names_the_laggard(smb_run_dir):
    with smb.Client(run_dir=smb_run_dir) as client:
        fast = progress.ProgressController(client, 100, 0, 2, staleness=1, name="units.timeout", timeout=0.3)
        progress.ProgressController(client, 100, 1, 2, staleness=1, name="units.timeout", timeout=0.3)
        assert not fast.should_stop() and not fast.should_stop()
        with pytest.raises(progress.ProgressTimeoutError, match="rank 1 at step 0"):
            fast.should_stop()


@pytest.mark.timeout(60)
def test_easgd_exchange_arithmetic(smb_run_dir):
    n = 4
    with smb.Client(run_dir=smb_run_dir) as client:
        workers = [ElasticAverager(client, n, w, 2, tau=2, alpha=0.25, name="units.easgd") for w in range(2)]
        assert workers[0].alpha == 0.25 and not workers[0].due(0) and workers[0].due(1)
        workers[0].initialize(np.zeros(n, np.float32))
        x0 = np.full(n, 4.0, np.float32)
        x1 = np.full(n, -8.0, np.float32)
        workers[0].exchange(x0)          # d = 1: x0 -> 3, centre -> 1
        workers[0].finish()              # the centre's axpy runs in the background: let it land
        np.testing.assert_allclose(x0, 3.0)
        workers[1].exchange(x1)          # d = 0.25 (-8 - 1) = -2.25: x1 -> -5.75, centre -> -1.25
        workers[1].finish()
        np.testing.assert_allclose(x1, -5.75)
        np.testing.assert_allclose(workers[0].read_center(), -1.25)
        assert ElasticAverager(client, n, 0, 4, name="units.easgd4").alpha == pytest.approx(0.225)
        with pytest.raises(ConfigError, match="EDDIS_EASGD_ALPHA"):
            ElasticAverager(client, n, 0, 2, alpha=1.5, name="units.bad")


@pytest.mark.timeout(60)
def test_overlapped_exchange_moves_the_centre_now_and_hands_the_move_over_later(smb_run_dir):
    """EDDIS_EASGD_OVERLAP: the exchange runs on a copy of the parameters in a thread; the
    centre moves when it is done, the worker when it takes the move (at its next exchange)."""
    n = 4
    with smb.Client(run_dir=smb_run_dir) as client:
        worker = ElasticAverager(client, n, 0, 2, tau=2, alpha=0.25, name="units.overlap", weighting="equal")
        worker.initialize(np.zeros(n, np.float32))
        assert worker.take_move() is None and not worker.exchange_pending
        x = np.full(n, 4.0, np.float32)
        worker.start_exchange(x)         # d = 0.25 (4 - 0) = 1 on the copy; the centre -> 1
        x += 2.0                         # the training goes on meanwhile: x = 6
        with pytest.raises(UsageError, match="still pending"):
            worker.start_exchange(x)
        np.testing.assert_allclose(worker.read_center(), 1.0)   # waits for it, keeps the move
        assert worker.exchange_pending
        move = worker.take_move()
        np.testing.assert_allclose(move, 1.0)
        np.testing.assert_allclose(x, 6.0)                       # the caller applies it
        assert not worker.exchange_pending and worker.exchanges == 1
        worker.start_exchange(x - move)  # 5: d = 0.25 (5 - 1) = 1, the centre -> 2
        np.testing.assert_allclose(worker.take_move(), 1.0)
        np.testing.assert_allclose(worker.read_center(), 2.0)


@pytest.mark.timeout(60)
def test_a_striped_exchange_moves_only_its_part(smb_run_dir):
    """EDDIS_EASGD_OVERLAP exchanges a stripe after every step: the tau stripes cover the
    vector once, in order; an exchange of one moves that part of the worker and the centre."""
    n, tau = 10, 4
    with smb.Client(run_dir=smb_run_dir) as client:
        worker = ElasticAverager(client, n, 0, 2, tau=tau, alpha=0.25, name="units.stripes", weighting="equal")
        stripes = [worker.stripe(step) for step in range(2 * tau)]
        assert stripes[:tau] == stripes[tau:]   # every coordinate once every tau steps
        assert stripes[:tau] == [[(0, 2)], [(2, 3)], [(5, 2)], [(7, 3)]]   # one server: one piece
        worker.initialize(np.zeros(n, np.float32))
        x = np.full(n, 4.0, np.float32)
        worker.start_exchange(x, part=stripes[1])   # d = 0.25 (4 - 0) = 1 on elements 2..4
        [move] = worker.take_move()
        np.testing.assert_allclose(move, [1.0] * 3)
        np.testing.assert_allclose(worker.read_center(), [0, 0, 1, 1, 1, 0, 0, 0, 0, 0])
        worker.exchange(x, part=stripes[3])           # in place: x 4 -> 3 on elements 7..9
        np.testing.assert_allclose(x, [4] * 7 + [3] * 3)
        np.testing.assert_allclose(worker.read_center(), [0, 0, 1, 1, 1, 0, 0, 1, 1, 1])


@pytest.fixture
def two_servers_run_dir(tmp_path):
    run_dir = tmp_path / "run2"
    smb.create_run_dir(run_dir)
    servers = [smb.Server(run_dir, index=i, memory=8 << 20) for i in range(2)]
    for server in servers:
        server.start()
    yield run_dir
    for server in servers:
        server.stop()


@pytest.mark.timeout(60)
def test_stripes_cut_every_servers_piece_alike(two_servers_run_dir):
    """Each stripe takes its share of every server's piece of the centre, so that every
    exchange reads and writes every server (the links carry a share of each, every step)."""
    n, tau = 20, 4
    with smb.Client(run_dir=two_servers_run_dir, expected_servers=2) as client:
        worker = ElasticAverager(client, n, 0, 2, tau=tau, name="units.stripes2", weighting="equal")
        pieces = [(start, count) for start, count, _ in worker.pool.layout()]
        assert len(pieces) == 2, pieces
        stripes = [worker.stripe(step) for step in range(tau)]
        assert all(len(stripe) == 2 for stripe in stripes), stripes
        covered = sorted(r for stripe in stripes for r in stripe)
        assert sum(c for _, c in covered) == n
        assert all(a + m == b for (a, m), (b, _) in zip(covered, covered[1:])), covered  # no gap, no overlap
        worker.initialize(np.zeros(n, np.float32))
        x = np.arange(n, dtype=np.float32)
        moves = worker.exchange(x.copy(), part=stripes[2])
        centre = worker.read_center()
        moved = np.zeros(n, bool)
        for (lo, count), move in zip(stripes[2], moves):
            moved[lo:lo + count] = True
            np.testing.assert_allclose(move, worker.pull * np.arange(lo, lo + count))
        assert np.all(centre[~moved] == 0), centre   # the other stripes are not touched
        np.testing.assert_allclose(centre[moved], worker.push * np.arange(n, dtype=np.float32)[moved])


@pytest.mark.timeout(60)
def test_easgd_throughput_weighting_splits_the_move_by_mass(smb_run_dir):
    n = 4
    with smb.Client(run_dir=smb_run_dir) as client:
        fast, slow = [ElasticAverager(client, n, w, 2, tau=2, alpha=0.25, name="units.mass",
                                      iterations_per_step=2 if w == 0 else 1) for w in range(2)]
        fast.initialize(np.zeros(n, np.float32))
        # two exchanges each, timed by hand: the fast worker does 2 steps x 2 iterations in
        # 0.1 s (40/s), the slow one 2 x 1 in 0.2 s (10/s); the mean is 25/s
        for worker, seconds in ((fast, 0.1), (slow, 0.2)):
            worker._weigh(100.0)
            worker._weigh(100.0 + seconds)
        fast._weigh(100.2)   # sees the slow worker's rate now; its own interval 0.1 s again
        assert fast.mass == pytest.approx(40 / 25) and slow.mass == pytest.approx(10 / 25)
        for worker in (fast, slow):
            assert worker.pull + worker.push == pytest.approx(2 * 0.25)
            assert worker.mass * worker.pull == pytest.approx(worker.push)   # momentum kept
        assert fast.pull < 0.25 < slow.pull

        x = np.full(n, 2.0, np.float32)
        fast._last_exchange = None   # exchange() measures again: keep the masses above
        pull, push = fast.pull, fast.push
        fast.exchange(x)
        fast.finish()
        np.testing.assert_allclose(x, 2.0 - 2.0 * pull, rtol=1e-6)
        np.testing.assert_allclose(fast.read_center(), 2.0 * push, rtol=1e-6)

        plain = ElasticAverager(client, n, 0, 2, alpha=0.25, name="units.plain", weighting="equal")
        assert plain.rates is None and plain.pull == plain.push == 0.25
        with pytest.raises(ConfigError, match="EDDIS_EASGD_WEIGHTING"):
            ElasticAverager(client, n, 0, 2, name="units.badweight", weighting="fastest")