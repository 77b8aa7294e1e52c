"""The parameter-offload engine at one rank against torch's AdamW on the same model, and its schedules
against each other (FSDP2 on the CPU device, gloo)."""

from __future__ import annotations

import math

import pytest
import torch
from offload_params_helpers import (
    Blocks,
    batches,
    full_state,
    loss_of,
    one_rank_group,
    relative_error,
    sharded_copy,
    torch_adamw_run,
    two_groups,
)

from lightning_zero_offload.engine import OffloadOptions
from lightning_zero_offload.engine.offload_params import ParamOffloadEngine
from lightning_zero_offload.warning import ZeroOffloadRuntimeWarning

# Observed: 1.5e-7 (kernel rounding vs torch's AdamW, and the double-precision clip norm vs torch's fp32 one).
FP32_ROUNDING = 1e-6


@pytest.fixture(autouse=True)
def group():
    with one_rank_group():
        yield


def engine_run(
    model, data, clip_norm=None, clip_value=None, dtype=torch.float32, user_code=None, autocast=False, **options
):
    sharded = sharded_copy(model, dtype)
    engine = ParamOffloadEngine(
        torch.optim.AdamW(two_groups(sharded)),
        torch.device("cpu"),
        torch.float32,
        OffloadOptions(offload_params=True, **options),
    )
    for window in data:
        for index, (x, y) in enumerate(window):
            if index == len(window) - 1:
                engine.expect_step(publish_early=True)
            engine.begin_backward()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_of(sharded, x, y, len(window)).float()
            engine.scale_loss(loss).backward()
            engine.finish_backward()
        if user_code is not None:
            engine.before_user_code()
            user_code(sharded)
            engine.after_user_code()
        engine.step(clip_norm=clip_norm, clip_value=clip_value)
        engine.zero_grad()
    engine.close()
    return full_state(sharded), engine


@pytest.mark.parametrize("clip_norm", [None, 0.4])
def test_sync_equals_torch_adamw_with_groups_accumulation_and_clipping(clip_norm):
    torch.manual_seed(0)
    model, data = Blocks(), batches(steps=5, micro=2)
    got, engine = engine_run(model, data, clip_norm=clip_norm, cpu_step="sync")
    want = torch_adamw_run(model, data, clip_norm=clip_norm)
    assert relative_error(got, want) < FP32_ROUNDING
    if clip_norm is not None:
        assert engine.last.grad_norm > clip_norm  # the clip fired


def test_clipping_by_value_equals_torch():
    torch.manual_seed(0)
    model, data = Blocks(), batches(steps=4, micro=1)
    got, _ = engine_run(model, data, clip_value=0.05, cpu_step="sync")
    assert relative_error(got, torch_adamw_run(model, data, clip_value=0.05)) < FP32_ROUNDING


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("clip_norm", "clip_value"), [(None, None), (0.4, None), (None, 0.05), (1e6, None)])
def test_speculative_equals_sync_bitwise(clip_norm, clip_value, overlap):
    torch.manual_seed(0)
    model, data = Blocks(), batches(steps=4, micro=2)
    sync, _ = engine_run(model, data, clip_norm, clip_value, cpu_step="sync")
    speculated, engine = engine_run(model, data, clip_norm, clip_value, cpu_step="speculative", overlap=overlap)
    assert all(torch.equal(speculated[k], sync[k]) for k in sync)
    # Clipping by norm takes back every speculated step; by value only those of gradients over the limit.
    expected = {(None, None): (1.0, 1.0), (0.4, None): (0.0, 0.0), (None, 0.05): (0.01, 0.99), (1e6, None): (1, 1)}
    low, high = expected[clip_norm, clip_value]
    assert low <= engine.last.speculated_fraction <= high
    assert (engine.rollbacks > 0) == (clip_norm == 0.4 or clip_value is not None)


def test_a_gradient_changed_by_user_code_takes_the_speculated_step_back():
    def halve_head_gradient(model):
        model.head.weight.grad.mul_(0.5)

    torch.manual_seed(0)
    model, data = Blocks(), batches(steps=3, micro=1)
    sync, _ = engine_run(model, data, cpu_step="sync", user_code=halve_head_gradient)
    speculated, engine = engine_run(model, data, cpu_step="speculative", user_code=halve_head_gradient)
    assert all(torch.equal(speculated[k], sync[k]) for k in sync)
    assert engine.rollbacks == 3 and 0 < engine.last.speculated_fraction < 1


