import json
import math
import os
import re
import warnings
from dataclasses import replace
from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from planner_ranks import host_tensor_bytes, ledger_at_two_ranks

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.core import make_offload_options
from lightning_zero_offload.demo.model import GPT
from lightning_zero_offload.engine import OffloadEngine, OffloadOptions
from lightning_zero_offload.engine.options import resolve
from lightning_zero_offload.planner import (
    Machine,
    check_host_memory,
    largest_models,
    measure_machine,
    plan,
    with_rates,
)
from lightning_zero_offload.planner.cli import main
from lightning_zero_offload.planner.machine import presets, probes
from lightning_zero_offload.planner.memory import DEVICE_CONTEXT_BYTES, host_memory
from lightning_zero_offload.planner.preflight import SKIP_CHECK_ENV
from lightning_zero_offload.planner.shape import LayoutSummary, ModelShape
from lightning_zero_offload.planner.validate import compare

GPU_BOX = presets.machine("server (2 sockets, 8ch DDR4-3200 each)", "H100 SXM (PCIe 5)")
CPU_BOX = Machine(
    host_bandwidth_gbs=20.0, cpu_cores=2, host_memory_gb=24.0, device_tflops=0.05, h2d_gbs=10.0, d2h_gbs=10.0,
    device_type="cpu",
)  # fmt: skip


