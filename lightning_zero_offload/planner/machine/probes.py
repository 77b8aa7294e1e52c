"""Short measurements of the quantities the planner's model needs, taken on the machine it runs on.

Each probe repeats a small piece of the real work (the engine's own kernels, copies and a matmul) a few
times and keeps the median, so one descheduled repetition on a shared machine does not decide the result.
The set is kept short (its time on one machine: docs/benchmarks.md, "Planner accuracy").
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_zero_offload import kernels

ADAM_BYTES_PER_PARAM = 28  # the fused offload step: read p, g, m, v and write p, m, v (fp32 each)


def median_seconds(fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls, after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


CGROUP_ROOT_ENV = "LZO_CGROUP_ROOT"  # where the cgroup filesystem is mounted (tests point it at a fake tree)
DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"
UNLIMITED_V1 = 2**62  # cgroup v1 writes "no limit" as 2**63 - 1 rounded down to a page


def meminfo_available() -> int:
    """Bytes the kernel estimates new allocations can get without swapping (MemAvailable), without psutil."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * size


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None for "max" (no limit), a missing or unreadable file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _reclaimable(stat: Path, key: str) -> int:
    """Inactive page cache, which the kernel drops before it OOM-kills (what the kubelet subtracts too)."""
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and cgroup v1 memory-controller path, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _walk_up(base: Path, path: str) -> list[Path]:
    """``base/path`` and its ancestors up to ``base``, from the deepest one that exists (inside a container
    the path is often the host's, of which only the container's own part is mounted)."""
    start = base / path.strip("/")
    while start != base and not start.is_dir():
        start = start.parent
    levels = [start]
    while levels[-1] != base and base in levels[-1].parents:
        levels.append(levels[-1].parent)
    return levels


def cgroup_memory_limits(
    cgroup_root: str | Path | None = None, proc_cgroup: str | Path = "/proc/self/cgroup"
) -> list[tuple[int, str]]:
    """``(bytes left, where)`` for each cgroup level that limits this process's memory (v2 and v1).

    Bytes left = the limit minus what is charged to that cgroup (less its inactive page cache). Every
    ancestor's limit applies too, so each level with a limit is listed; none when nothing is limited.
    ``cgroup_root`` (default ``$LZO_CGROUP_ROOT`` or /sys/fs/cgroup) and ``proc_cgroup`` are parameters
    so that tests can use a fake tree.
    """
    root = Path(cgroup_root or os.environ.get(CGROUP_ROOT_ENV) or DEFAULT_CGROUP_ROOT)
    v2, v1 = _cgroup_paths(Path(proc_cgroup))
    found = []
    if v2 is not None:
        for level in _walk_up(root, v2):
            limit = _read_int(level / "memory.max")
            usage = _read_int(level / "memory.current")
            if limit is not None and usage is not None:
                used = max(0, usage - _reclaimable(level / "memory.stat", "inactive_file"))
                found.append((max(0, limit - used), f"cgroup v2 memory.max of {level} ({limit / 2**20:.0f} MiB)"))
    if v1 is not None and (root / "memory").is_dir():
        for level in _walk_up(root / "memory", v1):
            limit = _read_int(level / "memory.limit_in_bytes")
            usage = _read_int(level / "memory.usage_in_bytes")
            if limit is not None and usage is not None and limit < UNLIMITED_V1:
                used = max(0, usage - _reclaimable(level / "memory.stat", "total_inactive_file"))
                found.append(
                    (max(0, limit - used), f"cgroup v1 memory.limit_in_bytes of {level} ({limit / 2**20:.0f} MiB)")
                )
    return found


def host_memory_limit(
    cgroup_root: str | Path | None = None, proc_cgroup: str | Path = "/proc/self/cgroup"
) -> tuple[int, str]:
    """Bytes of host memory this process can still allocate, and what sets that bound: the smallest of
    MemAvailable and every cgroup limit minus its usage (containers, SLURM, Kubernetes limit a job below
    what /proc/meminfo shows, and exceeding the limit gets the process OOM-killed)."""
    return min([(meminfo_available(), "MemAvailable"), *cgroup_memory_limits(cgroup_root, proc_cgroup)])


def host_memory_available() -> int:
    """Bytes of host memory available to new allocations: :func:`host_memory_limit` without the source."""
    return host_memory_limit()[0]


def device_memory_free(device: torch.device) -> int:
    """Bytes free on the accelerator ``device`` now (the driver's count: other processes' use is taken off)."""
    return torch.accelerator.get_memory_info(device)[0]


ADAM_ARGS = kernels.AdamArgs(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)


