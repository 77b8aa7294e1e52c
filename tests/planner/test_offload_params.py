"""The planner's offload_params mode: its formulas against hand computations, --largest, the verdicts, and the
ZeRO-2 mode's answers unchanged by it."""

import hashlib
import json

import pytest
import torch
from offload_params_helpers import one_rank_group, tokens
from planner_helpers import CPU_BOX, GPU_BOX, h200, layers
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from lightning_zero_offload.engine import OffloadOptions
from lightning_zero_offload.engine.meta_init.blockwise import BlockwiseInit
from lightning_zero_offload.engine.offload_params import ParamOffloadEngine
from lightning_zero_offload.engine.offload_params.placement import device_resident, init_units, shard_model
from lightning_zero_offload.planner import Machine, check_host_memory, largest_models, plan, presets, with_rates
from lightning_zero_offload.planner.cli import main
from lightning_zero_offload.planner.largest import IN_CONFIGURE_MODEL, PLAIN
from lightning_zero_offload.planner.machine import probes
from lightning_zero_offload.planner.offload_params import fsdp_units
from lightning_zero_offload.planner.preflight import SKIP_CHECK_ENV
from lightning_zero_offload.planner.shape import ModelShape
from lightning_zero_offload.planner.timing import step_time_params
from lightning_zero_offload.planner.verdicts import SETUP, SETUP_BY_BLOCKS, SETUP_WHOLE


