"""The CUDA-only paths: pinned buffers, the side stream and its events, non_blocking copies, worker-thread
devices, device timing, bf16/fp16 on the device, NCCL. Skipped without CUDA (the CPU tests in
tests/engine/ run the same selection logic with stand-in events). Run by benchmarks/gpu_check.sh.
"""

import contextlib

import pytest
import torch
from engine_helpers import batches, loss_fn, options
from torch import nn
from workers.streaming import two_gpu_checks

from lightning_zero_offload.engine import LossScalerConfig, OffloadEngine
from lightning_zero_offload.engine.infra import memory
from lightning_zero_offload.engine.infra.ledger import HOST_PINNED, MemoryLedger
from lightning_zero_offload.engine.step import streamer as grads
from lightning_zero_offload.engine.step.streamer import DEVICE_BUFFER_CAP
from lightning_zero_offload.testing.ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda", 0)


def deep_net(seed: int = 0, width: int = 256, depth: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(16, width), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def train(net: nn.Module, dtype: torch.dtype, steps: int = 4, device: torch.device = CUDA, **kwargs) -> OffloadEngine:
    kwargs.setdefault("bucket_size_mb", 0.25)
    engine = OffloadEngine(torch.optim.AdamW(net.parameters(), lr=1e-3), device, dtype, options(**kwargs))
    for x, y in batches(steps):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(net, (x.to(device), y.to(device)))
        engine.scale_loss(loss).backward()
        engine.step()
    engine.sync()
    torch.cuda.synchronize()
    return engine


@contextlib.contextmanager
def slow_side_stream(cycles: int = 2_000_000):
    """Delay every transfer on the side stream (a few ms each), as a slow bus or a busy NCCL would."""
    original = grads.on_stream

    @contextlib.contextmanager
    def delayed(stream):
        with original(stream) as entered:
            torch.cuda._sleep(cycles)
            yield entered

    grads.on_stream = delayed
    try:
        yield
    finally:
        grads.on_stream = original


def test_pinned_buffers_are_page_locked_at_their_exact_size():
    ledger = MemoryLedger()
    tensor = memory.host_empty(3 * 2**20 + 5, torch.bfloat16, pin=True, ledger=ledger)
    assert tensor.is_pinned() and memory.is_pinned_here(tensor[7:])
    assert ledger.bytes(HOST_PINNED) == tensor.numel() * 2


def test_fp32_on_the_device_matches_torch_adamw():
    ref_net, net = deep_net().to(CUDA), deep_net()
    ref_opt = torch.optim.AdamW(ref_net.parameters(), lr=1e-3)
    for x, y in batches(4):
        loss_fn(ref_net, (x.to(CUDA), y.to(CUDA))).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    engine = train(net, torch.float32)
    for p_ref, master in zip(ref_net.parameters(), engine.master_params()):
        torch.testing.assert_close(master, p_ref.detach().cpu(), rtol=1e-5, atol=1e-6)
    assert engine.publisher.h2d.staged_copies > 0  # the pageable fp32 master went through pinned staging


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_results_are_bitwise_the_same_across_overlap_pinning_buckets_and_delays(dtype):
    reference = train(deep_net(), dtype).master_params()
    variants = [{"overlap": False}, {"pin_memory": False}, {"bucket_size_mb": 0.01}, {"bucket_size_mb": 25.0}]
    for kwargs in variants:
        assert all(torch.equal(a, b) for a, b in zip(reference, train(deep_net(), dtype, **kwargs).master_params())), (
            kwargs
        )
    with slow_side_stream():
        delayed = train(deep_net(), dtype)
    assert all(torch.equal(a, b) for a, b in zip(reference, delayed.master_params()))


def test_slow_transfers_never_make_backward_wait_for_the_latest_one():
    with slow_side_stream():
        engine = train(deep_net(), torch.bfloat16, bucket_size_mb=0.13)
    pool = engine.grads.device_buffers
    assert len(engine.layout.buckets) > DEVICE_BUFFER_CAP
    assert pool.allocated == DEVICE_BUFFER_CAP and pool.waits
    assert all(waited != latest for waited, latest in pool.waits)
    # the delay shows up as transfer time not hidden behind backward, measured on the device
    assert 0 < engine.last.transfer_wait_s <= engine.last.transfer_s


def test_transfers_overlap_backward_on_a_fast_path():
    engine = train(deep_net(width=1024), torch.bfloat16, steps=6, bucket_size_mb=1.0)
    assert engine.grads.take_device_buffer_peak() <= 2
    assert 0 <= engine.last.transfer_wait_s <= engine.last.transfer_s and engine.last.transfer_s > 0


def test_worker_threads_run_on_the_engine_device():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    engine = train(deep_net(), torch.bfloat16, steps=1, device=device)
    assert engine.grads.worker.submit(torch.cuda.current_device).result() == device.index
    assert engine.update_worker.submit(torch.cuda.current_device).result() == device.index


def test_fp16_overflow_on_the_device_skips_the_step():
    net = deep_net()
    engine = OffloadEngine(
        torch.optim.AdamW(net.parameters()),
        CUDA,
        torch.float16,
        options(loss_scaler=LossScalerConfig(init_scale=2.0**10, hysteresis=1)),
    )
    before = [t.clone() for t in engine.master_params()]
    x = torch.randn(4, 16, device=CUDA)
    with torch.autocast("cuda", dtype=torch.float16):
        engine.scale_loss(net(x).float().sum() * float("inf")).backward()
    stats = engine.step()
    assert stats.skipped and engine.loss_scale == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(before, engine.master_params()))


