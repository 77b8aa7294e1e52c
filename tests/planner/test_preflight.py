import re
from dataclasses import replace

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from planner_helpers import layers

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.engine import OffloadOptions
from lightning_zero_offload.planner import (
    check_host_memory,
)
from lightning_zero_offload.planner.machine import probes
from lightning_zero_offload.planner.preflight import SKIP_CHECK_ENV


def fake_limit(monkeypatch, available: int, source: str = "MemAvailable") -> None:
    monkeypatch.setattr(probes, "host_memory_limit", lambda *args, **kwargs: (available, source))
    monkeypatch.delenv(SKIP_CHECK_ENV, raising=False)


def test_preflight_fails_with_the_numbers_and_the_fix(monkeypatch):
    fake_limit(monkeypatch, 2 * 10**9)
    with torch.device("meta"):
        model = torch.nn.Linear(20_000, 10_000)  # 200M params: 3.2 GB of optimizer state, nothing resident
    with pytest.raises(MemoryError) as info:
        check_host_memory(model, OffloadOptions(), torch.bfloat16, 2, 2, torch.device("cuda"))
    message = str(info.value)
    assert "3.20 GB" in message and "only 2.00 GB is available (MemAvailable" in message
    assert "200.0M trainable params" in message
    assert "more nodes" in message and 'checkpoint_format="sharded"' in message and SKIP_CHECK_ENV in message
    check_host_memory(model, OffloadOptions(checkpoint_format="sharded"), torch.bfloat16, 4, 1, torch.device("cuda"))
    monkeypatch.setenv(SKIP_CHECK_ENV, "1")
    check_host_memory(model, OffloadOptions(), torch.bfloat16, 2, 2, torch.device("cuda"))


def test_preflight_checks_the_checkpoint_save_and_the_setup_peak(monkeypatch):
    """The planner's verdict: steady state alone fits, the full save or the module next to the engine does not."""
    model = layers()  # 1M params, built on the host in fp32: 4 MB resident now
    params = 100 * (100 * 100 + 100)
    steady = 16 * params  # sync on a GPU, one rank (plus a few staging buffers)
    fake_limit(monkeypatch, int(steady * 1.05))  # steady fits (and the module frees 4 MB at setup)
    small = {"cpu_step": "sync", "bucket_size_mb": 0.1}  # staging buffers of 0.4 MB
    # Two ranks on this node: each holds half the state and gathers the whole of it to save a full file.
    with pytest.raises(MemoryError, match='saving a "full" checkpoint'):
        check_host_memory(model, OffloadOptions(**small), torch.bfloat16, 2, 2, torch.device("cuda"))
    check_host_memory(
        model, OffloadOptions(**small, checkpoint_format="sharded"), torch.bfloat16, 2, 2, torch.device("cuda")
    )
    check_host_memory(model, OffloadOptions(**small), torch.bfloat16, 1, 1, torch.device("cuda"))  # one rank: no copy
    with torch.device("meta"):
        meta = layers()
    fake_limit(monkeypatch, int(steady * 0.9))  # below the engine's own first buffers: setup fails
    with pytest.raises(MemoryError, match="host RAM, setup"):
        check_host_memory(
            meta, OffloadOptions(**small, checkpoint_format="sharded"), torch.bfloat16, 1, 1,
            torch.device("cuda"),
        )  # fmt: skip


def test_preflight_counts_delayed_and_snapshot_buffers(monkeypatch):
    with torch.device("meta"):
        model = layers()
    params = 100 * (100 * 100 + 100)
    fake_limit(monkeypatch, int(20 * params))  # sync's 16 B/param fits, not 16 + 4 + 2 (delayed) or + 12 (snapshot)
    sharded = {"checkpoint_format": "sharded", "bucket_size_mb": 0.1}
    check_host_memory(model, OffloadOptions(cpu_step="sync", **sharded), torch.bfloat16, 1, 1, torch.device("cuda"))
    with pytest.raises(MemoryError, match="delayed's second gradient buffer"):
        check_host_memory(
            model, OffloadOptions(cpu_step="delayed", **sharded), torch.bfloat16, 1, 1, torch.device("cuda")
        )
    with pytest.raises(MemoryError, match='cpu_step="sync" saves .* speculation_rollback="undo" also saves'):
        check_host_memory(
            model, OffloadOptions(cpu_step="speculative", **sharded), torch.float16, 1, 1, torch.device("cuda")
        )


