"""Machines, models and plans shared by the planner's tests."""

import torch

from lightning_zero_offload.planner import Machine, plan, with_rates
from lightning_zero_offload.planner.machine import presets

GPU_BOX = presets.machine("server (2 sockets, 8ch DDR4-3200 each)", "H100 SXM (PCIe 5)")


CPU_BOX = Machine(
    host_bandwidth_gbs=20.0, cpu_cores=2, host_memory_gb=24.0, device_tflops=0.05, h2d_gbs=10.0, d2h_gbs=10.0,
    device_type="cpu",
)  # fmt: skip


def layers() -> torch.nn.Module:
    """1M parameters in small tensors: with 0.1 MB buckets the staging buffers are negligible."""
    return torch.nn.Sequential(*[torch.nn.Linear(100, 100) for _ in range(100)])


# The H200 box of docs/planning.md: one 141 GB H200, 128 GB of host RAM, 16 cores.
H200_BOX = with_rates(
    presets.machine("server (1 socket, 8ch DDR4-3200)", "H200 SXM (PCIe 5)"), host_memory_gb=128, cpu_cores=16
)


LLAMA = {"1.3B": (1.3e9, 24, 2048), "7B": (7e9, 32, 4096), "13B": (13e9, 40, 5120), "70B": (70e9, 80, 8192)}


def h200(size: str, **kwargs):
    params, layers, width = LLAMA[size]
    args = {"batch_size": 4, "seq_len": 2048, "n_layer": layers, "hidden": width, "machine": H200_BOX, **kwargs}
    return plan(int(params), **args)
