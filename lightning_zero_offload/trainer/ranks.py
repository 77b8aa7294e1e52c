"""The Trainer strategy's processes and ranks: DDPStrategy's launching and collectives, without its wrapper.

Lightning's own launchers, ranks, barrier, broadcast and reduce, as in ``DDPStrategy``; the module is
never wrapped in ``DistributedDataParallel`` (the offload engine reduce-scatters gradients itself), and
one process gets no process group at all (no free port, no NCCL init; the dataloader keeps its own
sampler, so a one-GPU run matches ``strategy="auto"`` batch for batch). Subclassing ``DDPStrategy``
instead would not do: Lightning counts every ``DDPStrategy`` as distributed and adds a
``DistributedSampler`` even for one process.
"""

from __future__ import annotations

import atexit
import warnings
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_zero_offload.core import release_process_group
from lightning_zero_offload.trainer.launchers import MultiProcessingLauncher, SubprocessScriptLauncher


class ParallelLikeDDP(ParallelStrategy):
    """A ``ParallelStrategy`` whose processes, ranks and collectives are ``DDPStrategy``'s, minus the wrapper."""

    needs_process_group = False  # at one process too (the parameter-offload mode: FSDP2)

    def __init__(
        self,
        process_group_backend: str | None,
        timeout: timedelta | None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"],
        **parallel_arguments: Any,  # ParallelStrategy's, by name
    ) -> None:
        super().__init__(**parallel_arguments)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """More than one rank: Lightning then adds a DistributedSampler to the dataloaders."""
        return self.num_nodes * self.num_processes > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        if not self.is_distributed:
            if self.needs_process_group and not dist.is_initialized():
                # FSDP2 shards over a process group even at one rank: one of this process alone (no port).
                backend = _get_default_process_group_backend_for_device(self.root_device)
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                atexit.register(release_process_group)
                # Lightning takes any process group for several processes and advises sync_dist=True for
                # epoch-level logs; with one process there is nothing to sync.
                warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True")
            return  # otherwise one process needs no process group (no free port, no NCCL init)
        reset_seed()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        if not dist.is_initialized():
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
            # Lightning does this for NCCL only; a gloo group left to interpreter teardown can abort the
            # process at exit ("terminate called without an active exception").
            atexit.register(release_process_group)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src)
        return container[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)
