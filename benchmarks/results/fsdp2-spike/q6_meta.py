"""Q6: meta-device init -> fully_shard -> to_empty(cpu) -> reset_parameters per module, with CPUOffloadPolicy."""
import gc, torch, torch.nn as nn, torch.distributed as dist
from common import *
from q5_memory import Stack, reset_peak, W, NB
from torch.distributed.tensor import DTensor

def rank_fn(rank, big):
    torch.manual_seed(0)
    out = {}
    base = rss_mb(); reset_peak()
    with torch.device("meta"):
        model = Stack() if big else Net()
    shard(model)
    p = next(model.parameters())
    out["after_shard"] = f"param {type(p).__name__} local device={p.to_local().device}"
    model.to_empty(device="cpu")
    p = next(model.parameters())
    out["after_to_empty"] = f"local device={p.to_local().device} dtype={p.to_local().dtype}"
    for m in model.modules():
        if hasattr(m, "reset_parameters") and m is not model:
            m.reset_parameters()
    gc.collect()
    out["rss_MB"] = rss_mb() - base; out["peak_MB"] = hwm_mb() - base
    out["local_param_MB"] = sum(q.to_local().numel() * 4 for q in model.parameters()) / 2**20
    out["full_model_MB"] = sum(q.numel() * 4 for q in model.parameters()) / 2**20
    w = model.blocks[0].lin.weight if big else model.blocks[0].fc1.weight
    out["local_w"] = w.to_local()[:2, :4].clone()
    out["local_std"] = w.to_local().std().item()
    out["finite"] = all(torch.isfinite(q.to_local()).all().item() for q in model.parameters())
    # Does a training step run after meta init?
    x = torch.randn(2, W if big else D)
    model(x).float().pow(2).mean().backward()
    out["backward_ok"] = all(q.grad is not None for q in model.parameters())
    if not big:
        # Reference: the same seed, built eagerly (unsharded), then fully_shard: equal shards?
        torch.manual_seed(0)
        eager = shard(Net())
        out["equal_to_eager_init"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), eager.parameters()))
    return out

def main():
    for world, big in ((1, False), (2, False), (1, True), (2, True)):
        res = launch(rank_fn, world, big=big)
        print(f"== world={world} model={'Stack 100.7M' if big else 'Net (small)'}")
        for r, o in enumerate(res):
            print(f"  rank {r}: " + "; ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in o.items() if k != "local_w"))
        if world == 2:
            print(f"  rank0 and rank1 local shards of blocks[0] weight identical (first 2x4): {torch.equal(res[0]['local_w'], res[1]['local_w'])}")
            print(f"  rank0 local_w[:2,:4]={res[0]['local_w'].tolist()}\n  rank1 local_w[:2,:4]={res[1]['local_w'].tolist()}")

if __name__ == "__main__":
    main()
