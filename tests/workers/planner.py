"""What the planner is compared with at several ranks: the bytes the engine's buffers really hold, and each
configuration's planned host state next to the engine's ledger (top-level functions, so ``ranks.run_ranks``
can start them)."""

import torch

from lightning_zero_offload.engine import OffloadEngine, OffloadOptions
from lightning_zero_offload.planner.memory import host_memory
from lightning_zero_offload.planner.shape import LayoutSummary


def host_tensor_bytes(root: object) -> int:
    """Bytes of every distinct CPU storage reachable from the engine's own objects (what it really holds)."""
    storages: dict[int, int] = {}
    seen: set[int] = set()

    def visit(obj: object) -> None:
        if id(obj) in seen or isinstance(obj, torch.optim.Optimizer):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" and obj.numel():
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, list | tuple):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)
        elif type(obj).__module__.startswith("lightning_zero_offload") and hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                visit(item)

    visit(root)
    return sum(storages.values())


def ledger_at_two_ranks(rank: int) -> list[tuple]:
    """At two gloo ranks, each configuration's planned host state bytes next to the engine's ledger and the
    bytes its buffers really hold (top-level: ranks.run_ranks starts it)."""
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for cpu_state in ("fp32", "bf16") if dtype != torch.float16 else ("fp32",):
            for schedule in ("sync", "speculative", "delayed"):
                model = torch.nn.Sequential(torch.nn.Linear(301, 200), torch.nn.ReLU(), torch.nn.Linear(200, 71))
                options = OffloadOptions(bucket_size_mb=0.1, cpu_threads=1, cpu_step=schedule, cpu_state=cpu_state)
                engine = OffloadEngine(torch.optim.AdamW(model.parameters()), torch.device("cpu"), dtype, options)
                try:
                    params = sum(p.numel() for p in model.parameters())
                    predicted = host_memory(LayoutSummary.of(engine.layout), dtype, engine.resolved, 1, "cpu", params)
                    held = sum(n for name, n in predicted.per_rank.items() if name != "device_grad_buckets")
                    report = engine.memory_report()["host_state_bytes"]
                    rows.append((str(dtype), cpu_state, schedule, predicted.state_per_rank, report, held,
                                 host_tensor_bytes(engine), engine.layout.shard_numel))  # fmt: skip
                finally:
                    engine.close()
    return rows


def least_memory_over_ranks(rank: int) -> list[int]:
    """``device_share="auto"``'s agreement: each rank's own numbers in, the least of each out, on every rank."""
    from lightning_zero_offload.engine.infra.collectives import least_over_ranks

    return least_over_ranks([2**40 + rank, 7 * 2**30 - rank, 0.25 + rank, -0.5 * rank], 2, torch.device("cpu"))
