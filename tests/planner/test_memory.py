import math
import os
import warnings

import pytest
import torch
from planner_helpers import CPU_BOX, GPU_BOX, H200_BOX, h200
from workers.planner import host_tensor_bytes, ledger_at_two_ranks

from lightning_zero_offload.core import make_offload_options
from lightning_zero_offload.demo.model import GPT
from lightning_zero_offload.engine import OffloadEngine, OffloadOptions
from lightning_zero_offload.engine.options import resolve
from lightning_zero_offload.engine.state_dicts import buffers_shared_for_save
from lightning_zero_offload.planner import (
    plan,
    with_rates,
)
from lightning_zero_offload.planner.memory import DEVICE_CONTEXT_BYTES, device_memory, host_memory
from lightning_zero_offload.planner.shape import LayoutSummary, ModelShape, layout_summary


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
    from lightning_zero_offload.testing.ranks import run_ranks

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


@pytest.mark.parametrize("offload_params", [False, True])
def test_a_cpu_device_counts_its_activations_and_frozen_parameters_on_the_host(offload_params):
    """The device is host memory there: the plan said so, and left out the activations (and, ZeRO-2, the frozen
    parameters the module keeps), 0.4-0.75 of the RSS measured on Hugging Face models with a frozen embedding."""
    model = GPT(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)
    model.tok_emb.weight.requires_grad_(False)
    frozen = model.tok_emb.weight.numel()
    cpu = plan(model, batch_size=2, seq_len=64, machine=CPU_BOX, offload_params=offload_params)
    gpu = plan(model, batch_size=2, seq_len=64, machine=GPU_BOX, offload_params=offload_params)
    added = cpu.host["sync"].per_rank
    assert added["device_activations"] == cpu.activations.bytes > 0
    assert added.get("device_frozen_params", 0) == (0 if offload_params else 4 * frozen)  # offload_params: shards
    beyond = added["device_activations"] + added.get("device_frozen_params", 0)
    assert cpu.verdict("sync", "full").checks[0].need >= cpu.host["sync"].per_node >= beyond
    assert "device_activations" not in gpu.host["sync"].per_rank


def test_the_save_peak_is_one_constant(monkeypatch):
    from lightning_zero_offload.planner import memory as planner_memory

    assert planner_memory.checkpoint_save_bytes(10, "full", 1) == 0  # written from the engine's buffers
    assert planner_memory.checkpoint_save_bytes(10, "full", 2) == 120  # every rank gathers the full state
    assert planner_memory.checkpoint_save_bytes(10, "sharded", 4) == 0
    before = h200("1.3B").host["sync"].save_per_node("full")
    monkeypatch.setitem(planner_memory.CHECKPOINT_SAVE_BYTES_PER_PARAM, "full", (8, 12))  # a save with a copy
    assert h200("1.3B").host["sync"].save_per_node("full") == pytest.approx(before + 8 * 1.3e9)


@pytest.mark.parametrize("cpu_state", ["fp32", "bf16"])
@pytest.mark.parametrize("schedule", ["sync", "speculative"])
def test_a_device_share_of_the_buckets_is_planned_as_the_engine_allocates_it(schedule, cpu_state):
    """The ZeRO-2 share: the host's state shrinks by the last buckets', the device holds it (the CPU device's
    ledger tells the two apart), and a save copies its master and moments to the host (a run of buckets or a part
    at a time)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))  # a bucket each
    share = {"device_share": 0.5, "in_place_on_cpu": False}  # the offload data path on the CPU device
    options = make_offload_options(bucket_size_mb=0.01, cpu_threads=1, cpu_step=schedule, cpu_state=cpu_state, **share)
    engine = OffloadEngine(torch.optim.AdamW(model.parameters()), torch.device("cpu"), torch.bfloat16, options)
    try:
        params = sum(p.numel() for p in model.parameters())
        layout = LayoutSummary.of(engine.layout, 0.5)
        predicted = host_memory(layout, torch.bfloat16, engine.resolved, 1, "cpu", params)
        report = engine.memory_report()
        assert 0 < layout.device_shard_numel == report["device_share_params"] < params / 2 + 1
        assert predicted.state_per_rank == report["host_state_bytes"]
        states = device_memory(layout, torch.bfloat16, engine.state.dtype)
        assert states["device_share"] == report["device_state_bytes"] == predicted.per_rank["device_share"]
        # a full save copies the share's runs of buckets one at a time into one buffer (the largest placeholder the
        # checkpoint dict holds); a sharded one writes the CPU device's share as it is, and on an accelerator copies
        # one buffer's part at a time
        with buffers_shared_for_save(engine, streamed=True):
            held = [engine.full_tensors(b) for b in (engine.master, engine.exp_avg, engine.exp_avg_sq)]
            sources = engine.save_sharing.placeholders.sources.values()
            largest = max(numel * shard.dtype.itemsize for shard, _, numel in sources)
        del held
        share_part = engine.state.dtype.itemsize * layout.device_shard_numel
        assert predicted.checkpoint_save_per_rank == {"full": largest, "sharded": 0} and 0 < 2 * largest < share_part
        on_a_gpu = host_memory(layout, torch.bfloat16, engine.resolved, 1, "cuda", params).checkpoint_save_per_rank
        assert on_a_gpu == {"full": largest, "sharded": share_part}
        # a bare parameter count: the same rule, whole buckets from the last
        bare = layout_summary(ModelShape(None, params, (), 8, params), 0.01, torch.bfloat16, 1, 0.5)
        assert 0 < bare.device_shard_numel <= params / 2 and bare.host_shard_numel + bare.device_shard_numel == params
    finally:
        engine.close()