def test_preflight_names_bf16_state_when_only_it_fits(monkeypatch):
    with torch.device("meta"):  # 200.2M params in 10M tensors: 3.2 GB of fp32 state with the sync step, 1.6 of bf16
        model = torch.nn.Sequential(*[torch.nn.Linear(1000, 10_000) for _ in range(20)])
    one_rank = (torch.bfloat16, 1, 1, torch.device("cuda"))
    sync = OffloadOptions(cpu_step="sync")
    fake_limit(monkeypatch, 2 * 10**9)
    with pytest.raises(MemoryError) as info:
        check_host_memory(model, sync, *one_rank)
    message = str(info.value)
    assert "optimizer state 3.20 GB" in message
    assert 'cpu_state="bf16"' in message and "8 B/param of state instead of 16" in message
    assert re.search(r"needs about 1\.6\d GB instead of 3\.2\d GB", message)  # + staging buffers of a bucket
    check_host_memory(model, replace(sync, cpu_state="bf16"), *one_rank)  # which is so
    # The speculative step: 30 B/param (fp32 state and its snapshot) -> 14 (bf16 state and its snapshot).
    fake_limit(monkeypatch, 3 * 10**9)
    with pytest.raises(MemoryError, match="14 B/param of state instead of 30"):
        check_host_memory(model, OffloadOptions(cpu_step="speculative"), *one_rank)
    with pytest.raises(MemoryError) as info:  # fp16 parameters need fp32 state: not offered
        check_host_memory(model, sync, torch.float16, 1, 1, torch.device("cuda"))
    assert "cpu_state" not in str(info.value)
    fake_limit(monkeypatch, 10**9)  # bf16 state does not fit either: not offered
    with pytest.raises(MemoryError) as info:
        check_host_memory(model, sync, *one_rank)
    assert "cpu_state" not in str(info.value)
    with pytest.raises(MemoryError, match="optimizer state 1.60 GB") as info:  # bf16 state's own figures
        check_host_memory(model, replace(sync, cpu_state="bf16"), *one_rank)
    assert "8 B x params / nodes" in str(info.value)


def test_strategy_refuses_before_the_engine_allocates(monkeypatch, tmp_path):
    fake_limit(monkeypatch, 100)

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the memory check")

    monkeypatch.setattr("lightning_zero_offload.core.session.OffloadEngine", no_engine)
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(), accelerator="cpu", devices=1, max_steps=1, default_root_dir=tmp_path,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(MemoryError, match="only 0.00 GB is available"):
        trainer.fit(BoringModel())


def test_preflight_names_the_zero2_device_share_with_which_the_host_holds_the_rest(monkeypatch):
    """On an accelerator the last buckets' state can stay on the device: the error names the smallest share (in
    twentieths) with which the host fits, and its device bytes. A sharded save copies one of the share's master and
    moments at a time to the host (4 of its 16 B/param), so the save's peak falls by 12 B/param of share: it sets
    the share here."""
    model, options, cuda = _host_short_of_a_share(monkeypatch)
    share = _named_share(model, OffloadOptions(**options), cuda)
    assert 0.3 <= share <= 0.5
    check_host_memory(model, OffloadOptions(**options, device_share=share), torch.bfloat16, 1, 1, cuda)
    with pytest.raises(MemoryError) as info:  # delayed takes no share: not named
        check_host_memory(model, OffloadOptions(**{**options, "cpu_step": "delayed"}), torch.bfloat16, 1, 1, cuda)
    assert "the last buckets keep" not in str(info.value)


def test_auto_starts_with_the_share_the_host_needs_where_the_device_has_room(monkeypatch):
    """device_share="auto" takes that share by itself (the engine starts with it) where the device holds its state
    and the weights still to move there within 80% of its free memory; where it does not, the error names it."""
    model, options, cuda = _host_short_of_a_share(monkeypatch)
    share = _named_share(model, OffloadOptions(**options), cuda)
    auto = OffloadOptions(**options, device_share="auto")
    monkeypatch.setattr(probes, "device_memory_free", lambda device: 10**9)
    start = check_host_memory(model, auto, torch.bfloat16, 1, 1, cuda)
    assert start is not None and start.share == share and start.params > 0.2 * PARAMS
    assert start.why.startswith("auto: ") and "the host holds the rest only with their state on" in start.why
    state = 4 * 4 * start.params  # fp32 master, moments, gradient: what the share keeps on the device
    weights = 2 * PARAMS  # bf16, to move there (built on the meta device)
    monkeypatch.setattr(probes, "device_memory_free", lambda device: int((state + weights) / 0.8))
    with pytest.raises(MemoryError) as info:
        check_host_memory(model, auto, torch.bfloat16, 1, 1, cuda)
    assert f"device_share={share:g}: the last buckets" in str(info.value)
    assert 'device_share="auto" takes it by itself where the device has room, here only' in str(info.value)
    step_scratch = state // 4  # the device step's scratch (a few % here)
    monkeypatch.setattr(probes, "device_memory_free", lambda device: int((state + step_scratch + weights) / 0.8))
    assert check_host_memory(model, auto, torch.bfloat16, 1, 1, cuda).share == share
    with pytest.raises(MemoryError) as info:  # a CPU device's memory is the host's: no share helps
        check_host_memory(model, auto, torch.bfloat16, 1, 1, torch.device("cpu"))
    assert "the last buckets keep" not in str(info.value)


PARAMS = 100 * (100 * 100 + 100)  # planner_helpers.layers()


def _host_short_of_a_share(monkeypatch) -> tuple[torch.nn.Module, dict, torch.device]:
    with torch.device("meta"):
        model = layers()
    fake_limit(monkeypatch, int(13 * PARAMS))  # the sharded save needs about 16.4 - 12 x share B/param
    return model, {"checkpoint_format": "sharded", "bucket_size_mb": 0.1, "cpu_step": "sync"}, torch.device("cuda")


def _named_share(model: torch.nn.Module, options: OffloadOptions, device: torch.device) -> float:
    with pytest.raises(MemoryError) as info:
        check_host_memory(model, options, torch.bfloat16, 1, 1, device)
    found = re.search(r"device_share=([0-9.]+): the last buckets .* GB of device memory per rank", str(info.value))
    assert found is not None, str(info.value)
    return float(found.group(1))
