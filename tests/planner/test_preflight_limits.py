"""The pre-flight's memory limit: cgroup v1/v2 limits (containers, SLURM, Kubernetes) next to MemAvailable,
read from a fake cgroup tree; and a refused pre-flight reaching the user whatever teardown does."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.planner.machine import probes
from lightning_zero_offload.planner.preflight import SKIP_CHECK_ENV

MIB = 2**20


def write(path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("_", ".", 1)).write_text(text + "\n")


def test_v2_takes_the_tightest_limit_walking_up_the_hierarchy(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "job", memory_max=str(1024 * MIB), memory_current=str(100 * MIB))
    write(root / "job" / "step", memory_max="max", memory_current=str(50 * MIB))  # "max": no limit here
    write(root / "job" / "step" / "task", memory_max=str(2048 * MIB), memory_current=str(40 * MIB))
    proc = tmp_path / "cgroup.proc"
    proc.write_text("0::/job/step/task\n")
    limits = probes.cgroup_memory_limits(root, proc)
    assert sorted(n for n, _ in limits) == [924 * MIB, 2008 * MIB]
    available, source = probes.host_memory_limit(root, proc)
    assert available == 924 * MIB and "memory.max" in source and str(root / "job") in source


def test_v2_subtracts_inactive_page_cache(tmp_path):
    write(tmp_path, memory_max=str(600 * MIB), memory_current=str(500 * MIB))
    (tmp_path / "memory.stat").write_text(f"anon {100 * MIB}\ninactive_file {300 * MIB}\n")
    proc = tmp_path / "proc"
    proc.write_text("0::/\n")
    assert [n for n, _ in probes.cgroup_memory_limits(tmp_path, proc)] == [400 * MIB]  # 600 - (500 - 300)


def test_v1_memory_controller_and_its_unlimited_value(tmp_path):
    proc = tmp_path / "proc"
    proc.write_text("9:name=systemd:/\n4:memory:/docker/abc\n0::/\n")  # the host's path: not mounted here
    write(tmp_path / "memory", memory_limit_in_bytes=str(600 * MIB), memory_usage_in_bytes=str(100 * MIB))
    assert [n for n, _ in probes.cgroup_memory_limits(tmp_path, proc)] == [500 * MIB]
    assert "memory.limit_in_bytes" in probes.host_memory_limit(tmp_path, proc)[1]
    write(tmp_path / "memory", memory_limit_in_bytes=str(2**63 - 4096), memory_usage_in_bytes=str(100 * MIB))
    assert probes.cgroup_memory_limits(tmp_path, proc) == []
    assert probes.host_memory_limit(tmp_path, proc)[1] == "MemAvailable"


def test_no_cgroup_files_means_meminfo(tmp_path):
    proc = tmp_path / "proc"
    proc.write_text("0::/\n")
    assert probes.cgroup_memory_limits(tmp_path, proc) == []
    assert probes.host_memory_limit(tmp_path, tmp_path / "missing")[1] == "MemAvailable"


class MetaModel(BoringModel):
    """50M parameters on the meta device (800 MB of CPU state): nothing allocated until the engine."""

    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.layer = torch.nn.Sequential(
                *[torch.nn.Linear(2048, 2048) for _ in range(12)], torch.nn.Linear(2048, 2)
            )

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def fit(tmp_path) -> None:
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(), accelerator="cpu", devices=1, max_steps=1, default_root_dir=tmp_path,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(MetaModel())


def test_a_cgroup_limit_refuses_what_meminfo_would_let_through(tmp_path, monkeypatch):
    """600 MiB container limit, 50M params: /proc/meminfo alone would pass and the process be OOM-killed."""
    root = tmp_path / "cgroup"
    write(root, memory_max=str(600 * MIB), memory_current=str(200 * MIB))
    monkeypatch.setenv(probes.CGROUP_ROOT_ENV, str(root))
    monkeypatch.delenv(SKIP_CHECK_ENV, raising=False)
    assert probes.meminfo_available() > 2 * 10**9  # what the check read before
    with pytest.raises(MemoryError, match=r"cgroup v2 memory.max of .* \(600 MiB\)"):
        fit(tmp_path)


def test_the_pre_flight_error_survives_teardown_of_a_meta_module(tmp_path, monkeypatch):
    """Teardown moves the module to the CPU, which a meta module cannot do; the MemoryError must still be
    what the user sees (it was replaced by "Cannot copy out of meta tensor")."""
    monkeypatch.setattr(probes, "host_memory_limit", lambda *args, **kwargs: (10 * MIB, "a tiny fake limit"))
    monkeypatch.delenv(SKIP_CHECK_ENV, raising=False)
    with pytest.raises(MemoryError, match="a tiny fake limit"):
        fit(tmp_path)
