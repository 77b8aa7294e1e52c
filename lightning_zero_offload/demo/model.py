"""A small GPT-style byte-level decoder as a LightningModule (the demo model of the main job)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics import MeanMetric


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(LightningModule):
    """A GPT-style decoder over bytes, trained with AdamW and a warmup + cosine schedule.

    The output head is untied from the token embedding (one parameter, one optimizer state: simpler for an
    offloading strategy). The loss is always computed in fp32 (``logits.float()``), so the module trains
    in plain fp32, under ``torch.autocast(..., dtype=torch.bfloat16)``, and with bf16 parameters.

    Args:
        vocab_size: Number of token ids (256 for bytes).
        block_size: Maximum sequence length (size of the learned position embedding).
        n_layer: Transformer blocks.
        n_head: Attention heads per block.
        n_embd: Model width.
        dropout: Dropout on attention weights, residual branches and embeddings.
        lr: Peak learning rate.
        betas: AdamW betas.
        weight_decay: Weight decay of the matrix parameters (biases, LayerNorms and embeddings get none).
        warmup_steps: Linear warmup from 0 to ``lr``.
        lr_decay_steps: Step at which the cosine reaches ``min_lr_ratio * lr`` (held after);
            ``None``: ``trainer.estimated_stepping_batches``.
        min_lr_ratio: Floor of the schedule as a fraction of ``lr``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 256,
        dropout: float = 0.0,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        lr_decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self._init_weights()
        # Token-weighted mean of the validation loss; ``val_ppl`` is its exp. Kept in fp32 regardless of
        # the parameters' dtype (see `_apply`).
        self.val_loss_mean = MeanMetric()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        std = 0.02 / math.sqrt(2 * self.hparams.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=std)

    # ------------------------------------------------------------------------------------------ model
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(B, T, vocab_size)`` for token ids ``idx`` of shape ``(B, T)``."""
        _, t = idx.shape
        if t > self.block_size:
            raise ValueError(f"Sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy, computed in fp32 whatever the logits' dtype."""
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------------------------------ steps
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = self.loss(self(x), y)
        self.val_loss_mean.update(loss.detach().float(), weight=y.numel())

    def on_validation_epoch_end(self) -> None:
        mean_loss = self.val_loss_mean.compute()  # synced across processes by torchmetrics
        self.val_loss_mean.reset()
        self.log("val_loss", mean_loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", torch.exp(mean_loss), prog_bar=True, sync_dist=True)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> GPT:
        # `module.to(torch.bfloat16)` (what a low-precision strategy does to the parameters) must not turn
        # the metric's accumulators into bf16: keep them fp32.
        super()._apply(fn, *args, **kwargs)
        self.val_loss_mean.set_dtype(torch.float32)
        return self

    # ------------------------------------------------------------------------------------------ optim
    def param_groups(self) -> list[dict[str, Any]]:
        """Two AdamW groups: weight decay on the Linear weight matrices, none on the rest."""
        decay, no_decay = [], []
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.requires_grad:
                    continue
                if isinstance(module, nn.Linear) and name == "weight":
                    decay.append(param)
                else:  # biases, LayerNorm weights, embeddings
                    no_decay.append(param)
        return [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def lr_lambda(self, total_steps: int):
        warmup = max(0, int(self.hparams.warmup_steps))
        floor = float(self.hparams.min_lr_ratio)
        total = max(int(total_steps), warmup + 1)

        def fn(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        return fn

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.param_groups(), lr=hp.lr, betas=tuple(hp.betas))
        total = self.hparams.lr_decay_steps
        if total is None:
            total = self.trainer.estimated_stepping_batches if self._trainer is not None else 10_000
            if not math.isfinite(total):
                total = 10_000
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_lambda(int(total)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
