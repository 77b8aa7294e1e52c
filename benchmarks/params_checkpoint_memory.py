"""Host memory of the checkpoints of ``offload_params=True``, per rank, against the model's size.

    python benchmarks/params_checkpoint_memory.py                  # ~101M parameters, fp32 state, one rank
    python benchmarks/params_checkpoint_memory.py --world 2        # two gloo ranks
    python benchmarks/params_checkpoint_memory.py --cpu-state bf16
    python benchmarks/params_checkpoint_memory.py --params 20e6    # quicker

Ranks started by the rank launcher (``lightning_zero_offload/testing/ranks.py``) put a stack of
Linear(width, width) layers on FSDP2 (each layer, then the root; shards on the host), train one step with
the parameter-offload engine, then, while a thread samples each rank's RSS every millisecond: the sharded
save (``checkpoints.distributed.save_sharded``), the sharded load back in place, and the full format's
gathers (``full_model_state`` + ``full_optimizer_state``, held until both are done, as a save holds them;
also the bytes of the tensors they copied: RSS grows by less where the allocator reuses memory freed before).
Then, each in a fresh process: ``zero-offload-convert`` of the sharded checkpoint (the streamed fp32 export),
the same with ``--safetensors`` (a Hugging Face folder in 100 MB shards) and ``load_sharded_full`` (the whole
state built in memory); their peak RSS above what the process held after its imports. Reported in MB and
bytes per parameter (of the whole model). Writes JSON to
``benchmarks/results/params_checkpoint_memory[_LABEL].json``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import PeakSampler, rss  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MB = 2**20

# Run in a fresh interpreter: the peak RSS of one call above the RSS after the imports it needs.
FRESH = """
import resource, sys
sys.path.insert(0, {benchmarks!r})
from memory_probe import PeakSampler, rss
from lightning_zero_offload.checkpoints import distributed, export
import torch
sampler = PeakSampler(rss); before = rss(); sampler.start()
{call}
print(sampler.stop() - before)
"""


def peak_of(call) -> tuple[int, float]:
    """The peak RSS above the start while ``call()`` runs, and its seconds."""
    gc.collect()
    sampler = PeakSampler(rss)
    before = rss()
    sampler.start()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    return sampler.stop() - before, seconds


def fresh_peak(call: str) -> int:
    code = FRESH.format(benchmarks=str(Path(__file__).resolve().parent), call=call)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def ranks_part(path: str, params: float, width: int, cpu_state: str, rank: int) -> dict:
    """One rank: train a step, then the saves and the load, each with its peak RSS above its start."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from lightning_zero_offload.checkpoints import distributed
    from lightning_zero_offload.engine import OffloadOptions
    from lightning_zero_offload.engine.offload_params import ParamOffloadEngine
    from lightning_zero_offload.engine.offload_params.full_state import full_model_state, full_optimizer_state

    world = dist.get_world_size()
    dtype = torch.bfloat16 if cpu_state == "bf16" else torch.float32
    torch.manual_seed(0)
    layers = max(1, round(params / (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width, dtype=dtype) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    options = OffloadOptions(offload_params=True, cpu_state=cpu_state, cpu_step="sync")
    optimizer = torch.optim.AdamW(model.parameters())
    engine = ParamOffloadEngine(optimizer, torch.device("cpu"), torch.float32, options, world)
    engine.begin_backward()
    model(torch.randn(4, width, dtype=dtype)).float().pow(2).mean().backward()
    engine.finish_backward()
    engine.step()
    engine.zero_grad()
    held: list = []
    measured = {
        "sharded save": peak_of(lambda: distributed.save_sharded(path, model, engine, {"epoch": 0})),
        "sharded load (in place)": peak_of(lambda: distributed.load_sharded(path, model, engine)),
        "full gathers": peak_of(lambda: held.extend([full_model_state(model), full_optimizer_state(engine)])),
    }
    live = {t.untyped_storage().data_ptr() for slot in engine.slots for t in slot.tensors()}
    engine.close()
    numel = sum(p.numel() for p in model.parameters())  # DTensors: the whole parameters'
    return {"numel": numel, "measured": measured, "gathered_bytes": copied_bytes(held, live)}


def copied_bytes(obj, live: set[int]) -> int:
    """The bytes of the tensors in a nested structure of dicts and lists, but for views of ``live`` storages
    (at one rank the full state is the shards and moments themselves)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return 0 if obj.untyped_storage().data_ptr() in live else obj.nbytes
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    return sum(copied_bytes(value, live) for value in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--cpu-state", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--label", default="")
    args = parser.parse_args()

    from lightning_zero_offload.testing.ranks import run_ranks

    work = Path(tempfile.mkdtemp(prefix="params-ckpt-"))
    path = work / "last.ckpt"
    part = functools.partial(ranks_part, str(path), args.params, args.width, args.cpu_state)
    ranks = run_ranks(part, args.world, work, timeout=1800)
    numel = ranks[0]["numel"]

    def per_param(extra: int, seconds: float | None = None) -> dict[str, float]:
        shown = {"MB": round(extra / MB, 1), "B/param": round(extra / numel, 3)}
        return shown if seconds is None else {**shown, "s": round(seconds, 2)}

    output, folder = work / "model.pt", work / "hf"
    hugging_face = [str(path), str(folder), "--safetensors", "--max-shard-size", "100MB"]
    fresh = {
        "zero-offload-convert (fresh process)": fresh_peak(f"export.main([{str(path)!r}, {str(output)!r}])"),
        "zero-offload-convert --safetensors (fresh process)": fresh_peak(f"export.main({hugging_face!r})"),
        "load_sharded_full (fresh process)": fresh_peak(f"whole = distributed.load_sharded_full({str(path)!r})"),
    }
    element = 2 if args.cpu_state == "bf16" else 4
    summary = {
        "params": numel,
        "world": args.world,
        "cpu_state": args.cpu_state,
        "model_MB": round(numel * element / MB, 1),
        "export_MB": round(output.stat().st_size / MB, 1),
        "safetensors_MB": round(sum(f.stat().st_size for f in folder.iterdir()) / MB, 1),
        "checkpoint_MB": round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / MB, 1),
        "largest_tensor_MB": round(args.width * args.width * 4 / MB, 1),
        "gathered_MB_per_rank": [round(rank["gathered_bytes"] / MB, 1) for rank in ranks],
        "extra_rss_per_rank": [{name: per_param(*peak) for name, peak in rank["measured"].items()} for rank in ranks],
        "extra_rss": {name: per_param(extra) for name, extra in fresh.items()},
    }
    print(json.dumps(summary, indent=2))
    RESULTS.mkdir(exist_ok=True)
    name = "params_checkpoint_memory" + (f"_{args.label}" if args.label else "") + ".json"
    (RESULTS / name).write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
