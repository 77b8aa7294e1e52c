"""The device share's bf16-state step (kernels/device.py): its temporaries, as the peak RSS growth of one step
of n elements on the CPU device, after its inputs exist. Run once per size (the peak is per process):

    python benchmarks/device_step_scratch.py 4194304
    python benchmarks/device_step_scratch.py 1048576
"""

from __future__ import annotations

import argparse
import resource

import torch

from lightning_zero_offload.kernels import AdamArgs, device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n", type=int, nargs="?", default=device.BF16_STATE_CHUNK, help="elements (default: a pass)")
    n = parser.parse_args().n
    p, g, m, v = (torch.randn(n).to(torch.bfloat16) for _ in range(4))
    v.abs_()
    hparams = AdamArgs(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    device.adam_step_bf16_state(p, g, m, v, hparams=hparams, step=1, seed=3)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    print(f"n={n}: state {4 * 2 * n / 2**20:.0f} MiB, peak RSS growth {grown / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
