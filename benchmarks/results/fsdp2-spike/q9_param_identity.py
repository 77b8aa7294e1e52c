"""Extra: are the sharded Parameter objects (and hooks on them) stable across to_empty, DCP load, state-dict load?"""
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict, StateDictOptions
from common import *

def rank_fn(rank):
    out = {}
    with torch.device("meta"):
        model = Net()
    shard(model)
    before = {n: p for n, p in model.named_parameters()}
    fired = []
    for n, p in before.items():
        p.register_post_accumulate_grad_hook(lambda q, n=n: fired.append(n))
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters") and m is not model: m.reset_parameters()
    out["same_param_objects_after_to_empty"] = all(p is before[n] for n, p in model.named_parameters())
    model(torch.randn(4, D)).sum().backward()
    out["hooks_registered_before_to_empty_fired"] = len(fired)
    objs = {n: p for n, p in model.named_parameters()}
    sd = get_model_state_dict(model)
    set_model_state_dict(model, sd)
    out["same_param_objects_after_set_model_state_dict"] = all(p is objs[n] for n, p in model.named_parameters())
    ptr = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    full = {k: v.full_tensor() for k, v in sd.items()}
    try:
        set_model_state_dict(model, full)
    except Exception as e:
        out["plain_full_sd_without_options"] = f"FAILS: {type(e).__name__}: {str(e)[:300]}"
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    out["local_storage_same_after_full_sd_load"] = all(p.to_local().data_ptr() == ptr[n] for n, p in model.named_parameters())
    return out

if __name__ == "__main__":
    for world in (1, 2):
        print(f"world={world}", launch(rank_fn, world)[0])
