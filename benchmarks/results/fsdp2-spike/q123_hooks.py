"""Q1-Q3: fully_shard + CPUOffloadPolicy on a CPU device with gloo; dtypes; the post-accumulate-grad hook; accumulation."""
import threading, torch, torch.distributed as dist
from common import *

def rank_fn(rank, mp_name):
    torch.manual_seed(0)
    model = Net()
    mp = None if mp_name == "none" else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard(model, mp)
    out = {"world": dist.get_world_size(), "mp": mp_name}
    p0 = model.blocks[0].fc1.weight
    out["param"] = f"type={type(p0).__name__} placements={p0.placements} local: dtype={p0.to_local().dtype} device={p0.to_local().device} shape={tuple(p0.to_local().shape)} global={tuple(p0.shape)}"
    events = []
    snap = {}
    names = {p: n for n, p in model.named_parameters()}
    def hook(p):
        g = p.grad
        loc = g.to_local()
        events.append(f"{names[p]} thread={threading.current_thread().name} grad={type(g).__name__} dtype={loc.dtype} dev={loc.device} dptr_is_view_of_shared={loc.untyped_storage().nbytes() != loc.numel()*loc.element_size()}")
        snap.setdefault(names[p], []).append(loc.clone())
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(rank))
    # -- plain backward
    model(x).pow(2).mean().backward()
    out["main_thread"] = threading.current_thread().name
    out["events_sync"] = list(events)
    g0 = p0.grad
    out["grad"] = f"type={type(g0).__name__} local: dtype={g0.to_local().dtype} device={g0.to_local().device}"
    out["hook_grad_equals_final"] = all(torch.equal(snap[n][-1], p.grad.to_local()) for n, p in model.named_parameters())
    # -- accumulation: micro-batch 1 without sync, micro-batch 2 with sync
    for p in model.parameters():
        p.grad = None
    events.clear(); snap.clear()
    model.set_requires_gradient_sync(False)
    model(x).pow(2).mean().backward()
    out["after_nosync_events"] = len(events)
    out["after_nosync_sharded_grad_none"] = all(p.grad is None for p in model.parameters())
    fp = model.blocks[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    ug = fp._unsharded_param.grad if hasattr(fp, "_unsharded_param") else None
    acc = fp.unsharded_accumulated_grad
    out["unsynced_grad_where"] = (f"unsharded_param.grad: {None if ug is None else (ug.dtype, ug.device, tuple(ug.shape))}; "
                                  f"unsharded_accumulated_grad: {None if acc is None else (acc.dtype, acc.device, tuple(acc.shape))}")
    model.set_requires_gradient_sync(True)
    model(x).pow(2).mean().backward()
    out["after_sync_events"] = len(events)
    out["events_per_param_after_sync"] = sorted({len(v) for v in snap.values()})
    return out

def main():
    for world in (1, 2):
        for mp in ("none", "bf16"):
            res = launch(rank_fn, world, mp_name=mp)
            for r, o in enumerate(res):
                if r and world > 1 and o.get("mp") == mp:
                    # print only rank 1 differences briefly
                    print(f"  rank1 events order: {[e.split()[0] for e in o['events_sync']]}")
                    continue
                print(f"== world={world} mp={mp} rank={r}")
                for k, v in o.items():
                    if k == "events_sync":
                        print("  hook events (order):")
                        for e in v: print("    ", e)
                    else:
                        print(f"  {k}: {v}")

if __name__ == "__main__":
    main()
