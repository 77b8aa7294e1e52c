"""Q8: what does / does not work on CPU + gloo in torch 2.13 (each probe caught and reported)."""
import warnings, traceback, torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, StateDictOptions
from common import *

def probe(name, fn, out):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            r = fn()
            out[name] = f"OK {r if r is not None else ''}"
        except Exception as e:
            out[name] = f"FAILS: {type(e).__name__}: {str(e)[:400]}"
        ws = sorted({str(x.message)[:200] for x in w})
        if ws:
            out[name] += f" | warnings: {ws}"

def rank_fn(rank):
    out = {}
    x = torch.randn(4, D)
    def pinned():
        m = shard(Net(), pin=True)
        m(x).sum().backward()
    probe("CPUOffloadPolicy(pin_memory=True) on a CPU-only build", pinned, out)
    def dtensor_init():
        with torch.device("meta"):
            m = Net()
        shard(m); m.to_empty(device="cpu")
        m.blocks[0].fc1.reset_parameters()
        return "(shards identical across ranks is shown by q6_meta)"
    probe("reset_parameters() on CPU DTensor shards", dtensor_init, out)
    def fused_adamw():
        m = shard(Net()); opt = torch.optim.AdamW(m.parameters(), fused=True)
        m(x).sum().backward(); opt.step()
    probe("torch AdamW(fused=True) on CPU-offloaded DTensors", fused_adamw, out)
    def foreach_adamw():
        m = shard(Net()); opt = torch.optim.AdamW(m.parameters(), foreach=True)
        m(x).sum().backward(); opt.step()
    probe("torch AdamW(foreach=True) on CPU-offloaded DTensors", foreach_adamw, out)
    def clip():
        m = shard(Net()); m(x).sum().backward()
        n = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
        return f"norm type={type(n).__name__}"
    probe("clip_grad_norm_ on CPU DTensor grads (gloo)", clip, out)
    def clip_foreach():
        m = shard(Net()); m(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, foreach=True)
    probe("clip_grad_norm_(foreach=True) on CPU DTensor grads", clip_foreach, out)
    def allreduce_hook():
        m = shard(Net()); seen = []
        m.blocks[1].set_all_reduce_hook(lambda t: seen.append((t.device.type, t.dtype, t.numel())))
        m(x).sum().backward()
        return f"hook saw {seen}"
    probe("set_all_reduce_hook (1-D FSDP, CPU)", allreduce_hook, out)
    def offload_event():
        m = shard(Net()); fp = m.blocks[1]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
        seen = []
        orig = m.blocks[0]._get_fsdp_state()._fsdp_param_group.post_backward
        m(x).sum().backward()
        return f"grad_offload_event after backward: {fp.grad_offload_event}"
    probe("grad_offload_event (pin_memory=False)", offload_event, out)
    def full_export():
        m = shard(Net())
        sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        v = next(iter(sd.values())) if sd else None
        return f"rank {rank}: {len(sd)} entries, first {type(v).__name__} {tuple(v.shape) if v is not None else ''}"
    probe("get_model_state_dict(full_state_dict=True, cpu_offload=True)", full_export, out)
    def full_optim():
        m = shard(Net()); opt = torch.optim.AdamW(m.parameters())
        m(x).sum().backward(); opt.step()
        sd = get_optimizer_state_dict(m, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return f"rank {rank}: {len(sd.get('state', {}))} states"
    probe("get_optimizer_state_dict(full, cpu_offload) torch AdamW", full_optim, out)
    def bf16_param_fp32_reduce():
        m = Net().to(torch.bfloat16); shard(m, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        m(x.bfloat16()).float().sum().backward()
        p = next(m.parameters())
        return f"local {p.to_local().dtype}, grad local {p.grad.to_local().dtype}"
    probe("bf16 sharded param + reduce_dtype fp32", bf16_param_fp32_reduce, out)
    def fp32_param_bf16_compute_reduce_none():
        m = Net(); shard(m, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        m(x).float().sum().backward()
        p = next(m.parameters())
        return f"local {p.to_local().dtype}, grad local {p.grad.to_local().dtype} (reduce in param_dtype bf16 over gloo)"
    probe("fp32 shards, param_dtype bf16, reduce_dtype None", fp32_param_bf16_compute_reduce_none, out)
    def inplace_write_between_steps():
        m = shard(Net()); p = m.blocks[0].fc1.weight
        with torch.no_grad(): p.to_local().fill_(0.5)
        m(x).sum().backward()
        m2 = m.blocks[0].fc1.weight
        return f"write to p.to_local() visible in next all-gather: {bool((m2.full_tensor() == 0.5).all())}"
    probe("in-place write to p.to_local()", inplace_write_between_steps, out)
    return out

def main():
    for world in (1, 2):
        res = launch(rank_fn, world)
        print(f"== world={world}")
        for k, v in res[0].items():
            print(f"  {k}: {v}")

if __name__ == "__main__":
    main()
