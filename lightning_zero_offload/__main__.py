"""``python -m lightning_zero_offload fit --config configs/cpu_demo.yaml``."""

from lightning_zero_offload.cli import main

if __name__ == "__main__":
    main()
