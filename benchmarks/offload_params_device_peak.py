"""The planner's device memory for ``offload_params=True`` against FSDP2's device-side buffers, measured on
the CPU device (gloo, 1 and 2 ranks), for fp32 and bf16 compute, fp32 and bf16 CPU state, sync and
speculative CPU steps, driving the real engine (``ParamOffloadEngine`` over ``shard_model``).

    python benchmarks/offload_params_device_peak.py             # 8 transformer blocks of width 1024
    python benchmarks/offload_params_device_peak.py --tiny      # seconds: 3 blocks of width 64

How it measures. On the CPU device FSDP2's "device" buffers (all-gather outputs and the unsharded
parameters, autograd's unsharded gradients, the reduce-scatter input and output) are allocations of the
CPU allocator, beside the host's (shards, moments, the CPU step). One step, after a warm-up step, runs
under ``torch.profiler.profile(profile_memory=True, with_stack=True)``: every allocation and free with its
address, size, time, thread and the Python frames that made it. Each allocation of the training thread
between the start of forward and the end of backward is put in the category of the frame that made it:

- ``gathered``: under FSDP2's own frames (``_fully_shard/``) outside ``foreach_reduce``: the all-gather
  outputs, the unsharded parameters, the casts to the compute dtype;
- ``reduce``: under ``foreach_reduce``: the fp32 reduce-scatter input, its output, the cast of the output
  to the state's dtype. On the CPU device the output (or its cast) *is* the host gradient; on a GPU it
  is copied to the host and freed when ``foreach_reduce`` returns, so its device lifetime is cut there;
- ``param_grads``: autograd's allocations in backward that FSDP2 frees in ``foreach_reduce`` (the
  unsharded gradients, after their copy into the reduce-scatter input);
- ``activation_grads``: autograd's other allocations in backward;
- ``activations``: forward's allocations outside FSDP2 (the input included);
- ``cpu_only``, not counted: what only the CPU device allocates, gloo's buffers in the collectives (NCCL
  keeps its own outside torch's allocator), the copies of the CPU's ``chunk_cat`` (CUDA's is one
  kernel that allocates nothing) and a matrix product's scratch, freed before the product returns (oneDNN's
  reorders and scratchpad, on CPUs with AMX or AVX-512 bf16; cuBLAS works in a workspace it keeps);
- left out: the engine's frames (``lightning_zero_offload/engine/``: its hook, its step), other threads
  (the speculative step's worker), anything outside forward and backward.

The device figure is the peak over time of the live bytes of the counted categories (``device_peak``),
and of the first three alone (``fsdp_peak``), beside the planner's figure for the same model
(``device_memory_params``, ``activation_estimate``). Not measurable here: the copy of each shard to the
device before its cast (``.to(device)`` is a no-op on the CPU device): on a GPU one tensor's shard at a
time at one rank, a unit's input at several ranks, freed before the unit computes (the planner's
"gathering" moment, which it binds only at one rank with a cast: up to the largest tensor in the state's
dtype above what is measured here).

Private pieces read (as a benchmark may): FSDP2's function names and the profiler's event tree
(``prof.profiler.kineto_results.experimental_event_tree()``).

Writes ``benchmarks/results/offload_params/device_peak.json`` (``--tiny``: ``device_peak_tiny.json``).
"""

import argparse
import functools
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results" / "offload_params"
MB = 2**20
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
DEVICE_KINDS = ("gathered", "param_grads", "reduce", "activation_grads", "activations")
FSDP_KINDS = ("gathered", "param_grads", "reduce")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Config:
    compute: str  # MixedPrecisionPolicy.param_dtype: fp32 or bf16 (bf16 runs forward under autocast)
    cpu_state: str  # the engine's state: fp32 or bf16 (the sharded parameters themselves in bf16)
    cpu_step: str  # sync or speculative


CONFIGS = tuple(
    Config(compute, state, step)
    for compute, state in (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"))
    for step in ("sync", "speculative")
)


def build(width: int, blocks: int, heads: int, vocab: int = 0, tied: bool = False):
    """The demo GPT's pre-LN transformer blocks in a ModuleList and a final norm (the root's only parameters);
    with ``vocab``, a language model: a token embedding before them and an output head after, both smaller
    than a block, so the root holds them (``tied``: one weight), their gradients FSDP2's last to reduce."""
    from torch import nn

    from lightning_zero_offload.demo.model import Block

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width) if vocab else None
            self.blocks = nn.ModuleList(Block(width, heads, 0.0) for _ in range(blocks))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False) if vocab else None
            if tied:
                self.head.weight = self.embed.weight

        def forward(self, x):
            if self.embed is not None:
                x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            x = self.norm(x)
            return self.head(x) if self.head is not None else x

    return Stack()


