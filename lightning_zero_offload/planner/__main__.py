"""``python -m lightning_zero_offload.planner``."""

from lightning_zero_offload.planner.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