class Tiny(nn.Module):
    """An embedding, three blocks of 280 parameters (8x16 + 16 + 16x8 + 8), a norm and a head."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tiny(tied: bool = False) -> nn.Module:
    with torch.device("meta"):
        return Tiny(tied)


def test_three_ranks_fp32_state_by_hand():
    p = plan(tiny(), batch_size=1, seq_len=8, n_layer=3, devices=3, machine=GPU_BOX, accumulate_grad_batches=2,
             offload_params=True, configure_model=True)  # fmt: skip
    units = p.params_offload.units
    # Units: the three blocks (the engine's find_units); the embedding and head (80 each) hold less than a
    # block, so the root keeps them with the norm (16).
    assert (units.units, units.largest_unit, units.root_params, units.params) == (3, 280, 176, 1016)
    # Shards at 3 ranks, dim 0 padded: emb 4x8, per block 6x8 + 6 + 3x16 + 3, norm 3 + 3, head 4x8.
    assert units.shard_numel == 32 + 3 * (48 + 6 + 48 + 3) + 6 + 32 == 385
    sync, speculative = p.host["sync"], p.host["speculative"]
    state = 4 * 385  # fp32: master (FSDP2's shard), its gradient and two moments
    # Pinned shards rounded up to powers of two: per block 192 -> 256, 24 -> 32, 192 -> 256, 12 -> 16 B; norm 12 -> 16.
    rounding = 3 * (64 + 8 + 64 + 4) + 2 * 4
    block_copies = 4 * 94  # one block's gradient shards copied down: 280 / 3 ranks, rounded up
    shards = {"master": state, "exp_avg": state, "exp_avg_sq": state, "grad": state, "frozen_shards": 0}
    assert sync.per_rank == {**shards, "block_grad_copies": block_copies, "pinned_rounding": rounding}
    assert speculative.per_rank["snapshot"] == 3 * state
    assert sync.per_node == 3 * (4 * state + block_copies + rounding)
    assert sync.pinned_per_rank == state + rounding
    assert sync.setup_per_rank == state + rounding + 4 * 280  # configure_model: the shards, one block whole in fp32
    assert sync.checkpoint_save_per_rank == {"full": 4 * 128, "sharded": 3 * 4 * 94}  # one tensor; one block's state
    assert [c.name for c in p.verdict("sync").checks][1] == SETUP_BY_BLOCKS
    # Device (bf16 compute): the root's embedding, norm and head, the running block and the prefetched one, and
    # the largest moment of a block's backward, each next to the previous block's 4 x 280 B of fp32
    # reduce-scatter input: computing, its 2 x 280 B of gradients = 1680; gathering, the prefetch's bf16 casts
    # (2 x 280 / 3) and the largest tensor's fp32 copy (4 x 128 / 3) = 1477; reducing, the 4 x 94 B output, the
    # running block resharded = 936.
    assert p.device_bytes == {"root_params": 2 * 176, "blocks_in_flight": 2 * 2 * 280, "backward_buffers": 1680}
    # Traffic of 2 micro-batches: each gathers every shard twice (4 B) and sends the gradient shard down once.
    moved = p.params_offload.traffic
    assert (moved.up, moved.down) == (2 * 2 * 4 * 385, 2 * 4 * 385)
    assert moved.all_gather == 2 * 2 * 2 * 1155 * 2 / 3 and moved.reduce_scatter == 2 * 4 * 1155 * 2 / 3
    assert p.schedules == ("sync", "speculative") and "delayed" not in p.resolved
    assert "tensor_shards" not in p.to_dict()["params_offload"]["units"]


def test_one_rank_tied_weights_bf16_state_built_whole_by_hand():
    p = plan(tiny(tied=True), batch_size=1, seq_len=8, n_layer=3, machine=GPU_BOX, cpu_state="bf16",
             offload_params=True)  # fmt: skip
    units = p.params_offload.units
    assert (units.units, units.root_params, units.params) == (3, 96, 936)  # the tied embedding and head: the root
    sync = p.host["sync"]
    assert sync.per_rank["master"] == 2 * 936 and sync.per_rank["block_grad_copies"] == 2 * 280
    assert sync.per_rank["pinned_rounding"] == 256 - 160  # the 10x8 embedding: every other shard is a power of two
    assert p.host["speculative"].per_rank["snapshot"] == 3 * 2 * 936
    assert sync.setup_per_rank == 4 * 936 + 2 * 280  # the fp32 module as built, and one block's shard
    assert [c.name for c in p.verdict("sync").checks][1] == SETUP_WHOLE
    # One rank: one block in flight (FSDP2 prefetches nothing); bf16 kept as it is gathered (no cast); the reduce
    # in bf16 (nothing is summed at one rank); beside each block's moment the head's gradient of the tied weight
    # (2 x 80), which autograd holds until the embedding's arrives. Computing, its gradients and the previous
    # block's reduce input, 2 x 280 each, = 1280; reducing, 2 x 280 of input and 2 x 280 of output (no cast: the
    # state is bf16), the running block's 2 x 280 freed, = 720; gathering 2 x 280 and two 128-element tensors in
    # bf16 = 1232; the root's own moment, its gradients and the sum's copy (2 x (96 + 80)) and the last block's
    # reduce input (2 x 280) = 912.
    assert p.device_bytes == {"root_params": 2 * 96, "blocks_in_flight": 2 * 280, "backward_buffers": 1280}
    assert p.params_offload.units.root_tied == 80


def test_a_device_share_moves_its_units_from_the_host_by_hand_and_as_the_engine_holds_them():
    """Share 0.45 of Tiny's 1016 parameters: the root's own 176 and the first block's 280 (456; a second block would
    pass the 457 allowed). At one rank the engine's ledger is the plan's, byte for byte, on each side."""
    args = dict(batch_size=1, seq_len=8, n_layer=3, machine=GPU_BOX, offload_params=True, configure_model=True)
    p = plan(tiny(), **args, device_share=0.45)
    host = p.host["sync"].per_rank
    assert host["master"] == host["grad"] == 4 * (1016 - 456)
    assert p.device_bytes["device_share"] == 4 * 4 * 456  # master, gradient, two moments, fp32
    assert p.device_bytes["device_share_step"] == 4 * 128  # its step's fp32 copy of the largest scaled gradient
    # a full save at one rank copies the share's weights and both moments to the host (the rest are views)
    assert p.host["sync"].checkpoint_save_first_rank["full"] == 3 * 4 * 456
    moved = p.params_offload.traffic
    assert (moved.up, moved.down) == (2 * 4 * 560, 4 * 560)  # the share does not cross the link
    assert "device_share" not in plan(tiny(), **args).device_bytes
    with one_rank_group() as mesh:
        model = Tiny()
        shard_model(model, mesh, param_dtype=torch.float32, device_share=0.45, pin_memory=False)
        engine = ParamOffloadEngine(
            torch.optim.AdamW(model.parameters()),
            torch.device("cpu"),
            torch.float32,
            OffloadOptions(offload_params=True, device_share=0.45),
            on_device=device_resident(model),
        )
        model(tokens().reshape(-1) % 10).sum().backward()  # 2-D activations: no block returns a view
        engine.step()
        report = engine.memory_report()
        engine.close()
    assert report["host_shard_bytes"] == host["master"] and report["host_grad_bytes"] == host["grad"]
    assert report["host_state_bytes"] == host["exp_avg"] + host["exp_avg_sq"]
    device = sum(report[f"device_{kind}_bytes"] for kind in ("shard", "grad", "state"))
    assert device == p.device_bytes["device_share"]


def test_step_time_by_hand():
    m = Machine(host_bandwidth_gbs=14, cpu_cores=1, host_memory_gb=64, device_tflops=1, h2d_gbs=10, d2h_gbs=10,
                call_overhead_s=0, link_latency_s=0)  # fmt: skip
    units = fsdp_units(ModelShape.of(10**9), 10, 1)
    assert (units.units, units.largest_unit, units.shard_numel) == (10, 10**8, 10**9)

    def step(schedule: str, micro: int = 1, pinned: bool = True):
        return step_time_params(units, torch.bfloat16, schedule, m, 1, 1, 3e12 * micro, micro, torch.bfloat16, pinned)

    # Forward 1 s, backward 2 s; a pass of gathers 2 GB / 10 GB/s = 0.2 s, the gradients 0.2 s down; the CPU step
    # 14 GB / 14 GB/s = 1 s. Only the first unit's gather (0.02 s) waits in forward.
    sync = step("sync")  # pinned, no hook: the copies overlap backward but the first gather and last reduce
    assert sync.cpu_step == pytest.approx(1.0) and sync.copy_back == 0
    assert sync.exposed == pytest.approx(0.02 + 0.04 + 1.0) and sync.total == pytest.approx(3 + 1.06)
    speculative = step("speculative")  # the hook makes every copy down wait; the step hides behind backward
    assert speculative.exposed == pytest.approx(0.02 + (0.2 + 0.02) + 0.1)
    assert step("sync", pinned=False).exposed == pytest.approx(0.02 + 0.22 + 1.0)
    # Two micro-batches: the second adds into the first's gradient (read 2 shards, write 1: 6 GB at 14 GB/s)
    two = step("sync", micro=2)
    assert two.exposed == pytest.approx(2 * 0.02 + 0.04 + 0.22 + 6 / 14 + 1.0)
    assert step("sync", pinned=False).bound_by == "device compute"


def test_the_largest_model_grows_with_host_memory():
    sizes = {}
    for host in (128, 256, 512, 1024):
        rows = largest_models(with_rates(GPU_BOX, host_memory_gb=host), activation_checkpointing=True).rows
        offloaded = {r.setup: r for r in rows if r.offload_params and not r.auto_share}
        assert all(r.name.startswith("zero_offload_params") for r in offloaded.values())
        for state, row in offloaded.items():
            assert all(b.startswith("host RAM") for b in row.binds), row.binds
            sizes.setdefault(state, []).append(row.params)
    for state in ("fp32", "bf16"):
        assert sizes[state] == sorted(sizes[state]) and sizes[state][0] < sizes[state][-1]
    assert all(b > f for f, b in zip(sizes["fp32"], sizes["bf16"]))
    # plan() agrees with a row: that size recommends its schedule, 0.3% more has nothing that fits
    row = next(r for r in largest_models(GPU_BOX).rows if r.offload_params and r.setup == "bf16" and not r.auto_share)
    args = dict(batch_size=1, seq_len=2048, n_layer=32, machine=GPU_BOX, cpu_state="bf16", offload_params=True,
                configure_model=True)  # fmt: skip
    assert plan(row.params, **args).recommended["cpu_step"] == row.cpu_step
    assert plan(int(row.params * 1.003), **args).recommended == {}


H200_BOX = presets.machine("DGX H100 (2 sockets, 8ch DDR5-4800 each, 2 TB)", "H200 SXM (PCIe 5)")


def test_device_share_auto_trains_three_times_plain_on_the_h200_box():
    """141 GB of GPU, 128 GB of host: host RAM binds without a share, with 120 GB of the GPU idle. With
    device_share="auto" at each size, the host holds what it can and the GPU the rest, within 80% of its free
    memory; plan() agrees with the row (its choice is the row's; 0.3% more fits nowhere). Sharded checkpoints:
    a full one at one rank copies the share's weights and moments to the host at once (below)."""
    box = with_rates(H200_BOX, host_memory_gb=128)
    rows = largest_models(box, checkpoint_format="sharded").rows
    plain = next(r for r in rows if r.setup == PLAIN)
    shared = {r.setup: r for r in rows if r.offload_params and r.auto_share}
    without = {r.setup: r for r in rows if r.offload_params and not r.auto_share}
    assert shared["bf16"].params >= 24e9 and shared["bf16"].params >= 3 * plain.params
    for state, row in shared.items():
        assert row.params > 1.9 * without[state].params
        assert 0.4 < row.device_share < 0.5 and row.device_need > 100e9
        args = dict(batch_size=1, seq_len=2048, n_layer=32, machine=box, cpu_state=state, offload_params=True,
                    configure_model=True, device_share="auto", checkpoint_format="sharded")  # fmt: skip
        planned = plan(row.params, **args)
        assert planned.recommended["cpu_step"] == row.cpu_step
        assert planned.recommended["step_s"] == pytest.approx(row.step_s)  # the recommendation's, with the share
        without_share = plan(row.params, **{**args, "device_share": 0.0})
        assert planned.steps["sync"].cpu_step < without_share.steps["sync"].cpu_step  # the share steps elsewhere
        assert any(n.startswith("device_share=auto: ") for n in planned.notes)
        assert plan(int(row.params * 1.003), **args).recommended == {}
    # the full format: the save copies the share's weights and both moments whole to the host (3 x 2 B/param)
    full = next(r for r in largest_models(box).rows if r.offload_params and r.auto_share and r.setup == "bf16")
    assert 18e9 < full.params < shared["bf16"].params and full.binds == ['host RAM, saving a "full" checkpoint']


def test_the_recommended_step_time_counts_the_share():
    """Half the layers on the device: half the CPU step and half the link's traffic, in the schedule the planner
    recommends as in the table it prints (a host that holds either)."""
    box = with_rates(H200_BOX, host_memory_gb=4000)
    args = dict(batch_size=1, seq_len=2048, n_layer=32, machine=box, cpu_state="bf16", offload_params=True,
                configure_model=True)  # fmt: skip
    without, shared = plan(int(20e9), **args), plan(int(20e9), **args, device_share=0.5)
    assert shared.recommended["step_s"] < 0.7 * without.recommended["step_s"]
    assert shared.steps["sync"].cpu_step == pytest.approx(without.steps["sync"].cpu_step / 2, rel=0.05)


DGX = presets.machine("DGX H100 (2 sockets, 8ch DDR5-4800 each, 2 TB)", "H100 SXM (PCIe 5)")


@pytest.mark.parametrize("cpu_state", ["fp32", "bf16"])
def test_70b_on_an_8_gpu_node_fits_built_in_configure_model_only(cpu_state):
    args = dict(batch_size=1, seq_len=2048, n_layer=80, hidden=8192, devices=8, machine=DGX, cpu_state=cpu_state,
                offload_params=True)  # fmt: skip
    whole = plan(70_000_000_000, **args)  # every rank builds the 280 GB fp32 module: 2.24 TB at setup
    assert not whole.fits
    assert [c.name for c in whole.verdict("sync").failed] == [SETUP_WHOLE]
    assert whole.fixes[0].startswith("build the model in configure_model") and "still too much" not in whole.fixes[0]
    blockwise = plan(70_000_000_000, configure_model=True, **args)
    assert blockwise.fits and blockwise.recommended["cpu_step"] in ("sync", "speculative")
    assert "host RAM, setup" in str(whole).split("Smallest changes")[0]


def test_a_model_the_root_holds_mostly_is_said():
    class Blob(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(1000, 1000))
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(10, 10)) for _ in range(2))

    with torch.device("meta"):
        blob = Blob()
    p = plan(blob, batch_size=1, seq_len=8, n_layer=1, machine=GPU_BOX, offload_params=True)
    assert p.device_bytes["root_params"] == 2 * 10**6 and p.params_offload.units.units == 2
    assert any(n.startswith("the root keeps 1.0M parameters") for n in p.notes)
    cpu = plan(tiny(), batch_size=1, seq_len=8, n_layer=3, machine=CPU_BOX, offload_params=True)
    assert cpu.host["sync"].per_rank["device_buffers"] == sum(cpu.device_bytes.values())  # a CPU device is the host


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_the_mode_refuses_is_refused_with_the_engines_words(tied):
    """The plan of a model without repeated blocks, or with a weight tied across blocks, said it fits (as one unit
    the root gathers whole), where the strategy refuses it."""
    model = tiny()
    if tied:
        model.blocks[1][0].weight = model.blocks[0][0].weight
        match = r"offload_params=True refuses this model: parameter .* is also used outside that block"
    else:
        model = nn.Linear(100, 100)
        match = r"offload_params=True refuses this model: found no repeated blocks in Linear"
    with pytest.raises(ValueError, match=match):
        plan(model, batch_size=1, seq_len=8, n_layer=1, machine=GPU_BOX, offload_params=True)
    assert plan(model, batch_size=1, seq_len=8, n_layer=1, machine=GPU_BOX).fits  # the ZeRO-2 mode takes it
    with one_rank_group() as mesh:  # the fix the message names: the user's own fully_shard, which the mode honours
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        planned = plan(model, batch_size=1, seq_len=8, n_layer=1, machine=GPU_BOX, offload_params=True)
    assert planned.params_offload.units.root_params == sum(p.numel() for p in model.parameters())


