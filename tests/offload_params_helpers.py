"""Shared cases of the parameter-offload tests: models (a language model's shape, a stack of residual MLP
blocks), a one-rank process group, the plain torch run the engine is compared with."""

from __future__ import annotations

import contextlib
import copy
import tempfile
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_zero_offload.engine import OffloadOptions
from lightning_zero_offload.engine.offload_params import ParamOffloadEngine

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


class Rotary(nn.Module):
    """Buffers as models make them: one computed in __init__ on the default device (garbage after
    to_empty unless recomputed), one made on the CPU explicitly (real even under the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(WIDTH))
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)
        self.register_buffer("positions", torch.arange(5.0, device="cpu") * 3, persistent=False)
        self.reset_parameters()

    def frequencies(self) -> torch.Tensor:
        return 1.0 / 10000 ** (torch.arange(0, WIDTH, 2, dtype=torch.float32) / WIDTH)

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale)
        if not self.inv_freq.is_meta:
            self.inv_freq.copy_(self.frequencies())


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 7), generator=torch.Generator().manual_seed(seed))


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole (a sharded one gathered), by name: copies, not the live tensors (at one
    rank a DTensor's full tensor is its local shard)."""
    state = module.state_dict()
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for name, t in state.items()}


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


# The engine's tests: a regression model of residual MLP blocks, trained against torch's AdamW.


class MlpBlock(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Blocks(nn.Module):
    """An input layer, four residual blocks in a ModuleList, a head: the shape of a transformer."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(MlpBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def two_groups(model: nn.Module) -> list[dict]:
    """Weights (lr 2e-2, weight decay 0.1) and the rest (lr 5e-3, no decay)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "lr": 2e-2, "weight_decay": 0.1},
        {"params": [p for n, p in named if not n.endswith("weight")], "lr": 5e-3, "weight_decay": 0.0},
    ]


