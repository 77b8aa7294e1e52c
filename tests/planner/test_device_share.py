"""``device_share="auto"``: the share chosen from the host's and the device's memory (planner/device_share.py),
and what a run on the CPU device makes of it."""

from __future__ import annotations

import re
from dataclasses import replace

import lightning as L
import pytest
import torch
from helpers import QUIET, BlockRegression, block_data
from planner_helpers import H200_BOX
from torch import nn

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.core import release_process_group
from lightning_zero_offload.engine import OffloadOptions
from lightning_zero_offload.engine.options import resolve
from lightning_zero_offload.planner import plan
from lightning_zero_offload.planner.device_share import AUTO_ACTIVATION_RESERVE, choose_device_share
from lightning_zero_offload.planner.offload_params import device_memory_params, fsdp_units, host_memory_params
from lightning_zero_offload.planner.shape import ModelShape
from lightning_zero_offload.planner.verdicts import SETUP_BY_BLOCKS, host_checks
from lightning_zero_offload.trainer.callbacks import format_summary

GPU = torch.device("cuda")  # planned only
ROOT, BLOCK = 176, 280  # Tiny's own parameters (embedding, norm, head) and each block's


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)


def shape() -> ModelShape:
    with torch.device("meta"):
        return ModelShape.of(Tiny())


def host_peak(share: float, options: OffloadOptions) -> int:
    """The pre-flight's host peak with ``share`` (one rank, built on the meta device)."""
    config = resolve(replace(options, device_share=share), GPU, torch.bfloat16)
    need = host_memory_params(fsdp_units(shape(), None, 1), torch.bfloat16, config, 1, "cuda", module_bytes=0,
                              configure_model=True)  # fmt: skip
    return max(c.need for c in host_checks(need, "full", None, config.cpu_step, SETUP_BY_BLOCKS))


def choose(options: OffloadOptions, host: int, device: int | None = 10**9):
    return choose_device_share(shape(), options, torch.bfloat16, 1, 1, GPU, host_budget=host, device_free=device)


SYNC = OffloadOptions(offload_params=True, cpu_step="sync", device_share="auto")


def test_the_host_holding_everything_keeps_everything_there():
    choice = choose(SYNC, host=10**9)
    assert (choice.share, choice.params) == (0.0, 0)
    assert "the host holds everything" in choice.why


def test_the_fewest_units_that_let_the_host_hold_the_rest_in_the_order_gradients_arrive_last():
    """Just too little host for all: the root's own parameters go; for less, the root and the first block."""
    total = ROOT + 3 * BLOCK
    for budget, params in ((host_peak(0.0, SYNC) - 1, ROOT), (host_peak(ROOT / total, SYNC) - 1, ROOT + BLOCK)):
        choice = choose(SYNC, host=budget)
        assert choice.params == params, choice.why
        assert host_peak(choice.share, SYNC) <= budget < host_peak(0.0, SYNC)
        assert "holds the rest with it, not with fewer" in choice.why


def test_speculative_puts_the_unit_whose_gradient_arrives_last_on_the_device():
    choice = choose(replace(SYNC, cpu_step="speculative"), host=10**9)
    assert choice.params == ROOT and "no backward is left to hide" in choice.why


def test_never_more_than_the_device_can_take_beside_its_buffers_and_the_activations_reserve():
    """A device with room for the root's state but not a block's more: the host then cannot hold the rest (the
    pre-flight raises), and the choice says so."""
    own = sum(device_memory_params(fsdp_units(shape(), None, 1), torch.bfloat16, torch.float32).values())
    state = 4 * 4  # fp32 master, gradient and two moments per parameter
    free = own + int((ROOT + BLOCK - 1) * state / (1 - AUTO_ACTIVATION_RESERVE)) + 1
    choice = choose(SYNC, host=host_peak(ROOT / (ROOT + 3 * BLOCK), SYNC) - 1, device=free)
    assert choice.params == ROOT and "cannot hold the rest even so" in choice.why


