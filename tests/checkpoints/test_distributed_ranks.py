"""Checkpoints of offload_params=True across world sizes (gloo, FSDP2 on the CPU device): saved midway at two
ranks, resumed at two bitwise as the uninterrupted run, and at one and three ranks (uneven shards; the last
ranks hold no row of the head) from exactly the saved state; a save failing on one rank. Workers:
tests/workers/offload_params_checkpoints.py."""

from __future__ import annotations

import functools
import os

import pytest
from offload_params_helpers import differences, relative_error

from lightning_zero_offload.testing.ranks import run_ranks

# A resume at another world size continues from the same state; its gradients are summed over other
# partitions of the batch, so it parts from the two-rank run by rounding. Observed after three steps, at one
# and three ranks: 6.0e-8 and 6.9e-8 with fp32 state; 4.8e-3 with bf16 state, where a gradient rounded
# otherwise moves a stochastically rounded weight by one bf16 step (2^-8 relative) now and then.
OTHER_WORLD_ROUNDING = {"fp32": 1e-6, "bf16": 1e-2}


def parameters(state: dict) -> dict:
    return {key: value for key, value in state.items() if key.startswith("module/")}


def launch(fn, world: int, tmp_path, name: str) -> list:
    (tmp_path / name).mkdir()
    return run_ranks(fn, world, tmp_path / name, timeout=300)


@pytest.mark.slow  # six launches of 1-3 processes
@pytest.mark.parametrize(("fmt", "cpu_state"), [("sharded", "fp32"), ("sharded", "bf16"), ("full", "fp32")])
def test_saved_at_two_ranks_resumed_at_two_bitwise_and_at_one_and_three_from_the_saved_state(tmp_path, fmt, cpu_state):
    from workers.offload_params_checkpoints import resume, save_midway

    path = str(tmp_path / "last.ckpt")
    saved = launch(functools.partial(save_midway, path, fmt, cpu_state), 2, tmp_path, "save")
    if fmt == "full":
        assert saved[0]["held"] > 0 and saved[1]["held"] == 0  # the module's state gathered on rank 0 alone
    for world in (2, 1, 3):
        resumed = launch(functools.partial(resume, path, fmt, cpu_state), world, tmp_path, f"at{world}")
        for rank, result in enumerate(resumed):
            assert differences(result["loaded"], saved[0]["saved"]) == [], (world, rank)
            assert result["extra"] == ({"global_step": 3} if fmt == "sharded" else {})
        if world == 2:
            assert differences(resumed[0]["final"], saved[0]["final"]) == []
        else:
            got, want = parameters(resumed[0]["final"]), parameters(saved[0]["final"])
            assert 0 < relative_error(got, want) < OTHER_WORLD_ROUNDING[cpu_state]  # trained on, as at two ranks


@pytest.mark.slow  # two processes
def test_a_save_failing_on_one_rank_raises_on_both_and_leaves_the_previous_checkpoint(tmp_path):
    from workers.offload_params_checkpoints import save_failing_on_rank_1

    path = tmp_path / "last.ckpt"
    results = launch(functools.partial(save_failing_on_rank_1, str(path)), 2, tmp_path, "run")
    for result in results:
        assert "saving the sharded checkpoint failed on rank 1: OSError" in result["error"]
        assert "No space left on device" in result["error"]
        assert result["extra"] == {"step": 1} and differences(result["loaded"], result["saved"]) == []
    assert len(os.listdir(path)) == 1  # the failed version is gone
