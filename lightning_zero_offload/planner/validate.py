"""Check the plan against the engine on this machine: predicted and measured step times, side by side.

The probes and the training steps run interleaved, round after round, so a machine that gets busier or
quieter meanwhile moves both alike; each round's prediction uses that round's probes. Medians over rounds.
Drives the engine directly (no Trainer) on a causal language model with the CPU as the device.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_zero_offload.engine import OffloadEngine, OffloadOptions
from lightning_zero_offload.planner.machine import measure_machine
from lightning_zero_offload.planner.model import DTYPES, plan
from lightning_zero_offload.planner.shape import ModelShape


@dataclass
class Comparison:
    params: int
    predicted: dict[str, float]  # seconds: forward_backward (with transfers), cpu_step, total (sync schedule)
    measured: dict[str, float]

    def ratio(self, key: str) -> float:
        """predicted / measured."""
        return self.predicted[key] / self.measured[key]


def _engine(model: nn.Module, threads: int, bucket_size_mb: float, dtype: torch.dtype) -> OffloadEngine:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # The offload data path (what the plan models), not the in-place shortcut fp32 would take on a CPU device.
    options = OffloadOptions(bucket_size_mb=bucket_size_mb, cpu_threads=threads, overlap=False, in_place_on_cpu=False)
    return OffloadEngine(optimizer, torch.device("cpu"), dtype, options)


def _step(model: nn.Module, engine: OffloadEngine, tokens: torch.Tensor) -> tuple[float, float, float]:
    """(whole step, forward+backward, CPU step) seconds of one training step."""
    start = time.perf_counter()
    low_precision = engine.param_dtype != torch.float32
    with torch.autocast("cpu", dtype=engine.param_dtype, enabled=low_precision):
        logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    engine.begin_backward()
    loss.backward()
    engine.finish_backward()
    backward_end = time.perf_counter()
    stats = engine.step()
    return time.perf_counter() - start, backward_end - start, stats.cpu_step_s


def compare(
    builders: dict[str, Callable[[], nn.Module]],
    *,
    batch_size: int,
    seq_len: int,
    n_layer: dict[str, int],
    threads: int = 1,
    rounds: int = 3,
    steps: int = 3,
    bucket_size_mb: float = 8.0,
    precision: str = "bf16-mixed",
    vocab_size: int = 256,
) -> dict[str, Comparison]:
    """Predicted vs measured sync step of each model, ``rounds`` interleaved rounds of probes and steps."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        models = {name: build() for name, build in builders.items()}
        dtype = DTYPES[precision]
        engines = {name: _engine(model, threads, bucket_size_mb, dtype) for name, model in models.items()}
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
        for name in models:  # warm-up
            _step(models[name], engines[name], tokens)
        predicted = {name: [] for name in models}
        measured = {name: [] for name in models}
        for _ in range(rounds):
            for name, model in models.items():
                shapes = ModelShape.of(model).linear_shapes
                machine = measure_machine(
                    "cpu", threads, tokens=batch_size * seq_len, linear_shapes=shapes, dtype=dtype
                )
                p = plan(
                    model,
                    batch_size=batch_size,
                    seq_len=seq_len,
                    n_layer=n_layer[name],
                    cpu_threads=threads,
                    bucket_size_mb=bucket_size_mb,
                    precision=precision,
                    machine=machine,
                ).steps["sync"]
                # measured forward+backward includes the gradient transfers (on a CPU device nothing hides them)
                predicted[name].append((p.forward_backward + p.transfer, p.cpu_step, p.total))
                measured[name] += [_step(model, engines[name], tokens) for _ in range(steps)]
        result = {}
        for name, model in models.items():
            keys = ("forward_backward", "cpu_step", "total")
            pred = [statistics.median(row[i] for row in predicted[name]) for i in range(3)]
            meas = [statistics.median(row[i] for row in measured[name]) for i in (1, 2, 0)]
            result[name] = Comparison(
                params=sum(p.numel() for p in model.parameters()),
                predicted=dict(zip(keys, pred)),
                measured=dict(zip(keys, meas)),
            )
        for engine in engines.values():
            engine.close()
        return result
    finally:
        torch.set_num_threads(previous)
