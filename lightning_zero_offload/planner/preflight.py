"""Pre-flight: before the engine allocates, check that this node's ranks fit in host RAM.

Runs in the strategy's setup, before any rank builds its engine (all ranks compute the same numbers
from the same node, so they fail together). ``LZO_SKIP_MEMORY_CHECK=1`` skips it.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
from torch import nn

from lightning_zero_offload.engine.options import OffloadOptions, resolve_auto
from lightning_zero_offload.planner import probes
from lightning_zero_offload.planner.model import STATE_BYTES_PER_PARAM, ModelShape, _gb, _layout, host_memory

SKIP_CHECK_ENV = "LZO_SKIP_MEMORY_CHECK"


def check_host_memory(
    model: nn.Module,
    options: OffloadOptions,
    param_dtype: torch.dtype,
    world_size: int,
    local_world_size: int,
    device: torch.device,
) -> None:
    """Pre-flight: fail before the engine allocates if this node's ranks would not fit in host RAM.

    Set ``LZO_SKIP_MEMORY_CHECK=1`` to skip it (e.g. when swap or memory freed later will cover it).
    """
    if os.environ.get(SKIP_CHECK_ENV, "") not in ("", "0"):
        return
    shape = ModelShape.of(model)
    layout = _layout(shape, options.bucket_size_mb, param_dtype, world_size)
    with warnings.catch_warnings():  # the engine warns about its settings itself, once
        warnings.simplefilter("ignore")
        schedule = resolve_auto(options, device, local_world_size).cpu_step
    need = host_memory(layout, param_dtype, schedule, local_world_size, device.type, shape.params)
    available = probes.host_memory_available()
    if need.per_node <= available:
        return
    per_node_state = STATE_BYTES_PER_PARAM * shape.params * local_world_size / world_size
    nodes_needed = math.ceil(need.per_node * (world_size // local_world_size) / (0.9 * available))
    fixes = [
        f"more nodes: the optimizer state per node is 16 B x params / nodes, so about {nodes_needed} nodes fit",
        "fewer trainable parameters (freeze some: frozen parameters get no CPU state) or a smaller model",
    ]
    if schedule == "delayed":
        fixes.append(f"a schedule other than delayed saves {_gb(need.per_rank['grad_second'] * local_world_size)}")
    if options.checkpoint_format == "full":
        fixes.append(
            f'checkpoint_format="sharded": a full checkpoint also gathers '
            f"{_gb(need.checkpoint_full_per_rank * local_world_size)} on this node while it is saved"
        )
    raise MemoryError(
        f"zero_offload needs about {_gb(need.per_node)} of host RAM on this node ({local_world_size} rank(s) x "
        f"{_gb(sum(need.per_rank.values()))}; of which optimizer state {_gb(per_node_state)} for "
        f"{shape.params / 1e6:.1f}M trainable params over {world_size} rank(s)), but only {_gb(available)} is "
        f"available (MemAvailable). Options: " + "; ".join(fixes) + f". Set {SKIP_CHECK_ENV}=1 to skip this check."
    )
