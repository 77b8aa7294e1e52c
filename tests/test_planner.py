import json
import math
from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.demo.model import GPT
from lightning_zero_offload.engine import OffloadEngine, OffloadOptions
from lightning_zero_offload.planner import Machine, check_host_memory, measure_machine, plan, presets, probes
from lightning_zero_offload.planner.cli import main
from lightning_zero_offload.planner.model import LayoutSummary, ModelShape, host_memory
from lightning_zero_offload.planner.preflight import SKIP_CHECK_ENV
from lightning_zero_offload.planner.validate import compare

GPU_BOX = presets.machine("server (2 sockets, 8ch DDR4-3200 each)", "H100 SXM (PCIe 5)")
CPU_BOX = Machine(
    host_bandwidth_gbs=20.0, cpu_cores=2, host_memory_gb=24.0, device_tflops=0.05, h2d_gbs=10.0, d2h_gbs=10.0,
    device_type="cpu",
)  # fmt: skip


def host_tensor_bytes(root: object) -> int:
    """Bytes of every distinct CPU storage reachable from the engine's own objects (what it really holds)."""
    storages: dict[int, int] = {}
    seen: set[int] = set()

    def visit(obj: object) -> None:
        if id(obj) in seen or isinstance(obj, torch.optim.Optimizer):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" and obj.numel():
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, list | tuple):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)
        elif type(obj).__module__.startswith("lightning_zero_offload") and hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                visit(item)

    visit(root)
    return sum(storages.values())


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_memory_is_what_the_engine_allocates(delayed, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.ReLU(), torch.nn.Linear(200, 70))
    options = OffloadOptions(bucket_size_mb=0.1, cpu_threads=1, cpu_step="delayed" if delayed else "sync")
    engine = OffloadEngine(torch.optim.AdamW(model.parameters()), torch.device("cpu"), dtype, options)
    try:
        predicted = host_memory(
            LayoutSummary.of(engine.layout),
            dtype,
            "delayed" if delayed else "sync",
            1,
            "cpu",
            sum(p.numel() for p in model.parameters()),
        )
        # gradients (the device's buckets; in place, autograd's own) appear with the first backward
        later = ("device_grad_buckets", "autograd_grads")
        expected = sum(n for name, n in predicted.per_rank.items() if name not in later)
        assert ("autograd_grads" in predicted.per_rank) == engine.in_place
        assert host_tensor_bytes(engine) == expected
        assert len(engine.layout.buckets) > 1
    finally:
        engine.close()


def test_state_is_16_bytes_per_param_spread_over_the_ranks():
    p = plan(7_000_000_000, devices=8, num_nodes=2, machine=GPU_BOX)
    sync, delayed = p.host["sync"], p.host["delayed"]
    state = sum(sync.per_rank[k] for k in ("master", "exp_avg", "exp_avg_sq", "grad"))
    assert state == pytest.approx(16 * 7e9 / 16, rel=1e-3)  # 16 ranks, 16 B each
    assert sync.per_node == 8 * sum(sync.per_rank.values())
    assert delayed.per_rank["grad_second"] == sync.per_rank["grad"]
    assert delayed.per_rank["next_params"] == pytest.approx(2 * 7e9 / 16, rel=1e-3)
    assert p.device_bytes["params"] == pytest.approx(2 * 7e9, rel=1e-3)  # ZeRO-2: every device holds all params
    assert sync.checkpoint_full_per_rank == 12 * 7_000_000_000


