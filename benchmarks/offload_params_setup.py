"""Host memory and time of the parameter-offload mode's setup, per rank, at 1 and 2 gloo ranks on the CPU.

    python benchmarks/offload_params_setup.py                  # ~100M parameters (24 blocks of 2048 x 2048)
    python benchmarks/offload_params_setup.py --params 20e6    # quicker

Three measurements, each rank a fresh process (``lightning_zero_offload/testing/ranks.py``):

- materialize: a model built on the meta device, wrapped and initialized by ``shard_model``: the growth of
  the process's peak RSS (VmHWM, reset before) and of its RSS, against this rank's shards and one block;
- load: the same model's safetensors file (written by the ``safetensors`` package) streamed into the
  sharded model by ``load_pretrained`` (``initialize=False``), and at one rank a ``torch.save`` file
  (memory-mapped): time, peak RSS growth and peak anonymous RSS growth (sampled every millisecond)
  against the shards, the largest tensor and the file's size;
- heap: the FSDP2 spike's Q5 setup (the model built eagerly, sharded, fp32 moments, two steps of
  forward, backward and ``kernels.adam_step`` on the shards) with glibc's default mmap threshold, with
  ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment, and with ``limit_retained_heap()`` called at the
  start: the RSS growth per parameter after two steps and at the peak.

Writes JSON to ``benchmarks/results/offload_params_setup.json``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from memory_probe import PeakSampler, anonymous_rss, reset_peak, status  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MB = 2**20


def stack(params: float, width: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x)) + x

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(max(2, round(params / (width * width + width))))])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    return Stack


def sizes(model) -> dict:
    shards = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    return {"params": sum(p.numel() for p in model.parameters()), "shards_MB": shards / MB, "block_MB": block / MB}


def sharded_on_meta(params: float, width: int, initialize: bool, mesh):
    import torch

    from lightning_zero_offload.engine.offload_params.placement import shard_model

    with torch.device("meta"):
        model = stack(params, width)()
    return shard_model(model, mesh, param_dtype=torch.float32, initialize=initialize)


def cpu_mesh():
    """The ranks' CPU mesh, made (and the package imported) before any baseline is read."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero_offload.engine.offload_params import placement  # noqa: F401

    return init_device_mesh("cpu", (dist.get_world_size(),))


def materialize_rank(params: float, width: int, rank: int) -> dict:
    import torch

    from lightning_zero_offload.engine.offload_params.heap import limit_retained_heap

    limit_retained_heap()  # as the engine does at its start
    mesh = cpu_mesh()
    torch.manual_seed(0)
    gc.collect()
    base = status("VmRSS")
    reset_peak()
    start = time.perf_counter()
    model = sharded_on_meta(params, width, True, mesh)
    seconds = time.perf_counter() - start
    gc.collect()
    grown, peak = (status("VmRSS") - base) / MB, (status("VmHWM") - base) / MB
    return {"rank": rank, **sizes(model), "rss_growth_MB": grown, "peak_growth_MB": peak, "seconds": seconds}


def load_rank(params: float, width: int, path: str, rank: int) -> dict:
    from lightning_zero_offload.engine.offload_params.heap import limit_retained_heap
    from lightning_zero_offload.engine.offload_params.pretrained import load_pretrained

    limit_retained_heap()
    model = sharded_on_meta(params, width, False, cpu_mesh())  # shards allocated, not yet touched
    gc.collect()
    base, base_anon = status("VmRSS"), anonymous_rss()
    anon = PeakSampler(anonymous_rss)
    anon.start()
    reset_peak()
    start = time.perf_counter()
    load_pretrained(model, path)
    seconds = time.perf_counter() - start
    anon_peak = anon.stop()
    return {
        "rank": rank,
        "file": Path(path).name,
        "file_MB": Path(path).stat().st_size / MB,
        **sizes(model),
        "seconds": seconds,
        "peak_growth_MB": (status("VmHWM") - base) / MB,
        "anon_peak_growth_MB": (anon_peak - base_anon) / MB,
        "rss_growth_after_MB": (status("VmRSS") - base) / MB,
    }


def heap_child(params: float, width: int, call: bool) -> dict:
    """The spike's Q5 in this process (a one-rank group of its own), fp32 state."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from lightning_zero_offload import kernels
    from lightning_zero_offload.engine.offload_params.heap import limit_retained_heap

    if call:
        limit_retained_heap()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        torch.manual_seed(0)
        gc.collect()
        base = status("VmRSS")
        reset_peak()
        model = stack(params, width)()
        mesh = init_device_mesh("cpu", (1,))
        for unit in (*model.blocks, model):
            fully_shard(unit, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        params_ = list(model.parameters())
        moments = [(torch.zeros_like(p.to_local()), torch.zeros_like(p.to_local())) for p in params_]
        hparams = kernels.AdamArgs(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
        x = torch.randn(4, width)
        for step in range(1, 3):
            model(x).pow(2).mean().backward()
            with torch.no_grad():
                for p, (m, v) in zip(params_, moments):
                    kernels.adam_step(p.to_local(), p.grad.to_local(), m, v, hparams=hparams, step=step)
        n = sum(p.numel() for p in params_)
        result = {
            "after_2_steps_B_per_param": (status("VmRSS") - base) / n,
            "peak_B_per_param": (status("VmHWM") - base) / n,
        }
        dist.destroy_process_group()
    return result


def heap_runs(args: argparse.Namespace) -> list[dict]:
    runs = []
    for mode in ("default", "environment", "limit_retained_heap"):
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
        if mode == "environment":
            env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        command = [sys.executable, __file__, "--heap-child", str(mode == "limit_retained_heap")]
        command += ["--params", str(args.params), "--width", str(args.width)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200, check=True)
        runs.append({"mode": mode, **json.loads(done.stdout.splitlines()[-1])})
        print(runs[-1], flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--skip", nargs="*", default=[], choices=["materialize", "load", "heap"])
    parser.add_argument("--heap-child", choices=["True", "False"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.heap_child:
        print(json.dumps(heap_child(args.params, args.width, args.heap_child == "True")))
        return
    import torch

    from lightning_zero_offload.testing.ranks import run_ranks

    results: dict = {"params": args.params, "width": args.width, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        if "materialize" not in args.skip:
            results["materialize"] = []
            for world in (1, 2):
                with tempfile.TemporaryDirectory() as ranks:
                    rows = run_ranks(functools.partial(materialize_rank, args.params, args.width), world, ranks, 1200)
                results["materialize"] += [{"world": world, **row} for row in rows]
                print(results["materialize"][-world:], flush=True)
        if "load" not in args.skip:
            from safetensors.torch import save_file

            torch.manual_seed(0)
            state = stack(args.params, args.width)().state_dict()
            save_file(state, Path(tmp, "model.safetensors"))
            torch.save(state, Path(tmp, "state_dict.pt"))
            del state
            results["load"] = []
            for file, worlds in (("model.safetensors", (1, 2)), ("state_dict.pt", (1,))):
                for world in worlds:
                    load = functools.partial(load_rank, args.params, args.width, str(Path(tmp, file)))
                    with tempfile.TemporaryDirectory() as ranks:
                        rows = run_ranks(load, world, ranks, 1200)
                    results["load"] += [{"world": world, **row} for row in rows]
                    print(results["load"][-world:], flush=True)
    if "heap" not in args.skip:
        results["heap"] = heap_runs(args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offload_params_setup.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
