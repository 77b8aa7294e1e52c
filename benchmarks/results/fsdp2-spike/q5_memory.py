"""Q5: host RSS growth per parameter for a ~100M-parameter stack of Linear blocks at 1 rank, fp32 and bf16 shards."""
import gc, os, math, torch, torch.nn as nn, torch.distributed as dist
from common import *
from lightning_zero_offload import kernels

W, NB = 2048, 24                                      # 24 x (2048x2048 + 2048) = 100.7M params

class LinBlock(nn.Module):
    def __init__(self):
        super().__init__(); self.lin = nn.Linear(W, W)
    def forward(self, x):
        return torch.relu(self.lin(x)) + x

class Stack(nn.Module):
    def __init__(self):
        super().__init__(); self.blocks = nn.ModuleList([LinBlock() for _ in range(NB)])
    def forward(self, x):
        for b in self.blocks: x = b(x)
        return x

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f: f.write("5")

def rank_fn(rank, dtype_name, pin):
    torch.manual_seed(0)
    gc.collect()
    out = {"dtype": dtype_name, "pin": pin}
    base = rss_mb(); out["rss_base"] = base
    reset_peak()
    model = Stack()
    N = sum(p.numel() for p in model.parameters()); out["N"] = N
    dt = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    if dt == torch.bfloat16:
        model.to(torch.bfloat16)
    out["rss_built"] = rss_mb() - base
    mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32)
    try:
        shard(model, mp, pin=pin)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:500]; return out
    gc.collect()
    out["rss_sharded"] = rss_mb() - base; out["peak_setup"] = hwm_mb() - base
    params = list(model.parameters())
    out["param_local"] = f"{params[0].to_local().dtype} pinned={params[0].to_local().is_pinned()}"
    if dt == torch.bfloat16:
        st = [(torch.zeros_like(p.to_local()), torch.zeros_like(p.to_local())) for p in params]   # bf16 moments
    else:
        st = [(torch.zeros_like(p.to_local()), torch.zeros_like(p.to_local())) for p in params]   # fp32 moments
    out["rss_with_moments"] = rss_mb() - base
    hp = kernels.AdamArgs(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    reset_peak()
    x = torch.randn(4, W, dtype=dt)
    for s in range(2):
        model(x).float().pow(2).mean().backward()
        if s == 0:
            g = params[0].grad.to_local()
            out["grad_local"] = f"{g.dtype} {g.device} pinned={g.is_pinned()} storage_bytes={g.untyped_storage().nbytes()} own_bytes={g.numel()*g.element_size()}"
            out["rss_after_backward1"] = rss_mb() - base
        with torch.no_grad():
            for p, (m, v) in zip(params, st):
                if dt == torch.bfloat16:
                    kernels.adam_step_bf16_state(p.to_local(), p.grad.to_local(), m, v, hparams=hp, step=s + 1, seed=1)
                else:
                    kernels.adam_step(p.to_local(), p.grad.to_local(), m, v, hparams=hp, step=s + 1)
    out["rss_after_2_steps"] = rss_mb() - base; out["peak_training"] = hwm_mb() - base
    fs = model._get_fsdp_state()
    rs = fs._comm_ctx.reduce_scatter_states
    out["fsdp_reduce_scatter_inputs_held_MB"] = sum(x.reduce_scatter_input.untyped_storage().nbytes() for x in rs) / 2**20
    ag, un = 0, 0
    for b in model.blocks:
        for fp in b._get_fsdp_state()._fsdp_param_group.fsdp_params:
            ag += sum(t.untyped_storage().nbytes() for t in fp.all_gather_outputs)
            if hasattr(fp, "_unsharded_param"):
                un += fp._unsharded_param.untyped_storage().nbytes()
    out["fsdp_all_gather_outputs_held_MB"] = ag / 2**20
    out["fsdp_unsharded_params_held_MB"] = un / 2**20
    out["max_input_buffers"] = fs._comm_ctx.reduce_scatter_max_input_buffers
    grad_bytes = sum(p.grad.to_local().untyped_storage().nbytes() for p in params[::2])  # weight+bias share a flat buffer per block
    out["grad_storage_MB_total"] = grad_bytes / 2**20
    out["per_param_B"] = out["rss_after_2_steps"] * 2**20 / N
    return out

def main():
    print("MALLOC_MMAP_THRESHOLD_ =", os.environ.get("MALLOC_MMAP_THRESHOLD_"))
    world = int(os.environ.get("WORLD", "1"))
    for dtype_name in os.environ.get("DTYPES", "fp32,bf16").split(","):
        res = launch(rank_fn, world, dtype_name=dtype_name, pin=False)
        for r, o in enumerate(res):
          print(f"== {dtype_name} sharded param, world {world}, rank {r}, pin_memory=False")
          for k, v in o.items():
              print(f"  {k}: {v:.1f}" if isinstance(v, float) else f"  {k}: {v}")

if __name__ == "__main__":
    main()
