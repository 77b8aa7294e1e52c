"""The planner's device figure for offload_params against FSDP2's buffers measured on the CPU device, one
rank, with the engine stepping (benchmarks/offload_params_device_peak.py measures, at the sizes of
docs/benchmarks.md and at two ranks too)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_benchmark
from offload_params_helpers import one_rank_group

# Observed: the measured peak exceeds the planned one by 512 B in fp32 at this size (0.09%: the norms' small
# buffers), by 0.007% at the benchmark's sizes.
ABOVE_PLAN = 0.002


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("offload_params_device_peak")


@pytest.mark.parametrize(
    ("compute", "cpu_state"),
    [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")],
)
def test_the_blocks_buffers_are_what_fsdp2_allocates_at_one_rank(bench, compute, cpu_state):
    """The blocks in flight and their backward's buffers, planned, against the peak of FSDP2's gathered
    parameters, unsharded gradients and reduce buffers, measured. The plan may exceed the measurement by the
    one allocation the CPU device never makes: the copy of a tensor's shard to the device before its cast
    (one tensor at a time at one rank, in the state's dtype)."""
    shape = {"width": 64, "blocks": 3, "heads": 4, "vocab": 0, "tied": False, "batch": 1, "seq": 8}
    config = bench.Config(compute, cpu_state, "sync")
    with one_rank_group():
        (measured,) = bench.rank_run(*shape.values(), (config,), rank=0)
    plan = bench.planned(*shape.values(), world=1, config=config)
    planned = plan["blocks_in_flight"] + plan["backward_buffers"]
    got = measured["fsdp_peak"] - plan["root_params"]  # the measured "gathered" holds the root's norm too
    state_bytes = getattr(torch, bench.DTYPES[cpu_state]).itemsize
    copy_up = state_bytes * 64 * 4 * 64 if compute != cpu_state else 0  # the MLP's 64 x 256 matrices
    assert got <= planned * (1 + ABOVE_PLAN)
    assert planned <= got + copy_up


@pytest.mark.parametrize(("compute", "cpu_state"), [("fp32", "fp32"), ("bf16", "bf16")])
def test_a_tied_embedding_and_head_in_the_root_are_planned_with_the_sum_of_their_gradients(bench, compute, cpu_state):
    """A language model whose tied embedding and head stay with the root (each smaller than a block): autograd
    holds the head's gradient of the shared weight through every block's backward, until the embedding's
    arrives and the two are summed out of place. Planned, it covers what FSDP2 and autograd hold at the device
    peak but the logits' gradient, which the activation estimate leaves out (before the planner counted the
    held gradient: 9% under in fp32)."""
    shape = {"width": 128, "blocks": 3, "heads": 4, "vocab": 1024, "tied": True, "batch": 1, "seq": 16}
    config = bench.Config(compute, cpu_state, "sync")
    with one_rank_group():
        (measured,) = bench.rank_run(*shape.values(), (config,), rank=0)
    plan = bench.planned(*shape.values(), world=1, config=config)
    planned = plan["root_params"] + plan["blocks_in_flight"] + plan["backward_buffers"]
    at_peak = measured["at_device_peak"]
    got = sum(at_peak[kind] for kind in ("gathered", "param_grads", "reduce", "activation_grads"))
    logits_grad = shape["seq"] * shape["vocab"] * getattr(torch, bench.DTYPES[compute]).itemsize
    assert got - logits_grad <= planned * (1 + ABOVE_PLAN)
    assert planned <= got  # and not a loose bound
