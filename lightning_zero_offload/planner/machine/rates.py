"""The machine a plan is for: the rates a step's time depends on, and how they are measured here."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lightning_zero_offload import kernels
from lightning_zero_offload.planner.machine import probes

GB = 1e9


def format_gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB"


@dataclass
class Machine:
    """The rates the step time depends on. Bandwidths in GB/s (1e9 B/s), throughput in TFLOP/s.

    ``host_bandwidth_gbs`` is the Adam-shaped bandwidth of one node with all its cores;
    ``host_bandwidth_per_thread_gbs`` what one thread reaches (None: any thread count reaches the
    node's share). ``device_tflops`` is the achieved forward+backward throughput of training, not
    the datasheet peak. ``interconnect_gbs`` (per rank, for reduce-scatter/all-gather) None: collectives
    are left out of the step time.
    """

    host_bandwidth_gbs: float
    cpu_cores: int
    host_memory_gb: float
    device_tflops: float
    h2d_gbs: float
    d2h_gbs: float
    device_type: str = "cuda"
    device_memory_gb: float | None = None
    host_bandwidth_per_thread_gbs: float | None = None
    adam_efficiency: float = 1.0  # the kernel's rate / (bandwidth / 28 B): 1.0 at the roofline
    # The bf16-state kernel's rate / (bandwidth / 14 B); None: the fp32 kernel's efficiency at half the bytes.
    adam_bf16_state_efficiency: float | None = None
    call_overhead_s: float = 30e-6  # Python + thread wake-up per kernel call (once per bucket)
    link_latency_s: float = 20e-6  # per bucket copy (launch, event); a collective's latency comes on top
    interconnect_gbs: float | None = None
    torch_threads: int | None = None  # torch's CPU threads (a CPU device's forward/backward); None: all cores
    name: str = "custom"

    def rank_bandwidth(self, threads: int, ranks_per_node: int) -> float:
        """Bytes/s one rank's CPU step gets: its share of the node, or what its threads can pull."""
        share = self.host_bandwidth_gbs * GB / ranks_per_node
        if self.host_bandwidth_per_thread_gbs is None:
            return share
        return min(share, threads * self.host_bandwidth_per_thread_gbs * GB)


def measure_machine(
    device: str | torch.device | None = None,
    threads: int | None = None,
    tokens: int = 2048,
    linear_shapes: dict[tuple[int, int], int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Machine:
    """Measure this machine's rates with the short probes of :mod:`lightning_zero_offload.planner.machine.probes`.

    ``threads``: the thread count the node bandwidth is measured with (default: all cores).
    ``tokens``, ``linear_shapes``, ``dtype``: the matmul probe runs forward+backward of each ``(in, out)`` shape once
    for ``tokens`` rows and weighs it by its count (:func:`plan` passes the model's own layers: small
    matmuls run far below the peak, and how far depends on the shape). Default: one 1024 x 4096 layer.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cores = kernels.usable_cores()
    threads = threads or cores
    per_thread = probes.host_bandwidth(1)
    node = probes.host_bandwidth(threads) if threads > 1 else per_thread
    device_memory = None
    if device.type == "cuda":
        device_memory = torch.cuda.get_device_properties(device).total_memory / GB
    return Machine(
        host_bandwidth_gbs=node / GB,
        host_bandwidth_per_thread_gbs=per_thread / GB,
        cpu_cores=cores,
        host_memory_gb=probes.host_memory_available() / GB,
        device_tflops=probes.linear_layers_rate(device, dtype, tokens, linear_shapes or {(1024, 4096): 1}) / 1e12,
        h2d_gbs=probes.copy_bandwidth(device, to_device=True) / GB,
        d2h_gbs=probes.copy_bandwidth(device, to_device=False) / GB,
        device_type=device.type,
        device_memory_gb=device_memory,
        adam_efficiency=probes.adam_rate(threads) * probes.ADAM_BYTES_PER_PARAM / node,
        adam_bf16_state_efficiency=probes.adam_bf16_state_rate(threads) * probes.ADAM_BYTES_PER_PARAM / 2 / node,
        call_overhead_s=probes.call_overhead(threads),
        torch_threads=torch.get_num_threads(),
        name=f"measured here ({device.type}, {threads} threads)",
    )


def with_rates(machine: Machine, **changes: float) -> Machine:
    """A copy of ``machine`` with some rates replaced (e.g. a measured host with another GPU's numbers)."""
    return replace(machine, **changes)
