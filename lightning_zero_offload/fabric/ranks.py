"""The Fabric strategy's processes and ranks: Fabric's ``DDPStrategy`` without its wrapper.

Launching, ranks, barrier, broadcast and all-reduce are Fabric's DDP machinery (``devices=N`` with
``fabric.launch()``, ``fabric run``, torchrun, SLURM). The module is never wrapped in
``DistributedDataParallel``: the offload engine reduce-scatters gradients itself, and ``fabric.no_backward_sync``
(Fabric's gradient accumulation recipe) is accepted and does nothing (:class:`NoSyncToSkip`). One process gets no
process group at all (no free port, no init).
"""

from __future__ import annotations

import atexit
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch.distributed as dist
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from torch.nn import Module
from typing_extensions import override

from lightning_zero_offload.core import release_process_group


class NoSyncToSkip(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)`` does nothing, at any world size: each backward's gradients leave
    the device as they are made (into the CPU buckets; reduce-scattered there at several ranks, or by FSDP2), as the
    device has no room for a full unsynchronised sum. The step is the same either way; Fabric's warning to remove the
    call, or choose another strategy, would be wrong advice."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


class DDPWithoutWrapper(DDPStrategy):
    """Fabric's ``DDPStrategy`` minus ``DistributedDataParallel``, and minus the process group for one process."""

    needs_process_group = False  # at one process too (the parameter-offload mode: FSDP2)

    def __init__(self, **ddp_arguments: Any) -> None:  # DDPStrategy's, by name
        super().__init__(**ddp_arguments)
        self._backward_sync_control = NoSyncToSkip()

    @override
    def setup_environment(self) -> None:
        if self.num_nodes * self.num_processes > 1:
            super().setup_environment()  # DDP's process group
            # A gloo group left to interpreter teardown can abort the process at exit (see release_process_group).
            atexit.register(release_process_group)
        else:
            self.accelerator.setup_device(self.root_device)
            if self.needs_process_group and not dist.is_initialized():  # FSDP2 shards over a group of one
                backend = _get_default_process_group_backend_for_device(self.root_device)
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                atexit.register(release_process_group)

    @override
    def setup_module(self, module: Module) -> Module:
        module.to(self.root_device)  # no optimizer: evaluation only, the module keeps its dtype
        return module
