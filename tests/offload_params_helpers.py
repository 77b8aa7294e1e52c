"""Models and a one-rank process group for the parameter-offload placement, materialization and loading tests
(tests/engine/offload_params/ and their workers)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

# Odd sizes: at two ranks the shards are uneven (FSDP2 pads them), and the embedding and head (101 x 13 =
# 1313 parameters) hold more than one block (768), so they are units of their own.
VOCAB, WIDTH, HIDDEN, LAYERS = 101, 13, 27, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    """A language model's shape: embedding, repeated blocks, a final norm, an output head (tied to the
    embedding with ``tied``)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 7), generator=torch.Generator().manual_seed(seed))


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole (a sharded one gathered), by name."""
    state = module.state_dict()
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in state.items()}


def assert_same_state(module: nn.Module, reference: nn.Module) -> None:
    """Bitwise equal parameters and buffers, names included."""
    ours, theirs = full_state(module), full_state(reference)
    assert list(ours) == list(theirs)
    different = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert not different, different


@contextlib.contextmanager
def one_rank_group() -> Iterator[DeviceMesh]:
    """A gloo process group of this process alone, and its CPU mesh: ``fully_shard`` needs one."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            yield init_device_mesh("cpu", (1,))
        finally:
            dist.destroy_process_group()


def tiny_llama_config(tied: bool = False):
    """A Hugging Face Llama small enough for the fast machines of the tests: 3 layers of width 64 (its
    embeddings are smaller than a layer: the layers are the only units)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
