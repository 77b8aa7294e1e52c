"""gpu_check's driver keeps what a GPU run measured even when a sub-check runs out of time:
the partial result and summary.json are on disk, and the timed-out sub-check's whole process session
(grandchildren too) is gone before the next one starts. Plus the GPU-only verdict code, fed measured-shaped
numbers, since no GPU runs it here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_timed_out_subcheck_leaves_its_partial_result_the_summary_and_no_process(tmp_path):
    gpu_check = load_benchmark("gpu_check")
    # A sub-check that saves a partial result, starts a grandchild (as a rank or a benchmark variant would)
    # and then hangs: only a kill of its whole session stops both.
    child = textwrap.dedent(f"""
        import json, pathlib, subprocess, sys, time
        pathlib.Path({str(tmp_path)!r}, "hang.json").write_text(json.dumps({{"rows": {{"first": 1.5}}}}))
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        print("GRANDCHILD", grandchild.pid, flush=True)
        time.sleep(300)
    """)
    summary = {"checks": {"earlier": {"ok": True}}}
    start = time.monotonic()
    result = gpu_check.run_subcheck("hang", [sys.executable, "-c", child], 2.0, tmp_path, summary)
    assert time.monotonic() - start < 20  # the budget (2 s) plus the kill, not the child's 300 s

    assert result["timed_out"] and not result["ok"] and "timed out" in result["error"]
    assert result["partial"] == {"rows": {"first": 1.5}}
    assert not (tmp_path / "hang.json").exists()  # folded into summary.json: the device tool returns 8 files
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["checks"]["hang"]["partial"] == {"rows": {"first": 1.5}} and on_disk["checks"]["earlier"]["ok"]
    assert on_disk["passed"] is False

    grandchild = int(
        next(x for x in (tmp_path / "log.txt").read_text().splitlines() if x.startswith("GRANDCHILD")).split()[1]
    )
    assert result["left_running"] == [] and gpu_check.members(sid=result["session"]) == []
    assert not alive(result["session"]) and not alive(grandchild)


def test_a_subcheck_result_line_is_parsed_and_stray_children_are_killed_after_a_normal_exit(tmp_path):
    gpu_check = load_benchmark("gpu_check")
    child = textwrap.dedent("""
        import subprocess, sys
        stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        print("STRAY", stray.pid, flush=True)
        sys.stdout.buffer.write(b"\\xff not utf-8\\n")
        print('RESULT {"ok": true, "value": 3}', flush=True)
    """)
    summary = {"checks": {}}
    result = gpu_check.run_subcheck("quick", [sys.executable, "-c", child], 30.0, tmp_path, summary)
    assert result["ok"] and result["value"] == 3 and not result["timed_out"]
    stray = int(
        next(
            x for x in (tmp_path / "log.txt").read_text(errors="replace").splitlines() if x.startswith("STRAY")
        ).split()[1]
    )
    assert not alive(stray)


def test_run_in_group_kills_the_group_on_timeout(tmp_path):
    gpu_check = load_benchmark("gpu_check")
    sleep = "import time; time.sleep(300)"
    script = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleep!r}]); {sleep}"
    with open(tmp_path / "out.txt", "w") as out:
        rc, left = gpu_check.run_in_group([sys.executable, "-c", script], 1.5, out)
    assert rc == "timeout" and left == []


@pytest.mark.slow  # gpu_check.py in a fresh interpreter
def test_the_driver_writes_the_summary_and_at_most_8_files(tmp_path):
    """The real command line on the CPU, one sub-check: the device tool returns at most 8 files."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--only", "env"]
        + ["--results", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GPU_CHECK_SETUP_ERRORS": "wheel x.whl did not install"},
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 1, (done.stdout[-3000:], summary)  # a set-up error fails the run, nothing else
    assert summary["complete"] and list(summary["checks"]) == ["env"]
    assert summary["setup_errors"] == summary["checks"]["env"]["setup_errors"] == ["wheel x.whl did not install"]
    assert summary["checks"]["env"]["kernels"] and summary["checks"]["env"]["left_running"] == []
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) <= 8


def test_micro_saves_the_thread_count_rows_as_they_end(tmp_path):
    result = load_benchmark("gpu_check").check_micro(torch.device("cpu"), True, tmp_path)
    rows = result["cpu_adam"]
    assert result["ok"] and [r["busy"] for r in rows] == [0, 2]
    assert all(set(r["offload_time_vs_first"]) == set(r["threads"]) for r in rows)
    assert json.loads((tmp_path / "micro.json").read_text())["cpu_adam"] == json.loads(json.dumps(rows))


