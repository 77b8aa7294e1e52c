"""What the mixed-precision choices of docs/mixed-precision.md cost, measured on the CPU.

1. BatchNorm running statistics kept in bf16/fp16 (what converting the whole module does, as DeepSpeed
   does) versus fp32 (what zero_offload and AMP do): relative error of running_mean/running_var against
   an fp64 reference after N updates, with the default momentum (0.1) and with a cumulative average
   (momentum=None), on activations with a non-zero mean.
2. The forward-time cost of the norm/embedding rule (a TorchFunctionMode): forward time of a small
   GPT-2 with and without it, both under autocast, at a batch so small that per-op overhead dominates
   (an upper bound).

    python scripts/mixed_precision_costs.py [--steps 1000] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from lightning_zero_offload.mixed_precision import forward_context


def running_stats_error(dtype: torch.dtype, momentum: float | None, steps: int, channels: int = 64) -> tuple:
    """Relative error (max over channels) of running_mean and running_var after ``steps`` updates."""
    g = torch.Generator().manual_seed(0)
    mean = torch.linspace(-4, 4, channels)  # activations with a non-zero mean per channel
    std = torch.linspace(0.5, 3, channels)
    bn = {d: nn.BatchNorm1d(channels, momentum=momentum).to(d) for d in (torch.float64, dtype)}
    for _ in range(steps):
        x = torch.randn(32, channels, generator=g, dtype=torch.float64) * std + mean
        for d, module in bn.items():
            module(x.to(d))
    ref, low = bn[torch.float64], bn[dtype]
    err_mean = ((low.running_mean.double() - ref.running_mean).abs() / ref.running_mean.abs()).max().item()
    err_var = ((low.running_var.double() - ref.running_var).abs() / ref.running_var).max().item()
    return err_mean, err_var


def forward_overhead(repeats: int) -> tuple[float, float]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(torch.bfloat16)
    # a small batch: per-op overheads weigh the most when the ops themselves are cheap
    ids = torch.randint(0, 256, (1, 32))

    def timed(context) -> float:
        times = []
        for _ in range(repeats):
            with context():
                start = time.perf_counter()
                model(input_ids=ids)
                times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    plain = timed(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    ruled = timed(lambda: forward_context("cpu", torch.bfloat16))
    return plain, ruled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="BatchNorm updates")
    parser.add_argument("--repeats", type=int, default=20, help="timed forwards (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"BatchNorm running statistics after {args.steps} updates, max relative error vs fp64")
    print("| stats dtype | momentum | running_mean | running_var |")
    print("|---|---|---|---|")
    for momentum in (0.1, None):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            err_mean, err_var = running_stats_error(dtype, momentum, args.steps)
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {momentum} | {err_mean:.2e} | {err_var:.2e} |")
    plain, ruled = forward_overhead(args.repeats)
    print(
        f"\nGPT-2 (4 layers, width 64, batch 1x32) bf16 forward: autocast {plain * 1e3:.1f} ms, "
        f"with the norm/embedding rule {ruled * 1e3:.1f} ms (x{ruled / plain:.2f})"
    )


if __name__ == "__main__":
    main()
