"""benchmarks/sim_device.py: the simulated accelerator is what it claims, and the benchmark runs."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sim_device.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("sim_device", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_sleeping_blocks_take_their_device_time_and_give_gradients_of_the_declared_size(sim) -> None:
    blocks, per_block, forward_s, backward_s = 3, 20_000, 0.02, 0.04
    model = sim.SimulatedModel(blocks=blocks, params_per_block=per_block)
    params = list(model.parameters())
    assert len(params) == 3 * blocks
    assert sum(p.numel() for p in params) == pytest.approx(blocks * per_block, rel=0.02)
    model.set_device_time(forward_s, backward_s)

    start = time.perf_counter()
    loss = model.training_step([torch.zeros(1)], 0)
    forward = time.perf_counter() - start
    loss.backward()
    backward = time.perf_counter() - start - forward
    assert forward >= blocks * forward_s and backward >= blocks * backward_s  # sleep never returns early

    for p in params:
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))
    assert norm == pytest.approx(sim.GRAD_NORM, rel=0.03)  # so CLIP_QUIET never clips and CLIP_EVERY_STEP always does
    assert sim.CLIP_EVERY_STEP < sim.GRAD_NORM < sim.CLIP_QUIET

    # autograd copies the gradient out: the cached one is never handed over (or changed) by training
    cached = [g.clone() for b in model.blocks for g in b.gradients()]
    for p in params:
        p.grad.mul_(0.0)
    assert all(torch.equal(a, b) for a, b in zip(cached, (g for b in model.blocks for g in b.gradients())))


@pytest.mark.slow
def test_quick_mode_runs_every_schedule_and_writes_its_results(tmp_path: Path) -> None:
    out, figure = tmp_path / "sim.json", tmp_path / "sim.png"
    command = [sys.executable, str(SCRIPT), "--quick", "--params-per-block", "65536", "--rounds", "1"]
    command += ["--steps", "2", "--out", str(out), "--figure", str(figure)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert figure.stat().st_size > 0
    measured = set(result["points"][0]["results"])
    assert measured == {
        "sync",
        "speculative",
        "speculative, undo rollback",
        "delayed",
        "sync, clip every step",
        "speculative, clip every step",
    }
    for r in result["points"][0]["results"].values():
        assert r["steps"] == 2 and r["step_ms"] > 0 and r["cpu_step_ms"] > 0
        assert len(r["fit_median_step_ms"]) == 1 and r["exposed_ms"] < r["step_ms"]
    results = result["points"][0]["results"]
    # both speculative runs publish during backward; they differ in how a rollback would be taken
    assert results["speculative"]["early_published_per_step"] > 0
    assert results["speculative, undo rollback"]["early_published_per_step"] > 0
    assert "targets at backward / CPU step = 1" in done.stdout
