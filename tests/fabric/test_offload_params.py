"""``ZeroOffloadFabricStrategy(offload_params=True)`` under Fabric's loop API, against plain Fabric (torch AdamW)."""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
from offload_params_helpers import Blocks, batches, loss_of, relative_error, two_groups

import lightning_zero_offload  # noqa: F401  (registers strategy="zero_offload_params" for Fabric)
from lightning_zero_offload import ZeroOffloadFabricStrategy

FP32_ROUNDING = 1e-6  # normwise; observed below 2e-7


pytestmark = [
    pytest.mark.usefixtures("own_process_group"),  # conftest.py
    # train() follows Fabric's accumulation recipe: no warning to drop its no_backward_sync
    pytest.mark.filterwarnings("error::lightning.fabric.utilities.warnings.PossibleUserWarning"),
]


def train(
    strategy, two_calls: bool = False, clip: float | None = 0.3, empty_init: bool = False
) -> tuple[dict[str, torch.Tensor], object]:
    """The weights after four steps of two micro-batches, and what the last step did (None: not ours).
    ``empty_init``: built under ``fabric.init_module(empty_init=True)`` (the meta device, materialized in setup)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True) if empty_init else contextlib.nullcontext():
        model = Blocks()
    if two_calls:  # the optimizer built over the set-up (sharded) model, as Fabric's FSDP docs say
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(two_groups(model)))
    else:
        model, optimizer = fabric.setup(model, torch.optim.AdamW(two_groups(model)))
    ours = isinstance(fabric.strategy, ZeroOffloadFabricStrategy)
    for window in batches(steps=4, micro=2):
        for index, (x, y) in enumerate(window):
            if ours and index == len(window) - 1:
                fabric.strategy.expect_step(publish_early=True)  # the speculative step may run in this backward
            with fabric.no_backward_sync(model, enabled=index < len(window) - 1):  # Fabric's accumulation recipe
                fabric.backward(loss_of(model, x, y, len(window)))
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
    weights = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }
    return weights, fabric.strategy.last_step_stats if ours else None


@pytest.mark.parametrize(
    ("two_calls", "empty_init"),
    [(False, False), (True, True)]
    + [pytest.param(*case, marks=pytest.mark.slow) for case in ((True, False), (False, True))],
)
def test_equals_plain_fabric_with_accumulation_clipping_and_groups(two_calls, empty_init):
    want, _ = train("auto")
    strategy = ZeroOffloadFabricStrategy(offload_params=True, cpu_step="sync")
    got, _ = train(strategy, two_calls=two_calls, empty_init=empty_init)
    assert relative_error(got, want) < FP32_ROUNDING


def test_the_registered_name_and_speculative_equals_sync_bitwise():
    sync, _ = train("zero_offload_params")
    speculated, stats = train(ZeroOffloadFabricStrategy(offload_params=True, cpu_step="speculative"))
    assert stats.rolled_back  # the clip fired: the speculated steps were redone
    assert all(torch.equal(speculated[k], sync[k]) for k in sync)
    unclipped, stats = train(ZeroOffloadFabricStrategy(offload_params=True, cpu_step="speculative"), clip=None)
    assert stats.speculated_fraction == 1.0
    assert all(torch.equal(unclipped[k], v) for k, v in train("zero_offload_params", clip=None)[0].items())


def run(strategy, data, load=None, save=None, step=None) -> dict[str, torch.Tensor]:
    """Trains on ``data``; ``step``: the step count ``load`` must restore."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
    fabric.launch()
    torch.manual_seed(0)
    model = Blocks()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(two_groups(model)))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if load is not None:
        fabric.load(load, state)
        if step is not None:
            assert state["step"] == step  # a plain value, restored as Fabric restores it
    for window in data:
        for x, y in window:
            fabric.backward(loss_of(model, x, y, len(window)))
        fabric.clip_gradients(model, optimizer, max_norm=0.3)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
    if save is not None:
        fabric.save(save, state)
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


