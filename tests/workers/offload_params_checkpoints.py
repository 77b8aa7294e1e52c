"""Ranks of the checkpoints of offload_params=True: saved midway at two ranks, resumed at one, two and three, and
a save failing on one rank. Run by tests/checkpoints/test_distributed_ranks.py with ``ranks.run_ranks``
(top-level functions: ``functools.partial(fn, ...)``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers

import torch  # noqa: E402
from offload_params_helpers import Blocks, batches, make_engine, sharded_copy, train, training_state  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

from lightning_zero_offload.checkpoints import CheckpointError, distributed  # noqa: E402
from lightning_zero_offload.engine.offload_params.full_state import (  # noqa: E402
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)

SAVED_AFTER = 3  # of the six steps
CLIP = 0.5  # fires on some steps


def data() -> list:
    return batches(steps=6, micro=2, rows=12)  # 12 rows: divisible by 1, 2 and 3 ranks


def start(seed: int, cpu_state: str):
    """The model (``seed``'s init, and bf16 rounding seed) on FSDP2 over this group, and its engine."""
    torch.manual_seed(seed)
    sharded = sharded_copy(Blocks(), torch.bfloat16 if cpu_state == "bf16" else torch.float32)
    return sharded, make_engine(sharded, cpu_state=cpu_state, cpu_step="speculative")


def save_midway(path: str, fmt: str, cpu_state: str, rank: int) -> dict:
    """Train, save (``fmt``: "sharded" or "full"), train on: the state saved and the uninterrupted run's end."""
    sharded, engine = start(0, cpu_state)
    train(sharded, engine, data()[:SAVED_AFTER], clip_norm=CLIP)
    result = {}
    if fmt == "sharded":
        distributed.save_sharded(path, sharded, engine, {"global_step": SAVED_AFTER})
    else:
        full = {"state_dict": full_model_state(sharded), "optimizer": full_optimizer_state(engine)}
        if rank == 0:
            torch.save({**full, "engine": engine.state_dict()}, path)
        result["held"] = len(full["state_dict"])  # the module's whole tensors: on rank 0 alone
    result["saved"] = training_state(sharded, engine)
    train(sharded, engine, data()[SAVED_AFTER:], clip_norm=CLIP)
    result["final"] = training_state(sharded, engine)
    return result


def resume(path: str, fmt: str, cpu_state: str, rank: int) -> dict:
    """Another init, the checkpoint loaded, the rest of the run: the state loaded and the end."""
    sharded, engine = start(1, cpu_state)
    extra = {}
    if fmt == "sharded":
        extra = distributed.load_sharded(path, sharded, engine)
    else:
        checkpoint = torch.load(path, weights_only=True, mmap=True)  # every rank maps the file, reads its rows
        load_full_model_state(sharded, checkpoint["state_dict"])
        load_full_optimizer_state(engine, checkpoint["optimizer"])
        engine.load_state_dict(checkpoint["engine"])
    loaded = training_state(sharded, engine)
    train(sharded, engine, data()[SAVED_AFTER:], clip_norm=CLIP)
    return {"extra": extra, "loaded": loaded, "final": training_state(sharded, engine)}


def save_failing_on_rank_1(path: str, rank: int) -> dict:
    """A first save, then one whose writer fails on rank 1 after writing its shards: what each rank raised,
    what is left at ``path`` and what loads from it."""
    sharded, engine = start(0, "fp32")
    train(sharded, engine, data()[:1])
    distributed.save_sharded(path, sharded, engine, {"step": 1})
    saved = training_state(sharded, engine)
    train(sharded, engine, data()[1:2])
    written = FileSystemWriter.write_data

    def fails(self, plan, planner):
        written(self, plan, planner).wait()
        raise OSError(28, "No space left on device")

    if rank == 1:
        FileSystemWriter.write_data = fails
    error = None
    try:
        distributed.save_sharded(path, sharded, engine, {"step": 2})
    except CheckpointError as raised:
        error = str(raised)
    FileSystemWriter.write_data = written
    extra = distributed.load_sharded(path, sharded, engine)
    return {"error": error, "extra": extra, "saved": saved, "loaded": training_state(sharded, engine)}
