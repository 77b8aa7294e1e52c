"""Failures never hang the job and nothing silently trains wrong (docs/reliability.md lists the guarantees).

Multi-process cases start each rank of tests/workers/failures.py as its own process (as torchrun
does) under a hard timeout, so a regression fails here instead of hanging CI.
"""

import math
import re
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from engine_helpers import options
from helpers import QUIET, Classifier, loader
from torch import nn

import lightning_zero_offload  # noqa: F401  (registers "zero_offload")
from lightning_zero_offload import NonFiniteLossError, ZeroOffloadPrecision, ZeroOffloadStrategy
from lightning_zero_offload.core import collective_timeout
from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.state_dicts import full_tensors
from lightning_zero_offload.testing.ranks import run_script_ranks

SCENARIO = Path(__file__).parents[1] / "workers" / "failures.py"
HARD_TIMEOUT_S = 240  # the machine may be loaded: starting two ranks can take a minute
RELEASE_S = 10  # how long the healthy rank may take to leave fit after the failure (DDP: 4-6 s here)
EXIT_S = 60  # how long every process may take to be gone (interpreter teardown is slow on a loaded machine)


def run_ranks(*args: str, world: int = 2) -> list[dict]:
    """Start every rank of the scenario, wait for all of them (a hang fails at the hard timeout), return each
    rank's exit code, output and exit time (``time.time()``, comparable with the scenario's printed stamps)."""
    exits = run_script_ranks([sys.executable, str(SCENARIO), *args], world, timeout=HARD_TIMEOUT_S)
    return [{"rc": done.returncode, "out": done.output, "exited": done.exited} for done in exits]


def stamp(output: str, event: str) -> float:
    match = re.search(rf"{event} at (\d+\.\d+)", output)
    assert match, f"no '{event}' in:\n{output[-3000:]}"
    return float(match.group(1))


def assert_all_failed(results: list[dict]) -> str:
    for rank, result in enumerate(results):
        assert result["rc"] != 0, f"rank {rank} exited 0:\n{result['out'][-3000:]}"
    return "\n".join(r["out"] for r in results)


@pytest.mark.slow  # ranks in processes
@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_rank_that_raises_stops_every_rank_within_seconds(failing_rank):
    results = run_ranks("--failure", "raise", "--rank", str(failing_rank))
    output = assert_all_failed(results)
    assert f"deliberate failure in training_step on rank {failing_rank}" in output
    failed = stamp(results[failing_rank]["out"], f"rank {failing_rank} fails")
    healthy = 1 - failing_rank
    assert stamp(results[healthy]["out"], f"rank {healthy} left fit") - failed < RELEASE_S
    assert max(r["exited"] for r in results) - failed < EXIT_S


@pytest.mark.slow  # ranks in processes
def test_an_io_error_writing_one_shard_stops_every_rank(tmp_path):
    results = run_ranks("--failure", "shard-io", "--save", str(tmp_path / "step2.ckpt"))
    assert_all_failed(results)
    assert "File too large" in results[1]["out"]  # EFBIG: rank 1's own error, printed by rank 1
    assert not list(tmp_path.glob("step2.ckpt/**/meta.pt"))  # nothing half-written was published


@pytest.mark.slow  # waits for the timeout
def test_a_stalled_rank_makes_the_others_give_up_after_the_timeout_option(tmp_path):
    # The stall outlasts the timeout and the time allowed to leave; the stalled rank wakes once rank 0 has left.
    results = run_ranks("--failure", "stall", "--timeout", "15", "--stall", "40", "--left", str(tmp_path))
    assert_all_failed(results)
    gave_up = stamp(results[0]["out"], "rank 0 left fit") - stamp(results[1]["out"], "rank 1 stalls")
    assert 15 <= gave_up < 15 + RELEASE_S
    assert "Timed out" in results[0]["out"]


@pytest.mark.slow  # ranks in processes
@pytest.mark.parametrize(
    ("failure", "difference"),
    [
        ("extra-layer", "rank 1 has 'net.5.weight: shape (4, 4), torch.float32', which rank 0 lacks"),
        ("width", "rank 0 has 'net.0.weight: shape (32, 16), torch.float32', rank 1 has 'net.0.weight: shape (40, 16)"),
    ],
)
def test_models_that_differ_between_ranks_are_refused_at_setup(failure, difference):
    results = run_ranks("--failure", failure)
    assert_all_failed(results)
    for result in results:  # every rank names the same difference
        assert "The model differs between ranks (rank 1 vs rank 0)" in result["out"], result["out"][-3000:]
        assert difference in result["out"]


