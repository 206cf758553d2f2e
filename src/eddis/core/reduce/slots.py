"""What the SMB reducers whose ranks sum the buckets themselves share: the sum of a rank's
share of a bucket in the mapped slots, and who a timed-out counter was waiting for."""
import numpy as np

from ... import timeline
from ...errors import ConfigError
from ...smb import _core, _vecops
from ...timeline.events import CAT_COMM


def sum_bucket_share(reducer, k, state, generation, rank, parties, in_slot, by):
    """Bucket ``k`` summed by the ``parties`` ranks that share ``reducer``'s slots, on this
    one's thread: wait until all arrived (``state``'s counters), sum this rank's share of the
    columns weighted by the parties' weights (``reducer._weights``), count in as done and wait
    for the others' shares. ``state["pieces"]`` holds, per server piece of the share, (result
    view or None, [the share's view in slot 0, ..., slot W-1]). In slot: the sum goes into
    this rank's own slot, then into the same columns of every other slot (nobody else writes
    them), so every slot ends with the whole result. Returns the parties' weights added up."""
    arrived_base, done_base = state["base"]
    reducer._wait_count(state["arrived"], arrived_base + generation * parties, f"bucket {k}")
    weights = np.array([w[0] for w in reducer._weights])
    total = float(weights.sum())
    if reducer.op == "average":
        if total == 0:
            raise ConfigError(f"step {reducer.step}: the {by}' weights sum to 0; cannot average")
        weights /= total
    dtype = reducer.codec.smb_dtype
    # the event the server records for its sum, here on the rank's own thread: comm, not server
    with timeline.span(timeline.REDUCE, cat=CAT_COMM, args={"step": reducer.step, "bucket": k,
                                                            "count": state["count"], "by": by}):
        for dst, sources in state["pieces"]:
            if in_slot:
                dst = sources[rank]
            _vecops.weighted_sum(dst, sources, weights, dtype=dtype, src_dtypes=[dtype] * len(sources))
            if in_slot:
                for r, other in enumerate(sources):
                    if r != rank:  # GIL released: the other threads go on meanwhile
                        _core.memcpy_nogil(other.ctypes.data, dst.ctypes.data, dst.nbytes)
    state["done"].fetch_add(1)
    reducer._wait_count(state["done"], done_base + generation * parties, f"bucket {k} (the others' shares)")
    return total


def server_name(client, index):
    host = client.servers[index].get("hostname") if index < client.num_servers else None
    return f"smb-server {index}@{host}" if host else f"smb-server {index}"


def arrivals(client, counter, target, ranks):
    """Who a timed-out arrival counter was waiting for, from its value: 'k of the n ranks
    [...] arrived (counter on smb-server s@host): n - k missing'. The counter counts, it
    does not say who, so the ranks are those that take part."""
    where = server_name(client, counter.server)
    try:
        value = counter.read()
    except Exception:  # noqa: BLE001 - the server is gone: that is the answer
        return f"the arrival counter on {where} cannot be read any more (that server died?); ranks {ranks}"
    arrived = len(ranks) - max(0, target - value)
    return (f"{arrived} of the {len(ranks)} ranks {ranks} arrived (counter on {where}), "
            f"{len(ranks) - arrived} missing")