def test_a_cpu_device_moves_nothing():
    choice = choose_device_share(shape(), SYNC, torch.float32, 1, 1, torch.device("cpu"), host_budget=1, device_free=1)
    assert choice.share == 0.0 and "a CPU device is host memory" in choice.why


def test_a_run_with_auto_on_the_cpu_device_says_what_it_chose():
    try:
        module = BlockRegression()
        trainer = L.Trainer(
            strategy=ZeroOffloadStrategy(offload_params=True, device_share="auto"), max_steps=2, **QUIET
        )
        trainer.fit(module, block_data(32))
        session = trainer.strategy.session
        assert session.engine.memory_report()["device_share_params"] == 0
        assert trainer.strategy.options.device_share == "auto"  # the strategy's option stays as given
        assert "device_share=auto: none, a CPU device is host memory" in format_summary(session, {}, 0)
    finally:
        release_process_group()


def test_auto_is_a_number_only_once_chosen():
    """The parameter-offload mode chooses at setup (resolving "auto" before is refused); the ZeRO-2 mode starts with
    none and chooses after the second step (engine/step/device_share.py), which the planner says."""
    with pytest.raises(ValueError, match="chosen when the model is sharded"):
        resolve(SYNC, GPU, torch.bfloat16)
    zero2 = OffloadOptions(device_share="auto")
    assert resolve(zero2, GPU, torch.bfloat16).device_share == 0.0
    planned = plan(10**6, batch_size=1, seq_len=8, device_share="auto", machine=H200_BOX)
    assert any("chosen after the second step" in note and "planned here as none" in note for note in planned.notes)


def test_the_zero2_auto_plan_starts_with_the_share_the_host_needs():
    """Where the host holds the rest only with a share, a run's pre-flight starts "auto" with the smallest (in
    twentieths) whose state the GPU has room for: the planner plans that share, and its host need then fits."""
    args = dict(batch_size=1, seq_len=2048, n_layer=32, machine=H200_BOX, configure_model=True, cpu_state="bf16")
    assert not plan(18e9, **args).verdict("sync", "full").fits  # 8 B/param of state: 144 GB
    planned = plan(18e9, **args, device_share="auto")
    assert planned.verdict("sync", "full").fits
    (note,) = [n for n in planned.notes if "device_share=auto" in n]
    share = float(re.search(r"planned here as the ([0-9.]+) a run starts with", note).group(1))
    assert 0.1 < share < 1 and share == round(20 * share) / 20
    assert not plan(18e9, **args, device_share=share - 0.05).verdict("sync", "full").fits  # the smallest
    assert plan(18e9, **args, device_share=share).verdict("sync", "full").fits
    too_large = plan(40e9, **args, device_share="auto")  # the GPU has no room for the share the host needs
    assert too_large.recommended == {} and any("exceed GPU memory at setup" in note for note in too_large.notes)


def test_every_unit_on_the_device_is_a_share_of_at_most_one():
    """A host that cannot hold anything, a device that takes it all: the whole model, as a valid option."""
    choice = choose(SYNC, host=1, device=10**12)
    assert choice.params == ROOT + 3 * BLOCK and choice.share <= 1.0
    assert replace(SYNC, device_share=choice.share).device_share == choice.share
    assert "cannot hold the rest even so" in choice.why


@pytest.mark.slow  # two processes
def test_every_rank_chooses_from_the_least_memory_any_rank_has(tmp_path):
    """So every rank keeps the same units or buckets on the device (each rank's free memory, and in the ZeRO-2 mode
    its times, differ a little): ints stay ints, times stay floats."""
    from workers.planner import least_memory_over_ranks

    from lightning_zero_offload.testing.ranks import run_ranks

    least = run_ranks(least_memory_over_ranks, 2, tmp_path)
    assert least == [[2**40, 7 * 2**30 - 1, 0.25, -0.5]] * 2 and isinstance(least[0][0], int)