def sharded_copy(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A copy of ``model`` with each block, then the root, fully_shard-ed, the shards on the host."""
    copied = copy.deepcopy(model).to(dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    for block in copied.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(copied, mesh=mesh, offload_policy=policy)
    return copied


def batches(steps: int, micro: int, rows: int = 8, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(rows, 8, generator=generator), torch.randn(rows, 1, generator=generator)) for _ in range(micro)]
        for _ in range(steps)
    ]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean() / micro


def torch_adamw_run(
    model: nn.Module, data: list, clip_norm: float | None = None, clip_value: float | None = None
) -> dict[str, torch.Tensor]:
    """The reference: plain torch AdamW with torch's clipping, same groups and batches."""
    optimizer = torch.optim.AdamW(two_groups(model))
    for window in data:
        for x, y in window:
            loss_of(model, x, y, len(window)).backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest normwise relative difference over the tensors: ||got - want|| / ||want||."""
    return max(float((got[k].float() - w.float()).norm() / w.float().norm()) for k, w in want.items())


def make_engine(sharded: nn.Module, param_dtype: torch.dtype = torch.float32, **options) -> ParamOffloadEngine:
    """The engine over ``sharded`` with :func:`two_groups`, at this process group's world size."""
    world = dist.get_world_size()
    optimizer = torch.optim.AdamW(two_groups(sharded))
    return ParamOffloadEngine(
        optimizer, torch.device("cpu"), param_dtype, OffloadOptions(offload_params=True, **options), world
    )


def train(sharded: nn.Module, engine: ParamOffloadEngine, data: list, clip_norm: float | None = None) -> None:
    """test_engine.py's loop, each rank on its rows of every batch (all of them at one rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = next(sharded.parameters()).dtype  # bf16 with cpu_state="bf16"
    for window in data:
        for index, (x, y) in enumerate(window):
            if index == len(window) - 1:
                engine.expect_step(publish_early=True)
            engine.begin_backward()
            loss = loss_of(sharded, x.chunk(world)[rank].to(dtype), y.chunk(world)[rank], len(window))
            engine.scale_loss(loss.float()).backward()
            engine.finish_backward()
        engine.step(clip_norm=clip_norm)
        engine.zero_grad()


# blocks[0] frozen (True) or trainable in each of six windows; a resume saves after the first RESUMED_AT windows.
FREEZING = {
    "frozen-across-the-save": [False, False, False, True, True, False],
    "first-trained-after-the-save": [True, True, True, True, False, False],
}
RESUMED_AT = 4


def train_freezing(sharded: nn.Module, engine: ParamOffloadEngine, data: list, frozen: list[bool]) -> None:
    """:func:`train` (clipping at 0.5), ``blocks[0]`` frozen in the windows ``frozen`` says."""
    for window, freeze in zip(data, frozen):
        sharded.blocks[0].requires_grad_(not freeze)
        train(sharded, engine, [window], clip_norm=0.5)


def frozen_block_resume_differences(case: str, cpu_state: str, checkpoint: Callable) -> list[str]:
    """:data:`FREEZING` ``case`` trained through, and again stopped after :data:`RESUMED_AT` windows, carried by
    ``checkpoint(first, first_engine, resumed, resumed_engine)`` (a save and a load) into a fresh copy built with
    ``blocks[0]`` as frozen as it is then, and trained on: how the two ends differ (:func:`differences`)."""
    torch.manual_seed(0)
    model, data, frozen = Blocks(), batches(steps=6, micro=2), FREEZING[case]
    dtype = torch.bfloat16 if cpu_state == "bf16" else torch.float32
    uninterrupted = sharded_copy(model, dtype)
    engine = make_engine(uninterrupted, cpu_state=cpu_state)
    train_freezing(uninterrupted, engine, data, frozen)

    first = sharded_copy(model, dtype)
    first_engine = make_engine(first, cpu_state=cpu_state)
    train_freezing(first, first_engine, data[:RESUMED_AT], frozen)
    resumed = sharded_copy(Blocks(), dtype)
    resumed.blocks[0].requires_grad_(not frozen[RESUMED_AT])
    resumed_engine = make_engine(resumed, cpu_state=cpu_state)  # bf16: rounding offsets as before the save
    checkpoint(first, first_engine, resumed, resumed_engine)
    train_freezing(resumed, resumed_engine, data[RESUMED_AT:], frozen[RESUMED_AT:])
    return differences(training_state(resumed, resumed_engine), training_state(uninterrupted, engine))


def trained_copy(
    model: nn.Module, data: list, dtype: torch.dtype = torch.float32, clip_norm: float | None = None, **options
) -> tuple[nn.Module, ParamOffloadEngine]:
    """A :func:`sharded_copy` of ``model`` and its :func:`make_engine` (``options``), trained on ``data``."""
    sharded = sharded_copy(model, dtype)
    engine = make_engine(sharded, **options)
    train(sharded, engine, data, clip_norm=clip_norm)
    return sharded, engine


def training_state(sharded: nn.Module, engine: ParamOffloadEngine) -> dict[str, object]:
    """Everything a resume must restore, whole (a collective at several ranks): parameters and buffers, moments,
    step counts, the engine's counters (its ``state_dict``: steps, skips, loss scale, the bf16 rounding seed)."""
    names = {id(p): name for name, p in sharded.named_parameters()}
    state: dict[str, object] = {f"module/{name}": tensor for name, tensor in full_state(sharded).items()}
    for slot in engine.slots:
        name = names[id(slot.param)]
        spec = slot.param
        for moment in ("exp_avg", "exp_avg_sq"):
            whole = DTensor.from_local(
                getattr(slot, moment), spec.device_mesh, spec.placements, run_check=False, shape=spec.shape,
                stride=spec.stride(),
            ).full_tensor()  # fmt: skip
            state[f"{moment}/{name}"] = whole.clone()  # at one rank the local tensor itself: the next step changes it
        state[f"step/{name}"] = slot.step
    state["engine"] = engine.state_dict()
    return state


def differences(got: dict[str, object], want: dict[str, object]) -> list[str]:
    """The entries of two :func:`training_state` results that are not bitwise equal."""
    return [
        key
        for key, value in want.items()
        if not (torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value)
    ]
