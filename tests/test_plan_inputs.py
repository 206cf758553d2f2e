"""eddis plan's two files: the schema of cluster.json and model.json, and what a bad field says."""
import json

import pytest

from eddis.errors import ConfigError
from eddis.plan import spec

CLUSTER = {"format": spec.CLUSTER_FORMAT, "link": {"rate": "200gbit", "latency_us": 2},
           "smb": {"put_gbs": 20, "get_gbs": 22, "reduce_gbs": 30, "ring_gbs": 19}, "pcie_gbs": 25, "mpi_gbs": 18, "ring_gbs": 21,
           "nodes": [{"count": 8, "name": "a", "ranks": 4, "samples_per_s": 1200, "kind": "a100"},
                     {"count": 8, "name": "v", "ranks": [{"samples_per_s": 400, "kind": "v100"}] * 4,
                      "link": {"rate": "100gbit"}}]}
MODEL = {"format": spec.MODEL_FORMAT, "name": "resnet50", "local_batch": 64, "update_share": 0.05,
         "buckets": [{"bytes": 25 << 20, "ready": 0.3}, {"bytes": 25 << 20, "ready": 0.7},
                     {"bytes": 52_000_000, "ready": 1.0}],
         "samples_to_target": 1_000_000, "sample_efficiency": {"eddis-hybrid": 0.8}, "efficiency_tau": 4}


def with_field(data, path, value):
    """A deep copy of ``data`` with ``path`` (keys and indices) set to ``value`` (None: removed)."""
    data = json.loads(json.dumps(data))
    *parents, last = path
    target = data
    for key in parents:
        target = target[key]
    if value is None:
        del target[last]
    else:
        target[last] = value
    return data


def assert_refused(parse, data, where, names):
    """``parse`` refuses ``data`` with a message that starts with the file and holds ``names``."""
    with pytest.raises(ConfigError) as info:
        parse(data, where)
    message = str(info.value)
    assert message.startswith(where), message
    for name in names:
        assert name in message, message


def test_a_whole_cluster_reads_as_written():
    c = spec.cluster_from_dict(CLUSTER)
    assert c.num_nodes == 16 and c.size == 64
    assert [n.name for n in c.nodes[:2]] == ["a1", "a2"] and c.nodes[8].name == "v1"
    assert c.nodes[0].link_bps == pytest.approx(200e9 * spec.TCP_PAYLOAD_SHARE / 8)
    assert c.nodes[8].link_bps == pytest.approx(100e9 * spec.TCP_PAYLOAD_SHARE / 8)
    assert c.nodes[8].latency_s == pytest.approx(2e-6)        # the default link's, not given there
    assert (c.put_bps, c.get_bps, c.reduce_bps, c.pcie_bps, c.cast_bps) == (20e9, 22e9, 30e9, 25e9, None)
    assert (c.mpi_bps, c.ring_bps, c.smb_ring_bps) == (18e9, 21e9, 19e9)
    assert {r.kind for r in c.ranks} == {"a100", "v100"}
    again = spec.cluster_from_dict(spec.cluster_to_dict(c))
    assert again == c


def test_a_whole_model_reads_as_written():
    m = spec.model_from_dict(MODEL)
    assert m.gradient_bytes == 2 * (25 << 20) + 52_000_000
    assert m.sample_efficiency == {"eddis-hybrid": 0.8} and m.efficiency_tau == 4
    assert spec.model_from_dict(spec.model_to_dict(m)) == m


@pytest.mark.parametrize("text,bits", [("200gbit", 200e9), ("100MBIT", 1e8), ("1.5gbit", 1.5e9), (10, 1e10),
                                       ("25", 25e9)])