def host_bandwidth(threads: int, numel: int = 2**23, repeats: int = 5) -> float:
    """Bytes/s of the Adam memory pattern (read 4 fp32 arrays, write 3) with ``threads`` threads: the fp32
    Adam step, which streams at the memory's rate where the instruction set keeps up (docs/kernels.md)."""
    p, g, m, v = (torch.zeros(numel) for _ in range(4))

    def step() -> None:
        kernels.adam_step(p, g, m, v, hparams=ADAM_ARGS, step=1, num_threads=threads)

    return ADAM_BYTES_PER_PARAM * numel / median_seconds(step, repeats)


def adam_rate(threads: int, numel: int = 2**23, repeats: int = 5) -> float:
    """Params/s of the engine's CPU step: fp32 master and moments, bf16 gradient in, bf16 copy out."""
    p, m, v = (torch.zeros(numel) for _ in range(3))
    g, out = torch.zeros(numel, dtype=torch.bfloat16), torch.empty(numel, dtype=torch.bfloat16)

    def step() -> None:
        kernels.adam_step(p, g, m, v, hparams=ADAM_ARGS, step=1, param_out=out, num_threads=threads)

    return numel / median_seconds(step, repeats)


def adam_bf16_state_rate(threads: int, numel: int = 2**23, repeats: int = 5) -> float:
    """Params/s of the CPU step on bf16 state (``cpu_state="bf16"``): bf16 master, moments and gradient.

    Measured on its own rather than derived from :func:`adam_rate` at half the bytes: the stochastic
    rounding adds work per element, so where the fp32 step is bound by memory this one may be bound by
    compute (docs/kernels.md).
    """
    p, g, m, v = (torch.zeros(numel, dtype=torch.bfloat16) for _ in range(4))

    def step() -> None:
        kernels.adam_step_bf16_state(p, g, m, v, hparams=ADAM_ARGS, step=1, seed=0, num_threads=threads)

    return numel / median_seconds(step, repeats)


def call_overhead(threads: int, repeats: int = 20) -> float:
    """Seconds one tiny kernel call costs from Python (argument checks, thread wake-up): per-bucket cost."""
    p, m, v = (torch.zeros(64) for _ in range(3))
    g = torch.zeros(64, dtype=torch.bfloat16)
    return median_seconds(
        lambda: kernels.adam_step(p, g, m, v, hparams=ADAM_ARGS, step=1, num_threads=threads), repeats
    )


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    return lambda: torch.accelerator.synchronize(device)


def copy_bandwidth(device: torch.device, to_device: bool, nbytes: int = 2**26, repeats: int = 5) -> float:
    """Bytes/s of a bf16 copy between a (pinned, where possible) host buffer and ``device``."""
    numel = nbytes // 2
    host = torch.empty(numel, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    on_device = torch.empty(numel, dtype=torch.bfloat16, device=device)
    source, target = (host, on_device) if to_device else (on_device, host)
    seconds = median_seconds(lambda: target.copy_(source, non_blocking=True), repeats, _sync(device))
    return numel * 2 / seconds


def matmul_rate(
    device: torch.device, dtype: torch.dtype, tokens: int, in_features: int, out_features: int, repeats: int = 3
) -> float:
    """FLOP/s of forward+backward of one linear layer of this shape (6 x tokens x in x out FLOPs).

    Shaped like the model's own layers, so it sees the same efficiency as training does at that size.
    """
    # A generator of its own: measuring must leave the user's random state as it was.
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, in_features, device=device, dtype=dtype, generator=generator, requires_grad=True)
    w = torch.randn(out_features, in_features, device=device, dtype=dtype, generator=generator, requires_grad=True)

    def fwd_bwd() -> None:
        y = x @ w.t()
        x.grad = w.grad = None
        y.backward(torch.ones_like(y))

    return 6 * tokens * in_features * out_features / median_seconds(fwd_bwd, repeats, _sync(device))


def linear_layers_rate(
    device: torch.device, dtype: torch.dtype, tokens: int, shapes: dict[tuple[int, int], int], max_flops: float = 0.0
) -> float:
    """FLOP/s of forward+backward over a model's linear layers: each ``(in, out)`` shape timed once, weighted
    by its count. Rows are capped so that one probe stays short (``max_flops``; default 2 GFLOP on a
    CPU, 2 TFLOP on an accelerator): the rate at that many rows stands in for the full batch.
    """
    cap = max_flops or (2e9 if device.type == "cpu" else 2e12)
    flops = seconds = 0.0
    for (in_features, out_features), count in shapes.items():
        rows = max(64, min(tokens, int(cap / (6 * in_features * out_features))))
        rate = matmul_rate(device, dtype, rows, in_features, out_features)
        layer_flops = count * 6 * tokens * in_features * out_features
        flops += layer_flops
        seconds += layer_flops / rate
    return flops / seconds
