"""Pure functions of eddis.core: bucket plan, codecs, sampler shares."""
import numpy as np
import pytest

from eddis.core import BucketPlan, batch_slice, shard_indices, split_sizes
from eddis.core.layout import compression
from eddis.errors import ConfigError


@pytest.mark.timeout(30)
def test_bucket_plan_reverse_order_and_caps():
    params = [("a", (10,)), ("b", (4, 5)), ("big", (300,)), ("c", (7,)), ("d", (3,))]
    plan = BucketPlan(params, bucket_bytes=100)  # 25 floats per bucket
    # the last-defined parameter comes first: its gradient is ready first in backward
    assert plan.buckets[0].params[0] == 4
    order = [i for b in plan.buckets for i in b.params]
    assert order == [4, 3, 2, 1, 0]
    assert [b.params for b in plan.buckets] == [[4, 3], [2], [1], [0]]
    assert plan.total == 10 + 20 + 300 + 7 + 3
    # buckets tile the buffer without gaps, views land inside their bucket
    assert [b.start for b in plan.buckets] == [0, 10, 310, 330]
    for slot in plan.slots:
        b = plan.buckets[slot.bucket]
        assert b.start <= slot.start and slot.start + slot.count <= b.start + b.count
        view = plan.view(slot.index)
        assert view.size == slot.count and np.shares_memory(view, plan.buffer)
    assert plan.signature() != BucketPlan(params[:-1] + [("d", (4,))], 100).signature()
    with pytest.raises(ConfigError, match="EDDIS_BUCKET_BYTES"):
        BucketPlan(params, bucket_bytes=0)


@pytest.mark.timeout(30)
def test_bucket_cut_keeps_a_module_together():
    # the comm MLP's layout: a 16 KB bias left behind would hold bucket 0 until the 67 MB
    # weight of its module (computed by the same autograd node) is ready
    params = [("0.weight", (4096, 1024)), ("0.bias", (4096,)), ("2.weight", (4096, 4096)),
              ("2.bias", (4096,)), ("4.weight", (1024, 4096)), ("4.bias", (1024,)),
              ("6.weight", (10, 1024)), ("6.bias", (10,))]
    plan = BucketPlan(params, bucket_bytes=25 << 20)
    names = [[plan.slots[i].name for i in b.params] for b in plan.buckets]
    assert names == [["6.bias", "6.weight", "4.bias", "4.weight"], ["2.bias", "2.weight"],
                     ["0.bias", "0.weight"]]
    # Keras's names, and names without a module: a bucket is never emptied by the move
    keras = BucketPlan([("dense/kernel:0", (30,)), ("dense/bias:0", (2,)), ("out/kernel:0", (20,))],
                       bucket_bytes=100)
    assert [b.params for b in keras.buckets] == [[2], [1, 0]]
    unnamed = BucketPlan([(f"param.{i}", (n,)) for i, n in enumerate((30, 2, 20))], bucket_bytes=100)
    assert [b.params for b in unnamed.buckets] == [[2, 1], [0]]
    assert plan.total == sum(s.count for s in plan.slots)
    assert [b.start for b in plan.buckets] == [0, plan.buckets[0].count,
                                               plan.buckets[0].count + plan.buckets[1].count]


@pytest.mark.timeout(30)
def test_the_first_bucket_ends_after_the_first_module_that_fills_it():
    # a small CNN: everything fits one 25 MiB bucket; the classifier's gradients (ready first)
    # get a bucket of their own, cut after the first module that brings it to 1 MiB
    cnn = [("0.weight", (32, 3, 3, 3)), ("0.bias", (32,)), ("3.weight", (64, 32, 3, 3)),
           ("3.bias", (64,)), ("7.weight", (512, 4096)), ("7.bias", (512,)),
           ("9.weight", (10, 512)), ("9.bias", (10,))]
    plan = BucketPlan(cnn, bucket_bytes=25 << 20, first_bucket_bytes=1 << 20)
    names = [[plan.slots[i].name for i in b.params] for b in plan.buckets]
    assert names == [["9.bias", "9.weight", "7.bias", "7.weight"], ["3.bias", "3.weight", "0.bias", "0.weight"]]
    assert BucketPlan(cnn, bucket_bytes=25 << 20).signature() != plan.signature()
    # 0: cut as any other bucket; the whole model in one
    assert len(BucketPlan(cnn, bucket_bytes=25 << 20, first_bucket_bytes=0).buckets) == 1
    # never inside a module: a first module larger than the size is the first bucket whole, and
    # where no module follows inside the first bucket it stays as it was (the comm MLP's)
    mlp = [("0.weight", (4096, 1024)), ("0.bias", (4096,)), ("2.weight", (4096, 4096)),
           ("2.bias", (4096,)), ("4.weight", (1024, 4096)), ("4.bias", (1024,)),
           ("6.weight", (10, 1024)), ("6.bias", (10,))]
    assert (BucketPlan(mlp, 25 << 20, first_bucket_bytes=1 << 20).signature()
            == BucketPlan(mlp, 25 << 20).signature())
    one_module = [("fc.weight", (1024, 1024)), ("fc.bias", (1024,)), ("head.weight", (10, 8)), ("head.bias", (10,))]
    first = BucketPlan(one_module, 25 << 20, first_bucket_bytes=64).buckets[0]
    assert [one_module[i][0] for i in first.params] == ["head.bias", "head.weight"]
    with pytest.raises(ConfigError, match="EDDIS_FIRST_BUCKET_BYTES"):
        BucketPlan(cnn, first_bucket_bytes=-1)


