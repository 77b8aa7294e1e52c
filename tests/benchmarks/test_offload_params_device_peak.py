"""benchmarks/offload_params_device_peak.py: its bookkeeping of allocations, its --help, and its tiny mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "offload_params_device_peak.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("offload_params_device_peak")


def test_the_peak_is_the_largest_sum_of_live_device_bytes_and_says_what_made_it(bench):
    a = bench.Allocation
    device = [
        a(100, start=0, kind="gathered", reduce_end=None, end=50),
        a(30, start=10, kind="param_grads", reduce_end=None, end=40),
        a(400, start=40, kind="reduce", reduce_end=45, end=45),  # freed the moment after the gradients
        a(5, start=0, kind="activations", reduce_end=None, end=60),
        a(7, start=0, kind="activations", reduce_end=None, end=20),
        a(1000, start=41, kind="cpu_only", reduce_end=45, end=42),  # gloo's own buffer: never counted
    ]
    got = bench.peaks(device)
    assert got["device_peak"] == 100 + 400 + 5  # at 40: the gradients freed before the input is allocated
    assert got["at_device_peak"]["reduce"] == 400 and got["at_device_peak"]["param_grads"] == 0
    assert got["fsdp_peak"] == 500 and got["activations_peak"] == 12 and got["cpu_only_peak"] == 1000


def test_help_names_the_options():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--tiny" in done.stdout and "--ranks" in done.stdout


@pytest.mark.slow  # a rank process, two profiled training steps per configuration
def test_tiny_mode_measures_both_configurations_and_writes_them(tmp_path):
    out = tmp_path / "peak.json"
    command = [sys.executable, str(SCRIPT), "--tiny", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["compute"], r["cpu_state"], r["cpu_step"]) for r in rows] == [
        ("fp32", "fp32", "sync"),
        ("bf16", "fp32", "speculative"),
    ]
    # One rank: a block's own copy, its gradients and the previous block's fp32 reduce input (fp32: 12 B/param);
    # bf16 compute: the fp32 reduce input and output (8). Observed 12.01 and 8.01 (the norms' small buffers).
    assert [round(r["measured_per_block_B_per_param"], 1) for r in rows] == [12.0, 8.0]
    assert all(r["measured"]["activations_peak"] > 0 for r in rows)
    assert "B/param/block" in done.stdout
