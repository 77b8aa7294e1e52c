import pytest
import torch

from lightning_zero_offload.engine.step.layout import build_layout

SHAPES = [torch.Size(s) for s in [(7, 3), (5,), (64, 2), (1,), (13, 11), (3,)]]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("bucket_numel", [1, 30, 100, 10_000])
def test_shards_partition_every_parameter_exactly_once(world, bucket_numel):
    covered = [torch.zeros(s.numel(), dtype=torch.int32) for s in SHAPES]
    total_shard = None
    for rank in range(world):
        layout = build_layout(SHAPES, bucket_numel, world, rank)
        total_shard = layout.shard_numel if total_shard is None else total_shard
        assert layout.shard_numel == total_shard  # every rank holds the same amount
        for bucket in layout.buckets:
            assert bucket.padded_numel % world == 0
            assert bucket.padded_numel - bucket.numel < world
            for seg in bucket.segments:
                assert bucket.shard_start <= seg.shard_start < seg.shard_end <= bucket.shard_start + bucket.shard_numel
                covered[seg.param_index][seg.param_start : seg.param_start + seg.numel] += 1
    assert all(bool((c == 1).all()) for c in covered)


def test_buckets_follow_reverse_registration_order_and_size_limit():
    layout = build_layout(SHAPES, 100, 1, 0)
    order = [i for b in layout.buckets for i in b.param_indices]
    assert order == list(reversed(range(len(SHAPES))))
    for bucket in layout.buckets:
        assert bucket.numel <= 143  # 13x11 is larger than the limit and sits alone
        if len(bucket.param_indices) > 1:
            assert bucket.numel <= 100
    # flat offsets are contiguous and slot ranges do not overlap
    starts = sorted((s.flat_start, s.numel) for s in layout.slots)
    for (a, n), (b, _) in zip(starts, starts[1:]):
        assert a + n <= b


def test_bad_arguments():
    with pytest.raises(ValueError, match="bucket_numel"):
        build_layout(SHAPES, 0)
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        build_layout(SHAPES, 10, 2, 2)
