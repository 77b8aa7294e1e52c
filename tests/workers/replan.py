"""The runs of tests/engine/test_replan.py and test_state_dicts.py at two ranks (top-level: ``run_ranks`` starts
them)."""

from engine_helpers import MID_WINDOW, frozen_resume_training, replan_training, unfreezing


def unfreeze_two_ranks(rank: int, micro: int = 1) -> dict:
    return replan_training(rank, 2, unfreezing(micro), 6, micro)


def mid_window_two_ranks(rank: int, **engine_options) -> dict:
    return replan_training(rank, 2, MID_WINDOW, 4, 2, clip=0.05, **engine_options)


def frozen_state_two_ranks(rank: int, scenario: str) -> dict:
    return frozen_resume_training(rank, 2, scenario, {"cpu_step": "speculative"})
