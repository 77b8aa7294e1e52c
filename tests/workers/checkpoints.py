"""One rank of a full-format save at several ranks, driven through the shared core: the streamed save, its
host memory, its file, and failed saves (top-level functions: ``run_ranks(functools.partial(fn, tmp), ...)``)."""

import functools
import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist
from engine_helpers import CPU, options
from torch import nn

import lightning_zero_offload  # noqa: F401 - imported before the rank's group exists (see ranks._rank_main)
from lightning_zero_offload import checkpoints as ckpt
from lightning_zero_offload.checkpoints import (
    FORMAT_KEY,
    CheckpointError,
    atomic_save,
    load_checkpoint_file,
)
from lightning_zero_offload.checkpoints import sharded as checkpoint_sharded
from lightning_zero_offload.core import ENGINE_STATE_KEY, OffloadSession

WIDTH, LAYERS = 512, 32  # 8.4M parameters: gathering the fp32 state (12 B/param) would add about 100 MB
BUCKET_MB = 1.0  # fp32: a weight (1 MiB) per bucket, the biases together: rank 0 writes from 1 MiB at a time
STEPS = 3


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def start(seed: int, world: int, device_share: float = 0.0, bucket_mb: float = BUCKET_MB) -> OffloadSession:
    module = net(seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)
    opts = options(bucket_size_mb=bucket_mb, in_place_on_cpu=False, device_share=device_share)
    return OffloadSession.start(module, [optimizer], CPU, "32-true", opts, world, world)


def train(session: OffloadSession, rank: int, steps: range) -> None:
    """Each rank its own batches (the engine averages the gradients over ranks)."""
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, WIDTH, generator=g)
        session.before_training_forward()
        session.zero_grad()
        session.begin_backward()
        session.scale_loss(session.module(x).pow(2).mean()).backward()
        session.finish_backward()
        session.step()


def broadcast(obj):
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def anonymous_rss() -> int:
    """Resident memory less file-backed pages (code paged in the first time a path runs, mapped files)."""
    with open("/proc/self/statm") as f:
        _, resident, shared = map(int, f.read().split()[:3])
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")


def to_save(session: OffloadSession) -> dict:
    """What the Trainer's ``dump_checkpoint`` builds from the strategy's hooks."""
    with session.shared_buffers():
        checkpoint = {
            "state_dict": session.module_state_to_save(),
            "optimizer_states": [session.optimizer_state_to_save()],
        }
    checkpoint[ENGINE_STATE_KEY] = session.engine_state_dict()
    return checkpoint


def shards(session: OffloadSession) -> dict:
    return {k: v.clone() for k, v in session.engine.shard_state_dict().items()}


def resume(path: str, rank: int, world: int) -> OffloadSession:
    checkpoint = load_checkpoint_file(path)
    session = start(seed=7, world=world)  # other initial weights: everything must come from the file
    session.module.load_state_dict(checkpoint["state_dict"])
    session.load_master_weights(checkpoint["state_dict"])
    session.load_optimizer_state(checkpoint["optimizer_states"][0])
    session.load_engine_state(checkpoint[ENGINE_STATE_KEY])
    return session


def streamed_save(tmp: str, rank: int) -> dict:
    """Train, save streamed (RSS sampled around it), save the gathered copies as before for reference,
    then resume from the streamed file at this world size and train on; the uninterrupted run too."""
    import threading
    import time

    world = dist.get_world_size()
    path, reference = os.path.join(tmp, "streamed.ckpt"), os.path.join(tmp, "reference.ckpt")
    session = start(seed=0, world=world)
    train(session, rank, range(STEPS))
    save = lambda ckpt, streamed: atomic_save(ckpt, path, streamed)  # noqa: E731
    session.save_full(to_save(session), rank, broadcast, save)  # once before: buffers of gloo's, torch's
    checkpoint = to_save(session)
    placeholders = [t for t in checkpoint["state_dict"].values() if t.is_meta]
    assert len(placeholders) == 2 * LAYERS  # every weight and bias, on the meta device: no bytes held yet

    gc.collect()
    before = peak = anonymous_rss()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, anonymous_rss())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    session.save_full(checkpoint, rank, broadcast, save)
    done.set()
    sampler.join()
    extra = max(peak, anonymous_rss()) - before
    del checkpoint, placeholders

    # The gathered copies (what a user's CheckpointIO gets, the values the file held before streaming).
    copies = {
        "state_dict": session.master_state_dict(),
        "optimizer_states": [session.optimizer_state_to_save()],
        ENGINE_STATE_KEY: session.engine_state_dict(),
    }
    if rank == 0:
        torch.save(copies, reference)
    del copies
    saved = shards(session)
    train(session, rank, range(STEPS, STEPS + 2))
    straight = shards(session)

    resumed = resume(path, rank, world)
    loaded = shards(resumed)
    train(resumed, rank, range(STEPS, STEPS + 2))
    result = {"extra": extra, "params": sum(p.numel() for p in session.module.parameters())}
    result["buckets"] = len(session.engine.layout.buckets)
    result["largest_bucket_bytes"] = max(b.shard_numel * world * 4 for b in session.engine.layout.buckets)
    result["loaded_equal"] = all(torch.equal(saved[k], loaded[k]) for k in saved)
    result["resumed_equal"] = all(torch.equal(straight[k], v) for k, v in shards(resumed).items())
    result["steps_equal"] = resumed.engine.steps == session.engine.steps
    session.close()
    resumed.close()
    return result


