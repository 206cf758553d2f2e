"""The ring's schedule (eddis.core.reduce.ring.RingSchedule), a pure function of the bucket's
length, the number of nodes, the node and the piece size: played out here in numpy, every node
must end with the sum of all, each piece read from the region the node before wrote it into,
and the arrival counts the relay waits for must be the pieces that landed before."""
import numpy as np
import pytest

from eddis.core.reduce.ring import RingSchedule, piece_length


def play(count, n, piece, rng):
    grads = [rng.standard_normal(count) for _ in range(n)]
    plans = [RingSchedule(count, n, node, piece) for node in range(n)]
    inbox = [np.full(plans[0].steps * plans[0].chunk, np.nan) for _ in range(n)]
    landed = [0] * n
    out = [g.copy() for g in grads]
    for s in range(plans[0].steps + 1):
        sends = []
        for node, plan in enumerate(plans):
            j = plan.chunk_at[s]
            for m, (lo, hi) in enumerate(plan.pieces[j]):
                mine = out[node][lo:hi]
                if s > 0:
                    # what the relay waits for before this piece: everything that landed before it
                    assert plan.before[s - 1] + m + 1 <= landed[node]
                    a, b = plan.region(s - 1, j, lo, hi)
                    incoming = inbox[node][a:b]
                    assert not np.isnan(incoming).any(), (s, node, j, m)
                    value = incoming + mine if s < n else incoming.copy()
                else:
                    value = mine.copy()
                if s >= n - 1:
                    out[node][lo:hi] = value
                if s < plan.steps:
                    sends.append(((node + 1) % n, plan.region(s, j, lo, hi), value))
        for to, (a, b), value in sends:
            inbox[to][a:b] = value
            landed[to] += 1
    for plan in plans:
        assert landed[plan.node] == plan.per_step
    return grads, out


@pytest.mark.parametrize("count,n,piece", [(1000, 4, 64), (1000, 4, 1000), (7, 4, 2), (3, 4, 1),
                                           (1, 2, 1), (4097, 8, 100), (10, 3, 3)])
def test_every_node_ends_with_the_sum_of_all(count, n, piece):
    grads, out = play(count, n, piece, np.random.default_rng(count + n))
    total = np.sum(grads, axis=0)
    for node in range(n):
        np.testing.assert_allclose(out[node], total, rtol=1e-12, atol=1e-12)


def test_each_node_sends_two_n_minus_one_chunks_of_a_ring():
    plan = RingSchedule(1000, 4, 1, 100)
    assert plan.steps == 6 and plan.chunk == 250
    sent = sum(hi - lo for s in range(plan.steps) for lo, hi in plan.pieces[plan.chunk_at[s]])
    assert sent == 2 * 3 * 250   # 2 (n-1)/n of the bucket, the ring's least


def test_a_chunk_is_cut_into_pieces_that_pipeline_within_bounds():
    itemsize = 4
    # an 8.8 MB bucket over 4 nodes: 2.2 MB chunks in 8 pieces of about 275 KB
    assert piece_length(2_200_000, 4, itemsize) == -(-550_000 // 8)
    # never below 128 KiB: a small bucket's chunk goes in fewer, larger pieces
    assert piece_length(100_000, 4, itemsize) == (128 << 10) // itemsize
    # never above 4 MiB
    assert piece_length(500_000_000, 2, itemsize) == (4 << 20) // itemsize
    assert piece_length(1, 8, 2) >= 1
