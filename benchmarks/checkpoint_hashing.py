"""What the sharded checkpoint's CRC-32 costs: a shard written with and without it, and verified on load.

    python benchmarks/checkpoint_hashing.py            # a 400 MB shard (100M fp32 values), 3 repeats
    python benchmarks/checkpoint_hashing.py --mb 40    # quicker

Prints the best of the repeats for: torch.save to a path (no checksum), the checkpoint writer (checksum
of the bytes as written, fsync, rename), and the load-side check (size + CRC-32 of the file, then
torch.load with mmap), each in seconds and GB/s, with the ratios that docs/checkpoints.md quotes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib

import torch

from lightning_zero_offload.checkpoints.files import Location, file_record, save_file


def best(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=400, help="shard size in MB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.mb * 1_000_000 // 4 // 3
    shard = {name: torch.randn(n) for name in ("master", "exp_avg", "exp_avg_sq")}
    with tempfile.TemporaryDirectory() as tmp:
        plain, checked = os.path.join(tmp, "plain.pt"), os.path.join(tmp, "checked.pt")

        def save_plain() -> None:
            torch.save(shard, plain)
            with open(plain, "rb+") as f:
                os.fsync(f.fileno())

        t_plain = best(args.repeats, save_plain)
        t_checked = best(args.repeats, lambda: save_file(shard, Location(checked)))
        size = os.path.getsize(checked)
        t_verify = best(args.repeats, lambda: file_record(Location(checked)))
        t_load = best(
            args.repeats,
            lambda: sum(
                t.sum()
                for t in torch.load(checked, weights_only=True, mmap=True).values()
                if isinstance(t, torch.Tensor)
            ),
        )
        with open(checked, "rb") as f:
            data = f.read()
        t_crc = best(args.repeats, lambda: zlib.crc32(data))
    gb = size / 1e9
    print(f"shard: {size / 1e6:.0f} MB")
    print(f"torch.save + fsync (no checksum):   {t_plain:.2f} s ({gb / t_plain:.2f} GB/s)")
    print(
        f"with CRC-32 (checkpoint writer):   {t_checked:.2f} s ({gb / t_checked:.2f} GB/s) x{t_checked / t_plain:.2f}"
    )
    print(f"CRC-32 of bytes in memory:          {t_crc:.2f} s ({gb / t_crc:.2f} GB/s)")
    print(f"load check (read + CRC-32 of file): {t_verify:.2f} s ({gb / t_verify:.2f} GB/s)")
    print(f"torch.load(mmap), reading all:      {t_load:.2f} s; check adds x{(t_load + t_verify) / t_load:.2f}")


if __name__ == "__main__":
    main()
