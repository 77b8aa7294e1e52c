"""ZeroOffloadFabricStrategy under Lightning Fabric's loop API, against plain Fabric and DDP runs.

The loop (tests/scenarios/fabric_train.py) uses two param groups, an LR scheduler, clipping,
``fabric.backward``, ``optimizer.step()``/``zero_grad()`` and ``fabric.save``/``fabric.load``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from engine_helpers import batches, loss_fn, make_net
from ranks import launch
from scenarios.fabric_train import train

import lightning_zero_offload  # noqa: F401  (registers strategy="zero_offload" for Fabric)
from lightning_zero_offload import (
    ZeroOffloadFabricPrecision,
    ZeroOffloadFabricStrategy,
    convert_checkpoint_to_fp32_state_dict,
)

SCENARIO = Path(__file__).parent / "scenarios" / "fabric_train.py"


def fabric(strategy="zero_offload", precision="32-true", plugins=None, **options) -> L.Fabric:
    if options:
        strategy = ZeroOffloadFabricStrategy(bucket_size_mb=0.002, **options)  # several buckets
    if plugins:
        precision = None
    f = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision, plugins=plugins)
    f.launch()
    return f


def assert_weights_close(ours: dict, ref: dict, rtol: float, atol: float) -> None:
    assert ours["params"].keys() == ref["params"].keys()
    for key, expected in ref["params"].items():
        torch.testing.assert_close(ours["params"][key], expected, rtol=rtol, atol=atol, msg=key)


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_32_true_matches_plain_fabric_adamw_with_clipping(clip):
    ref = train(fabric("auto"), steps=10, clip=clip)
    ours = train(fabric(), steps=10, clip=clip)
    # fp32 end to end; the fused CPU kernel differs from torch AdamW by fp32 rounding only
    assert ours["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert_weights_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_string_and_instance_select_the_strategy_and_translate_the_precision():
    f = L.Fabric(accelerator="cpu", devices=1, strategy="zero_offload", precision="bf16-mixed")
    assert isinstance(f.strategy, ZeroOffloadFabricStrategy)
    assert isinstance(f.strategy.precision, ZeroOffloadFabricPrecision)
    assert f.strategy.precision.param_dtype == torch.bfloat16
    f = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroOffloadFabricStrategy(bucket_size_mb=1))
    assert f.strategy.options.bucket_size_mb == 1
    assert f.strategy.precision.param_dtype == torch.float32
    with pytest.raises(ValueError, match="bucket_size_mb must be"):
        ZeroOffloadFabricStrategy(bucket_size_mb=0)
    with pytest.raises(ValueError, match="precision='bf16-mixed'"):
        L.Fabric(accelerator="cpu", devices=1, strategy="zero_offload", precision="bf16-true")


def test_setup_keeps_fp32_weights_off_the_device_and_zero_grad_drops_gradients():
    f = fabric(precision="bf16-mixed")
    net = make_net(0)
    reference = [p.detach().clone() for p in net.parameters()]
    model, optimizer = f.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert isinstance(optimizer, torch.optim.AdamW)
    batch = batches(1)[0]
    f.backward(loss_fn(model, batch))
    optimizer.zero_grad()  # discards this gradient: the step below has nothing to apply
    optimizer.step()
    masters = f.strategy.master_state_dict(model.module)
    assert all(torch.equal(masters[k], r) for k, r in zip(masters, reference))
    f.backward(loss_fn(model, batch))
    norm = f.clip_gradients(model, optimizer, max_norm=1e-3)
    assert norm > 1e-3
    optimizer.step()
    masters = f.strategy.master_state_dict(model.module)
    assert not torch.equal(next(iter(masters.values())), reference[0])


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_save_load_resumes_bitwise_and_exports_fp32(tmp_path, fmt):
    options = {"checkpoint_format": fmt}
    full = train(fabric(precision="bf16-mixed", **options), steps=10)
    ckpt = tmp_path / "state.ckpt"
    first = train(fabric(precision="bf16-mixed", **options), steps=10, save=str(ckpt), save_at=4)
    assert first["losses"] == full["losses"]
    resumed = train(fabric(precision="bf16-mixed", **options), steps=10, resume=str(ckpt))
    assert resumed["losses"] == full["losses"][4:]  # bitwise: loss scale, moments, step counts, scheduler
    assert all(torch.equal(resumed["params"][k], v) for k, v in full["params"].items())

    exported = convert_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "export.pt")
    assert exported.keys() == full["params"].keys()
    assert all(v.dtype == torch.float32 for v in exported.values())
    if fmt == "sharded":
        assert sorted(p.name for p in (ckpt / "v000001").iterdir()) == ["meta.pt", "shard_00000.pt"]
    else:  # one plain file: plain Fabric with torch AdamW resumes from it
        ref = train(fabric("auto"), steps=10, resume=str(ckpt))
        assert ref["losses"][0] == pytest.approx(resumed["losses"][0], rel=1e-2)


def test_fp16_loss_scale_lowered_by_natural_overflows_resumes(tmp_path):
    """A loss scale of 2^20 overflows fp16 gradients by itself (no injected inf): the scale comes down
    before the save, grows back (every 4 good steps) and overflows again after it."""
    fp16 = [ZeroOffloadFabricPrecision("16-mixed")]  # on the CPU Fabric turns precision="16-mixed" into bf16
    scaler = {"loss_scale_init": 2.0**20, "loss_scale_growth_interval": 4}
    ckpt = str(tmp_path / "fp16.ckpt")
    f = fabric(plugins=fp16, **scaler)
    full = train(f, steps=16, save=ckpt, save_at=8)
    saved = torch.load(ckpt, weights_only=True)["optimizer"]["zero_offload_engine"]
    assert saved["loss_scaler"]["scale"] < scaler["loss_scale_init"] and saved["skipped_steps"] > 0
    assert f.strategy.engine.skipped_steps > saved["skipped_steps"]  # overflows after the save too

    loaded = fabric(plugins=fp16, **scaler)
    train(loaded, steps=8, resume=ckpt)  # loads and runs no step
    assert loaded.strategy.engine.scaler.state_dict() == saved["loss_scaler"]
    g = fabric(plugins=fp16, **scaler)
    resumed = train(g, steps=16, resume=ckpt)
    assert resumed["losses"] == full["losses"][8:]
    assert all(torch.equal(resumed["params"][k], v) for k, v in full["params"].items())
    assert g.strategy.engine.loss_scale == f.strategy.engine.loss_scale


def test_litgpt_learns_under_bf16_mixed():
    from litgpt.config import Config
    from litgpt.model import GPT

    f = fabric(precision="bf16-mixed")
    torch.manual_seed(0)
    config = Config(block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config)
    model, optimizer = f.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 64, (4, 1), generator=g)
    sequences = (start + torch.randint(1, 3, (4, 17), generator=g).cumsum(1)) % 64  # learnable
    losses = []
    for _ in range(16):
        logits = model(sequences[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), sequences[:, 1:].reshape(-1))
        f.backward(loss)
        f.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])


def train_at_two_ranks(tmp: Path, runs: dict[str, dict]) -> dict[str, dict]:
    """``runs`` (name: options, as tests/scenarios/fabric_train.py takes them) one after another in one
    launch of two ranks; what rank 0 wrote for each, by name."""
    specs = [{**run, "out": str(tmp / f"{name}.pt")} for name, run in runs.items()]
    (tmp / "runs.json").write_text(json.dumps(specs))
    launch([sys.executable, str(SCENARIO), "--devices", "2", "--runs", str(tmp / "runs.json")], 300 + 60 * len(runs))
    return {name: torch.load(tmp / f"{name}.pt", weights_only=True) for name in runs}


@pytest.mark.slow  # two ranks in processes
def test_two_ranks_match_ddp_and_sharded_checkpoint_resumes_at_one(tmp_path):
    ckpt = tmp_path / "two.ckpt"
    runs = {"ddp": {"strategy": "ddp"}, "zero": {"format": "sharded", "save": str(ckpt), "save_at": 6}}
    ddp, ours = train_at_two_ranks(tmp_path, runs).values()
    assert_weights_close(ours, ddp, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in (ckpt / "v000001").iterdir()) == ["meta.pt", "shard_00000.pt", "shard_00001.pt"]
    resumed = train(fabric(checkpoint_format="sharded"), steps=12, resume=str(ckpt))
    assert_weights_close(resumed, ours, rtol=1e-5, atol=1e-6)  # one rank: fp32 reduction order only


def _fabric_loop(cpu_step: str, announce: bool) -> tuple[list[torch.Tensor], list[float]]:
    f = fabric(cpu_step=cpu_step, in_place_on_cpu=False)
    net = make_net()
    model, optimizer = f.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    speculated = []
    for batch in batches(6):
        if announce:  # a step follows this backward, and nothing reads the weights in between
            f.strategy.engine.expect_step(publish_early=True)
        f.backward(loss_fn(model, batch))
        optimizer.step()
        optimizer.zero_grad()
        speculated.append(f.strategy.engine.last.speculated_fraction)
    return [p.detach().clone() for p in model.parameters()], speculated


def test_the_speculative_step_under_fabric_runs_when_the_step_is_announced():
    """Fabric cannot know that a step follows a backward: unannounced, the speculative schedule runs as sync
    (nothing speculated); announced, it speculates, with sync's results."""
    sync, _ = _fabric_loop("sync", announce=False)
    quiet, unannounced = _fabric_loop("speculative", announce=False)
    spec, announced = _fabric_loop("speculative", announce=True)
    assert max(unannounced) == 0 and min(announced) > 0
    for a, b, c in zip(sync, quiet, spec):
        assert torch.equal(a, b) and torch.equal(a, c)
