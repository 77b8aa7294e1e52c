"""The re-planning runs of tests/engine/test_replan.py at two ranks (top-level: ``run_ranks`` starts them)."""

from engine_helpers import mid_window_training, unfreeze_training


def unfreeze_two_ranks(rank: int, micro: int = 1) -> dict:
    return unfreeze_training(rank, 2, micro=micro)


def mid_window_two_ranks(rank: int, **engine_options) -> dict:
    return mid_window_training(rank, 2, **engine_options)