def test_the_zero2_mode_built_in_configure_model_holds_one_unit_at_setup_not_the_module():
    args = dict(batch_size=1, seq_len=8, n_layer=3, machine=GPU_BOX)  # fmt: skip
    whole, blockwise = plan(tiny(), **args), plan(tiny(), configure_model=True, **args)
    # The unit initialized whole: a block (280 parameters), or the root's own (embedding, norm, head: 176).
    assert whole.host["sync"].transient_model_per_rank == 4 * 1016
    assert blockwise.host["sync"].transient_model_per_rank == 4 * 280
    assert whole.host["sync"].setup_per_rank - blockwise.host["sync"].setup_per_rank == 4 * (1016 - 280)
    assert [c.name for c in blockwise.verdict("sync").checks][1] == SETUP_BY_BLOCKS
    assert [c.name for c in whole.verdict("sync").checks][1] == SETUP


def test_the_preflight_check_plans_the_mode(monkeypatch):
    options = OffloadOptions(offload_params=True)
    device = torch.device("cuda")  # planned only: FSDP2 pins the shards there
    planned = plan(tiny(), batch_size=1, seq_len=8, n_layer=3, devices=2, machine=GPU_BOX, offload_params=True,
                   configure_model=True)  # fmt: skip
    peak = planned.host["sync"].save_per_node("full")  # cpu_step="auto" with offload_params
    monkeypatch.delenv(SKIP_CHECK_ENV, raising=False)
    monkeypatch.setattr(probes, "host_memory_limit", lambda *args, **kwargs: (peak, "MemAvailable"))
    check_host_memory(tiny(), options, torch.bfloat16, 2, 2, device)  # on the meta device: block by block
    monkeypatch.setattr(probes, "host_memory_limit", lambda *args, **kwargs: (peak - 1, "MemAvailable"))
    with pytest.raises(MemoryError, match='host RAM, saving a "full" checkpoint: .*device_share="auto"'):
        check_host_memory(tiny(), options, torch.bfloat16, 2, 2, device)


