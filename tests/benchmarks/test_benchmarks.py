"""The benchmark scripts' own logic: the GPU check refuses a machine without a GPU (so a lent GPU's minutes
are not the first run of it), its engine-level sub-checks run at toy size on the CPU, and train_step's
variant names map onto the strategy that is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-GPU refusal")


@pytest.mark.slow  # a fresh interpreter
@no_gpu
def test_gpu_check_sh_says_there_is_no_gpu_and_exits_non_zero(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "NO GPU" in done.stderr and "nothing was checked" in done.stderr
    assert not (tmp_path / "out").exists()  # refused before installing or building anything


@pytest.mark.slow  # a fresh interpreter
@no_gpu
def test_gpu_check_py_refuses_cuda_without_a_gpu(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--results", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "NO GPU" in done.stderr


@pytest.mark.slow  # eight training runs
def test_determinism_check_runs_and_passes_on_the_cpu(tmp_path):
    gpu_check = load_benchmark("gpu_check")
    result = gpu_check.check_determinism(torch.device("cpu"), True, tmp_path)
    assert result["ok"], result
    assert len(result["configs"]) == 8


def test_determinism_check_notices_a_different_result(tmp_path):
    gpu_check = load_benchmark("gpu_check")
    a = gpu_check.train(torch.device("cpu"), True, steps=2)
    b = gpu_check.train(torch.device("cpu"), True, steps=3)
    assert gpu_check.same(a, a) and not gpu_check.same(a, b)


def test_fp16_overflow_check_on_the_cpu(tmp_path):
    result = load_benchmark("gpu_check").check_fp16_overflow(torch.device("cpu"), True, tmp_path)
    assert result["ok"], result
    assert result["skipped_steps"] == 1


def test_train_step_variant_names():
    train_step = load_benchmark("train_step")
    assert train_step.parse_variant("zero_offload") == ("zero_offload", None, {})
    assert train_step.parse_variant("zero_offload:delayed@overlap=False,cpu_threads=1") == (
        "zero_offload",
        "delayed",
        {"overlap": False, "cpu_threads": 1},
    )
    # a word is a string: gpu_check's throughput runs this variant
    assert train_step.parse_variant("zero_offload:speculative@speculation_rollback=undo") == (
        "zero_offload",
        "speculative",
        {"speculation_rollback": "undo"},
    )
    assert train_step.available("plain", torch.device("cpu")) is None
    assert "CUDA" in train_step.available("deepspeed", torch.device("cpu"))
    assert train_step.available("zero_offload:nonsense", torch.device("cpu")) is not None
    assert train_step.available("zero_offload:sync", torch.device("cpu")) is None
    assert "even --batch" in train_step.available("ddp", torch.device("cpu"), batch=1)
    assert train_step.available("ddp", torch.device("cpu"), batch=8) is None


@pytest.mark.slow  # a fresh interpreter
def test_in_place_step_compares_the_three_loops_and_records_them(tmp_path):
    out = tmp_path / "in_place.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "in_place_step.py"), "--preset", "quick"]
    done = subprocess.run(
        [*command, "--steps", "2", "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"plain", "in place", "offload path"}
    assert all(rows[k]["step_time_ratio_to_plain"] > 0 for k in ("in place", "offload path"))


def test_compact_state_control_rounds_to_nearest_and_loses_what_stochastic_rounding_keeps():
    # The convergence control's premise: at an lr whose update is below half a bf16 ulp, round-to-nearest
    # leaves every weight where it was, while the real bf16-state kernel moves them by the update on average.
    from lightning_zero_offload import kernels

    control = load_benchmark("compact_state_convergence")
    n, lr = 1 << 16, 1e-4  # at 1.0 the update lr is 1/39 of the 2^-8 ulp below it
    hp = kernels.AdamArgs(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    grad = torch.full((n,), 0.5)
    states = {}
    for name, step_fn in (("nearest", control.nearest_bf16_state_step), ("stochastic", kernels.adam_step_bf16_state)):
        p, m, v = (
            torch.ones(n, dtype=torch.bfloat16),
            torch.zeros(n, dtype=torch.bfloat16),
            torch.zeros(n, dtype=torch.bfloat16),
        )
        step_fn(p, grad, m, v, hparams=hp, step=1, seed=7)
        states[name] = (p, m, v)
    p32, m32, v32 = torch.ones(n), torch.zeros(n), torch.zeros(n)
    kernels.adam_step(p32, grad, m32, v32, hparams=hp, step=1)
    nearest, stochastic = states["nearest"], states["stochastic"]
    assert torch.equal(nearest[0], torch.ones(n, dtype=torch.bfloat16))  # every update lost
    for got, want in zip(nearest, (p32, m32, v32)):
        assert torch.equal(got, want.to(torch.bfloat16))  # the fp32 step, rounded to nearest
    # Stochastic rounding keeps the mean update: the count of elements rounded down to 1 - 2^-8 is
    # binomial (n/39 = 1678 expected, relative sd 2.4%), so 10% of lr is a 4-sigma margin.
    assert abs((1.0 - stochastic[0].double().mean().item()) - lr) < 0.1 * lr


def test_compact_state_ablations_round_what_they_name_to_bf16_values_without_bias():
    # The ablation arms: the fp32 step, then only the master (every step or after the first) or only the
    # moments stochastically rounded.
    from lightning_zero_offload import kernels

    control = load_benchmark("compact_state_convergence")
    n = 1 << 16
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen)
    rounded = x.clone()
    control.round_to_bf16_values(rounded, torch.Generator().manual_seed(1))
    assert torch.equal(rounded, rounded.bfloat16().float())  # bf16 values
    bits = x.view(torch.int32)
    down = (bits & -(1 << 16)).view(torch.float32)  # the magnitude truncated, and one bf16 ulp above it
    up = ((bits & -(1 << 16)) + (1 << 16)).view(torch.float32)
    assert bool(((rounded == down) | (rounded == up)).all())  # one of the two neighbours
    frac = (bits & 0xFFFF).double() / 65536  # the probability of rounding up
    for low, high in ((0.0, 0.5), (0.5, 1.0)):  # unbiased in each half (round-to-nearest fails both)
        sel = (frac >= low) & (frac < high)
        f = frac[sel]
        z = ((rounded == up)[sel].double().sum() - f.sum()) / (f * (1 - f)).sum().sqrt()
        assert abs(float(z)) < 5, f"round-ups for dropped fractions in [{low}, {high}): z = {float(z):.1f}"

    hp = kernels.AdamArgs(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    for part, step in (("weights", 1), ("weights", 2), ("moments", 1), ("moments", 2), ("once", 1), ("once", 2)):
        p, m, v = torch.randn(n, generator=gen), torch.rand(n, generator=gen), torch.rand(n, generator=gen)
        p32, m32, v32 = p.clone(), m.clone(), v.clone()
        grad = torch.randn(n, generator=gen)
        control.round_after_fp32_step(part, seed=0)(p, grad, m, v, hparams=hp, step=step)
        kernels.adam_step(p32, grad, m32, v32, hparams=hp, step=step)
        weights = part == "weights" or (part == "once" and step == 1)  # "once": after the first step only
        for got, exact, is_rounded in ((p, p32, weights), (m, m32, part == "moments"), (v, v32, part == "moments")):
            if is_rounded:
                assert torch.equal(got, got.bfloat16().float()) and not torch.equal(got, exact)
                assert float((got - exact).abs().max()) <= float(exact.abs().max()) * 2.0**-7
            else:
                assert torch.equal(got, exact)


def test_compact_state_pairs_give_the_mean_difference_its_standard_error_and_interval(tmp_path):
    control = load_benchmark("compact_state_convergence")

    def arm(directory, state, final, batches=(3, 1, 4)):
        directory.mkdir(exist_ok=True)
        record = {"val": [[500, 9.0], [1000, final]], "batch_sums": list(batches), "steps": 1000, "seed": 5}
        (directory / f"llama_{state}.json").write_text(json.dumps(record))

    finals = {"a": (2.0, 1.98), "b": (2.0, 2.02), "c": (1.0, 1.03)}  # -1%, +1%, +3%
    for name, (fp32, bf16) in finals.items():
        arm(tmp_path / name, "fp32", fp32)
        arm(tmp_path / name, "bf16", bf16)
    arm(tmp_path / "lone", "fp32", 1.0)  # no bf16 arm: not a pair
    summary = control.pairs(sorted(tmp_path.iterdir()))
    assert [r["dir"] for r in summary["pairs"]] == ["a", "b", "c"]
    assert summary["n"] == 3 and summary["within_bar"] == 0  # the bar is 0.5%
    assert summary["mean"] == pytest.approx(0.01)
    assert summary["sd"] == pytest.approx(0.02)  # deviations -2, 0, +2 (%): sqrt(8 / 2)
    assert summary["se"] == pytest.approx(0.02 / 3**0.5)
    assert summary["ci95"] == pytest.approx([0.01 - 4.30 * 0.02 / 3**0.5, 0.01 + 4.30 * 0.02 / 3**0.5])
    arm(tmp_path / "c", "bf16", 1.03, batches=(3, 1, 5))  # another data order: refused, not averaged
    with pytest.raises(SystemExit, match="same batches"):
        control.pairs([tmp_path / "c"])


@pytest.mark.slow  # a fresh interpreter and a 19M-parameter model
def test_compact_state_convergence_trains_an_arm_and_reports_it(tmp_path):
    pytest.importorskip("transformers")
    script = str(ROOT / "benchmarks" / "compact_state_convergence.py")
    arm = [sys.executable, script, "--case", "llama", "--state", "bf16-nearest", "--steps", "2", "--out", str(tmp_path)]
    done = subprocess.run(arm, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    run = json.loads((tmp_path / "llama_bf16-nearest.json").read_text())
    assert [step for step, _ in run["train"]] == [1, 2] and [step for step, _ in run["val"]] == [2]
    assert run["parameters"] == 19_241_472
    figure = tmp_path / "curves.png"
    report = [sys.executable, script, "--report", "--out", str(tmp_path), "--figure", str(figure)]
    done = subprocess.run(report, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "llama         bf16-nearest      2" in done.stdout and figure.stat().st_size > 0


@pytest.mark.slow  # a fresh interpreter, two 2^24-element engines per state
@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="no huge pages")
def test_huge_pages_benchmark_runs_both_arms_and_only_one_asks_for_huge_pages(tmp_path):
    out = tmp_path / "huge_pages.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "huge_pages.py"), "--numel", str(1 << 24), "--steps", "2"]
        + ["--threads", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [(row["cpu_state"], row["threads"]) for row in report["rows"]] == [("fp32", 1), ("bf16", 1)]
    fp32 = report["rows"][0]
    for arm in ("huge pages", "4 KiB pages"):  # the engine's CPU-step time lies inside the whole step's
        assert fp32["medians_s"][arm]["step_s"] > fp32["medians_s"][arm]["cpu_step_s"] > 0
    if report["transparent_hugepage"] == "madvise":  # only the advised arm gets huge pages ("always": both)
        assert fp32["anon_huge_pages_kib"]["huge pages"] > 0 == fp32["anon_huge_pages_kib"]["4 KiB pages"]


def test_cpu_adam_cold_cache_runs_the_flush_untimed_before_every_call():
    bench = load_benchmark("cpu_adam")
    events = []
    cases = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    samples = bench.measure_samples(cases, reps=2, warmup=1, before=lambda: events.append("flush"))
    assert events == ["flush", "a", "flush", "b", "flush", "b", "flush", "a", "flush", "a", "flush", "b"]
    assert {k: len(v) for k, v in samples.items()} == {"a": 2, "b": 2}


@pytest.mark.slow  # a fresh interpreter and a 2 GiB flush buffer read before every call
def test_cpu_adam_bf16_state_rows_run_from_a_cold_cache(tmp_path):
    out = tmp_path / "bf16_state.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_adam.py"), "--bf16-state", "--cold-cache"]
        + ["--log2-sizes", "16", "--threads", "1", "--reps", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["config"]["cold_cache"] is True
    (row,) = report["rows"]
    assert row["n"] == 1 << 16 and all(s > 0 for s in row["seconds"].values())
    assert set(row["ratios"]) == {f"{a} / {b}" for a, b in load_benchmark("cpu_adam").BF16_STATE_PAIRS}


SCRIPTS = sorted(
    path.relative_to(ROOT).as_posix()
    for path in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")]
    if 'if __name__ == "__main__":' in path.read_text()
)

# Each script run as `python script --help` runs it, one after another in one fresh interpreter: a
# fresh interpreter per script spent ~4.5 s each importing torch and Lightning again (2 minutes in all).
ANSWER_HELP = """
import contextlib, io, json, runpy, sys, traceback
from pathlib import Path