def test_link_rates(text, bits):
    assert spec.parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("path,value,names", [
    (["format"], "eddis-plan-model/1", ["format", spec.CLUSTER_FORMAT]),
    (["link"], None, ["link", "rate"]),
    (["link", "rate"], "fast", ["rate", "200gbit"]),
    (["link", "rate"], "-3gbit", ["rate", "200gbit"]),
    (["link", "latency_us"], -1, ["latency_us", ">= 0"]),
    (["link", "speed"], 3, ["speed", "unknown field", "rate"]),
    (["smb", "put_gbs"], 0, ["put_gbs", "GB/s"]),
    (["smb", "put"], 10, ["put", "put_gbs"]),
    (["nodes"], [], ["nodes", "non-empty list"]),
    (["nodes", 0, "count"], 0, ["count", ">= 1"]),
    (["nodes", 0, "count"], 2.5, ["count", "whole number"]),
    (["nodes", 0, "ranks"], None, ["ranks", "number of ranks"]),
    (["nodes", 0, "samples_per_s"], -5, ["samples_per_s", "> 0"]),
    (["nodes", 0, "speed"], 1.0, ["samples_per_s", "exactly one"]),
    (["nodes", 1, "ranks"], [], ["ranks", "one rank or more"]),
    (["nodes", 1, "samples_per_s"], 5, ["samples_per_s", "in each rank"]),
    (["nodes", 1, "ranks", 0], {"sample_per_s": 4}, ["sample_per_s", "unknown field", "samples_per_s"]),
    (["nodes", 1, "ranks", 0], {"kind": "v100"}, ["exactly one"]),
    (["pcie_gbs"], "fast", ["pcie_gbs", "not a number"]),
])
def test_a_bad_cluster_field_is_named_with_its_fix(path, value, names):
    assert_refused(spec.cluster_from_dict, with_field(CLUSTER, path, value), "c.json", names)


@pytest.mark.parametrize("path,value,names", [
    (["format"], None, ["format", spec.MODEL_FORMAT]),
    (["local_batch"], None, ["local_batch", "samples per rank"]),
    (["local_batch"], 0, ["local_batch"]),
    (["buckets"], None, ["buckets", "list"]),
    (["buckets", 0, "bytes"], None, ["buckets[0].bytes", "fp32 gradient bytes"]),
    (["buckets", 1, "ready"], 1.5, ["buckets[1].ready", "backward"]),
    (["buckets", 1, "ready"], 0, ["buckets[1].ready", "> 0"]),
    (["update_share"], 1.0, ["update_share", "0.9"]),
    (["sample_efficiency", "hybrid"], 0.8, ["hybrid", "eddis-hybrid"]),
    (["sample_efficiency", "eddis-easgd"], 0, ["eddis-easgd", "sample efficiency"]),
    (["samples_to_targets"], 5, ["samples_to_targets", "samples_to_target"]),
])
def test_a_bad_model_field_is_named_with_its_fix(path, value, names):
    assert_refused(spec.model_from_dict, with_field(MODEL, path, value), "m.json", names)


def test_ranks_by_speed_need_the_compute_per_sample():
    cluster = spec.cluster_from_dict(with_field(CLUSTER, ["nodes", 0], {"ranks": 2, "speed": 2.0}))
    with pytest.raises(ConfigError, match="compute_s_per_sample"):
        spec.check_pair(cluster, spec.model_from_dict(MODEL))
    spec.check_pair(cluster, spec.model_from_dict(dict(MODEL, compute_s_per_sample=0.01)))


def test_files_that_are_missing_or_not_json(tmp_path):
    with pytest.raises(ConfigError, match="no such file.*--calibrate"):
        spec.load_cluster(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "eddis-plan-cluster/1",\n "nodes": [}')
    with pytest.raises(ConfigError, match="not JSON .* line 2"):
        spec.load_cluster(bad)
    good = tmp_path / "m.json"
    good.write_text(json.dumps(MODEL))
    assert spec.load_model(good).name == "resnet50"


def test_more_nodes_repeat_the_pattern_and_a_new_link_replaces_every_nodes():
    c = spec.cluster_from_dict(CLUSTER).with_nodes(40)
    assert c.num_nodes == 40 and c.nodes[16].ranks == c.nodes[0].ranks and c.nodes[16].name == "a1.1"
    assert len({n.name for n in c.nodes}) == 40
    fast = c.with_link(400e9, 1e-6)
    assert {n.link_bps for n in fast.nodes} == {400e9 * spec.TCP_PAYLOAD_SHARE / 8}
    assert {n.latency_s for n in fast.nodes} == {1e-6}
    with pytest.raises(ConfigError, match="--nodes"):
        c.with_nodes(0)
