"""A persistent fault on the gradient worker ends training with that error instead of hanging.

The fault is injected into the accumulate kernel the worker runs (overlap=True, what a GPU uses): from
its 5th call on it raises, which is the second backward here. Each run happens in a thread under a hard
guard, so a regression fails the test instead of hanging CI.
"""

import threading

import lightning as L
import pytest
import torch
from engine_helpers import CPU, batches, loss_fn, make_net, options, two_groups
from helpers import QUIET, Classifier, loader

from lightning_zero_offload import ZeroOffloadStrategy, kernels
from lightning_zero_offload.engine import OffloadEngine

GUARD_S = 20  # a fault must end training well within this; the runs take under a second without one
FAULT_FROM = 5
BUCKET_MB = 600 / 2**20  # 300 bf16 elements: 4 buckets, so the worker fails twice in one backward


class InjectedFault(RuntimeError):
    """What the accumulate kernel raises from its ``FAULT_FROM``-th call on (host OOM, a CUDA error...)."""


def accumulate_fails_from_call(monkeypatch, first: int = FAULT_FROM) -> list[int]:
    real = kernels.grad_accumulate
    calls = [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= first:
            raise InjectedFault(f"injected accumulate fault at call {calls[0]}")
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "grad_accumulate", faulty)
    return calls


def error_within_guard(run) -> BaseException | None:
    """Run ``run()`` in a thread; the exception it raised (None if it returned), failing if it is still running."""
    outcome: dict[str, BaseException] = {}

    def target() -> None:
        try:
            run()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(GUARD_S)
    if thread.is_alive():
        pytest.fail(f"training still running {GUARD_S} s after the gradient worker started failing (a hang)")
    return outcome.get("error")


@pytest.mark.parametrize("cpu_step", ["sync", "speculative", "delayed"])
def test_a_persistent_worker_fault_ends_training_with_the_original_error(monkeypatch, cpu_step):
    net = make_net(width=64)
    engine = OffloadEngine(
        two_groups(net),
        CPU,
        torch.bfloat16,
        options(cpu_step=cpu_step, **({"dpu_warmup_steps": 1} if cpu_step == "delayed" else {})),
    )
    buckets = len(engine.layout.buckets)
    assert engine.overlap and buckets >= 4  # the worker fails at least twice in one backward
    calls = accumulate_fails_from_call(monkeypatch, first=buckets + 1)  # one call per bucket and step
    steps = []

    def train() -> None:
        for batch in batches(6):
            engine.expect_step(publish_early=True)
            engine.begin_backward()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss_fn(net, batch).backward()
            engine.finish_backward()
            engine.step()
            steps.append(engine.step_calls)

    error = error_within_guard(train)
    assert isinstance(error, InjectedFault), error
    assert str(error).startswith(f"injected accumulate fault at call {buckets + 1}")  # the first one
    assert steps == [1]  # the first step completed; the fault stopped the second backward
    assert calls[0] >= buckets + 1
    engine.close(after_failure=True)


def test_the_fault_is_raised_again_at_every_later_call(monkeypatch):
    """Once the worker failed, the flush and the next backward raise the same error, never train on."""
    accumulate_fails_from_call(monkeypatch, first=1)
    net = make_net(width=64)
    engine = OffloadEngine(two_groups(net), CPU, torch.bfloat16, options())

    def backward() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(net, batches(1)[0]).backward()
        engine.finish_backward()

    for _ in range(2):  # the hook or the flush raises it, whichever comes first after the failure
        error = error_within_guard(backward)
        assert isinstance(error, InjectedFault) and str(error) == "injected accumulate fault at call 1", error
        for p in net.parameters():
            p.grad = None
    with pytest.raises(InjectedFault, match=r"at call 1(\n|$)"):  # (with a note on Python 3.11+)
        engine.grads.wait()
    engine.close(after_failure=True)


def test_trainer_fit_raises_the_worker_error(monkeypatch, tmp_path):
    accumulate_fails_from_call(monkeypatch)
    model = Classifier(width=64, scheduler=False)
    strategy = ZeroOffloadStrategy(in_place_on_cpu=False, overlap=True, bucket_size_mb=BUCKET_MB)
    trainer = L.Trainer(strategy=strategy, precision="bf16-mixed", max_steps=6, default_root_dir=tmp_path, **QUIET)
    error = error_within_guard(lambda: trainer.fit(model, loader(48)))
    assert isinstance(error, InjectedFault), error
    assert str(error).startswith(f"injected accumulate fault at call {FAULT_FROM}")
    assert len(strategy.engine.layout.buckets) >= 4 and strategy.engine.closed


def test_a_fault_in_the_cpu_update_ends_the_step_and_close_returns(monkeypatch):
    """The update worker runs ahead of publishing through a two-buffer pool: a bucket whose update fails
    must not leave the next ones waiting for a buffer, or close() would wait for the worker forever."""
    net = make_net()
    engine = OffloadEngine(two_groups(net), CPU, torch.bfloat16, options(bucket_size_mb=BUCKET_MB))
    assert len(engine.layout.buckets) >= 4 and engine.overlap
    real = kernels.adam_step
    calls = [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise InjectedFault("injected CPU-update fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "adam_step", faulty)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(net, batches(1)[0])
        engine.begin_backward()
        loss.backward()
        engine.step()

    error = error_within_guard(step)
    assert isinstance(error, InjectedFault)
    assert error_within_guard(engine.close) is None
