"""Mode sync across nodes: the order in which the nodes read and write the servers' pieces."""
import pytest

from eddis.core.reduce.hierarchical import visiting_order


@pytest.mark.parametrize("servers", [1, 2, 3, 4, 8])
def test_each_turn_every_server_serves_exactly_one_node(servers):
    orders = [visiting_order(servers, own) for own in range(servers)]
    for order in orders:
        assert sorted(order) == list(range(servers))
    for turn in range(servers):
        assert sorted(order[turn] for order in orders) == list(range(servers))


def test_a_node_starts_with_its_own_server_then_the_next():
    assert visiting_order(4, 2) == [2, 3, 0, 1]