# -- the measurement --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frames:
    """What a profiler event runs under."""

    engine: bool = False  # this project's engine (its hook, its step): host memory
    fsdp: bool = False  # FSDP2's own code
    reduce_end: int | None = None  # the end (ns) of the foreach_reduce call it runs in
    collective: bool = False  # a c10d collective: gloo's own temporaries
    cpu_kernel: bool = False  # the CPU's chunk_cat (a GPU's fused kernel allocates nothing)
    matmul_end: int | None = None  # the end (ns) of the matrix product it runs in

    def under(self, node) -> "Frames":
        name = node.name
        if "lightning_zero_offload/engine/" in name:
            return replace(self, engine=True)
        if "/fsdp/_fully_shard/" in name:
            end = node.end_time_ns if name.endswith(": foreach_reduce") else self.reduce_end
            return replace(self, fsdp=True, reduce_end=end)
        if name.startswith("c10d::") or "distributed_c10d.py" in name:
            return replace(self, collective=True)
        if "chunk_cat" in name:
            return replace(self, cpu_kernel=True)
        if name in MATMULS:
            return replace(self, matmul_end=node.end_time_ns)
        return self


@dataclass
class Allocation:
    size: int
    start: int
    kind: str
    reduce_end: int | None
    matmul_end: int | None = None
    end: int | None = None
    freed_in_reduce: bool = False


def kind_of(frames: Frames, time: int, forward: tuple[int, int], backward: tuple[int, int]) -> str:
    if frames.engine or not forward[0] <= time <= backward[1]:
        return "host"
    if frames.collective or frames.cpu_kernel:
        return "cpu_only"
    if frames.reduce_end is not None:
        return "reduce"
    if frames.fsdp:
        return "gathered"
    return "activations" if time <= forward[1] else "autograd"


