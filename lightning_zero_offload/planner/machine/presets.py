"""Typical hosts and accelerators, to plan for machines other than this one.

Numbers are round figures from public datasheets, not measurements; what a given machine reaches can
differ by tens of percent, so measure it (``measure_machine()`` on that machine) before buying.
- Host bandwidth: what an Adam-shaped loop sustains (STREAM-like, about 65-75% of the DRAM peak).
- Accelerator throughput: dense bf16 datasheet peak x ``MFU`` (0.45: what well-tuned transformer
  training reaches; forward+backward is never at the matmul peak).
- Links: achieved one-direction copy bandwidth of pinned memory (PCIe gen4 x16 ~25 GB/s, gen5 x16 ~50
  GB/s, NVLink-C2C ~400 GB/s).
"""

from __future__ import annotations

from lightning_zero_offload.planner.machine.rates import Machine

MFU = 0.45

# name: (Adam-shaped bandwidth GB/s, one thread's GB/s, cores, host RAM GB)
HOSTS: dict[str, tuple[float, float, int, float]] = {
    "workstation (1 socket, 2ch DDR5)": (60.0, 20.0, 16, 128.0),
    "server (1 socket, 8ch DDR4-3200)": (130.0, 12.0, 64, 512.0),
    "server (2 sockets, 8ch DDR4-3200 each)": (200.0, 12.0, 128, 1024.0),
    "Grace (GH200, LPDDR5X)": (400.0, 25.0, 72, 480.0),
    # The host of an 8 x H100 node (DGX H100: 2 x 56-core Xeon 8480C, 2 TB; plan it with --devices 8).
    "DGX H100 (2 sockets, 8ch DDR5-4800 each, 2 TB)": (430.0, 12.0, 112, 2048.0),
}

# name: (dense bf16 peak TFLOP/s, host link GB/s, device memory GB)
DEVICES: dict[str, tuple[float, float, float]] = {
    "RTX 4090 (PCIe 4)": (165.0, 25.0, 24.0),
    "A100 80GB SXM (PCIe 4)": (312.0, 25.0, 80.0),
    "H100 SXM (PCIe 5)": (989.0, 50.0, 80.0),
    "H200 SXM (PCIe 5)": (989.0, 50.0, 141.0),
    "GH200 (NVLink-C2C)": (989.0, 400.0, 96.0),
}


def machine(host: str, device: str, interconnect_gbs: float | None = None) -> Machine:
    """A :class:`Machine` from a host and a device of the tables above (names as listed)."""
    if host not in HOSTS:
        raise KeyError(f"unknown host {host!r}; choose one of {sorted(HOSTS)}")
    if device not in DEVICES:
        raise KeyError(f"unknown device {device!r}; choose one of {sorted(DEVICES)}")
    bandwidth, per_thread, cores, ram = HOSTS[host]
    peak, link, device_memory = DEVICES[device]
    return Machine(
        host_bandwidth_gbs=bandwidth,
        host_bandwidth_per_thread_gbs=per_thread,
        cpu_cores=cores,
        host_memory_gb=ram,
        device_tflops=peak * MFU,
        h2d_gbs=link,
        d2h_gbs=link,
        device_memory_gb=device_memory,
        interconnect_gbs=interconnect_gbs,
        name=f"{host} + {device}",
    )
