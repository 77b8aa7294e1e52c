"""Models nobody here wrote (Lightning's demo Transformer, a CNN with batch norm, Hugging Face GPT-2 and
Llama), their data and losses, wrapped in one LightningModule: the Trainer-level model tests and the
mixed-precision rule's tests share them."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.demos.transformer import Transformer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero_offload  # noqa: F401  (registers "zero_offload")

VOCAB = 64


class Wrapped(L.LightningModule):
    """Any module and loss: ``loss_fn(module, batch) -> loss``."""

    def __init__(self, build, loss_fn, lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = build()
        self.loss_fn = loss_fn
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.loss_fn(self.net, batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss_fn(self.net, batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def tokens(n: int = 48, length: int = 17) -> DataLoader:
    """Learnable token sequences: each token is the previous one plus a small step, mod VOCAB."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    steps = torch.randint(1, 3, (n, length), generator=g).cumsum(1)
    seq = (start + steps) % VOCAB
    return DataLoader(TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=8)


def images(n: int = 48) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 8, 8, generator=g) + 0.5  # non-zero mean: the running stats have work to do
    y = (x[:, 0].mean((1, 2)) > 0.5).long() + 2 * (x[:, 1].mean((1, 2)) > 0.5).long()
    return DataLoader(TensorDataset(x, y), batch_size=8)


def demo_transformer() -> nn.Module:
    return Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=1, dropout=0.0)


def demo_transformer_loss(net, batch):
    x, y = batch
    return nn.functional.nll_loss(net(x, y).float(), y.reshape(-1))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),  # BatchNorm makes a bias useless: its gradient is noise
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def cnn_loss(net, batch):
    x, y = batch
    return nn.functional.cross_entropy(net(x).float(), y)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def hf_loss(net, batch):
    x, y = batch
    logits = net(input_ids=x).logits
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


MODELS = {
    "demo_transformer": (demo_transformer, demo_transformer_loss, 3e-3, tokens),
    "cnn": (cnn, cnn_loss, 3e-2, images),
    "gpt2": (gpt2, hf_loss, 3e-3, tokens),
    "llama": (llama, hf_loss, 3e-3, tokens),
}