def allocations(prof, forward: tuple[int, int], backward: tuple[int, int], main_tid: int) -> list[Allocation]:
    """The training thread's allocations of forward and backward, each paired with its free, in a category
    (the module's docstring); the others (host, other threads) are left out."""
    from torch._C._profiler import _EventType

    events = []  # (time, is a free, address, size, frames, thread)
    stack = [(root, Frames()) for root in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, frames = stack.pop()
        frames = frames.under(node)
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            events.append((node.start_time_ns, f.alloc_size < 0, f.ptr, abs(f.alloc_size), frames, node.start_tid))
        stack.extend((child, frames) for child in node.children)
    events.sort(key=lambda e: e[:2])
    live: dict[int, Allocation] = {}
    made = []
    for time, is_free, ptr, size, frames, tid in events:
        if is_free:
            if (allocation := live.pop(ptr, None)) is not None:
                allocation.end, allocation.freed_in_reduce = time, frames.reduce_end is not None
            continue
        kind = kind_of(frames, time, forward, backward) if tid == main_tid else "host"
        live[ptr] = Allocation(size, time, kind, frames.reduce_end, frames.matmul_end)
        made.append(live[ptr])
    for a in made:
        if a.matmul_end is not None and a.end is not None and a.end <= a.matmul_end:
            a.kind = "cpu_only"  # the product's scratch (the module's docstring)
        if a.kind == "autograd":  # the unsharded gradients are freed by FSDP2 once copied into the reduce input
            a.kind = "param_grads" if a.freed_in_reduce else "activation_grads"
        if a.kind == "reduce" and (a.end is None or a.end > backward[1]):  # on the CPU device: the host gradient
            a.end = a.reduce_end  # on a GPU: copied to the host, freed as foreach_reduce returns
    return [a for a in made if a.kind != "host"]


def peaks(device: list[Allocation]) -> dict:
    """The peak of the device categories' live bytes and what made it up; the same for FSDP2's buffers
    alone, for the activations alone, and for what only the CPU device allocates."""
    changes = sorted(
        [(a.start, 1, a) for a in device] + [(a.end, 0, a) for a in device if a.end is not None],
        key=lambda c: c[:2],
    )
    live = dict.fromkeys((*DEVICE_KINDS, "cpu_only"), 0)
    found = {"device": (-1, {}), "fsdp": (-1, {}), "activations": (-1, {}), "cpu_only": (-1, {})}
    groups = {"device": DEVICE_KINDS, "fsdp": FSDP_KINDS, "activations": ("activations",), "cpu_only": ("cpu_only",)}
    for _, is_alloc, a in changes:
        live[a.kind] += a.size if is_alloc else -a.size
        for name, kinds in groups.items():
            total = sum(live[k] for k in kinds)
            if total > found[name][0]:
                found[name] = (total, dict(live))
    return {
        "device_peak": found["device"][0],
        "at_device_peak": found["device"][1],
        "fsdp_peak": found["fsdp"][0],
        "at_fsdp_peak": found["fsdp"][1],
        "activations_peak": found["activations"][0],
        "cpu_only_peak": found["cpu_only"][0],
    }


def scope(prof, name: str) -> tuple[int, int, int]:
    """(start ns, end ns, thread) of the record_function scope ``name`` in the profiler's event tree."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.name == name:
            return node.start_time_ns, node.end_time_ns, node.start_tid
        stack.extend(node.children)
    raise LookupError(name)


def train_step(model, engine, x_shape: tuple[int, ...], compute: str, vocab: int = 0) -> None:
    """One optimizer step through the engine, forward and backward in named scopes (``vocab``: token inputs
    of ``x_shape[:2]``, else hidden states of ``x_shape``)."""
    import torch
    from torch.profiler import record_function

    engine.expect_step(publish_early=True)
    engine.begin_backward()
    bf16 = compute == "bf16"
    with record_function("bench::forward"), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        generator = torch.Generator().manual_seed(1)
        if vocab:
            x = torch.randint(0, vocab, x_shape[:2], generator=generator)
        else:
            x = torch.randn(x_shape, generator=generator)
            x = x.to(torch.bfloat16) if bf16 else x  # bf16: an embedding's output
        loss = model(x).float().square().mean()
    with record_function("bench::backward"):
        engine.scale_loss(loss).backward()
    engine.finish_backward()
    engine.step()
    engine.zero_grad()


def measure(model, engine, x_shape: tuple[int, ...], compute: str, vocab: int = 0) -> dict:
    """A warm-up step (FSDP2's lazy init, the gradients' first allocation), then one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    train_step(model, engine, x_shape, compute, vocab)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        train_step(model, engine, x_shape, compute, vocab)
    forward, backward = scope(prof, "bench::forward"), scope(prof, "bench::backward")
    return peaks(allocations(prof, forward[:2], backward[:2], forward[2]))


def planned(
    width: int, blocks: int, heads: int, vocab: int, tied: bool, batch: int, seq: int, world: int, config: Config
) -> dict:
    """The planner's device figure (``device_memory_params``, bytes) and activation estimate for this model
    (built on the meta device), rank count and dtypes, with the units it sees."""
    import torch

    from lightning_zero_offload.planner.memory import activation_estimate
    from lightning_zero_offload.planner.offload_params import device_memory_params, fsdp_units
    from lightning_zero_offload.planner.shape import ModelShape

    with torch.device("meta"):
        model = build(width, blocks, heads, vocab, tied)
    units = fsdp_units(ModelShape.of(model), blocks, world)
    compute, state = (getattr(torch, DTYPES[d]) for d in (config.compute, config.cpu_state))
    activations = activation_estimate(batch, seq, width, blocks, compute, False).bytes
    return {
        "units": units.units,
        "largest_unit": units.largest_unit,
        **device_memory_params(units, compute, state),
        "activations": activations,
    }


def rank_run(
    width: int,
    blocks: int,
    heads: int,
    vocab: int,
    tied: bool,
    batch: int,
    seq: int,
    configs: tuple[Config, ...],
    rank: int,
):
    """Each configuration on a fresh model, sharded by the engine's placement: its measured peaks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero_offload.engine import OffloadOptions
    from lightning_zero_offload.engine.offload_params import ParamOffloadEngine
    from lightning_zero_offload.engine.offload_params.placement import shard_model

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = []
    for config in configs:
        compute = getattr(torch, DTYPES[config.compute])
        torch.manual_seed(0)
        model = build(width, blocks, heads, vocab, tied).to(getattr(torch, DTYPES[config.cpu_state]))
        shard_model(model, mesh, param_dtype=compute)
        options = OffloadOptions(offload_params=True, cpu_step=config.cpu_step, cpu_state=config.cpu_state)
        optimizer = torch.optim.AdamW(model.parameters())
        engine = ParamOffloadEngine(optimizer, torch.device("cpu"), compute, options, dist.get_world_size())
        measured = measure(model, engine, (batch, seq, width), config.compute, vocab)
        engine.close()
        results.append({"rank": rank, **asdict(config), **measured})
    return results


def row(config: Config, world: int, plan: dict, measured: dict) -> dict:
    """One configuration, planned beside measured: per block (FSDP2's buffers, the root's parameters aside:
    the measured "gathered" holds them) and in all (with the activations)."""
    unit, root = plan["largest_unit"], plan["root_params"]
    blocks = plan["blocks_in_flight"] + plan["backward_buffers"]
    total = root + blocks + plan["activations"]
    return {
        "world": world,
        **asdict(config),
        "planned": plan,
        "measured": measured,
        "planned_per_block_B_per_param": blocks / unit,
        "measured_per_block_B_per_param": (measured["fsdp_peak"] - root) / unit,
        "per_block_ratio": blocks / (measured["fsdp_peak"] - root),
        "planned_total": total,
        "total_ratio": total / measured["device_peak"],
        # FSDP2's buffers alone (the root's parameters with them): what the activation estimate leaves out
        # (a language model's logits) aside
        "fsdp_ratio": (root + blocks) / measured["fsdp_peak"],
    }


COLUMNS = (  # (header, width, value of a row, format)
    ("ranks", 5, lambda r: r["world"], "d"),
    ("compute", 7, lambda r: r["compute"], "s"),
    ("state", 5, lambda r: r["cpu_state"], "s"),
    ("cpu_step", 11, lambda r: r["cpu_step"], "s"),
    ("| plan: root", 11, lambda r: r["planned"]["root_params"] / MB, ".2f"),
    ("blocks", 6, lambda r: r["planned"]["blocks_in_flight"] / MB, ".1f"),
    ("bwd", 6, lambda r: r["planned"]["backward_buffers"] / MB, ".1f"),
    ("act", 5, lambda r: r["planned"]["activations"] / MB, ".1f"),
    ("total", 6, lambda r: r["planned_total"] / MB, ".1f"),
    ("| peak: gathered", 15, lambda r: r["measured"]["at_device_peak"]["gathered"] / MB, ".1f"),
    ("pgrads", 6, lambda r: r["measured"]["at_device_peak"]["param_grads"] / MB, ".1f"),
    ("reduce", 6, lambda r: r["measured"]["at_device_peak"]["reduce"] / MB, ".1f"),
    ("agrads", 6, lambda r: r["measured"]["at_device_peak"]["activation_grads"] / MB, ".1f"),
    ("act", 5, lambda r: r["measured"]["at_device_peak"]["activations"] / MB, ".1f"),
    ("total", 6, lambda r: r["measured"]["device_peak"] / MB, ".1f"),
    ("| act peak", 10, lambda r: r["measured"]["activations_peak"] / MB, ".1f"),
    ("| B/param/block: plan", 20, lambda r: r["planned_per_block_B_per_param"], ".2f"),
    ("meas", 5, lambda r: r["measured_per_block_B_per_param"], ".2f"),
    ("ratio", 5, lambda r: r["per_block_ratio"], ".2f"),
    ("| total ratio", 13, lambda r: r["total_ratio"], ".2f"),
    ("fsdp ratio", 10, lambda r: r["fsdp_ratio"], ".2f"),
)


def report(rows: list[dict]) -> str:
    """The table printed: MB planned (root's parameters, blocks in flight, their backward's buffers,
    activations) and measured at the device peak (by category), then per block and in all."""
    lines = [" ".join(f"{name:>{width}}" for name, width, _, _ in COLUMNS)]
    for r in rows:
        lines.append(" ".join(f"{value(r):>{width}{form}}" for _, width, value, form in COLUMNS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=0, help="a language model: embedding and head in the root")
    parser.add_argument("--tied", action="store_true", help="with --vocab: the head's weight is the embedding's")
    parser.add_argument("--ranks", type=int, nargs="+", help="world sizes (default: 1 2; --tiny: 1)")
    parser.add_argument("--tiny", action="store_true", help="3 blocks of width 64, sequence 8, two configs")
    parser.add_argument("--out", type=Path, help="the JSON file (default: benchmarks/results/offload_params/)")
    args = parser.parse_args(argv)
    configs = CONFIGS
    if args.tiny:
        args.width, args.blocks, args.heads, args.seq = 64, 3, 4, 8
        configs = (CONFIGS[0], CONFIGS[3])
    ranks = args.ranks or ([1] if args.tiny else [1, 2])
    from lightning_zero_offload.testing.ranks import run_ranks

    shape = (args.width, args.blocks, args.heads, args.vocab, args.tied)
    rows = []
    for world in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            fn = functools.partial(rank_run, *shape, args.batch, args.seq, configs)
            by_rank = run_ranks(fn, world, tmp, timeout=1800)
        for index, config in enumerate(configs):
            measured = by_rank[0][index]  # every rank holds the same buffers (the shards are even or padded)
            others = [r[index]["fsdp_peak"] for r in by_rank[1:]]
            assert all(o == measured["fsdp_peak"] for o in others), (measured["fsdp_peak"], others)
            rows.append(row(config, world, planned(*shape, args.batch, args.seq, world, config), measured))
    text = report(rows)
    print(text)
    out = args.out or RESULTS / ("device_peak_tiny.json" if args.tiny else "device_peak.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    setup = {"width": args.width, "blocks": args.blocks, "heads": args.heads, "batch": args.batch, "seq": args.seq}
    setup |= {"vocab": args.vocab, "tied": args.tied}
    out.write_text(json.dumps({"setup": setup, "rows": rows, "printed": text}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