@pytest.mark.parametrize("cpu_state", ["fp32", "bf16"])
@pytest.mark.parametrize("schedule", ["sync", "speculative", "delayed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_host_memory_is_what_the_engine_allocates(schedule, dtype, cpu_state):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.ReLU(), torch.nn.Linear(200, 70))
    options = OffloadOptions(bucket_size_mb=0.1, cpu_threads=1, cpu_step=schedule, cpu_state=cpu_state)
    if cpu_state == "bf16" and dtype == torch.float16:  # refused by the engine, so by the planner too
        with pytest.raises(ValueError, match="cpu_state='bf16'"):
            plan(10_000, batch_size=1, seq_len=8, precision="16-mixed", cpu_state="bf16", machine=CPU_BOX)
        return
    engine = OffloadEngine(torch.optim.AdamW(model.parameters()), torch.device("cpu"), dtype, options)
    try:
        predicted = host_memory(
            LayoutSummary.of(engine.layout),
            dtype,
            engine.resolved,
            1,
            "cpu",
            sum(p.numel() for p in model.parameters()),
        )  # speculative in fp16 keeps a snapshot of master and moments ("auto" rollback)
        # gradients (the device's buckets; in place, autograd's own) appear with the first backward
        later = ("device_grad_buckets", "autograd_grads")
        expected = sum(n for name, n in predicted.per_rank.items() if name not in later)
        assert ("autograd_grads" in predicted.per_rank) == engine.in_place
        # exact up to bookkeeping scalars (a few bytes each); the smallest modelled buffer is 1000x larger
        assert expected <= host_tensor_bytes(engine) <= expected + 256
        assert predicted.state_per_rank == engine.memory_report()["host_state_bytes"]  # the ledger, exactly
        assert len(engine.layout.buckets) > 1
    finally:
        engine.close()


# Host state bytes per trainable parameter, one rank (no padding), as the engine's ledger reports them
# (memory_report()["host_state_bytes"] / params, measured with the engine on tiny models): docs/planning.md.
STATE_BYTES = {
    ("bf16-mixed", "fp32"): {"sync": 16, "speculative": 30, "delayed": 22},  # snapshot rollback; copies to publish
    ("bf16-mixed", "bf16"): {"sync": 8, "speculative": 14, "delayed": 10},  # snapshot rollback; the master published
    ("32-true", "fp32"): {"sync": 16, "speculative": 28, "delayed": 20},
    ("32-true", "bf16"): {"sync": 8, "speculative": 14, "delayed": 10},
}


@pytest.mark.parametrize(("precision", "cpu_state"), list(STATE_BYTES))
def test_host_state_bytes_per_parameter_of_each_cpu_state(precision, cpu_state):
    p = plan(2**20, batch_size=1, seq_len=8, precision=precision, cpu_state=cpu_state, machine=GPU_BOX)
    assert {s: p.host[s].state_per_rank / p.params for s in p.host} == STATE_BYTES[precision, cpu_state]
    sync = STATE_BYTES[precision, cpu_state]["sync"]
    assert f"shard with cpu_state={cpu_state!r}: sync {sync}.0 B," in str(p)
    assert p.to_dict()["resolved"]["sync"]["state_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[cpu_state]
    # A full save at several ranks gathers master and moments in the state's dtype (12 or 6 B/param).
    two = plan(2**20, batch_size=1, seq_len=8, devices=2, precision=precision, cpu_state=cpu_state, machine=GPU_BOX)
    assert two.host["sync"].checkpoint_save_per_rank["full"] == {"fp32": 12, "bf16": 6}[cpu_state] * 2**20


@pytest.mark.slow
def test_host_memory_is_what_the_engine_allocates_at_two_ranks(tmp_path):
    from ranks import run_ranks

    for rows in run_ranks(ledger_at_two_ranks, 2, tmp_path, timeout=300):
        assert len(rows) == 15
        for dtype, cpu_state, schedule, planned, ledger, held, really, shard in rows:
            assert planned == ledger, (dtype, cpu_state, schedule)
            assert held <= really <= held + 256, (dtype, cpu_state, schedule)
            per_param = {"fp32": 4, "bf16": 2}[cpu_state]
            assert planned >= 4 * per_param * shard  # master, moments, gradient buffer: half of 16 or 8 B/param


PLANNED_OPTIONS = [
    {},
    {"in_place_on_cpu": False},
    {"in_place_on_cpu": True},
    {"speculation_rollback": "snapshot"},
    {"speculation_rollback": "undo"},
    {"cpu_threads": 1},
    {"cpu_threads": 10_000},
    {"cpu_state": "bf16"},
]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_planner_resolves_options_exactly_as_the_engine(device_type):
    """Over devices, precisions, world sizes and options, each schedule's planned configuration (in place
    or not, rollback, threads, overlap, pinning, notes) is the one the engine resolves for it."""
    cores = len(os.sched_getaffinity(0))
    here = with_rates(CPU_BOX if device_type == "cpu" else GPU_BOX, cpu_cores=cores)
    here = with_rates(here, torch_threads=torch.get_num_threads())  # as measure_machine records them
    compared = built = 0
    for precision, dtype in (("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16), ("32-true", torch.float32)):
        for devices, nodes in ((1, 1), (2, 1), (2, 2)):
            for given in PLANNED_OPTIONS:
                planned_args = dict(batch_size=1, seq_len=8, devices=devices, num_nodes=nodes, precision=precision)
                in_place_refused = given.get("in_place_on_cpu") and not (
                    device_type == "cpu" and dtype == torch.float32 and devices * nodes == 1
                )
                if in_place_refused:  # the sync schedule cannot run in place: refused by both
                    with pytest.raises(ValueError, match="in_place_on_cpu=True needs"):
                        plan(10_000, machine=here, **planned_args, **given)
                    continue
                if given.get("cpu_state") == "bf16" and dtype == torch.float16:  # refused by both
                    with pytest.raises(ValueError, match="fp16 device parameters cannot hold"):
                        plan(10_000, machine=here, **planned_args, **given)
                    with pytest.raises(ValueError, match="fp16 device parameters cannot hold"):
                        resolve(make_offload_options(**given), torch.device(device_type), dtype, devices * nodes)
                    continue
                planned = plan(10_000, machine=here, **planned_args, **given).resolved
                for schedule in ("sync", "speculative", "delayed"):
                    if given.get("in_place_on_cpu") and schedule != "sync":
                        continue  # the engine refuses in_place_on_cpu=True there; the plan shows it without
                    options = make_offload_options(cpu_step=schedule, **given)
                    device = torch.device(device_type)
                    engine_side = resolve(options, device, dtype, devices * nodes, devices)  # as the engine calls it
                    assert planned[schedule] == engine_side, (precision, devices, nodes, given, schedule)
                    compared += 1
                    if devices * nodes == 1 and (device_type == "cpu" or torch.cuda.is_available()):
                        layer = torch.nn.Linear(4, 4)
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")  # the notes, compared above
                            engine = OffloadEngine(torch.optim.AdamW(layer.parameters()), device, dtype, options)
                        engine.close()
                        assert engine.resolved == planned[schedule], (precision, given, schedule)
                        built += 1
    # in place required: runs only on the CPU, fp32, 1 rank; bf16 state: not with fp16 parameters
    assert compared == 9 * 6 * 3 + (device_type == "cpu") + 3 * 2 * 3
    assert built == (3 * 6 * 3 + 1 + 2 * 3 if device_type == "cpu" or torch.cuda.is_available() else 0)


def test_state_is_16_bytes_per_param_spread_over_the_ranks():
    p = plan(7_000_000_000, batch_size=4, seq_len=2048, devices=8, num_nodes=2, machine=GPU_BOX)
    sync, delayed = p.host["sync"], p.host["delayed"]
    state = sum(sync.per_rank[k] for k in ("master", "exp_avg", "exp_avg_sq", "grad"))
    assert state == pytest.approx(16 * 7e9 / 16, rel=1e-3)  # 16 ranks, 16 B each
    assert sync.per_node == 8 * sum(sync.per_rank.values())
    assert delayed.per_rank["grad_second"] == sync.per_rank["grad"]
    assert delayed.per_rank["next_params"] == pytest.approx(2 * 7e9 / 16, rel=1e-3)
    assert p.device_bytes["params"] == pytest.approx(2 * 7e9, rel=1e-3)  # ZeRO-2: every device holds all params
    assert sync.checkpoint_full_per_rank == 12 * 7_000_000_000  # 16 ranks: each gathers the full fp32 state


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
    assert plan(1_000_000_000, batch_size=8, seq_len=2048, machine=host).steps["sync"].cpu_step == pytest.approx(
        0.22, rel=1e-6
    )


def test_the_bf16_state_step_runs_at_its_own_kernel_efficiency():
    """Half the bytes at half the fp32 kernel's efficiency (a compute-bound bf16 kernel) takes as long as the
    fp32 step; without a measured efficiency it is assumed to be the fp32 kernel's (half the time)."""
    args = dict(batch_size=8, seq_len=1024)
    box = replace(GPU_BOX, call_overhead_s=0.0)  # the bandwidth term alone
    fp32 = plan(1_000_000_000, machine=box, **args).steps["sync"].cpu_step
    assumed = plan(1_000_000_000, machine=box, cpu_state="bf16", **args).steps["sync"].cpu_step
    measured = replace(box, adam_bf16_state_efficiency=box.adam_efficiency / 2)
    compute_bound = plan(1_000_000_000, machine=measured, cpu_state="bf16", **args).steps["sync"].cpu_step
    assert assumed == pytest.approx(fp32 / 2, rel=0.01) and compute_bound == pytest.approx(fp32, rel=0.01)


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
    assert (
        plan(10_000_000, batch_size=1, seq_len=64, machine=CPU_BOX).recommended["cpu_step"] == "sync"
    )  # nothing to overlap


def test_bad_arguments_name_the_option():
    with pytest.raises(ValueError, match="precision"):
        plan(10, batch_size=1, seq_len=8, precision="fp8", machine=GPU_BOX)
    with pytest.raises(ValueError, match="batch_size"):
        plan(10, batch_size=0, seq_len=8, machine=GPU_BOX)
    with pytest.raises(ValueError, match="requires_grad"):
        plan(torch.nn.Linear(2, 2).requires_grad_(False), batch_size=1, seq_len=8, machine=GPU_BOX)
    with pytest.raises(KeyError, match="unknown host"):
        presets.machine("laptop", "H100 SXM (PCIe 5)")


def test_measure_machine_gives_sane_rates():
    m = measure_machine("cpu", threads=1, tokens=64, linear_shapes={(64, 256): 2})
    for rate in (m.host_bandwidth_gbs, m.device_tflops, m.h2d_gbs, m.d2h_gbs, m.adam_efficiency):
        assert math.isfinite(rate) and rate > 0
    assert 0.2 < m.adam_efficiency < 3  # the kernel runs near the Adam-shaped probe's bandwidth
    assert 0.1 < m.adam_bf16_state_efficiency < 3  # bf16 state: compute-bound below that where rounding costs
    assert m.host_memory_gb > 0 and m.cpu_cores >= 1 and m.device_type == "cpu"


@pytest.mark.slow  # times the engine against the prediction (seconds, and load-sensitive)
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


def layers() -> torch.nn.Module:
    """1M parameters in small tensors: with 0.1 MB buckets the staging buffers are negligible."""
    return torch.nn.Sequential(*[torch.nn.Linear(100, 100) for _ in range(100)])


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


# -- verdicts ----------------------------------------------------------------------------------

# The H200 box of docs/planning.md: one 141 GB H200, 128 GB of host RAM, 16 cores.
H200_BOX = with_rates(
    presets.machine("server (1 socket, 8ch DDR4-3200)", "H200 SXM (PCIe 5)"), host_memory_gb=128, cpu_cores=16
)
LLAMA = {"1.3B": (1.3e9, 24, 2048), "7B": (7e9, 32, 4096), "13B": (13e9, 40, 5120), "70B": (70e9, 80, 8192)}


def h200(size: str, **kwargs):
    params, layers, width = LLAMA[size]
    args = {"batch_size": 4, "seq_len": 2048, "n_layer": layers, "hidden": width, "machine": H200_BOX, **kwargs}
    return plan(int(params), **args)


def test_7b_on_the_h200_box_does_not_fit_and_says_why_first():
    p = h200("7B")
    assert not p.fits and p.recommended == {}
    delayed = {c.name: c for c in p.verdict("delayed", "sharded").checks}
    training = next(c for name, c in delayed.items() if name.startswith("host RAM, training"))
    assert training.need == pytest.approx(154e9, rel=0.01) and not training.fits  # 22 B/param
    setup = p.verdict("sync", "sharded").failed
    assert [c.name for c in setup] == ["host RAM, setup (the module as built + the engine's state)"]
    assert setup[0].need == pytest.approx(140e9, rel=0.01)  # 16 B/param of state next to the fp32 module
    text = str(p)
    assert text.splitlines()[3].startswith("DOES NOT FIT")
    assert text.index("DOES NOT FIT") < text.index("step time") and "recommended: nothing" in text
    assert any(f.startswith("2 nodes") and "sharded" in f for f in p.fixes)
    assert any(f.startswith("build the module in bfloat16") for f in p.fixes)


def test_bf16_state_is_offered_when_fp32_state_does_not_fit_the_host():
    fix = next(f for f in h200("7B").fixes if f.startswith('cpu_state="bf16"'))
    # setup: 16 -> 8 B/param of state next to the fp32 module as built (4 B/param); the sync step's peak
    assert "host RAM per node at its peak 140.00 GB -> 84.00 GB with the sync step (16 -> 8 B/param" in fix
    compact = h200("7B", cpu_state="bf16")
    assert compact.fits and compact.recommended["cpu_step"] in ("sync", "speculative")
    assert not any(f.startswith("cpu_state=") for f in h200("7B", precision="16-mixed").fixes)  # fp16: fp32 state
    with pytest.raises(ValueError, match="speculation_rollback='snapshot'"):
        h200("7B", cpu_state="bf16", speculation_rollback="undo")


def test_70b_does_not_fit_the_device_and_more_nodes_are_not_offered():
    p = h200("70B")
    assert not p.fits
    for verdict in p.verdicts.values():
        assert any(c.name.startswith("device memory") for c in verdict.failed)
    assert p.device_bytes["params"] == pytest.approx(140e9, rel=1e-3)
    assert not any("nodes" in fix for fix in p.fixes)  # ZeRO-2 keeps every parameter on every GPU
    assert any(fix.startswith("a model of at most") for fix in p.fixes)
    assert not p.plain_fits_device


# The case of issue 36: 70B with bf16 state on one H200 of a 1 TB host, no --n-layer. Its bf16 parameters alone
# are 140 GB of the 141: it "fitted" with 0.95 GB to spare, activations not estimated, no CUDA context reserved.
BIG_HOST_H200 = ["--host", "server (2 sockets, 8ch DDR4-3200 each)", "--device", "H200 SXM (PCIe 5)"]


def test_70b_on_one_h200_without_n_layer_does_not_fit_with_nothing_left_for_activations(capsys):
    machine = presets.machine("server (2 sockets, 8ch DDR4-3200 each)", "H200 SXM (PCIe 5)")
    p = plan(70_000_000_000, batch_size=1, seq_len=2048, machine=machine, cpu_state="bf16")
    assert not p.fits and p.recommended == {}
    for verdict in p.verdicts.values():
        before, total = verdict.failed  # the host fits; the device does not, even without activations
        assert before.name.startswith("device memory per GPU, before activations")
        assert before.need == p.device_bytes["params"] + p.device_bytes["grad_buckets"] + DEVICE_CONTEXT_BYTES
        assert total.need == p.device_total
    assert p.activation_room < 0 and p.activations.bytes > 0 and p.activations.assumed_shape.startswith("32 layers")
    args = ["--params", "70e9", "--batch-size", "1", "--seq-len", "2048", "--cpu-state", "bf16", *BIG_HOST_H200]
    assert main(args) == 3  # exited 0 before
    out = capsys.readouterr().out
    assert (
        "DOES NOT FIT" in out and "room for activations per GPU, after the model states and the runtime: nothing" in out
    )


def test_without_n_layer_the_activations_are_estimated_for_a_shape_the_plan_names():
    p = plan(1_300_000_000, batch_size=4, seq_len=2048, machine=H200_BOX)
    width = 1856  # sqrt(1.3e9 / (12 x 32)) to a multiple of 64, as --largest's family
    assert p.activations.bytes == 32 * 34 * 4 * 2048 * width
    assert p.activations.assumed_shape.startswith(f"32 layers of width {width}, the planner's transformer")
    assert p.fits and f"n_layer not given: the shape is assumed, 32 layers of width {width}" in str(p)
    assert any(note.startswith("n_layer not given: activations estimated") for note in p.notes)
    # the room any shape may use: what is left after the model states and the runtime
    room = p.activation_room
    assert room == math.floor((141e9 - DEVICE_CONTEXT_BYTES - sum(p.device_bytes.values())) / 1.05)
    assert f"room for activations per GPU, after the model states and the runtime: {room / 1e9:.2f} GB" in str(p)
    given = plan(1_300_000_000, batch_size=4, seq_len=2048, machine=H200_BOX, hidden=2048)
    assert given.activations.bytes == 26 * 34 * 4 * 2048 * 2048  # 1.3e9 / (12 x 2048^2) = 25.8 layers
    with torch.device("meta"):  # a built model: its own list of blocks and its width
        gpt = GPT(n_layer=3, n_embd=128, block_size=64)
    built = plan(gpt, batch_size=2, seq_len=64, machine=H200_BOX)
    assert built.activations.bytes == 3 * 34 * 2 * 64 * 128
    assert built.activations.assumed_shape == (
        "3 layers (the model's longest list of blocks) of width 128 (the model's most common matmul input width)"
    )
    # the layers, not a layer's longer list of experts
    experts = [torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8)) for _ in range(16)) for _ in range(3)]
    layers = torch.nn.ModuleList(torch.nn.ModuleDict({"experts": e, "attn": torch.nn.Linear(8, 8)}) for e in experts)
    assert ModelShape.of(layers).blocks == 3
    assert h200("1.3B").activations.assumed_shape == ""  # n_layer given: nothing assumed


def test_the_runtime_reserve_is_in_the_device_total():
    p = h200("1.3B", batch_size=1)
    activations = p.activations.bytes
    assert p.device_runtime == DEVICE_CONTEXT_BYTES + math.ceil(0.05 * activations)
    assert p.device_total == sum(p.device_bytes.values()) + activations + p.device_runtime
    assert p.verdict("sync").checks[-1].need == p.device_total
    # plain training: 16 B/param and the activations, its gradients and activations freed every step
    plain = 16 * 1.3e9 + activations + DEVICE_CONTEXT_BYTES + math.ceil(0.05 * (4 * 1.3e9 + activations))
    assert p.plain_device_bytes == pytest.approx(plain, abs=1)
    # A GPU that holds the tensors but not the runtime next to them: does not fit
    tensors = sum(p.device_bytes.values()) + activations
    tight = h200("1.3B", batch_size=1, machine=with_rates(H200_BOX, device_memory_gb=(tensors + 2**29) / 1e9))
    assert not tight.fits and all(c.name.startswith("device") for c in tight.verdict("sync").failed)
    cpu = plan(1_300_000_000, batch_size=1, seq_len=2048, n_layer=24, machine=CPU_BOX)
    assert cpu.device_runtime == 0  # a CPU device: no CUDA runtime, its memory is the host's


def test_plain_training_that_fits_the_device_is_said():
    p = h200("1.3B", batch_size=1)
    assert p.fits and p.plain_fits_device
    assert "zero_offload is not needed for memory" in str(p)
    assert not h200("7B").plain_fits_device  # 112 GB + 36.5 GB of activations > 141 GB


def test_only_what_fits_is_recommended(monkeypatch):
    from lightning_zero_offload.planner import memory as planner_memory

    # A save that copies 8 B/param (as with a user's CheckpointIO). 1.3B: sync needs 20.8 GB training and
    # 26 GB at setup; delayed 28.6 GB; such a full save 31.2 GB.
    monkeypatch.setitem(planner_memory.CHECKPOINT_SAVE_BYTES_PER_PARAM, "full", (8, 12))
    p = h200("1.3B", machine=with_rates(H200_BOX, host_memory_gb=27))
    r = p.recommended
    assert r["checkpoint_format"] == "sharded" and r["cpu_step"] in ("sync", "speculative")
    assert r["delayed_step_s"] is None and not p.verdict("delayed", "sharded").fits
    text = str(p)
    assert 'checkpoint_format="full" does not fit' in text and "cpu_step='delayed' does not fit" in text
    assert h200("1.3B").recommended["delayed_speedup"] > 1.0  # with room, delayed is reported again


def test_activations_and_activation_checkpointing():
    plain = h200("1.3B", batch_size=8)
    assert plain.activations.bytes == 24 * 34 * 8 * 2048 * 2048  # layers x 34 B x batch x seq x hidden
    recompute = h200("1.3B", batch_size=8, activation_checkpointing=True)
    assert recompute.activations.bytes == (24 * 2 + 34) * 8 * 2048 * 2048
    assert "activation checkpointing" in recompute.activations.formula
    fp32 = h200("1.3B", batch_size=8, precision="32-true")
    assert fp32.activations.bytes == 2 * plain.activations.bytes
    wide = h200("1.3B", batch_size=64)  # 219 GB of activations: no configuration fits the GPU
    assert not wide.fits and all(c.name.startswith("device") for c in wide.verdict("sync", "sharded").failed)
    assert any(fix.startswith("activation checkpointing") for fix in wide.fixes)
    # 24 x 34 x 38 x 2048^2 = 130 GB of activations, x 1.05 for the allocator, + 2.7 GB of states + 1.07 GB of
    # CUDA context fits 141 GB; 39 does not
    assert any(fix.startswith("a micro-batch of 38 ") for fix in wide.fixes)


def test_the_save_peak_is_one_constant(monkeypatch):
    from lightning_zero_offload.planner import memory as planner_memory

    assert planner_memory.checkpoint_save_bytes(10, "full", 1) == 0  # written from the engine's buffers
    assert planner_memory.checkpoint_save_bytes(10, "full", 2) == 120  # every rank gathers the full state
    assert planner_memory.checkpoint_save_bytes(10, "sharded", 4) == 0
    before = h200("1.3B").host["sync"].save_per_node("full")
    monkeypatch.setitem(planner_memory.CHECKPOINT_SAVE_BYTES_PER_PARAM, "full", (8, 12))  # a save with a copy
    assert h200("1.3B").host["sync"].save_per_node("full") == pytest.approx(before + 8 * 1.3e9)


def test_the_largest_model_per_way_of_training_on_the_h200_box():
    answer = largest_models(H200_BOX)  # 32 layers, micro-batch 1 x 2048, no activation checkpointing
    rows = {r.name: r for r in answer.rows}
    plain = rows["plain training (AdamW on the GPU)"]
    fp32, bf16 = rows['zero_offload, cpu_state="fp32"'], rows['zero_offload, cpu_state="bf16"']
    assert plain.binds == ["GPU memory (16 B/param + activations + runtime)"] and 7.9e9 < plain.params < 8.1e9
    # Host RAM at setup binds zero_offload: the fp32 module as built (4 B/param) next to 16 or 8 B/param of state.
    for row, per_param in ((fp32, 20), (bf16, 12)):
        assert row.binds == ["host RAM, setup (the module as built + the engine's state)"]
        assert row.params == pytest.approx(128e9 / per_param, rel=2e-3)
        assert row.cpu_step == "sync"  # speculative's 2 or 6 B/param more do not fit at that size
        # plan() agrees: the size fits and recommends that schedule; 0.3% more has no exact schedule that fits
        args = dict(batch_size=1, seq_len=2048, n_layer=32, machine=H200_BOX, cpu_state=row.setup)
        assert plan(row.params, **args).recommended["cpu_step"] == row.cpu_step
        assert plan(int(row.params * 1.003), **args).recommended == {}
    # plain training by the same device rule (the runtime reserved) in plan() and here
    args = dict(batch_size=1, seq_len=2048, n_layer=32, machine=H200_BOX)
    assert plan(plain.params, **args).plain_fits_device
    assert not plan(int(plain.params * 1.003), **args).plain_fits_device
    assert rows['zero_offload, cpu_state="bf16", built in bf16'].params == pytest.approx(128e9 / 10, rel=2e-3)
    text = " ".join(str(answer).split())  # the assumptions are wrapped
    assert "micro-batch 1 x 2048 tokens" in text and "activation checkpointing off" in text
    assert 'cpu_state="bf16" 10.66B sync 128.0 34.7 host RAM, setup' in text
    refused = largest_models(H200_BOX, precision="16-mixed").rows
    assert [r.refused != "" for r in refused] == [False, False, True, False, True]  # bf16 state with fp16 params
    with pytest.raises(ValueError, match="device_memory_gb"):
        largest_models(CPU_BOX)


# -- command line ------------------------------------------------------------------------------


def test_cli_with_presets(capsys):
    code = main(["--params", "1.3e9", "--batch-size", "4", "--seq-len", "1024", "--host", "Grace (GH200, LPDDR5X)"]
                + ["--device", "GH200 (NVLink-C2C)"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "1300.0M trainable params" in out and "recommended: cpu_step=" in out and "GH200" in out
    main(["--model", "lightning_zero_offload.demo.GPT", "--model-args", '{"n_layer": 2}', "--json", "--batch-size"]
         + ["2", "--seq-len", "64", "--host", "Grace (GH200, LPDDR5X)", "--device", "GH200 (NVLink-C2C)"]
         + ["--h2d-gbs", "1"])  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == sum(p.numel() for p in GPT(n_layer=2).parameters())
    assert data["machine"]["h2d_gbs"] == 1.0 and data["fits"] is True


def test_cli_errors(capsys):
    with pytest.raises(SystemExit, match="go together"):
        main(["--params", "10", "--batch-size", "1", "--seq-len", "8", "--host", "Grace (GH200, LPDDR5X)"])
    with pytest.raises(SystemExit) as exc:  # no silent 1-token step: batch and sequence length are required
        main(["--params", "10", "--host", "Grace (GH200, LPDDR5X)", "--device", "GH200 (NVLink-C2C)"])
    assert exc.value.code == 2 and "--batch-size, --seq-len" in capsys.readouterr().err


H200_ARGS = ["--host", "server (1 socket, 8ch DDR4-3200)", "--device", "H200 SXM (PCIe 5)", "--host-memory-gb", "128"]


def test_cli_largest(capsys):
    box = [*H200_ARGS, "--device-memory-gb", "141", "--cpu-cores", "16"]
    assert main(["--largest", *box]) == 0
    out = capsys.readouterr().out
    assert out.startswith("largest model that trains on") and "micro-batch 1 x 2048 tokens" in " ".join(out.split())
    assert str(largest_models(H200_BOX)) in out  # the same machine as H200_BOX
    assert main(["--largest", *box, "--seq-len", "4096", "--activation-checkpointing", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "micro-batch 1 x 4096 tokens, activation checkpointing on" in data["assumptions"]
    assert [r["setup"] for r in data["rows"]][:3] == ["plain", "fp32", "bf16"]
    tiny = ["--host-memory-gb", "1", "--device-memory-gb", "1"]  # nothing of 32 layers x 2048 tokens fits
    assert main(["--largest", *H200_ARGS, *tiny, "--n-layer", "32", "--batch-size", "64"]) == 3
    capsys.readouterr()
    with pytest.raises(SystemExit, match="--largest needs a GPU"):
        main(["--largest", *H200_ARGS, "--device-type", "cpu"])


@pytest.mark.slow  # the CLI in a fresh interpreter
def test_a_configuration_that_does_not_fit_exits_non_zero():
    import subprocess
    import sys

    args = ["--params", "70e9", "--n-layer", "80", "--hidden", "8192", "--batch-size", "1", "--seq-len", "2048"]
    done = subprocess.run(
        [sys.executable, "-m", "lightning_zero_offload.planner", *args, *H200_ARGS],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout.splitlines()[3].startswith("DOES NOT FIT") and "device memory per GPU" in done.stdout
    fits = ["--params", "1.3e9", "--n-layer", "24", "--batch-size", "1", "--seq-len", "2048"]
    assert main([*fits, *H200_ARGS]) == 0


def test_the_bf16_state_fix_is_offered_when_the_user_asked_for_the_undo_rollback():
    """The fix is bf16 state with its own (snapshot) rollback: asking for "undo" must not make planning fail."""
    p = h200("7B", speculation_rollback="undo")
    assert not p.fits
    assert any(f.startswith('cpu_state="bf16"') for f in p.fixes)