def test_the_preflight_check_plans_a_zero2_model_built_on_the_meta_device_as_held_by_blocks(monkeypatch):
    options = OffloadOptions(cpu_step="sync")
    device = torch.device("cuda")  # planned only
    planned = plan(tiny(), batch_size=1, seq_len=8, n_layer=3, machine=GPU_BOX, configure_model=True)
    host = planned.host["sync"]
    # Master, moments and gradient buffer (4 x 4 B x 1016) allocated next to one block whole in fp32 (4 B x 280).
    assert host.setup_per_node == 4 * 4 * 1016 + 4 * 280
    peak = max(host.per_node, host.setup_per_node, host.save_per_node("full"))
    model = tiny()
    BlockwiseInit(model, "cpu", init_units(model))  # placeholders, as OffloadSession.placeholders leaves them
    monkeypatch.delenv(SKIP_CHECK_ENV, raising=False)
    monkeypatch.setattr(probes, "host_memory_limit", lambda *args, **kwargs: (peak, "MemAvailable"))
    check_host_memory(model, options, torch.bfloat16, 1, 1, device, blockwise=True)
    monkeypatch.setattr(probes, "host_memory_limit", lambda *args, **kwargs: (peak - 1, "MemAvailable"))
    with pytest.raises(MemoryError):
        check_host_memory(model, options, torch.bfloat16, 1, 1, device, blockwise=True)


