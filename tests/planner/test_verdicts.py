import math
import re

import pytest
import torch
from planner_helpers import CPU_BOX, H200_BOX, h200

from lightning_zero_offload.demo.model import GPT
from lightning_zero_offload.planner import (
    largest_models,
    plan,
    with_rates,
)
from lightning_zero_offload.planner.cli import main
from lightning_zero_offload.planner.device_share import START_ROOM
from lightning_zero_offload.planner.machine import presets
from lightning_zero_offload.planner.memory import DEVICE_CONTEXT_BYTES
from lightning_zero_offload.planner.shape import ModelShape


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


# A case a user met: 70B with bf16 state on one H200 of a 1 TB host, no --n-layer. Its bf16 parameters alone
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
    # Built in configure_model: 8 B/param of state and one layer (1/32 of the model) whole in fp32 at setup.
    blockwise = rows['zero_offload, cpu_state="bf16", in configure_model']
    assert blockwise.params == pytest.approx(128e9 / (8 + 4 / 32), rel=2e-3)
    assert blockwise.binds == ["host RAM, setup (configure_model: the engine's buffers + one block whole in fp32)"]
    args = dict(batch_size=1, seq_len=2048, n_layer=32, machine=H200_BOX, cpu_state="bf16", configure_model=True)
    assert plan(blockwise.params, **args).recommended["cpu_step"] == "sync"
    assert plan(int(blockwise.params * 1.003), **args).recommended == {}
    # With device_share="auto" the ZeRO-2 mode starts with the share the host needs, where the GPU has room for it:
    # a larger model needs a share whose state the GPU's 80% at setup does not take
    (shared,) = [r for name, r in rows.items() if name.startswith(f"{blockwise.name}, device_share=")]
    assert shared.params > 1.4 * blockwise.params and shared.device_need > 2 * blockwise.device_need
    assert 0 < shared.device_share < 1 and shared.binds == [START_ROOM]
    args = dict(args, device_share="auto")
    assert plan(shared.params, **args).recommended["cpu_step"] == "sync"
    assert plan(int(shared.params * 1.003), **args).recommended == {}
    text = " ".join(str(answer).split())  # the assumptions are wrapped
    assert "micro-batch 1 x 2048 tokens" in text and "activation checkpointing off" in text
    assert 'cpu_state="bf16" 10.66B sync 128.0 34.7 1.70 host RAM, setup' in text  # GB, GB, seconds per step
    assert rows['zero_offload, cpu_state="bf16"'].step_s == pytest.approx(
        plan(bf16.params, batch_size=1, seq_len=2048, n_layer=32, machine=H200_BOX, cpu_state="bf16").recommended[
            "step_s"
        ]
    )
    refused = largest_models(H200_BOX, precision="16-mixed").rows
    # bf16 state with fp16 params, parameters on the GPU (built in fp32, in fp16, in configure_model) or offloaded
    # (the last two with a row for device_share="auto")
    expected = [False, False, True, False, True, False, False, True, True, False, False, True, True]
    assert [r.refused != "" for r in refused] == expected
    with pytest.raises(ValueError, match="device_memory_gb"):
        largest_models(CPU_BOX)


@pytest.mark.parametrize(
    ("model", "given", "error", "said"),
    [
        ("7e9", {}, TypeError, "the model must be an nn.Module or a whole parameter count, got '7e9'"),
        (1e9 + 0.5, {}, TypeError, "a whole parameter count, got 1000000000.5"),
        (1e9, {"hidden": 0}, ValueError, "hidden must be a whole number >= 1, got 0"),  # a ZeroDivisionError
        (1e9, {"hidden": -64}, ValueError, "hidden must be a whole number >= 1, got -64"),  # planned
        (1e9, {"batch_size": 2.5}, ValueError, "batch_size must be a whole number >= 1, got 2.5"),  # planned
    ],
)
def test_plan_refuses_what_is_not_a_model_or_a_size(model, given, error, said):
    with pytest.raises(error, match=re.escape(said)):
        plan(model, **{"batch_size": 1, "seq_len": 64, "machine": CPU_BOX, **given})
