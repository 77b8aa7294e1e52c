"""When nothing fits: the smallest single changes that would, each checked by evaluating it."""

from __future__ import annotations

from dataclasses import replace

import torch

from lightning_zero_offload.engine.options import STATE_DTYPES, with_compact_state
from lightning_zero_offload.planner.machine import GB, format_gb
from lightning_zero_offload.planner.memory import CHECKPOINT_FORMATS, state_bytes_per_param
from lightning_zero_offload.planner.shape import ModelShape, scaled
from lightning_zero_offload.planner.verdicts import EXACT_SCHEDULES, SETUP, SETUP_WHOLE, Evaluation, evaluate


def fixes_for(shape: ModelShape, args: tuple, memory: Evaluation, asked: str) -> list[str]:
    """The smallest single changes with which an exact schedule fits, each checked by recomputing. A change
    that fits only with the other checkpoint format says so."""
    dtype, machine, devices, num_nodes, options, batch, seq_len, n_layer, checkpointing = args

    def fitting_format(m: Evaluation) -> str | None:
        for checkpoint_format in (asked, *(f for f in CHECKPOINT_FORMATS if f != asked)):
            if any(m.verdicts[f"{s}/{checkpoint_format}"].fits for s in EXACT_SCHEDULES):
                return checkpoint_format
        return None

    def also(checkpoint_format: str | None) -> str:
        return "" if checkpoint_format == asked else f' and checkpoint_format="{checkpoint_format}"'

    fixes = []
    per_param = state_bytes_per_param(STATE_DTYPES[options.cpu_state])
    if fitting_format(memory) not in (None, asked):
        fixes.append(f'checkpoint_format="{fitting_format(memory)}" (a save then gathers no copy of the state)')
    failed = {c.name.split(",")[0].split(" per ")[0] for v in memory.verdicts.values() for c in v.failed}
    device_fails = "device memory" in failed
    setup_fails = any(c.name in (SETUP, SETUP_WHOLE) for v in memory.verdicts.values() for c in v.failed)
    if setup_fails:  # named even when something else fails too: this peak has one fix
        blockwise = evaluate(replace(shape, configure_model=True), *args)
        found = fitting_format(blockwise)
        before, after = memory.host["sync"].setup_per_node, blockwise.host["sync"].setup_per_node
        still = [f"{c.name.split(' (')[0]} {format_gb(c.need)}" for c in blockwise.verdicts[f"sync/{asked}"].failed]
        fixes.append(
            "build the model in configure_model (or under trainer.init_module(empty_init=True)): it is then "
            f"materialized block by block, never whole; host RAM at setup {format_gb(before)} -> "
            f"{format_gb(after)} per node" + (also(found) if found else f" (still too much: {'; '.join(still)})")
        )
    if "host RAM" in failed and options.cpu_state == "fp32" and dtype != torch.float16:  # fp16 needs fp32 state
        try:
            compact = evaluate(shape, dtype, machine, devices, num_nodes, with_compact_state(options), *args[5:])
        except ValueError:  # a combination bf16 state refuses (dpu_weight_prediction): not a fix to offer
            compact = None
        found = fitting_format(compact) if compact is not None else None
        if found:

            def peak(m: Evaluation) -> int:  # the sync step's highest host RAM need (training, setup, save)
                return max(c.need for c in m.verdicts[f"sync/{found}"].checks if c.name.startswith("host"))

            fixes.append(
                f'cpu_state="bf16": host RAM per node at its peak {format_gb(peak(memory))} -> '
                f"{format_gb(peak(compact))} with the sync step ({per_param} -> 8 B/param of state: master, moments "
                "and gradient buffer in bf16, stochastically rounded, docs/compact-state.md)" + also(found)
            )
    if dtype != torch.float32 and shape.built_bytes > 2 * (shape.params + shape.frozen):
        bf16 = replace(shape, module_bytes=2 * (shape.params + shape.frozen))
        found = fitting_format(evaluate(bf16, *args))
        if found:
            fixes.append(
                f"build the module in {str(dtype).split('.')[-1]} (module.to(torch.{str(dtype).split('.')[-1]}) "
                f"before fit): {format_gb(bf16.built_bytes)} instead of {format_gb(shape.built_bytes)} on the host "
                "until setup; the master weights and Adam state keep cpu_state's dtype, initialised from the rounded "
                "values" + also(found)
            )
    if n_layer and not checkpointing and device_fails:
        again = evaluate(shape, dtype, machine, devices, num_nodes, options, batch, seq_len, n_layer, True)
        found = fitting_format(again)
        if found:
            fixes.append(
                f"activation checkpointing: activations {format_gb(memory.activations.bytes)} -> "
                f"{format_gb(again.activations.bytes)} per GPU" + also(found)
            )
    if n_layer and device_fails and batch > 1:
        for b in range(batch - 1, 0, -1):
            smaller = evaluate(shape, dtype, machine, devices, num_nodes, options, b, seq_len, n_layer, checkpointing)
            found = fitting_format(smaller)
            if found:
                fixes.append(f"a micro-batch of {b} (accumulate_grad_batches keeps the tokens per step)" + also(found))
                break
    # Both modes shard the CPU state over nodes; neither the device's (ZeRO-2 holds every parameter on every GPU,
    # offload_params a block in flight whole).
    if failed & {"host RAM"} and not device_fails:
        for nodes in range(num_nodes + 1, 1025):
            more = evaluate(shape, dtype, machine, devices, nodes, options, batch, seq_len, n_layer, checkpointing)
            found = fitting_format(more)
            if found:
                blockwise = shape.configure_model and options.offload_params
                whole = "" if blockwise else "; the module as built is not sharded"
                fixes.append(
                    f"{nodes} nodes (num_nodes={nodes}): the CPU state per node is {per_param} B x params / nodes"
                    + whole
                    + also(found)
                )
                break
            if more.host["sync"].transient_model_per_rank * devices >= machine.host_memory_gb * GB:
                break  # the module as built alone does not fit: more nodes never help

    low, high = 0, shape.params
    while high - low > max(1, shape.params // 1000):
        mid = (low + high) // 2
        if fitting_format(evaluate(scaled(shape, mid, n_layer), *args)):
            low = mid
        else:
            high = mid
    if low > 0:
        found = fitting_format(evaluate(scaled(shape, low, n_layer), *args))
        fixes.append(
            f"a model of at most {low / 1e9:.2f}B parameters" + also(found) + " (freezing parameters removes their "
            f"{per_param} B/param of CPU state, but not their memory while the module is built nor on the device)"
        )
    return fixes