answers, path = {}, list(sys.path)
helpers = tuple(str(Path(folder).resolve()) for folder in ("benchmarks", "scripts", "tests"))
for script in sys.argv[1:]:
    # As a fresh `python script`: its directory first, none of an earlier script's paths or helper modules
    # (torch and the package stay imported: a C extension cannot be imported twice).
    sys.path[:], sys.argv = [str(Path(script).parent), *path[1:]], [script, "--help"]
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(helpers):
            del sys.modules[name]
    said, errors = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(errors):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code or 0
    except BaseException:
        code = traceback.format_exc()[-2000:]
    answers[script] = {"code": code, "stdout": said.getvalue(), "stderr": errors.getvalue()[-2000:]}
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def help_answers() -> dict[str, dict]:
    done = subprocess.run(
        [sys.executable, "-c", ANSWER_HELP, *SCRIPTS], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh interpreter for all of them
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_imports_and_answers_help(script, help_answers):
    """A moved module breaks a benchmark's imports long before anyone runs it again: each one at least starts."""
    answer = help_answers[script]
    assert answer["code"] == 0, (answer["code"], answer["stderr"])
    assert "usage:" in answer["stdout"]


@pytest.mark.slow  # two fresh interpreters
def test_zero2_setup_from_the_meta_device_holds_less_than_the_module_built_whole():
    script = str(ROOT / "benchmarks" / "zero2_setup.py")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    rows = {}
    for built in ("eager", "meta"):
        command = [sys.executable, script, "--params", "8e6", "--width", "512", "--case", f"{built}/bf16"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        rows[built] = json.loads(done.stdout.strip().splitlines()[-1])
    # The fp32 module as built (4 B/param) against one block of 31 (0.13): measured 3.5 less at 100M.
    assert rows["meta"]["setup_peak_B_per_param"] < rows["eager"]["setup_peak_B_per_param"] - 2


def test_the_replan_memory_benchmark_unfreezes_a_layer_and_measures_the_re_plan():
    """Its run at one rank (the RSS figures are for docs/benchmarks.md: at this size glibc reuses freed memory;
    tests/engine/test_replan.py checks the order buffers are made and freed in)."""
    row = load_benchmark("replan_memory").unfreeze(0, 2e6, 256, "32-true")
    assert row["params"] == 30 * (256 * 256 + 256) and row["seconds"] > 0 and row["rss_peak"] >= row["rss_before"]


def test_the_device_step_check_compares_the_device_kernels_with_the_native_ones(tmp_path):
    result = load_benchmark("gpu_check").check_device_step(torch.device("cpu"), True, tmp_path)
    assert result["ok"] and result["bf16_state_bitwise"] and result["fp32_within_rounding"], result
    assert result["fp32_step_ms_per_100M_params"] > 0 and (tmp_path / "device_step.json").exists()


@pytest.mark.slow  # six short fits
def test_the_offload_params_check_runs_every_variant_on_the_cpu(tmp_path):
    result = load_benchmark("gpu_check").check_offload_params(torch.device("cpu"), True, tmp_path)
    assert result["ok"], result
    rows = result["rows"]
    assert rows["offload_params, bf16 state, device_share 0.5"]["device_share_params"] > 0
    assert "a CPU device is host memory" in rows["offload_params, speculative, device_share auto"]["device_share_why"]


@pytest.mark.slow  # nine training runs
def test_the_zero2_share_check_runs_and_passes_on_the_cpu(tmp_path):
    result = load_benchmark("gpu_check").check_zero2_share(torch.device("cpu"), True, tmp_path)
    assert result["ok"], result
    assert result["auto"]["share"] == 0.0 and "a CPU device is host memory" in result["auto"]["why"]


@pytest.mark.slow  # three fits
def test_the_zero2_share_start_check_runs_and_passes_on_the_cpu(tmp_path):
    """The dry run: no short host pretended on a CPU device (its memory is the host's), the saves with a share hold
    the engine's weights and training is bitwise as without one."""
    result = load_benchmark("gpu_check").check_zero2_share_start(torch.device("cpu"), True, tmp_path)
    assert result["ok"], result
    assert result["0.5, sharded save"]["share_params_at_save"] > 0 and "start" not in result


@pytest.mark.slow  # five fits, each in a fresh interpreter
def test_the_zero2_share_simulation_lets_auto_choose_and_compares_it_with_sync(tmp_path):
    """One layer, one round, the tied model (its embedding lands last): "auto" chooses in the fit itself (its device
    memory pretended), the sync rows take its share, every row has its times."""
    out = tmp_path / "share.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "sim_device_share.py"), "--layers", "1", "--rounds", "1"]
    command += ["--models", "tied", "--steps", "1", "--warmup", "3", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (model,) = json.loads(out.read_text())["models"]
    (auto,) = model["auto"]
    assert model["tied"] and 0.0 <= auto["share"] <= 1.0 and auto["why"].startswith("auto: ")
    rows = model["results"]
    assert {"speculative, share auto", "sync, share 0.000", "speculative, share 0.000"} <= rows.keys()
    assert f"sync, share {auto['share']:.3f}" in rows
    assert rows["speculative, share auto"]["share_params"] > 0 or auto["share"] == 0.0
    assert all(r["step_ms"] > 0 and r["after_backward_ms"] >= 0 for r in rows.values())
