"""Small checkpoints written and read at one rank, and a save killed at any step: shared by the tests of
tests/checkpoints/."""

import gc
import os
import traceback
from collections.abc import Callable

import torch

from lightning_zero_offload import checkpoints as ckpt
from lightning_zero_offload import convert_checkpoint_to_fp32_state_dict
from lightning_zero_offload.checkpoints import FORMAT_KEY
from lightning_zero_offload.checkpoints import sharded as checkpoint_sharded


def full_checkpoint(value: float) -> dict:
    return {"state_dict": {"w": torch.full((5,), value)}, "optimizer_states": [{"state": {}, "param_groups": []}]}


def save_sharded_one_rank(path, value: float, world: int = 1) -> None:
    """A world-size-``world`` sharded checkpoint of one parameter ``w`` (5 values) in one bucket, saved from
    this process as every rank in turn would (only rank 0's collectives matter with trivial ones)."""
    chunk = -(-5 // world)
    flat = torch.cat([torch.full((5,), value), torch.zeros(chunk * world - 5)])
    meta = full_checkpoint(value)
    meta.pop("state_dict")
    meta[FORMAT_KEY] = {
        "format": "sharded",
        "version": 2,
        "world_size": world,
        "buckets": [{"shard_start": 0, "shard_numel": chunk}],
        "params": [{"keys": ["w"], "shape": [5], "bucket": 0, "offset": 0, "step": 1, "torch_index": 0}],
    }
    assert world == 1, "one process plays rank 0 only"
    shard = {name: flat.clone() for name in checkpoint_sharded.SHARD_KEYS}
    ckpt.save_sharded(path, shard, meta, 0, broadcast=lambda x: x, gather=lambda x: [x])


def save(fmt: str, path, value: float) -> None:
    if fmt == "full":
        ckpt.atomic_save(full_checkpoint(value), path)
    else:
        save_sharded_one_rank(path, value)


def load_w(path) -> torch.Tensor:
    return convert_checkpoint_to_fp32_state_dict(path)["w"]


# Every call that changes the filesystem during a save; a crash is injected before or after each of them.
MUTATIONS = ("replace", "rename", "unlink", "rmdir", "mkdir", "open")


def crash_at(step: int, after: bool, save: Callable[[], None]) -> bool:
    """``save()`` in a forked child that dies (os._exit: no cleanup, like kill -9) at mutation ``step``.

    Returns whether the child reached that step (``False``: the save finished with fewer mutations); a child
    that fails otherwise (an exception, a signal) fails the test.
    """
    gc.freeze()  # the child's collector must not free what the fork copied: torch's threads did not come along
    pid = os.fork()
    if pid == 0:  # the child
        counter = [0]

        def wrap(name):
            real = getattr(os, name)

            def mutation(*args, **kwargs):
                if name == "open" and not (args[1] if len(args) > 1 else kwargs["flags"]) & os.O_CREAT:
                    return real(*args, **kwargs)  # reading is not a step
                counter[0] += 1
                if counter[0] == step and not after:
                    os._exit(9)
                try:
                    return real(*args, **kwargs)
                finally:
                    if counter[0] == step:
                        os._exit(9)

            return mutation

        for name in MUTATIONS:
            setattr(os, name, wrap(name))
        try:
            save()
        except BaseException:  # the child must not go on into the parent's test session
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    gc.unfreeze()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 9), f"the save in the forked child failed otherwise (exit code {code})"
    return code == 9