def test_a_module_on_the_meta_device_is_counted_without_memory():
    with torch.device("meta"):
        model = GPT(n_layer=24, n_embd=2048, block_size=1024)  # 1.2B params: would need ~5 GB in fp32
    model.head.weight.requires_grad_(False)
    shape = ModelShape.of(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape.params == trainable
    assert shape.linear_shapes[(2048, 8192)] == 24 and shape.linear_shapes[(8192, 2048)] == 24
    assert plan(model, batch_size=2, seq_len=1024, machine=GPU_BOX).params == trainable


def test_table4_arithmetic_one_billion_params_at_127_gbs_take_0_22_s():
    host = Machine(
        host_bandwidth_gbs=1e9 * 28 / 0.22 / 1e9, cpu_cores=32, host_memory_gb=512, device_tflops=100, h2d_gbs=25,
        d2h_gbs=25, call_overhead_s=0.0,
    )  # fmt: skip
    assert host.host_bandwidth_gbs == pytest.approx(127.3, abs=0.1)
    assert plan(1_000_000_000, machine=host).steps["sync"].cpu_step == pytest.approx(0.22, rel=1e-6)


def test_schedules_overlap_only_on_an_accelerator():
    gpu = plan(1_000_000_000, batch_size=8, seq_len=1024, machine=GPU_BOX).steps
    assert gpu["delayed"].total < gpu["speculative"].total < gpu["sync"].total
    for step in gpu.values():
        assert step.total == pytest.approx(step.forward_backward + step.exposed)
        assert step.exposed < step.transfer + step.cpu_step + step.copy_back
    cpu = plan(10_000_000, batch_size=1, seq_len=64, machine=CPU_BOX).steps
    assert cpu["sync"].total == cpu["speculative"].total == cpu["delayed"].total
    assert cpu["sync"].exposed == pytest.approx(cpu["sync"].transfer + cpu["sync"].cpu_step + cpu["sync"].copy_back)


def test_bound_by_follows_the_slowest_resource():
    slow_host = presets.machine("workstation (1 socket, 2ch DDR5)", "H100 SXM (PCIe 5)")
    assert plan(1_000_000_000, batch_size=1, seq_len=512, machine=slow_host).steps["sync"].bound_by == (
        "host memory bandwidth"
    )
    busy_device = plan(1_000_000_000, batch_size=64, seq_len=2048, machine=GPU_BOX).steps["sync"]
    assert busy_device.bound_by == "device compute"


def test_recommendation():
    p = plan(7_000_000_000, batch_size=4, seq_len=2048, devices=8, machine=GPU_BOX)
    r = p.recommended
    # 200 GB/s over 8 ranks = 25 GB/s each; one thread pulls 12 GB/s, so 2 threads (of the 16 per rank)
    assert r["cpu_threads"] == 2
    assert r["cpu_step"] in ("sync", "speculative") and r["bucket_size_mb"] > 0
    assert r["delayed_speedup"] >= 1.0
    assert "recommended: cpu_step=" in str(p)
    assert plan(10_000_000, seq_len=64, machine=CPU_BOX).recommended["cpu_step"] == "sync"  # nothing to overlap


def test_bad_arguments_name_the_option():
    with pytest.raises(ValueError, match="precision"):
        plan(10, precision="fp8", machine=GPU_BOX)
    with pytest.raises(ValueError, match="batch_size"):
        plan(10, batch_size=0, machine=GPU_BOX)
    with pytest.raises(ValueError, match="requires_grad"):
        plan(torch.nn.Linear(2, 2).requires_grad_(False), machine=GPU_BOX)
    with pytest.raises(KeyError, match="unknown host"):
        presets.machine("laptop", "H100 SXM (PCIe 5)")


def test_measure_machine_gives_sane_rates():
    m = measure_machine("cpu", threads=1, tokens=64, linear_shapes={(64, 256): 2})
    for rate in (m.host_bandwidth_gbs, m.device_tflops, m.h2d_gbs, m.d2h_gbs, m.adam_efficiency):
        assert math.isfinite(rate) and rate > 0
    assert 0.2 < m.adam_efficiency < 3  # the kernel runs near the Adam-shaped probe's bandwidth
    assert m.host_memory_gb > 0 and m.cpu_cores >= 1 and m.device_type == "cpu"


def test_predictions_match_the_engine_on_this_machine():
    """Three sizes, probes and steps interleaved; a generous bound here (the 25% figures come from
    benchmarks/planner_accuracy.py on a quiet machine: docs/benchmarks.md)."""
    sizes = {"2x448": (2, 448), "2x512": (2, 512), "3x512": (3, 512)}
    result = compare(
        {name: partial(GPT, n_layer=n, n_embd=d, block_size=32) for name, (n, d) in sizes.items()},
        batch_size=2,
        seq_len=32,
        n_layer={name: n for name, (n, _) in sizes.items()},
        precision="32-true",
        rounds=2,
        steps=2,
    )
    for name, c in result.items():
        assert 0.5 < c.ratio("cpu_step") < 2.0, (name, c)
        assert 0.5 < c.ratio("total") < 2.0, (name, c)


# -- pre-flight --------------------------------------------------------------------------------


def test_preflight_fails_with_the_numbers_and_the_fix(monkeypatch):
    monkeypatch.setattr(probes, "host_memory_available", lambda: 2 * 10**9)
    monkeypatch.delenv(SKIP_CHECK_ENV, raising=False)
    with torch.device("meta"):
        model = torch.nn.Linear(20_000, 10_000)  # 200M params: 3.2 GB of optimizer state
    with pytest.raises(MemoryError) as info:
        check_host_memory(model, OffloadOptions(), torch.bfloat16, 2, 2, torch.device("cuda"))
    message = str(info.value)
    assert "3.20 GB" in message and "2.00 GB is available" in message and "200.0M trainable params" in message
    assert "more nodes" in message and 'checkpoint_format="sharded"' in message and SKIP_CHECK_ENV in message
    check_host_memory(model, OffloadOptions(), torch.bfloat16, 4, 1, torch.device("cuda"))  # 4 nodes: fits
    monkeypatch.setenv(SKIP_CHECK_ENV, "1")
    check_host_memory(model, OffloadOptions(), torch.bfloat16, 2, 2, torch.device("cuda"))


def test_strategy_refuses_before_the_engine_allocates(monkeypatch, tmp_path):
    monkeypatch.setattr(probes, "host_memory_available", lambda: 1000)
    monkeypatch.delenv(SKIP_CHECK_ENV, raising=False)

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the memory check")

    monkeypatch.setattr("lightning_zero_offload.strategy.OffloadEngine", no_engine)
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(), accelerator="cpu", devices=1, max_steps=1, default_root_dir=tmp_path,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(MemoryError, match="only 0.00 GB is available"):
        trainer.fit(BoringModel())


# -- command line ------------------------------------------------------------------------------


def test_cli_with_presets(capsys):
    main(["--params", "1.3e9", "--batch-size", "4", "--seq-len", "1024", "--host", "Grace (GH200, LPDDR5X)"]
         + ["--device", "GH200 (NVLink-C2C)"])  # fmt: skip
    out = capsys.readouterr().out
    assert "1300.0M trainable params" in out and "recommended: cpu_step=" in out and "GH200" in out
    main(["--model", "lightning_zero_offload.demo.GPT", "--model-args", '{"n_layer": 2}', "--json"]
         + ["--host", "Grace (GH200, LPDDR5X)", "--device", "GH200 (NVLink-C2C)", "--h2d-gbs", "1"])  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == sum(p.numel() for p in GPT(n_layer=2).parameters())
    assert data["machine"]["h2d_gbs"] == 1.0


def test_cli_errors():
    with pytest.raises(SystemExit, match="go together"):
        main(["--params", "10", "--host", "Grace (GH200, LPDDR5X)"])