# -- in one process ------------------------------------------------------------------------------


def fit(strategy, model, precision="32-true", max_steps=12, ckpt_path=None, **kwargs):
    trainer = L.Trainer(strategy=strategy, precision=precision, max_steps=max_steps, **QUIET, **kwargs)
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer


class _NanFromStep2(Classifier):
    """The loss is NaN from step 2 on (every ``period``-th step only, if given)."""

    def __init__(self, period: int = 1) -> None:
        super().__init__(scheduler=False)
        self.period = period

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step >= 2 and self.global_step % self.period == 0:
            loss = loss * math.nan
        return loss


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_persistent_nan_loss_raises_naming_the_count(precision):
    strategy = ZeroOffloadStrategy(max_consecutive_skipped_steps=5)
    with (
        pytest.warns(RuntimeWarning, match="Non-finite gradients"),
        pytest.raises(NonFiniteLossError, match="5 consecutive optimizer steps were skipped .*inf/nan"),
    ):
        fit(strategy, _NanFromStep2(), precision, max_steps=30)
    assert strategy.session.skipped_steps == 5
    assert not strategy.session.training  # the exception path closed it


def test_occasional_nan_steps_and_disabled_policy_keep_training():
    strategy = ZeroOffloadStrategy(max_consecutive_skipped_steps=2)
    with pytest.warns(RuntimeWarning, match="Non-finite gradients"):
        trainer = fit(strategy, _NanFromStep2(period=2), max_steps=12)  # never two in a row
    assert trainer.global_step == 12 and strategy.session.skipped_steps == 5
    strategy = ZeroOffloadStrategy(max_consecutive_skipped_steps=None)
    with pytest.warns(RuntimeWarning, match="Non-finite gradients"):
        fit(strategy, _NanFromStep2(), max_steps=30)
    assert strategy.session.skipped_steps == 28


def test_fp16_raises_when_the_loss_scale_is_at_its_minimum_and_still_overflows():
    strategy = ZeroOffloadStrategy(
        loss_scale_init=4.0, loss_scale_min=1.0, loss_scale_hysteresis=1, max_consecutive_skipped_steps=None
    )
    with pytest.raises(NonFiniteLossError, match=r"minimum loss scale \(loss_scale_min=1.0\): 3 consecutive"):
        fit(strategy, _NanFromStep2(), precision=None, plugins=[ZeroOffloadPrecision("16-mixed")], max_steps=30)
    assert strategy.session.loss_scale == 1.0  # 4 -> 2 -> 1, then an overflow at 1 raised


class _DuplicateParam(Classifier):
    def configure_optimizers(self):
        return torch.optim.AdamW([self.net[0].weight, *self.parameters()], lr=1e-2)


def test_a_parameter_listed_twice_is_refused_instead_of_frozen():
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch trains it (twice per step), warning
        fit("auto", _DuplicateParam(), max_steps=2)
    with (
        pytest.warns(UserWarning, match="duplicate parameters"),  # torch's, when the optimizer is built
        pytest.raises(ValueError, match="'net.0.weight' is listed twice in param group 0 of the optimizer"),
    ):
        fit("zero_offload", _DuplicateParam(), max_steps=2)


class _Float64Head(Classifier):
    def __init__(self) -> None:
        super().__init__(scheduler=False)
        self.head = nn.Linear(4, 4).double()

    def forward(self, x):
        return self.head(self.net(x).double()).float()


def test_a_float64_submodule_under_32_true_is_refused_at_setup_naming_the_fix():
    fit("auto", _Float64Head(), max_steps=2)  # fine without offload: the head keeps its own dtype
    with pytest.raises(ValueError, match=r"'head.weight' is torch.float64 \(and 1 more\).*model.float\(\)"):
        fit("zero_offload", _Float64Head(), max_steps=2)
    frozen = _Float64Head()
    frozen.head.requires_grad_(False)  # frozen parameters keep their dtype
    fit("zero_offload", frozen, max_steps=2)
    assert frozen.head.weight.dtype == torch.float64


