"""Q4: the core data path. FSDP2 (fully_shard per block + root, CPUOffloadPolicy, fp32 params) with the project's
kernels.adam_step stepping each local shard in place; (a) sync after backward, (b) speculative per parameter in the
post-accumulate-grad hook with exact redo from a snapshot when clipping fires. Compared with torch AdamW on the same
unsharded model and global batch (and with torch AdamW stepping the DTensors directly)."""
import math, sys, torch, torch.nn as nn, torch.distributed as dist
from common import *
from lightning_zero_offload import kernels

STEPS, ACCUM, MB = 6, 2, 8            # 6 optimizer steps, 2 micro-batches, 8 samples per global micro-batch
import os; MAX_NORM = float(os.environ.get("MAX_NORM", "0.4"))
GROUPS = [dict(lr=2e-2, weight_decay=0.1), dict(lr=5e-3, weight_decay=0.0)]
BETAS, EPS = (0.9, 0.999), 1e-8

def group_of(name):                  # two param groups: block weights vs. biases + head
    return 0 if name.startswith("blocks") and name.endswith("weight") else 1

def data(step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(MB, D, generator=g), torch.randn(MB, 1, generator=g)

def loss_fn(out, y):
    return (out - y).pow(2).mean() / ACCUM

def reference():
    torch.manual_seed(0)
    model = Net()
    named = list(model.named_parameters())
    groups = [dict(params=[p for n, p in named if group_of(n) == i], **GROUPS[i]) for i in range(2)]
    opt = torch.optim.AdamW(groups, betas=BETAS, eps=EPS)
    log = []
    for s in range(STEPS):
        for m in range(ACCUM):
            x, y = data(s, m)
            loss_fn(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        log.append(round(norm.item(), 5))
        opt.step(); opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, log

class ShardStepper:
    """Our CPU step on FSDP2's local shards: master = p.to_local() itself, fp32 moments of the shard's size."""
    def __init__(self, model):
        self.model = model
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.state = {p: (torch.zeros_like(p.to_local()), torch.zeros_like(p.to_local())) for _, p in self.params}
        self.group = {p: group_of(n) for n, p in self.params}
        self.step_no = 0
        self.snap = {}
        self.speculated = set()
        self.final_micro = False
        self.clipped_steps = 0

    def hparams(self, p):
        g = GROUPS[self.group[p]]
        return kernels.AdamArgs(lr=g["lr"], beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=g["weight_decay"], adamw_mode=True)

    def step_one(self, p, scale):
        loc, grad = p.to_local(), p.grad.to_local()
        if loc.numel() == 0:
            return
        m, v = self.state[p]
        kernels.adam_step(loc, grad, m, v, hparams=self.hparams(p), step=self.step_no, grad_scale=scale)

    def global_clip_scale(self):
        if os.environ.get("CLIP_MODE") == "torchlike":   # torch's clip_grad_norm_ arithmetic: fp32 per-tensor norms
            sq = torch.stack([torch.linalg.vector_norm(p.grad.to_local(), 2.0) for _, p in self.params]).pow(2)
            t = sq.sum().reshape(1)
            dist.all_reduce(t)                            # fp32 sum of squared norms over ranks
            total = t.sqrt()[0]
            coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
            return coef.item(), total.item()
        local = sum(kernels.sum_of_squares(p.grad.to_local())[0] for _, p in self.params if p.grad.to_local().numel())
        t = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(t)                                            # one all-reduce of the sum of squares
        norm = math.sqrt(t.item())
        coef = MAX_NORM / (norm + 1e-6)
        return (min(coef, 1.0), norm)

    # (b) the hook: speculative step with scale 1 as soon as the reduced shard is on the host
    def hook(self, p):
        if not self.final_micro:
            return
        loc = p.to_local()
        m, v = self.state[p]
        self.snap[p] = (loc.clone(), m.clone(), v.clone())             # exact rollback
        self.step_one(p, 1.0)
        self.speculated.add(p)

    def hook_threaded(self, p):
        if not self.final_micro:
            return
        import concurrent.futures, threading
        if not hasattr(self, "pool"):
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lzo-update")
            self.futures, self.worker_threads = [], set()
        def work():
            self.worker_threads.add(threading.current_thread().name)
            loc = p.to_local(); m, v = self.state[p]
            self.snap[p] = (loc.clone(), m.clone(), v.clone())
            self.step_one(p, 1.0)
        self.speculated.add(p)
        self.futures.append(self.pool.submit(work))

    def validate(self):
        for f in getattr(self, "futures", []):
            f.result()
        if hasattr(self, "futures"):
            self.futures.clear()
        scale, norm = self.global_clip_scale()
        redo = scale < 1.0
        missing = [n for n, p in self.params if p not in self.speculated]
        for n, p in self.params:
            if p not in self.speculated:
                self.step_one(p, scale)                               # never speculated: step now
            elif redo:
                loc = p.to_local(); m, v = self.state[p]; s = self.snap[p]
                loc.copy_(s[0]); m.copy_(s[1]); v.copy_(s[2])
                self.step_one(p, scale)
        self.clipped_steps += redo
        self.speculated.clear(); self.snap.clear()
        return norm, missing

def run_variant(rank, schedule, accum):
    torch.manual_seed(0)
    model = shard(Net())
    world, r = dist.get_world_size(), dist.get_rank()
    lo, hi = r * MB // world, (r + 1) * MB // world
    stepper = ShardStepper(model)
    torch_opt = None
    if schedule == "torch_adamw_dtensor":
        named = list(model.named_parameters())
        torch_opt = torch.optim.AdamW([dict(params=[p for n, p in named if group_of(n) == i], **GROUPS[i]) for i in range(2)], betas=BETAS, eps=EPS)
    elif schedule == "speculative":
        for _, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(stepper.hook)
    elif schedule == "speculative_thread":
        for _, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(stepper.hook_threaded)
    norms, notes = [], set()
    for s in range(STEPS):
        stepper.step_no = s + 1
        for m in range(ACCUM):
            last = m == ACCUM - 1
            stepper.final_micro = last
            if accum == "no_sync":
                model.set_requires_gradient_sync(last)
            x, y = data(s, m)
            loss_fn(model(x[lo:hi]), y[lo:hi]).backward()
        with torch.no_grad():
            if schedule == "torch_adamw_dtensor":
                norms.append(round(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor().item(), 5))
                torch_opt.step(); torch_opt.zero_grad()
                continue
            if schedule == "sync":
                scale, norm = stepper.global_clip_scale()
                for _, p in stepper.params:
                    stepper.step_one(p, scale)
                stepper.clipped_steps += scale < 1.0
            else:
                norm, missing = stepper.validate()
                if missing: notes.add(f"not speculated (stepped after backward): {missing}")
            norms.append(round(norm, 5))
        for _, p in stepper.params:
            p.grad = None
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return full, norms, stepper.clipped_steps, sorted(notes)

def kernel_unsharded():
    """The same kernel + clip arithmetic on the plain (unsharded, no FSDP) model: isolates FSDP2's contribution."""
    torch.manual_seed(0)
    model = Net()
    named = list(model.named_parameters())
    st = {p: (torch.zeros_like(p), torch.zeros_like(p)) for _, p in named}
    for s in range(STEPS):
        for m in range(ACCUM):
            x, y = data(s, m)
            loss_fn(model(x), y).backward()
        with torch.no_grad():
            norm = math.sqrt(sum(kernels.sum_of_squares(p.grad)[0] for _, p in named))
            scale = min(MAX_NORM / (norm + 1e-6), 1.0)
            for n, p in named:
                g = GROUPS[group_of(n)]
                hp = kernels.AdamArgs(lr=g["lr"], beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=g["weight_decay"], adamw_mode=True)
                kernels.adam_step(p.data, p.grad, *st[p], hparams=hp, step=s + 1, grad_scale=scale)
                p.grad = None
    return {n: p.detach().clone() for n, p in named}

def rank_fn(rank):
    ref, ref_norms = reference()
    out = {"ref_norms": ref_norms, "variants": {}}
    for schedule, accum in [("sync", "reduce_each"), ("speculative", "reduce_each"), ("speculative_thread", "reduce_each"), ("sync", "no_sync"),
                            ("speculative", "no_sync"), ("torch_adamw_dtensor", "reduce_each")]:
        full, norms, clipped, notes = run_variant(rank, schedule, accum)
        abs_d = max((full[n] - ref[n]).abs().max().item() for n in ref)
        rel_d = max(((full[n] - ref[n]).abs() / ref[n].abs().clamp_min(1e-3)).max().item() for n in ref)
        rel_norm = max(((full[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref)
        bitwise = all(torch.equal(full[n], ref[n]) for n in ref)
        out["variants"][f"{schedule}/{accum}"] = dict(max_abs=abs_d, max_rel=rel_d, rel_norm=rel_norm, bitwise=bitwise, norms=norms,
                                                      clipped_steps=clipped, notes=notes, params=full)
    out["kernel_unsharded"] = kernel_unsharded()
    return out

def main():
    for world in (1, 2):
        res = launch(rank_fn, world)
        o = res[0]
        print(f"== world={world} max_norm={MAX_NORM} clip_mode={os.environ.get('CLIP_MODE', 'kernel')} reference (torch AdamW, unsharded) grad norms per step: {o['ref_norms']}")
        for k, v in o["variants"].items():
            print(f"  {k:34s} max_abs={v['max_abs']:.3e} max_rel(elementwise, floor 1e-3)={v['max_rel']:.3e} max_tensor_rel_norm={v['rel_norm']:.3e} bitwise_eq_ref={v['bitwise']} "
                  f"clipped_steps={v['clipped_steps']} norms={v['norms']} {v['notes']}")
        a, b = o["variants"]["sync/reduce_each"]["params"], o["variants"]["speculative/reduce_each"]["params"]
        print(f"  speculative == sync bitwise (reduce_each): {all(torch.equal(a[n], b[n]) for n in a)}")
        b = o["variants"]["speculative_thread/reduce_each"]["params"]
        print(f"  speculative_thread (step on a worker thread fed by the hook) == sync bitwise (reduce_each): {all(torch.equal(a[n], b[n]) for n in a)}")
        a, b = o["variants"]["sync/no_sync"]["params"], o["variants"]["speculative/no_sync"]["params"]
        print(f"  speculative == sync bitwise (no_sync): {all(torch.equal(a[n], b[n]) for n in a)}")
        t = o["variants"]["torch_adamw_dtensor/reduce_each"]["params"]
        for k in ("sync/reduce_each", "speculative/reduce_each"):
            a = o["variants"][k]["params"]
            print(f"  {k} vs FSDP2 + torch AdamW on the same shards (the ModelParallelStrategy anchor): max_abs={max((a[n]-t[n]).abs().max().item() for n in a):.3e} max_tensor_rel_norm={max(((a[n]-t[n]).norm()/t[n].norm()).item() for n in a):.3e}")
        ku = o["kernel_unsharded"]
        for k in ("sync/reduce_each", "sync/no_sync"):
            a = o["variants"][k]["params"]
            print(f"  {k} vs kernel on the unsharded model (no FSDP, same clip arithmetic): max_abs={max((a[n]-ku[n]).abs().max().item() for n in a):.3e} bitwise={all(torch.equal(a[n], ku[n]) for n in a)}")
        if world > 1:
            print(f"  rank1 agrees with rank0 on full params: {all(torch.equal(res[1]['variants'][k]['params'][n], o['variants'][k]['params'][n]) for k in o['variants'] for n in o['variants'][k]['params'])}")

if __name__ == "__main__":
    main()
