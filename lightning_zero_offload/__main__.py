"""``python -m lightning_zero_offload fit --config configs/cpu_demo.yaml``."""

import sys

from lightning_zero_offload.cli import main

if __name__ == "__main__":
    sys.argv[0] = "python -m lightning_zero_offload"  # argparse names the program after argv[0] in --help
    main()