@pytest.mark.parametrize("how", ["load_raw", "load"])
def test_a_load_between_setup_module_and_setup_optimizers_reaches_the_shards(how, tmp_path):
    """setup_module shards the model; a load before the optimizer is set up went to load_state_dict, which cannot
    copy into FSDP2's shards ("aten.copy_.default got mixed torch.Tensor and DTensor")."""
    torch.manual_seed(7)
    saved = Blocks().state_dict()
    torch.save({"model": saved} if how == "load" else saved, tmp_path / "weights.pt")
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="zero_offload_params", precision="32-true")
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Blocks())
    if how == "load":
        fabric.load(tmp_path / "weights.pt", {"model": model})
    else:
        fabric.load_raw(tmp_path / "weights.pt", model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    loaded = fabric.strategy.master_state_dict(model)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    optimizer.step()  # the engine trains the loaded shards


def test_a_second_clip_and_a_clip_inside_the_window_are_refused():
    """As in the ZeRO-2 mode (tests/core/test_session.py): torch would apply them otherwise than the fused clip."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="zero_offload_params", precision="32-true")
    fabric.launch()
    model = Blocks()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    x, y = batches(steps=1, micro=1)[0][0]
    fabric.backward(loss_of(model, x, y, 1))
    fabric.clip_gradients(model, optimizer, max_norm=0.5)
    with pytest.raises(ValueError, match="one gradient clip per optimizer step"):
        fabric.clip_gradients(model, optimizer, clip_val=0.1)
    with pytest.raises(ValueError, match="recorded before this backward"):
        fabric.backward(loss_of(model, x, y, 1))


def test_an_optimizer_over_another_models_parameters_is_refused_before_sharding():
    """It failed with a KeyError naming a parameter's id, after the model was sharded."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="zero_offload_params", precision="32-true")
    fabric.launch()
    model = Blocks()
    with pytest.raises(ValueError, match="not parameters of the module it trains"):
        fabric.setup(model, torch.optim.AdamW(Blocks().parameters()))
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_save_and_load_resume_bitwise(tmp_path):
    data = batches(steps=4, micro=2)
    whole = run("zero_offload_params", data)
    run("zero_offload_params", data[:2], save=tmp_path / "half.ckpt")
    resumed = run("zero_offload_params", data[2:], load=tmp_path / "half.ckpt")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    plain = run("auto", data[2:], load=tmp_path / "half.ckpt")  # the full format: plain Fabric loads it too
    assert relative_error(plain, whole) < FP32_ROUNDING


def test_a_sharded_checkpoint_resumes_bitwise_and_restores_the_other_entries(tmp_path):
    data = batches(steps=4, micro=2)
    sharded = ZeroOffloadFabricStrategy(offload_params=True, checkpoint_format="sharded")
    whole = run("zero_offload_params", data)
    run(sharded, data[:2], save=tmp_path / "half.ckpt")
    assert (tmp_path / "half.ckpt").is_dir()
    resumed = run(
        ZeroOffloadFabricStrategy(offload_params=True, checkpoint_format="sharded"),
        data[2:],
        load=tmp_path / "half.ckpt",
        step=2,
    )
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_a_sharded_checkpoint_loaded_into_another_module_goes_into_that_module(tmp_path):
    """fabric.load(path, {"model": other}) with a second module set up for evaluation: the checkpoint went into the
    trained module's shards in place (it lost its steps since the save) and the other stayed as built; it also
    failed for a model alone (KeyError 'optimizer_states')."""
    strategy = ZeroOffloadFabricStrategy(offload_params=True, checkpoint_format="sharded")
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    net = Blocks()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    (x, y), *_ = batches(steps=1, micro=1)[0]
    for step in range(3):
        fabric.backward(loss_of(model, x, y, 1))
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    whole = lambda module: {k: getattr(p, "full_tensor", p.detach)().clone() for k, p in module.named_parameters()}  # noqa: E731
    trained = whole(net)
    other = Blocks()
    fabric.load(tmp_path / "ckpt", {"model": fabric.setup(other)})
    saved = lightning_zero_offload.convert_checkpoint_to_fp32_state_dict(tmp_path / "ckpt")
    assert all(torch.equal(v, saved[k]) for k, v in whole(other).items())
    assert all(torch.equal(v, trained[k]) for k, v in whole(net).items())  # untouched


@pytest.mark.parametrize("two_calls", [False, True])
def test_a_device_share_trains_as_none(two_calls):
    """A share in both of Fabric's setups (the meta-device build with the two calls): the same weights, within
    fp32 rounding (observed: bitwise); the share's shards step on the device."""
    want, _ = train(ZeroOffloadFabricStrategy(offload_params=True))
    strategy = ZeroOffloadFabricStrategy(offload_params=True, device_share=0.5)
    got, _ = train(strategy, two_calls=two_calls, empty_init=two_calls)
    assert relative_error(got, want) < FP32_ROUNDING
    assert any(slot.on_device for slot in strategy.session.engine.slots)
