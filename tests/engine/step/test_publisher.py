"""The publisher's flat device buffer (the weights' device copy) is held once: a re-plan frees the old one before
it makes the new one (filled from the master), and closing the engine frees it. On a GPU that buffer is 2 B/param
of device memory; held twice, an unfreeze of a model that fills the device runs out of memory."""

import gc
import weakref

import pytest
import torch
from engine_helpers import CPU, batches, loss_fn, make_net, options, two_groups

from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.step import publisher

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def trained_with_a_frozen_layer(dtype: torch.dtype) -> tuple[torch.nn.Module, OffloadEngine]:
    net = make_net().to(dtype)
    net[0].requires_grad_(False)
    engine = OffloadEngine(two_groups(net), CPU, dtype, options())
    ((x, y),) = batches(1)
    engine.begin_backward()
    loss_fn(net, (x.to(dtype), y)).backward()
    engine.step()
    engine.zero_grad()
    return net, engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_re_plan_frees_the_old_device_copy_before_it_makes_the_new_one(monkeypatch, dtype):
    net, engine = trained_with_a_frozen_layer(dtype)
    before = [p.detach().clone() for p in net.parameters()]
    old = weakref.ref(engine.publisher.flat_params)
    alive = []
    made = publisher.device_zeros

    def noting(*args, **kwargs):
        gc.collect()
        alive.append(old() is not None)
        return made(*args, **kwargs)

    monkeypatch.setattr(publisher, "device_zeros", noting)
    net[0].requires_grad_(True)
    assert engine.replan_if_changed()
    assert alive == [False]
    # The new copy holds what the old one did (the master, rounded as before), the unfrozen layer its own values.
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), before))
    assert all(p.data_ptr() != 0 and p.numel() for p in net.parameters())


def test_closing_the_engine_frees_the_device_copy():
    """The module gets its weights back as tensors of their own; the flat buffer is no longer referenced, though
    the engine (and its optimizer state) lives on with the Trainer's optimizer."""
    net, engine = trained_with_a_frozen_layer(torch.bfloat16)
    flat = weakref.ref(engine.publisher.flat_params)
    engine.close()
    gc.collect()
    assert flat() is None
