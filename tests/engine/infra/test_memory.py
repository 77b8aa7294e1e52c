"""Host buffers, pinning (with a stand-in driver on the CPU), staging copies and the memory ledger."""

import gc
import sys
import threading
from collections import deque
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import CPU, batches, loss_fn, make_net, options, two_groups

from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine import engine as engine_module
from lightning_zero_offload.engine.infra import memory
from lightning_zero_offload.engine.infra.ledger import COLLECTIVE, HOST, HOST_PINNED, MemoryLedger

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from memory_probe import mappings, transparent_huge_pages  # noqa: E402  (the readers benchmarks/huge_pages.py uses)


class StandInDriver:
    """``torch.cuda.cudart()`` stand-in: registers (or refuses) host memory and remembers what it holds."""

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.registered: set[int] = set()
        self.flags: list[int] = []

    def cudaHostRegister(self, pointer, nbytes, flags):
        self.flags.append(flags)
        if self.status == 0:
            self.registered.add(pointer)
        return self.status

    def cudaHostUnregister(self, pointer):
        self.registered.remove(pointer)
        return 0


@pytest.fixture
def driver(monkeypatch):
    stand_in = StandInDriver()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: stand_in)
    return stand_in


def test_pinning_registers_the_exact_size_and_unregisters_when_freed(driver):
    ledger = MemoryLedger()
    tensor = memory.host_empty(1000, torch.float32, pin=True, ledger=ledger)
    view = tensor[10:20]
    assert memory.is_pinned_here(view) and len(driver.registered) == 1
    assert ledger.bytes(HOST_PINNED) == 4000 and ledger.bytes(HOST) == 0
    del tensor
    gc.collect()
    assert driver.registered  # the view still uses the memory
    del view
    gc.collect()
    assert not driver.registered


@pytest.mark.parametrize("failure", ["status", "no driver"])
def test_a_refused_pin_falls_back_to_pageable_memory_with_a_warning(monkeypatch, failure):
    if failure == "status":
        monkeypatch.setattr(torch.cuda, "cudart", lambda: StandInDriver(status=2))
    else:

        def no_driver():
            raise RuntimeError("Torch not compiled with CUDA enabled")

        monkeypatch.setattr(torch.cuda, "cudart", no_driver)
    ledger = MemoryLedger()
    with pytest.warns(RuntimeWarning, match="pageable memory"):
        tensor = memory.host_zeros(256, torch.bfloat16, pin=True, ledger=ledger)
    assert tensor.shape == (256,) and not memory.is_pinned_here(tensor)
    assert ledger.bytes(HOST) == 512 and ledger.bytes(HOST_PINNED) == 0


def test_pageable_sources_reach_the_target_through_pinned_staging(driver):
    stager = memory.HostToDevice(CPU, 8, torch.float32, pin=True)
    target = torch.zeros(20)
    pinned = memory.host_empty(8, torch.float32, pin=True).copy_(torch.arange(8.0))
    stager.copy(target[:8], pinned)  # already pinned: copied directly
    assert stager.staged_copies == 0 and stager.staging_buffers == []
    for start, end in ((8, 11), (11, 15), (15, 20)):  # pageable: staged, through two pinned buffers in turn
        source = torch.arange(float(start), float(end))
        stager.copy(target[start:end], source)
        source.fill_(-1)  # the caller may reuse its memory at once
    assert stager.staged_copies == 3
    assert torch.equal(target, torch.arange(20.0))
    staging = stager.staging_buffers
    assert len(staging) == 2 and all(memory.is_pinned_here(b) for b in staging)


def reachable_storages(root) -> dict[int, int]:
    """Bytes of every distinct tensor storage reachable from the engine's own objects (not the user's
    optimizer or parameters), found by walking attributes: what the ledger must add up to."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, (list, tuple, deque)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith("lightning_zero_offload.engine") and hasattr(obj, "__dict__"):
            stack.extend(v for k, v in vars(obj).items() if k not in ("optimizer", "params", "layout"))
    return found


@pytest.mark.parametrize("dpu", [False, True])
def test_memory_report_accounts_for_every_buffer_the_engine_holds(dpu):
    net = make_net()
    engine = OffloadEngine(
        two_groups(net),
        CPU,
        torch.bfloat16,
        options(cpu_step="delayed", dpu_warmup_steps=1) if dpu else options(cpu_step="sync"),
    )
    for batch in batches(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(net, batch).backward()
        engine.step()
    report = engine.memory_report()
    held = sum(reachable_storages(engine).values())
    assert report["host_total_bytes"] + report["device_total_bytes"] == held
    n = report["params"]
    # fp32 master, moments, gradient; DPU adds the second gradient buffer and the bf16 next parameters
    assert report["host_state_bytes"] == (16 + (4 + 2 if dpu else 0)) * n
    assert report["device_param_bytes"] == 2 * n


def test_32_true_and_dpu_pin_only_bucket_sized_buffers(driver, monkeypatch):
    """The fp32 master (32-true) and DPU's next parameters stay pageable; what is pinned is a few buckets."""
    # Pinning as on a CUDA machine: resolve() asks for it only for CUDA devices, can_pin() only where CUDA runs.
    monkeypatch.setattr(engine_module, "can_pin", lambda device: True)
    resolve = engine_module.resolve
    monkeypatch.setattr(engine_module, "resolve", lambda *a, **k: replace(resolve(*a, **k), pin_memory=True))

    def train(dtype: torch.dtype, dpu: bool) -> OffloadEngine:
        net = make_net()
        engine = OffloadEngine(
            two_groups(net),
            CPU,
            dtype,
            options(cpu_step="delayed", dpu_warmup_steps=1) if dpu else options(cpu_step="sync"),
        )
        for batch in batches(3):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
                loss_fn(net, batch).backward()
            engine.step()
        return engine

    results = []
    for dtype, dpu in ((torch.float32, False), (torch.bfloat16, True)):
        engine = train(dtype, dpu)
        engine.sync()
        report = engine.memory_report()
        max_shard = max(b.shard_numel for b in engine.layout.buckets)
        assert not memory.is_pinned_here(engine.master.host)
        assert 0 < report["host_pinned_bytes"] <= 6 * max_shard * 4 < report["host_state_bytes"]
        assert engine.publisher.h2d.staged_copies > 0  # the pageable master / next parameters went through staging
        results.append(engine.master_params())
    # and the results are the ones an unpinned run gets
    monkeypatch.undo()
    for (dtype, dpu), pinned in zip(((torch.float32, False), (torch.bfloat16, True)), results):
        assert all(torch.equal(a, b) for a, b in zip(pinned, train(dtype, dpu).master_params()))


