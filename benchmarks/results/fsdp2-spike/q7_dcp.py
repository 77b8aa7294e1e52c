"""Q7: torch.distributed.checkpoint of model + our moments (sharded DTensors) on CPU/gloo; save at 2 ranks, load at 1 and 3.
A: moments as a plain nested dict of DTensors (views of our local buffers).
B: a minimal torch.optim.Optimizer subclass holding the same DTensor views, through get_state_dict/set_state_dict."""
import tempfile
import os, sys, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, set_model_state_dict, get_state_dict,
                                                     set_state_dict, StateDictOptions)
from torch.distributed.tensor import DTensor
from common import *
from lightning_zero_offload import kernels

CKPT = os.path.join(tempfile.gettempdir(), "dcp-spike")  # one path for every rank process

def as_dtensor(local, p):
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

class KernelAdam(torch.optim.Optimizer):
    """Holds our moments for DCP; the step is the kernel on the local shards."""
    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0))
        for g in self.param_groups:
            for p in g["params"]:
                loc = p.to_local()
                self.state[p] = {"step": torch.tensor(0.0), "exp_avg": as_dtensor(torch.zeros_like(loc), p),
                                 "exp_avg_sq": as_dtensor(torch.zeros_like(loc), p)}
    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            hp = kernels.AdamArgs(lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"], weight_decay=g["weight_decay"], adamw_mode=True)
            for p in g["params"]:
                st = self.state[p]; st["step"] += 1
                loc = p.to_local()
                if loc.numel():
                    kernels.adam_step(loc, p.grad.to_local(), st["exp_avg"].to_local(), st["exp_avg_sq"].to_local(), hparams=hp, step=int(st["step"]))

def train(model, opt, steps=2):
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(8, D, generator=g)
        r, w = dist.get_rank(), dist.get_world_size()
        model(x[r * 8 // w:(r + 1) * 8 // w]).pow(2).mean().backward()
        opt.step(); opt.zero_grad()

def full_state(model, opt):
    out = {}
    for n, p in model.named_parameters():
        st = opt.state[p]
        out[n] = p.full_tensor().clone()
        out[n + ".exp_avg"] = st["exp_avg"].full_tensor().clone()
        out[n + ".exp_avg_sq"] = st["exp_avg_sq"].full_tensor().clone()
        out[n + ".step"] = st["step"].clone()
    return out

def save_fn(rank):
    torch.manual_seed(0)
    model = shard(Net()); opt = KernelAdam(model.parameters())
    train(model, opt)
    res = {"full": full_state(model, opt)}
    # A: plain dict of DTensors
    osd = {n: {"exp_avg": opt.state[p]["exp_avg"], "exp_avg_sq": opt.state[p]["exp_avg_sq"], "step": opt.state[p]["step"]}
           for n, p in model.named_parameters()}
    dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=CKPT + "_A")
    # B: through get_state_dict with our Optimizer subclass
    msd, osd_b = get_state_dict(model, opt)
    k0 = next(iter(osd_b["state"]))
    res["B_optim_keys"] = f"state key example: {k0!r} -> {sorted(osd_b['state'][k0])}; types: {type(osd_b['state'][k0]['exp_avg']).__name__}"
    dcp.save({"model": msd, "optim": osd_b}, checkpoint_id=CKPT + "_B")
    return res

def load_fn(rank, how):
    torch.manual_seed(123)                      # different init: everything must come from the checkpoint
    model = shard(Net()); opt = KernelAdam(model.parameters())
    ptrs = {id(p): (opt.state[p]["exp_avg"].to_local().data_ptr(), opt.state[p]["step"]) for p in model.parameters()}
    if how == "A":
        osd = {n: {"exp_avg": opt.state[p]["exp_avg"], "exp_avg_sq": opt.state[p]["exp_avg_sq"], "step": opt.state[p]["step"]}
               for n, p in model.named_parameters()}
        sd = {"model": get_model_state_dict(model), "optim": osd}
        dcp.load(sd, checkpoint_id=CKPT + "_A")  # in place into the DTensors (views of our buffers)
        set_model_state_dict(model, sd["model"])
        for n, p in model.named_parameters():   # step is a 0-dim plain tensor: loaded into a new object?
            opt.state[p]["step"] = sd["optim"][n]["step"]
    else:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=CKPT + "_B")
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    p0 = next(model.parameters())
    same_buf = all(opt.state[p]["exp_avg"].to_local().data_ptr() == ptrs[id(p)][0] for p in model.parameters())
    same_step_obj = all(opt.state[p]["step"] is ptrs[id(p)][1] for p in model.parameters())
    return {"full": full_state(model, opt), "state_type": f"{type(opt.state[p0]['exp_avg']).__name__}, moments loaded in place into the pre-existing buffers: {same_buf}, step tensor same object: {same_step_obj}"}

def main():
    import shutil
    for d in (CKPT + "_A", CKPT + "_B"):
        shutil.rmtree(d, ignore_errors=True)
    saved = launch(save_fn, 2)
    print("saved at 2 ranks;", saved[0]["B_optim_keys"])
    ref = saved[0]["full"]
    for how in ("A", "B"):
        for world in (1, 3):
            try:
                res = launch(load_fn, world, how=how)
            except Exception as e:
                print(f"== load {how} at world={world}: FAILED: {str(e)[-1500:]}"); continue
            got = res[0]["full"]
            diffs = {k: torch.equal(got[k], ref[k]) for k in ref}
            bad = [k for k, v in diffs.items() if not v]
            print(f"== load {how} at world={world}: {len(diffs) - len(bad)}/{len(diffs)} tensors bitwise equal to the saved full state; "
                  f"moment type after load: {res[0]['state_type']}; mismatches: {bad[:6]}")

if __name__ == "__main__":
    main()
