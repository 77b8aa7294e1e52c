"""Parameters offloaded too: this project's CPU step over a model whose parameters torch FSDP2 keeps on the
host (``offload_params=True``). Plain torch, no Lightning imports.

- ``placement``: which modules become FSDP2 units, wrapping them (or checking the user's), then the root;
- ``materialize``: a model built on the meta device materialized unit by unit, never whole anywhere;
- ``pretrained``: Hugging Face safetensors (one file or an index) or a state-dict file streamed into the shards;
- ``heap``: glibc's retained heap capped (it would add ~11 B/param of host memory), or handed back;
- ``shards``: the CPU state per sharded parameter (moments, step count, snapshot) and its Adam step;
- ``speculation``: the shard steps started during backward from FSDP2's post-accumulate-grad hook;
- ``engine``: :class:`ParamOffloadEngine`, the step (norm, clip, skip, the kernels) and ``zero_grad``;
- ``full_state``: the engine's state in the full checkpoint format (the ZeRO-2 mode's);
- ``sharded_state``: the engine's state in the sharded format (``torch.distributed.checkpoint``, by name).
"""

from lightning_zero_offload.engine.offload_params.engine import ParamOffloadEngine

__all__ = ["ParamOffloadEngine"]