def test_ledger_counts_transients_at_their_largest():
    ledger = MemoryLedger()
    for numel in (10, 30, 20):
        memory.device_empty(numel, torch.float32, CPU, COLLECTIVE, ledger)
    memory.device_empty(5, torch.float32, CPU, "gradient buckets", ledger)
    memory.device_empty(5, torch.float32, CPU, "gradient buckets", ledger)
    report = ledger.report(params=1)
    assert report["device_collective_bytes"] == 120
    assert report["device_grad_buffers_peak"] == 2 and report["device_grad_buffer_bytes"] == 20
    assert report["device_total_bytes"] == 160


class ErrorKeepingDriver(StandInDriver):
    """Like the CUDA runtime, a failed call is kept as the thread's last error until cudaGetLastError."""

    last_error = 0

    def cudaHostRegister(self, pointer, nbytes, flags):
        status = super().cudaHostRegister(pointer, nbytes, flags)
        if status:
            self.last_error = status
        return status

    def cudaGetLastError(self):
        error, self.last_error = self.last_error, 0
        return error


def test_a_refused_pin_clears_the_error_it_leaves_for_the_next_kernel_launch(monkeypatch):
    """Otherwise torch's check after the next kernel launch reports the refused pin as that kernel's error."""
    driver = ErrorKeepingDriver(status=712)  # cudaErrorHostMemoryAlreadyRegistered
    monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
    with pytest.warns(RuntimeWarning, match="pageable memory"):
        tensor = memory.host_empty(64, torch.float32, pin=True)
    assert not memory.is_pinned_here(tensor)
    assert driver.last_error == 0


class RefusingUnregister(ErrorKeepingDriver):
    """Unregistering fails, as when the CUDA runtime is shutting down at exit."""

    def cudaHostUnregister(self, pointer):
        super().cudaHostUnregister(pointer)
        self.last_error = 4  # cudaErrorCudartUnloading
        return 4


def test_pins_are_portable_and_a_failed_unpin_clears_its_error(monkeypatch):
    """Pinned for every device's context (a rank's engine need not be the thread's current device), and a failed
    unregister, like a failed register, leaves no error for the next kernel launch to report."""
    driver = RefusingUnregister()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
    tensor = memory.host_empty(64, torch.float32, pin=True)
    assert driver.flags == [1] and driver.registered  # cudaHostRegisterPortable
    del tensor
    gc.collect()
    assert not driver.registered and driver.last_error == 0


def test_a_failed_pool_wakes_a_waiting_acquire_and_refuses_later_ones():
    """The thread that would return the buffer failed: the waiter gets its error instead of waiting forever."""
    pool = memory.BufferPool(1, 8, torch.float32, pin=False)
    pool.acquire()  # held by the thread that is about to fail
    outcome = []

    def wait_for_buffer() -> None:
        try:
            pool.acquire()
        except RuntimeError as error:
            outcome.append(error)

    waiter = threading.Thread(target=wait_for_buffer, daemon=True)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # blocked: no buffer is free
    failure = RuntimeError("accumulate failed")
    pool.fail(failure)
    waiter.join(10)
    assert not waiter.is_alive() and outcome == [failure]
    pool.fail(RuntimeError("a later one"))  # the first error is the one reported
    for _ in range(2):
        with pytest.raises(RuntimeError, match="accumulate failed"):
            pool.acquire()


@pytest.mark.skipif(transparent_huge_pages() == "absent", reason="no transparent huge pages here")
def test_model_sized_host_buffers_ask_for_huge_pages_and_get_them():
    tensor = memory.host_zeros(16 << 20, torch.float32, pin=False)  # 64 MiB: mmap'd, several whole 2 MiB pages
    middle = tensor.data_ptr() + tensor.numel() * 2
    (mapping,) = mappings(middle, middle + 1)
    assert "hg" in mapping["VmFlags"].split()  # MADV_HUGEPAGE on the buffer's whole 2 MiB pages
    if transparent_huge_pages() != "never":
        assert int(mapping["AnonHugePages"].split()[0]) >= 32 << 10  # kB: at least half of it, faulted in huge
    assert torch.count_nonzero(tensor) == 0


def test_huge_page_advice_skips_buffers_without_a_whole_huge_page():
    assert not memory.advise_huge_pages(torch.empty(1000))