class FailAt:
    """A stream whose ``fetch`` raises at the ``at``-th placeholder (a write failing mid-file)."""

    def __init__(self, stream, at: int) -> None:
        self.stream, self.at, self.calls = stream, at, 0

    def number(self, storage):
        return self.stream.number(storage)

    def begin(self, order):
        self.stream.begin(order)

    def fetch(self, number):
        self.calls += 1
        if self.calls == self.at:
            raise OSError(28, "No space left on device")
        return self.stream.fetch(number)


def failed_saves(tmp: str, rank: int) -> dict:
    """A write that fails before the first bucket and one that fails mid-file: every rank raises rank 0's
    error (none waits for a bucket that never comes), the previous file stays, and a save works after."""
    world = dist.get_world_size()
    path = os.path.join(tmp, "kept.ckpt")
    session = start(seed=0, world=world)
    train(session, rank, range(1))
    session.save_full(to_save(session), rank, broadcast, lambda ckpt, streamed: atomic_save(ckpt, path, streamed))
    with open(path, "rb") as f:
        first = f.read()
    train(session, rank, range(1, 2))
    errors = []
    not_a_dir = os.path.join(tmp, "kept.ckpt", "under-a-file.ckpt")  # its parent is a file: nothing begins
    writers = [
        lambda ckpt, streamed: atomic_save(ckpt, not_a_dir, streamed),
        lambda ckpt, streamed: atomic_save(ckpt, path, FailAt(streamed, at=3)),
    ]
    for write in writers:
        try:
            session.save_full(to_save(session), rank, broadcast, write)
        except (CheckpointError, OSError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    with open(path, "rb") as f:
        kept = f.read() == first
    session.save_full(to_save(session), rank, broadcast, lambda ckpt, streamed: atomic_save(ckpt, path, streamed))
    master = load_checkpoint_file(path)["state_dict"]["0.weight"]
    full = session.master_state_dict()["0.weight"]
    session.close()
    return {"errors": errors, "kept": kept, "saved_after": torch.equal(master, full), "left": sorted(os.listdir(tmp))}


def save_weights_only_at_rank(path: str, rank: int) -> list[str]:
    """Rank ``rank`` of two saves ``w`` = 0..4 (3 values on rank 0, 2 and padding on rank 1) in a checkpoint
    without optimizer state (only rank 0 holds it: the others learn it from rank 0); its shard's entries."""
    import torch.distributed as dist

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(obj):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    meta = None
    if rank == 0:
        meta = {
            "state_dict": {},
            FORMAT_KEY: {
                "format": "sharded",
                "version": 2,
                "world_size": 2,
                "buckets": [{"shard_start": 0, "shard_numel": 3}],
                "params": [{"keys": ["w"], "shape": [5], "bucket": 0, "offset": 0, "step": 1, "torch_index": 0}],
            },
        }
    flat = torch.arange(6.0)[3 * rank : 3 * rank + 3]
    ckpt.save_sharded(path, {name: flat for name in checkpoint_sharded.SHARD_KEYS}, meta, rank, broadcast, gather)
    return sorted(torch.load(in_version(path, ckpt.shard_file(rank)), weights_only=True))


def in_version(root, name: str) -> Path:
    return Path(checkpoint_sharded.current_version(root).path) / name


def streamed_saves(tmp: str, settings: dict[str, tuple[float, float]], rank: int) -> None:
    """Streamed full saves at several ranks: for each name, a run with its (device share, bucket size in MB); rank 0
    writes ``<name>.ckpt`` (a device bucket's chunks are sent from the device part; a split parameter's buckets are
    gathered together)."""
    world = dist.get_world_size()
    for name, (share, bucket_mb) in settings.items():
        session = start(seed=0, world=world, device_share=share, bucket_mb=bucket_mb)
        assert (session.engine.state.device_share_numel > 0) == bool(share)
        train(session, rank, range(STEPS))
        save = functools.partial(_save_to, os.path.join(tmp, f"{name}.ckpt"))
        session.save_full(to_save(session), rank, broadcast, save)
        session.close()


def _save_to(path: str, checkpoint: dict, streamed: object) -> None:
    atomic_save(checkpoint, path, streamed)
