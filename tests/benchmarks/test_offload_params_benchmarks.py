"""benchmarks/sim_device_params.py and benchmarks/offload_params_memory.py: the parameter-offload mode against
FSDP2 + CPUOffloadPolicy + torch's fused AdamW. Their arithmetic on shaped numbers, and tiny runs of both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BENCHMARKS, load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sim():
    return load_benchmark("sim_device_params")


@pytest.fixture(scope="module")
def memory():
    return load_benchmark("offload_params_memory")


def test_speedups_are_the_anchors_time_over_ours_per_round_and_what_each_adds_to_fsdp2_alone(sim):
    def row(*fits: float) -> dict:
        return {"step_ms": sorted(fits)[len(fits) // 2], "fit_median_step_ms": list(fits)}

    results = {sim.ANCHOR: row(300.0, 330.0, 360.0), sim.FSDP2_ALONE: row(200.0, 200.0, 200.0)}
    results["ours"] = row(150.0, 220.0, 180.0)
    sim.compare(results)
    ours = results["ours"]
    assert ours["speedup_vs_anchor"] == 330.0 / 180.0
    assert ours["speedup_vs_anchor_per_round"] == [300.0 / 150.0, 330.0 / 220.0, 360.0 / 180.0]
    assert ours["added_to_fsdp2_alone_ms"] == -20.0 and results[sim.ANCHOR]["added_to_fsdp2_alone_ms"] == 130.0
    assert results[sim.ANCHOR]["speedup_vs_anchor"] == 1.0


def test_every_target_names_a_measured_configuration(sim):
    simulated = {c.name for c in sim.SIMULATED}
    assert {name for name, _ in sim.TARGETS["simulated"]} <= simulated
    assert {name for name, _ in sim.TARGETS["real"]} <= {c.name for c in sim.REAL}
    assert {sim.ANCHOR, sim.FSDP2_ALONE} <= simulated


def test_memory_targets_are_judged_per_allocator_setting_on_the_held_bytes(memory):
    def row(case: str, world: int, env: bool, held: float, peak: float) -> dict:
        return {
            "case": case,
            "world": world,
            "malloc_mmap_threshold_env": env,
            "held_bytes_per_param": held,
            "peak_bytes_per_param": peak,
        }

    anchor = memory.CASES[0].name
    rows = [
        row(anchor, 1, False, 28.0, 29.0),
        row("ours fp32, sync", 1, False, 27.0, 28.0),
        row("ours bf16, sync", 1, False, 14.0, 15.0),
        row(anchor, 1, True, 16.2, 16.6),
        row("ours fp32, sync", 1, True, 16.2, 16.7),
        row("ours bf16, sync", 1, True, 8.2, 8.6),
        row("ours bf16, sync", 2, True, 4.2, 4.6),
    ]
    verdict = memory.judge(rows)
    glibc, tuned = verdict["glibc defaults"], verdict["MALLOC_MMAP_THRESHOLD_=131072"]
    assert not glibc["ours bf16, sync <= 8.5 B/param"]["met"] and not glibc["ours fp32, sync <= 16.5 B/param"]["met"]
    assert tuned["ours bf16, sync <= 8.5 B/param"]["met"] and tuned["ours fp32, sync <= 16.5 B/param"]["met"]
    assert tuned["ours bf16 / anchor <= 0.55"] == {"held": 8.2 / 16.2, "peak": 8.6 / 16.6, "met": True}
    assert glibc["ours bf16 / anchor <= 0.55"]["met"]  # 14 / 28: the ratio can hold where the bytes do not
    assert tuned["ours bf16, sync: per rank at 2 ranks / 1 rank"] == {"held": 4.2 / 8.2, "peak": 4.6 / 8.6}
    assert "ours bf16, sync: per rank at 2 ranks / 1 rank" not in glibc


@pytest.mark.slow  # a fresh interpreter, ten short fits
def test_quick_simulated_run_measures_every_configuration_and_speculates_in_backward(tmp_path):
    out = tmp_path / "sim.json"
    command = [sys.executable, str(BENCHMARKS / "sim_device_params.py"), "--quick", "--warmup", "1"]
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    results = record["results"]
    assert list(results) == [
        "anchor: FSDP2 + AdamW(fused)",
        "FSDP2 alone, no step",
        "ours fp32, speculative",
        "ours fp32, sync",
        "ours bf16, sync",
        "ours bf16, speculative",
        "ours fp32, sync, block 0 on device",
        "ours fp32, speculative, block 0 on device",
    ]
    for name, r in results.items():
        assert r["steps"] == 2 and r["step_ms"] > 0 and len(r["fit_median_step_ms"]) == 1
        if name.startswith("ours"):
            # speculative: every host shard stepped from FSDP2's gradient hook, during backward; sync: none
            host = 7 / 8 if name.endswith("on device") else 1.0  # the device share steps after backward
            assert r["speculated_fraction"] == pytest.approx(host if "speculative" in name else 0.0, abs=1e-3)
    assert results["anchor: FSDP2 + AdamW(fused)"]["optimizer_step_ms"] > 0
    assert set(record["targets"]) == {
        "ours fp32, speculative vs anchor",
        "ours bf16, sync vs anchor",
        "ours bf16, speculative vs anchor",
    }
    assert record["device_backward_ms"] > 0 and "targets (anchor step time / ours" in done.stdout


@pytest.mark.slow  # a fresh interpreter, three short fits
def test_quick_real_run_compares_the_cpu_defaults_with_the_anchor(tmp_path):
    out = tmp_path / "real.json"
    command = [sys.executable, str(BENCHMARKS / "sim_device_params.py"), "--real", "--quick", "--warmup", "1"]
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["device_backward_ms"] == 0 and list(record["targets"]) == ["ours fp32, CPU defaults vs anchor"]
    assert record["results"]["ours fp32, CPU defaults"]["speculated_fraction"] == 0.0  # a CPU device: sync


@pytest.mark.slow  # fresh rank processes
def test_quick_memory_run_measures_the_state_each_side_holds(tmp_path):
    out = tmp_path / "memory.json"
    command = [sys.executable, str(BENCHMARKS / "offload_params_memory.py"), "--quick", "--out", str(out)]
    cases = ["anchor: FSDP2 + AdamW(fused)", "ours bf16, sync", "ours fp32, speculative"]
    done = subprocess.run([*command, "--cases", *cases], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted(cases)  # run in CASES order
    params = rows["ours bf16, sync"]["params"]
    (anchor,) = rows["anchor: FSDP2 + AdamW(fused)"]["ranks"]
    (bf16,) = rows["ours bf16, sync"]["ranks"]
    (speculative,) = rows["ours fp32, speculative"]["ranks"]
    # the state each side allocates: torch's two fp32 moments (and its 4-byte step per tensor); our two bf16
    # moments; fp32 moments plus the snapshot of master and moments that speculation keeps
    assert params * 8 < anchor["optimizer_state_bytes"] <= params * 8 + 4 * 2 * 8
    assert bf16["engine_host_state_bytes"] == 4 * params
    assert speculative["engine_host_state_bytes"] == (8 + 12) * params
    for row in rows.values():
        assert 0 < row["held_bytes_per_param"] <= row["peak_bytes_per_param"]