def test_memory_report_matches_the_caching_allocator():
    train(deep_net(width=512), torch.bfloat16, steps=1).close()  # cuBLAS workspaces etc. exist before the baseline
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(CUDA)
    net = deep_net(width=512)
    engine = OffloadEngine(torch.optim.AdamW(net.parameters()), CUDA, torch.bfloat16, options(bucket_size_mb=0.5))
    for x, y in batches(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_fn(net, (x.to(CUDA), y.to(CUDA))).backward()
        engine.step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(CUDA) - baseline
    report = engine.memory_report()
    persistent = report["device_total_bytes"] - report["device_collective_bytes"]
    blocks = 2 + report["device_grad_buffers_peak"]  # the allocator rounds each block up to 512 bytes
    assert persistent <= held <= persistent + 512 * blocks
    assert report["host_pinned_bytes"] <= 6 * max(b.shard_numel for b in engine.layout.buckets) * 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for NCCL")
def test_two_gpus_over_nccl(tmp_path):
    fp16, peaks, weights = zip(*run_ranks(two_gpu_checks, 2, tmp_path, timeout=300, backend="nccl"))
    assert fp16 == ((40000.0, False),) * 2  # fp16 sum of 2 x 40000 would overflow without the pre-division
    assert all(max(p[1:]) <= 2 for p in peaks), peaks
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_registering_a_buffer_twice_falls_back_and_the_next_kernel_still_runs():
    """The second cudaHostRegister fails (already registered) and leaves its error as the thread's last
    error: it is cleared, so torch's check after the next kernel launch does not report it."""
    tensor = memory.host_empty(2**20, torch.float32, pin=True)
    assert memory.is_pinned_here(tensor)
    with pytest.warns(RuntimeWarning, match="pageable memory"):
        assert not memory._register_pinned(tensor)
    x = torch.arange(8.0, device=CUDA)
    assert (x * 2).sum().item() == 56.0
    torch.cuda.synchronize()


SANITIZED_RUN = """
import sys, time
sys.path[:0] = [{tests!r}, {cuda_tests!r}]
import torch
from lightning_zero_offload.engine.infra import streams
from lightning_zero_offload.engine.step import streamer as grads
from lightning_zero_offload.engine.step.streamer import DEVICE_BUFFER_CAP
from test_cuda_paths import deep_net, train

# The worker synchronises with each transfer late, so the training thread finds completed transfers
# whose buffers no host wait has ordered yet: only the pool's own stream wait orders their reuse.
grads.wait_event = lambda event: (time.sleep(0.02), streams.wait_event(event))
engine = train(deep_net(), torch.bfloat16, steps=2, bucket_size_mb=0.05)
assert len(engine.layout.buckets) > DEVICE_BUFFER_CAP, len(engine.layout.buckets)
print("sanitized run done")
"""


def test_reused_device_buffers_pass_the_cuda_sanitizer():
    """Under TORCH_CUDA_SANITIZER=1, reusing a gradient buffer whose transfer has completed is ordered by
    a stream wait: no "data race" report (a completed event.query() alone orders nothing for it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    code = SANITIZED_RUN.format(tests=str(tests), cuda_tests=str(tests / "cuda"))
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "sanitized run done" in output, output[-4000:]
    assert "data race" not in output, output[-4000:]
