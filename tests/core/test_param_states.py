"""``optimizer.state`` over the ZeRO-2 engine, for a parameter frozen since it trained (its state parked outside the
layout): shown, changed in place and reset as torch's AdamW shows, changes and resets it, and what it holds is what
the parameter resumes with when it is unfrozen. Tolerance: the fused step's fp32 rounding (observed <= 1e-7)."""

from types import SimpleNamespace

import pytest
import torch
from engine_helpers import CPU, batches, loss_fn, make_net, options, two_groups

from lightning_zero_offload.core.param_states import ParamStates
from lightning_zero_offload.engine import OffloadEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-6


def parked_then_unfrozen(change, engine_options: dict | None) -> list[torch.Tensor]:
    """Two steps, net[0] frozen and parked (a re-plan while it has no gradient), ``change(state, net)`` on
    ``optimizer.state``, two steps, net[0] unfrozen, two steps: torch's AdamW (``engine_options`` None) or the
    engine's."""
    net = make_net()
    optimizer = two_groups(net)
    engine = (
        OffloadEngine(optimizer, CPU, torch.float32, options(**engine_options)) if engine_options is not None else None
    )
    stepper = engine or optimizer
    for index, batch in enumerate(batches(6)):
        if index == 2:
            net[0].requires_grad_(False)
            if engine is not None:
                assert engine.replan_if_changed()
                assert all(p is not net[0].weight for p in engine.params)  # parked
            state = optimizer.state if engine is None else ParamStates(SimpleNamespace(engine=engine, world_size=1))
            change(state, net)
        if index == 4:
            net[0].requires_grad_(True)
            if engine is not None:
                engine.replan_if_changed()
        loss_fn(net, batch).backward()
        stepper.step()
        stepper.zero_grad()
    if engine is not None:
        engine.close()
    return [p.detach().clone() for p in net.parameters()]


def halve_moments(state, net) -> None:
    entry = state[net[0].weight]
    assert float(entry["step"]) == 2 and set(entry) == {"step", "exp_avg", "exp_avg_sq"}
    entry["exp_avg"].mul_(0.5)
    state[net[0].bias]["exp_avg_sq"] = torch.full_like(net[0].bias, 1e-4)


def reset(state, net) -> None:
    del state[net[0].weight]
    assert net[0].weight not in state and net[0].bias in state


@pytest.mark.parametrize("change", [halve_moments, reset])
@pytest.mark.parametrize("engine_options", [{}, {"in_place_on_cpu": True}], ids=["offload", "in-place"])
def test_a_parked_parameters_state_is_shown_changed_and_reset_as_torchs(change, engine_options):
    reference = parked_then_unfrozen(change, None)
    for ours, theirs in zip(parked_then_unfrozen(change, engine_options), reference):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL)
    unchanged = parked_then_unfrozen(lambda state, net: None, None)
    assert max(float((a - b).abs().max()) for a, b in zip(reference, unchanged)) > 1e-4  # the change matters


def test_an_entry_given_its_step_alone_gets_zero_moments_and_saves():
    """``state[p] = {"step": t}`` on a parked parameter: torch would keep an entry without moments (and fail at
    its next step); here the moments are zero until given, and the state dict keeps working."""
    net = make_net()
    engine = OffloadEngine(two_groups(net), CPU, torch.float32, options())
    for batch in batches(2):
        loss_fn(net, batch).backward()
        engine.step()
        engine.zero_grad()
    net[0].requires_grad_(False)
    assert engine.replan_if_changed()
    state = ParamStates(SimpleNamespace(engine=engine, world_size=1))
    del state[net[0].weight]
    state[net[0].weight] = {"step": 7}
    saved = engine.optimizer_state_dict()["state"][0]
    assert float(saved["step"]) == 7 and not saved["exp_avg"].any() and not saved["exp_avg_sq"].any()
    engine.close()