def test_the_command_line_takes_the_mode(capsys):
    box = ["--host", "server (2 sockets, 8ch DDR4-3200 each)", "--device", "H100 SXM (PCIe 5)"]
    args = ["--params", "30e9", "--n-layer", "48", "--batch-size", "1", "--seq-len", "2048", *box]
    assert main([*args, "--offload-params", "--configure-model", "--cpu-state", "bf16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("zero_offload_params plan") and "offload_params=True" in out and "traffic per step" in out
    assert main(args) == 3  # ZeRO-2 keeps the 60 GB of bf16 parameters on the GPU, next to the activations
    capsys.readouterr()
    assert main(["--largest", *box]) == 0
    assert 'zero_offload_params, cpu_state="bf16"' in capsys.readouterr().out


# The ZeRO-2 mode's answers as printed before offload_params came to the planner (computed on the commit
# before it, 92b4f82): their text and JSON, and the --largest rows of the ZeRO-2 mode built as before. Since,
# the JSON has one more key, the host memory's checkpoint_save_first_rank ({} in this mode): without it the
# texts hash to the earlier digest, 4fbdfbea5ae29b807cd4c395c4b9ff041d13290cfbe300e8af481480701e8516; and the
# fixes offer "build the model in configure_model" to this mode too: without those lines, f9530c9881108f809e8
# 2623d7edb9e49caab73ded1ccdd40c3e76599725b6cdd; and the resolved options' JSON has device_share (0.0 in this
# mode): without it, 732829084d440578f3f77995c1127415cc0021143d57b88cd3cc38f3a25e1242. The CPU device's plan
# counts its activations on the host (a "device_activations" row and the note's words): without those,
# fd2b2ea60c1ad8a2405fe4865cb502876bf97e21eaa5e8a36edb35664eb9126d.
ZERO2_DIGEST = "183752da03d22ce6051e8a9a9b288d96f218b065202d3d089be70c0a93ef7429"


def test_the_zero2_answers_are_unchanged():
    texts = []
    for size in ("1.3B", "7B", "70B"):
        for cpu_state in ("fp32", "bf16"):
            p = h200(size, cpu_state=cpu_state)
            texts += [str(p), json.dumps(p.to_dict(), sort_keys=True, default=str)]
    p = plan(7e9, batch_size=4, seq_len=2048, n_layer=32, devices=8, machine=GPU_BOX, accumulate_grad_batches=4)
    texts += [str(p), json.dumps(p.to_dict(), sort_keys=True, default=str)]
    texts.append(str(plan(layers(), batch_size=2, seq_len=64, machine=CPU_BOX, bucket_size_mb=0.1)))
    for precision in ("bf16-mixed", "16-mixed"):
        rows = largest_models(GPU_BOX, devices=8, precision=precision).rows
        texts += [
            repr((r.name, r.params, r.cpu_step, r.host_need, r.device_need, r.binds, r.refused))
            for r in rows
            if not r.offload_params and r.built != IN_CONFIGURE_MODEL
        ]
    assert hashlib.sha256("\n".join(texts).encode()).hexdigest() == ZERO2_DIGEST


@pytest.mark.parametrize("cpu_state", ["fp32", "bf16"])
def test_a_full_save_at_several_ranks_holds_the_whole_state_on_the_first_rank(cpu_state):
    """What engine/offload_params/full_state.py keeps for the file: the weights and both moments whole on the
    first rank (measured at two ranks: +12.2 B/param fp32, +6.1 bf16), views at one rank."""
    element = 4 if cpu_state == "fp32" else 2
    for devices, extra in ((1, 0), (2, 3 * element)):
        p = plan(tiny(), batch_size=1, seq_len=8, n_layer=3, devices=devices, machine=GPU_BOX, offload_params=True,
                 cpu_state=cpu_state, precision="bf16-mixed")  # fmt: skip
        host = p.host["sync"]
        assert host.checkpoint_save_first_rank["full"] == extra * p.params_offload.units.params
        assert host.save_per_node("full") == (
            host.per_node
            + host.checkpoint_save_per_rank["full"] * host.ranks_per_node
            + extra * p.params_offload.units.params
        )
        assert "sharded" not in host.checkpoint_save_first_rank  # each rank writes its own shards