def test_step_announces_the_step_so_the_speculative_schedule_speculates(tmp_path):
    gpu_check = load_benchmark("gpu_check")
    cpu = torch.device("cpu")
    speculative = gpu_check.train(cpu, True, steps=3, bucket_size_mb=0.05, cpu_step="speculative")
    sync = gpu_check.train(cpu, True, steps=3, bucket_size_mb=0.05, cpu_step="sync")
    assert max(s.speculated_fraction for s in speculative["stats"]) > 0
    assert gpu_check.same(speculative, sync)  # the speculative step is the synchronous one, bitwise


def test_throughput_verdicts_follow_the_physics_on_a_gpu():
    """The GPU-only branch of judge_throughput, on rows shaped like train_step's (1e9 params; 25 GB/s)."""
    gpu_check = load_benchmark("gpu_check")
    cores = gpu_check.usable_cores()

    def row(step, backward, optimizer, **extra):
        timing = {"step_ms": step, "tokens_per_s": 16384 / step * 1e3, "forward_ms": 100.0, "backward_ms": backward}
        return {**timing, "optimizer_ms": optimizer, **extra}

    engine = {"transfer": 80.0, "transfer_wait": 8.0, "cpu_step": 400.0, "backward": 200.0}
    rows = {
        "plain": row(400.0, 60.0, 20.0, device_model_states_bytes=16 * 10**9),
        "zero_offload:sync": row(800.0, 90.0, 500.0, engine_ms=engine, device_model_states_bytes=2 * 10**9),
        "zero_offload:speculative": row(500.0, 200.0, 150.0, engine_ms=engine),
        f"zero_offload:speculative@cpu_threads={max(1, cores - 2)}": row(520.0, 200.0, 170.0, engine_ms=engine),
        "zero_offload:delayed": row(450.0, 90.0, 50.0, engine_ms=engine),
    }
    micro = {
        "bandwidth_gb_per_s": {"d2h_pinned": 25.0, "h2d_pinned": 25.0},
        "cpu_adam": [{"busy": 0, "mparam_per_s": {f"ours offload @{cores}": 4000.0}}],
    }
    out = gpu_check.judge_throughput({"rows": rows, "params": 10**9}, micro, torch.device("cuda"))
    physics, verdicts = out["physics"], out["verdicts"]
    # 2 B/param over 25 GB/s: 80 ms, more than plain's 60 ms backward: the bound is the transfer
    assert abs(physics["gradient_transfer_ms_at_measured_bandwidth"] - 80.0) < 1e-9
    assert physics["backward_bound_ms"] == physics["gradient_transfer_ms_at_measured_bandwidth"]
    assert verdicts["zero_offload:sync backward within 1.25x of the bound"]  # 90 <= 100
    assert not verdicts["zero_offload:speculative backward within 1.25x of the bound"]  # 200 > 100
    assert abs(physics["cpu_step_ms_at_kernel_rate"] - 250.0) < 1e-9  # 1e9 params at 4000 Mparam/s
    assert not verdicts["sync cpu_step within 1.5x of the kernel's rate"]  # 400 > 375
    assert verdicts["required_variants_ran"]
    table = out["table"]
    assert table["zero_offload:sync"]["device_model_state_bytes_per_param"] == 2.0
    assert table["plain"]["device_model_state_bytes_per_param"] == 16.0
    assert abs(table["zero_offload:speculative"]["hidden_transfer_fraction"] - 0.9) < 1e-9
    assert abs(table["zero_offload:speculative"]["optimizer_time_hidden_vs_sync"] - 0.7) < 1e-9
    assert out["threads"]["step_time_fewer_over_cores"] == 520.0 / 500.0


@pytest.mark.slow  # four short Trainer fits
def test_offload_params_check_runs_both_modes_and_saves_them(tmp_path):
    gpu_check = load_benchmark("gpu_check")
    result = gpu_check.check_offload_params(torch.device("cpu"), True, tmp_path)
    assert result["ok"] and result["verdicts"] == {"every_variant_ran": True}  # memory is judged on a GPU only
    rows = result["rows"]
    assert list(rows) == list(gpu_check.OFFLOAD_PARAMS_VARIANTS)
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    # every mode's default on a CPU device is sync; the speculative variant sets it
    assert {name: r["cpu_step"] for name, r in rows.items()} == {
        name: options.get("cpu_step", "sync") for name, options in gpu_check.OFFLOAD_PARAMS_VARIANTS.items()
    }
    assert rows["zero2"]["tokens_per_s_vs_zero2"] == 1.0
    assert json.loads((tmp_path / "offload_params.json").read_text())["rows"] == json.loads(json.dumps(rows))