class _RaisesAtStep3(Classifier):
    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_after_a_failure_one_process_hands_back_the_master_weights():
    model = _RaisesAtStep3(scheduler=False)
    strategy = ZeroOffloadStrategy()
    with pytest.raises(RuntimeError, match="boom"):
        fit(strategy, model, precision="bf16-mixed")
    engine = strategy.engine
    assert engine.closed and engine.failed
    masters = full_tensors(engine, engine.master)
    for p, master in zip(engine.params, masters):
        assert p.dtype == torch.float32 and torch.equal(p.detach(), master)  # fp32, not the bf16 device copy


def test_closing_after_a_failure_never_waits_for_a_blocked_worker():
    """A failed publish leaves the update worker waiting for a buffer: close must not wait for it."""
    net = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    engine = OffloadEngine(torch.optim.AdamW(net.parameters()), torch.device("cpu"), torch.bfloat16, options())
    held = [engine.publisher.pool.acquire(), engine.publisher.pool.acquire()]  # the failed main thread's
    blocked = engine.update_worker.submit(engine.publisher.pool.acquire)
    queued = engine.update_worker.submit(time.sleep, 60)
    closer = threading.Thread(target=engine.close, kwargs={"after_failure": True}, daemon=True)
    closer.start()
    closer.join(timeout=20)
    assert not closer.is_alive(), "close(after_failure=True) hangs"
    assert blocked.done() and queued.cancelled() and len(held) == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_consecutive_skipped_steps": 0}, ValueError, "max_consecutive_skipped_steps"),
        ({"max_consecutive_skipped_steps": 2.5}, TypeError, "max_consecutive_skipped_steps"),
        ({"timeout": 0}, ValueError, r"timeout must be a finite number of seconds in \(0, 1e\+09\]"),
        ({"timeout": timedelta(0)}, ValueError, r"timeout must be a finite number of seconds in \(0, 1e\+09\]"),
        ({"timeout": "30"}, TypeError, r"timeout must be a number of seconds in \(0, 1e\+09\].*got '30' \(str\)"),
    ],
)
def test_invalid_reliability_options_name_the_option(kwargs, error, message):
    with pytest.raises(error, match=message):
        ZeroOffloadStrategy(**kwargs)


def test_timeout_in_seconds_becomes_the_process_group_timeout():
    assert collective_timeout(90) == timedelta(seconds=90)
    assert ZeroOffloadStrategy(timeout=timedelta(minutes=2))._timeout == timedelta(minutes=2)


class _Payload:
    """Unpickling this runs ``Path.touch(marker)``: what a planted checkpoint could do with full pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_resuming_from_a_checkpoint_holding_a_pickle_payload_never_runs_it(tmp_path, fmt):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "planted.ckpt"
    if fmt == "sharded":  # a sharded checkpoint is a directory whose meta.pt holds the Lightning state
        path.mkdir()
        torch.save({"state_dict": {}, "payload": _Payload(marker)}, path / "meta.pt")
    else:
        torch.save({"state_dict": {}, "payload": _Payload(marker)}, path)
    with pytest.raises(Exception):  # noqa: B017, PT011 - whichever error names the file; the point is below
        fit(ZeroOffloadStrategy(checkpoint_format=fmt), Classifier(), max_steps=1, ckpt_path=path)
    assert not marker.exists()


def test_consecutive_skipped_steps_survive_a_resume(tmp_path):
    """The run that resumes raises after the same total of skipped steps in a row as one without a pause."""
    first = ZeroOffloadStrategy(max_consecutive_skipped_steps=5)
    with pytest.warns(RuntimeWarning, match="Non-finite gradients"):
        trainer = fit(first, _NanFromStep2(), max_steps=5)  # steps 2, 3, 4 skipped
    assert first.session.engine_state_dict()["nonfinite"]["consecutive"] == 3
    trainer.save_checkpoint(tmp_path / "skipping.ckpt")
    resumed = ZeroOffloadStrategy(max_consecutive_skipped_steps=5)
    with (
        pytest.warns(RuntimeWarning, match="Non-finite gradients"),
        pytest.warns(UserWarning, match="ended before the epoch ended"),  # Lightning's, on a mid-epoch resume
        pytest.raises(NonFiniteLossError, match="5 consecutive optimizer steps were skipped"),
    ):
        fit(resumed, _NanFromStep2(), max_steps=30, ckpt_path=tmp_path / "skipping.ckpt")
    assert resumed.session.skipped_steps == 5  # 3 before the save, 2 after it
