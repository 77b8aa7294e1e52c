"""Q3b: accumulation by syncing every micro-batch: the hook fires per micro-batch and sees the running sum."""
import torch
from common import *

def rank_fn(rank):
    torch.manual_seed(0)
    model = shard(Net()); p = model.blocks[2].fc1.weight
    seen = []
    p.register_post_accumulate_grad_hook(lambda q: seen.append(q.grad.to_local().clone()))
    xs = [torch.randn(4, D, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    for x in xs:
        model(x).pow(2).mean().backward()
    final = p.grad.to_local().clone()
    return {"hook_calls": len(seen), "last_call_equals_final_sum": torch.equal(seen[-1], final),
            "first_call_differs": not torch.equal(seen[0], final),
            "grad_storage_is_block_flat_buffer": p.grad.to_local().untyped_storage().nbytes() > p.grad.to_local().numel() * 4}

if __name__ == "__main__":
    for world in (1, 2):
        print(f"world={world}", launch(rank_fn, world))
