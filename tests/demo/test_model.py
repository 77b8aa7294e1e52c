"""The demo GPT: size, shapes, initial loss, trainability, bf16, optimizer/scheduler, val perplexity."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero_offload.demo.model import GPT

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32}


@pytest.fixture(autouse=True)
def _one_thread():
    # These models are tiny: one intra-op thread is fastest, and it avoids OpenMP spin-waiting turning a
    # sub-second test into tens of seconds when other processes share the (2-core) machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_default_size_is_a_few_million_parameters():
    model = GPT()
    n = model.num_parameters()
    assert 2_000_000 < n < 6_000_000, n
    # Untied head: the output projection is its own parameter.
    assert model.head.weight is not model.tok_emb.weight


def test_forward_shape():
    torch.manual_seed(0)
    model = GPT(**TINY)
    idx = torch.randint(0, 256, (3, 20))
    assert model(idx).shape == (3, 20, 256)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randint(0, 256, (1, TINY["block_size"] + 1)))


def test_initial_loss_is_close_to_uniform():
    # Weights are N(0, 0.02): the head sees a LayerNorm'ed (unit-variance) input of width n_embd, so the
    # logits have std ~ 0.02 * sqrt(n_embd) = 0.32 for the default width. For small iid logits the expected
    # cross-entropy exceeds ln(V) by about var/2 ~ 0.05 nats; 0.15 leaves room for sampling noise.
    torch.manual_seed(0)
    model = GPT()
    idx = torch.randint(0, 256, (4, 128))
    with torch.no_grad():
        loss = model.loss(model(idx), idx).item()
    assert abs(loss - math.log(256)) < 0.15, loss


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(**TINY, dropout=0.0)
    x = torch.randint(0, 256, (4, TINY["block_size"]))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch.no_grad():
        initial = model.loss(model(x), y).item()
    for _ in range(40):
        loss = model.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < initial - 2.0, (initial, loss.item())


def test_bf16_parameters_under_cpu_autocast():
    torch.manual_seed(0)
    model = GPT(**TINY).to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # The validation metric's accumulators stay fp32 when the module is cast.
    assert model.val_loss_mean.mean_value.dtype == torch.float32
    idx = torch.randint(0, 256, (2, TINY["block_size"]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx)
        loss = model.loss(logits, idx)
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(256)) < 0.3
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


def test_fp32_and_bf16_autocast_agree():
    torch.manual_seed(0)
    model = GPT(**TINY)
    idx = torch.randint(0, 256, (2, TINY["block_size"]))
    with torch.no_grad():
        ref = model.loss(model(idx), idx).item()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model.loss(model(idx), idx).item()
    assert low == pytest.approx(ref, abs=2e-2)


def test_configure_optimizers_two_groups_and_step_scheduler():
    model = GPT(**TINY, lr=1e-3, weight_decay=0.1, warmup_steps=10, lr_decay_steps=100, min_lr_ratio=0.1)
    config = model.configure_optimizers()
    opt = config["optimizer"]
    assert isinstance(opt, torch.optim.AdamW)
    assert len(opt.param_groups) == 2
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    matrices = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    assert {id(p) for p in decay["params"]} == matrices
    assert all(id(p) not in matrices for p in no_decay["params"])
    assert id(model.tok_emb.weight) in {id(p) for p in no_decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))

    sched = config["lr_scheduler"]
    assert sched["interval"] == "step"
    assert isinstance(sched["scheduler"], torch.optim.lr_scheduler.LambdaLR)
    fn = model.lr_lambda(100)
    assert fn(0) < fn(5) < fn(9) <= 1.0  # warmup
    assert fn(10) == pytest.approx(1.0)  # peak right after warmup
    assert fn(55) < fn(10)  # cosine decay
    assert fn(100) == pytest.approx(0.1) and fn(1000) == pytest.approx(0.1)  # floor


def test_validation_perplexity_is_exp_of_token_mean_loss(tmp_path):
    """val_ppl through a real Trainer under bf16-mixed equals exp of the fp32 mean loss over all tokens."""
    torch.manual_seed(0)
    model = GPT(**TINY)
    x = torch.randint(0, 256, (10, TINY["block_size"]))
    y = torch.randint(0, 256, (10, TINY["block_size"]))
    loader = DataLoader(TensorDataset(x, y), batch_size=4)  # uneven last batch (4, 4, 2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    (result,) = trainer.validate(model, loader, verbose=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [model.loss(model(xb), yb) * yb.numel() for xb, yb in loader]
    expected_loss = (torch.stack(losses).sum() / y.numel()).item()
    assert result["val_loss"] == pytest.approx(expected_loss, rel=1e-4)
    assert result["val_ppl"] == pytest.approx(math.exp(expected_loss), rel=1e-4)
