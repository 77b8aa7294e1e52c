"""Q2b: hook order when the first block's input requires grad (an embedding-like root-owned layer in front)."""
import torch, torch.nn as nn
from common import *

class EmbNet(Net):
    def __init__(self):
        super().__init__(); self.embed = nn.Linear(D, D)
    def forward(self, x):
        return super().forward(self.embed(x))

def rank_fn(rank):
    torch.manual_seed(0)
    model = shard(EmbNet())
    names = {p: n for n, p in model.named_parameters()}
    order = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: order.append(names[q]))
    model(torch.randn(4, D)).sum().backward()
    return [n for n in order if n.endswith("weight")]

if __name__ == "__main__":
    for world in (1, 2):
        print(f"world={world} hook order (weights):", launch(rank_fn, world)[0])
