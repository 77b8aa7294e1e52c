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
    order = list(dict.fromkeys(i for b in layout.buckets for i in b.param_indices))
    assert order == list(reversed(range(len(SHAPES))))
    assert all(bucket.numel <= 100 for bucket in layout.buckets)  # 13x11 is larger than the limit: split
    # flat offsets are contiguous and slot ranges do not overlap
    starts = sorted((s.flat_start, s.numel) for s in layout.slots)
    for (a, n), (b, _) in zip(starts, starts[1:]):
        assert a + n <= b


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_parameter_larger_than_a_bucket_is_split_without_a_gap(world):
    """The 13x11 parameter (143 elements) with buckets of 40: it starts a bucket, fills whole buckets of 40 rounded
    down to the world size, and its remainder opens the next bucket, which the smaller parameters after it join."""
    layout = build_layout(SHAPES, 40, world, 0)
    slot = layout.slots[4]
    chunk = 40 // world * world
    pieces = layout.pieces_of(4)
    assert [p.numel for _, p in pieces] == [chunk] * (143 // chunk) + [143 % chunk]
    assert [b.index for b, _ in pieces] == list(slot.buckets)
    assert [p.param_start for _, p in pieces] == [chunk * i for i in range(len(pieces))]
    assert all(p.bucket_offset == 0 for _, p in pieces)  # a split parameter starts each of its buckets
    for bucket, _ in pieces[:-1]:
        assert bucket.numel == bucket.padded_numel == chunk and bucket.param_indices == [4]  # no padding inside
    assert layout.buckets[slot.last_bucket].param_indices == [4, 3]  # the remainder, (1,); (64, 2) does not fit
    assert layout.buckets[slot.last_bucket].numel == 143 % chunk + 1
    # the parameter is one contiguous run of the flat buffer, so the device weight stays a view
    assert slot.flat_start == layout.buckets[slot.bucket].flat_start
    assert layout.buckets[slot.last_bucket].flat_start == slot.flat_start + chunk * (len(pieces) - 1)
    runs = layout.bucket_runs()
    assert range(slot.bucket, slot.last_bucket + 1) in runs
    assert sum(len(r) for r in runs) == len(layout.buckets) and [r.start for r in runs] == sorted(r.start for r in runs)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_segments_of_a_split_parameter_cover_it_once_over_all_ranks(world):
    covered = torch.zeros(143, dtype=torch.int32)
    for rank in range(world):
        layout = build_layout(SHAPES, 40, world, rank)
        for seg in layout.segments_of(4):
            covered[seg.param_start : seg.param_start + seg.numel] += 1
            bucket = next(b for b in layout.buckets if b.shard_start <= seg.shard_start < b.shard_start + b.shard_numel)
            assert seg.shard_end <= bucket.shard_start + bucket.shard_numel
    assert bool((covered == 1).all())


def test_a_bucket_smaller_than_the_world_still_splits():
    layout = build_layout([torch.Size([10])], 2, 3, 0)  # chunks of the world size, 3 > 2
    assert [b.numel for b in layout.buckets] == [3, 3, 3, 1]
    assert [b.padded_numel for b in layout.buckets] == [3, 3, 3, 3]


def test_bad_arguments():
    with pytest.raises(ValueError, match="bucket_numel"):
        build_layout(SHAPES, 0)
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        build_layout(SHAPES, 10, 2, 2)