def _nasty_floats(n=4096):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)
    x[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 65504.0, 3.4e38]
    # halfway cases of bf16 rounding (ties to even)
    x[8:12] = np.array([0x3F808000, 0x3F818000, 0x3F80C000, 0x3F817FFF], dtype=np.uint32).view(np.float32)
    return x


@pytest.mark.timeout(30)
def test_bf16_numpy_fallback_matches_c_kernels(monkeypatch):
    x = _nasty_floats()
    fast = compression.float32_to_bfloat16_bits(x)
    monkeypatch.setattr(compression, "_vecops", None)
    slow = compression.float32_to_bfloat16_bits(x)
    finite = ~np.isnan(x)
    assert np.array_equal(fast[finite], slow[finite])
    assert np.all(np.isnan(compression.bfloat16_bits_to_float32(slow[~finite])))
    assert list(slow[8:12]) == [0x3F80, 0x3F82, 0x3F81, 0x3F81]  # ties to even, above half up
    back = compression.bfloat16_bits_to_float32(slow)
    ok = np.isfinite(x) & (np.abs(x) > 1e-37) & (np.abs(x) < 3e38)
    assert np.all(np.abs(back[ok] - x[ok]) <= np.abs(x[ok]) * 2.0 ** -8)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_codec_round_trip(name, monkeypatch):
    codec = compression.get_codec(name)
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    results = []
    for vecops in (compression._vecops, None):
        monkeypatch.setattr(compression, "_vecops", vecops)
        wire = codec.compress(x, out=codec.empty(x.size))
        assert wire.dtype == codec.wire_dtype and wire.nbytes == x.size * codec.itemsize
        results.append(codec.decompress(wire, np.empty_like(x)))
    assert np.array_equal(results[0], results[1])
    bound = {"none": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}[name]
    assert np.all(np.abs(results[0] - x) <= np.abs(x) * bound + 1e-7)
    with pytest.raises(ConfigError, match="none, fp16, bf16"):
        compression.get_codec("int8")


@pytest.mark.timeout(30)
def test_split_sizes_are_proportional_and_complete():
    assert split_sizes(10, [1, 1]) == [5, 5]
    assert split_sizes(10, [1, 2, 2]) == [2, 4, 4]
    assert sum(split_sizes(1001, [1.0, 2.5, 3.3, 0.7])) == 1001
    assert split_sizes(7, [0, 1]) == [0, 7]
    with pytest.raises(ConfigError, match="one weight per rank"):
        shard_indices(10, 0, 3, weights=[1, 2])
    with pytest.raises(ConfigError, match=">= 0"):
        split_sizes(10, [-1, 2])
    assert batch_slice(24, 2, 4) == slice(12, 18)
    assert batch_slice(10, 1, 2, weights=[1, 4]) == slice(2, 10)


@pytest.mark.timeout(30)
def test_shards_match_torch_sampler_without_weights():
    import torch
    from torch.utils.data import DistributedSampler

    data = list(range(23))
    for drop_last in (False, True):
        for rank in range(4):
            theirs = list(DistributedSampler(data, num_replicas=4, rank=rank, shuffle=False, drop_last=drop_last))
            ours = shard_indices(23, rank, 4, shuffle=False, drop_last=drop_last).tolist()
            assert ours == theirs


@pytest.mark.timeout(30)
def test_weighted_shards_partition_the_epoch_and_reshuffle():
    weights = [1, 3]
    shards = [shard_indices(1000, r, 2, weights=weights, epoch=3, seed=7) for r in range(2)]
    assert [len(s) for s in shards] == [250, 750]
    assert sorted(np.concatenate(shards).tolist()) == list(range(1000))
    again = shard_indices(1000, 0, 2, weights=weights, epoch=3, seed=7)
    assert np.array_equal(again, shards[0])
    assert not np.array_equal(shard_indices(1000, 0, 2, weights=weights, epoch=4, seed=7), shards[0])