def test_bf16_state_adds_little_to_what_bf16_compute_changes():
    """bf16 master and moments (stochastically rounded) against torch's fp32 AdamW, beside fp32 state with the
    same bf16 forward/backward: observed 1.27e-2 vs 1.13e-2, 3.49e-2 vs 3.50e-2, 3.12e-2 vs 3.20e-2 (seeds 0-2)."""
    torch.manual_seed(0)
    model, data = Blocks(), batches(steps=5, micro=1)
    compact, engine = engine_run(model, data, dtype=torch.bfloat16, autocast=True, cpu_state="bf16")
    fp32_state, _ = engine_run(model, data, autocast=True)
    want = torch_adamw_run(model, data)
    assert all(p.dtype == torch.bfloat16 for p in compact.values())
    report = engine.memory_report()
    assert report["host_state_bytes"] == 4 * report["params"]  # two bf16 moments
    assert report["host_shard_bytes"] == 2 * report["params"]  # the bf16 master is the shard
    assert relative_error(compact, want) < 1.3 * relative_error(fp32_state, want)


def test_step_twice_without_backward_steps_again_with_the_clipped_gradients():
    torch.manual_seed(0)
    model = Blocks()
    x, y = batches(steps=1, micro=1)[0][0]
    sharded = sharded_copy(model)
    engine = ParamOffloadEngine(
        torch.optim.AdamW(two_groups(sharded)), torch.device("cpu"), torch.float32, OffloadOptions(offload_params=True)
    )
    engine.begin_backward()
    loss_of(sharded, x, y, 1).backward()
    engine.finish_backward()
    engine.step(clip_norm=0.1)
    engine.step(clip_norm=0.1)
    optimizer = torch.optim.AdamW(two_groups(model))
    loss_of(model, x, y, 1).backward()
    for _ in range(2):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
    want = {n: p.detach() for n, p in model.named_parameters()}
    assert relative_error(full_state(sharded), want) < FP32_ROUNDING
    assert torch.allclose(sharded.head.weight.grad.full_tensor(), model.head.weight.grad, rtol=1e-5, atol=1e-7)


def test_zeroed_gradients_are_still_stepped_and_dropped_ones_are_not():
    torch.manual_seed(0)
    sharded = sharded_copy(Blocks())
    engine = ParamOffloadEngine(
        torch.optim.AdamW(two_groups(sharded)), torch.device("cpu"), torch.float32, OffloadOptions(offload_params=True)
    )
    x, y = batches(steps=1, micro=1)[0][0]
    engine.begin_backward()
    loss_of(sharded, x, y, 1).backward()
    engine.finish_backward()
    engine.zero_grad(set_to_none=False)  # weight decay still applies to a zero gradient, as in torch
    sharded.head.bias.grad = None  # no step at all for it
    before = full_state(sharded)
    engine.step()
    after = full_state(sharded)
    assert torch.equal(after["head.bias"], before["head.bias"])
    assert torch.allclose(after["head.weight"], before["head.weight"] * (1 - 2e-2 * 0.1), rtol=0, atol=1e-7)
    slots = {id(slot.param): slot for slot in engine.slots}
    assert slots[id(sharded.head.bias)].step == 0 and slots[id(sharded.head.weight)].step == 1


def test_an_overflowing_fp16_step_is_skipped_and_lowers_the_loss_scale():
    torch.manual_seed(0)
    sharded = sharded_copy(Blocks())
    engine = ParamOffloadEngine(
        torch.optim.AdamW(two_groups(sharded)), torch.device("cpu"), torch.float16, OffloadOptions(offload_params=True)
    )
    x, y = batches(steps=1, micro=1)[0][0]
    engine.begin_backward()
    engine.scale_loss(loss_of(sharded, x, y, 1)).backward()
    engine.finish_backward()
    sharded.head.bias.grad.to_local()[0] = math.inf
    before, scale = full_state(sharded), engine.loss_scale
    stats = engine.step()
    assert stats.skipped and engine.skipped_steps == 1 and engine.loss_scale == scale  # hysteresis 2
    assert all(torch.equal(full_state(sharded)[k], v) for k, v in before.items())


def test_non_finite_gradients_without_loss_scaling_skip_the_step_with_a_warning():
    sharded = sharded_copy(Blocks())
    engine = ParamOffloadEngine(
        torch.optim.AdamW(two_groups(sharded)), torch.device("cpu"), torch.float32, OffloadOptions(offload_params=True)
    )
    engine.begin_backward()
    (sharded(torch.full((2, 8), math.nan)).sum()).backward()
    engine.finish_backward()
    with pytest.warns(ZeroOffloadRuntimeWarning, match="Non-finite gradients"):
        assert engine.step().skipped


