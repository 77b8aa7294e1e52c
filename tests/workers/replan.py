"""The unfreezing run of tests/engine/test_replan.py at two ranks (top-level: ``run_ranks`` starts it)."""

from engine_helpers import unfreeze_training


def unfreeze_two_ranks(rank: int, micro: int = 1) -> dict:
    return unfreeze_training(rank, 2, micro=micro)
