"""Shared helpers of the spike (not a product)."""
import os, sys, tempfile, threading, functools
import torch, torch.nn as nn
import torch.distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository
from lightning_zero_offload.testing.ranks import run_ranks
from torch.distributed.fsdp import fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.device_mesh import init_device_mesh

D = 16

class Block(nn.Module):
    def __init__(self, d=D, hidden=None):
        super().__init__()
        hidden = hidden or 2 * d
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))

class Net(nn.Module):
    def __init__(self, nblocks=4, d=D, hidden=None):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, hidden) for _ in range(nblocks)])
        self.head = nn.Linear(d, 1)
    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)

def shard(model, mp=None, pin=False, world=None):
    mesh = init_device_mesh("cpu", (world or dist.get_world_size(),))
    kw = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin))
    if mp is not None:
        kw["mp_policy"] = mp
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model

def launch(fn, world, **kw):
    with tempfile.TemporaryDirectory() as tmp:
        return run_ranks(functools.partial(fn, **kw) if kw else fn, world, tmp, timeout=kw.pop("timeout", 300) if False else 600)

def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
def hwm_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
