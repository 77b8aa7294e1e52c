"""The runs of tests/engine/test_replan.py and test_state_dicts.py at two ranks (top-level: ``run_ranks`` starts
them)."""

from engine_helpers import (
    CPU,
    MID_WINDOW,
    batches,
    frozen_resume_training,
    loss_fn,
    make_net,
    options,
    replan_training,
    two_groups,
    unfreezing,
)


def unfreeze_two_ranks(rank: int, micro: int = 1) -> dict:
    return replan_training(rank, 2, unfreezing(micro), 6, micro)


def mid_window_two_ranks(rank: int, **engine_options) -> dict:
    return replan_training(rank, 2, MID_WINDOW, 4, 2, clip=0.05, **engine_options)


def frozen_state_two_ranks(rank: int, scenario: str) -> dict:
    return frozen_resume_training(rank, 2, scenario, {"cpu_step": "speculative"})


def failed_re_plan(rank: int, world: int = 2) -> dict:
    """A re-plan that fails after the old device copy was freed (the gradient source raises, as an out-of-memory
    error would), then the failure path's close: the weights before, and what the parameters hold after."""
    from unittest import mock

    import torch

    from lightning_zero_offload.engine import OffloadEngine
    from lightning_zero_offload.engine import engine as engine_module

    net = make_net()
    net[0].requires_grad_(False)
    engine = OffloadEngine(two_groups(net), CPU, torch.float32, options())
    for x, y in batches(1):
        share = len(x) // world
        loss_fn(net, (x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share])).backward()
        engine.step()
        engine.zero_grad()
    before = [p.detach().clone() for p in net.parameters()]
    net[0].requires_grad_(True)
    with mock.patch.object(engine_module, "GradientStreamer", side_effect=MemoryError("out of memory")):
        try:
            engine.replan_if_changed()
        except MemoryError:
            engine.close(after_failure=True)
    return {"before": before, "after": [p.detach().clone() for p in net.parameters()]}
