"""Parameters offloaded too: this project's CPU step over a model whose parameters torch FSDP2 keeps on the
host (``offload_params=True``). Plain torch, no Lightning imports.

- ``shards``: the CPU state per sharded parameter (moments, step count, snapshot);
- ``speculation``: the shard steps started during backward from FSDP2's post-accumulate-grad hook;
- ``engine``: :class:`ParamOffloadEngine`, the step (norm, clip, skip, the kernels) and ``zero_grad``.
"""

from lightning_zero_offload.engine.offload_params.engine import ParamOffloadEngine

__all__ = ["ParamOffloadEngine"]