def test_what_offload_params_cannot_run_is_refused_with_the_fix():
    sharded = sharded_copy(Blocks())
    optimizer = torch.optim.AdamW(sharded.parameters())
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="the window cpu_step='speculative' uses exactly"):
        ParamOffloadEngine(optimizer, cpu, torch.float32, OffloadOptions(offload_params=True, cpu_step="delayed"))
    with pytest.raises(ValueError, match="speculation_rollback='undo' is not available"):
        options = OffloadOptions(offload_params=True, cpu_step="speculative", speculative=_undo())
        ParamOffloadEngine(optimizer, cpu, torch.float32, options)
    with pytest.raises(ValueError, match=r"convert the model to torch.bfloat16 \(model.to\(...\)\) before fit"):
        ParamOffloadEngine(optimizer, cpu, torch.bfloat16, OffloadOptions(offload_params=True, cpu_state="bf16"))


def _undo():
    from lightning_zero_offload.engine import SpeculativeOptions

    return SpeculativeOptions(rollback="undo")


@pytest.mark.parametrize("clip", [None, 0.05])
def test_frozen_layers_unfrozen_mid_run_and_added_groups_train_as_under_torch(clip):
    """Frozen parameters (a whole block, half of another) get no state until unfrozen, as torch's AdamW
    keeps none for a parameter without a gradient; a param group added mid-run is read at the next step. With
    clipping that fires, the norm of the step after the unfreeze counts the unfrozen layer's gradient."""

    def freeze(model):
        model.blocks[0].requires_grad_(False)
        model.blocks[1].fc1.requires_grad_(False)

    def unfreeze(model):
        model.blocks[1].fc1.requires_grad_(True)

    def groups(model):  # the head's bias joins in a group of its own after two steps
        named = [(n, p) for n, p in model.named_parameters() if n != "head.bias"]
        return [{"params": [p for _, p in named], "lr": 1e-2, "weight_decay": 0.1}]

    torch.manual_seed(0)
    model, data = Blocks(), batches(steps=4, micro=1)
    freeze(model)
    sharded = sharded_copy(model)
    engine = ParamOffloadEngine(
        torch.optim.AdamW(groups(sharded)), torch.device("cpu"), torch.float32, OffloadOptions(offload_params=True)
    )
    reference = torch.optim.AdamW(groups(model))
    for step, ((x, y),) in enumerate(data):
        if step == 2:
            for net, optimizer in ((sharded, engine.optimizer), (model, reference)):
                unfreeze(net)
                optimizer.add_param_group({"params": [net.head.bias], "lr": 3e-2, "weight_decay": 0.0})
        engine.begin_backward()
        loss_of(sharded, x, y, 1).backward()
        engine.finish_backward()
        engine.step(clip_norm=clip)
        engine.zero_grad()
        loss_of(model, x, y, 1).backward()
        if clip is not None:
            stepped = [p for group in reference.param_groups for p in group["params"]]  # as Lightning clips
            assert float(torch.nn.utils.clip_grad_norm_(stepped, clip)) > clip  # it fires
        reference.step()
        reference.zero_grad()
    want = {n: p.detach() for n, p in model.named_parameters()}
    assert relative_error(full_state(sharded), want) < FP32_ROUNDING
    steps = {id(slot.param): slot.step for slot in engine.slots}
    assert id(sharded.blocks[0].fc1.weight) not in steps  # frozen throughout: no state at all
    assert steps[id(sharded.blocks[1].fc1.weight)] == 2 and steps[id(sharded.head.bias)] == 2


@pytest.mark.parametrize("cpu_step", ["sync", "speculative"])
def test_a_block_frozen_in_the_middle_of_a_window_is_stepped_with_its_gradient_as_torch_does(cpu_step):
    """torch's AdamW steps every parameter whose ``.grad`` is set: a block frozen after the window's first
    micro-batch is still stepped with that gradient (and counted in the clipped norm), then no more."""
    torch.manual_seed(0)
    model, data = Blocks(), batches(steps=3, micro=2)
    sharded = sharded_copy(model)
    options = OffloadOptions(offload_params=True, cpu_step=cpu_step)
    engine = ParamOffloadEngine(
        torch.optim.AdamW(sharded.parameters(), lr=1e-2), torch.device("cpu"), torch.float32, options
    )
    reference = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, window in enumerate(data):
        for part, (x, y) in enumerate(window):
            for net in (sharded, model):
                net.blocks[1].requires_grad_(not (step == 1 and part == 1))
            if part == len(window) - 1:
                engine.expect_step(publish_early=True)
            engine.begin_backward()
            loss_of(sharded, x, y, len(window)).backward()
            engine.finish_backward()
            loss_of(model, x, y, len(window)).backward()
        engine.step(clip_norm=0.05)
        engine.zero_grad()
        assert float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.05)) > 0.05
        reference.step()
        reference.zero_grad()
    want = {n: p.detach() for n, p in model.named_parameters()}
    assert relative_error(full_state(sharded), want) < FP32_ROUNDING
