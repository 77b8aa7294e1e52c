"""CPU Adam benchmark: our kernels against torch and the memory roofline, measured in one process.

Rows, at 1 and 2 threads, for N params as one tensor and as 200 tensors of mixed sizes:
  roofline        C probe that reads p, g, m, v and writes p, m, v (28 B/param), the Adam traffic
                  (benchmarks/roofline.c, compiled on first use)
  torch foreach   torch.optim.AdamW(foreach=True)
  torch fused     torch.optim.AdamW(fused=True)
  deepspeed       DeepSpeedCPUAdam (only if importable)
  ours fp32       kernels.adam_step (one tensor) / CPUAdam (200 tensors)
  torch offload   the offload step with torch ops: bf16 grad -> fp32, x unscale/clip factor,
                  fused AdamW, params -> bf16
  torch offload2  the same with the factor folded into fused AdamW's grad_scale (one pass fewer)
  ours offload    kernels.adam_step_multi: bf16 grad in, fp32 master + bf16 param_out, one pass
  ours predict    the same with extrapolate=1.0 (DPU weight prediction); should cost nothing
  ours checked    kernels.adam_step_multi_if_finite: fp32 grads, the norm and inf/nan check inside
                  the update (the in-place CPU-device step without clipping)
  ours sum+step   kernels.sum_of_squares over the grads, then kernels.adam_step_multi: what the
                  checked step replaces

The implementations are interleaved within every repetition (the machine is shared and noisy) and
each row reports the median; ratios are taken between rows of the same run.

    python benchmarks/cpu_adam.py            # full run (about 3 minutes on 2 cores)
    python benchmarks/cpu_adam.py --quick    # small sizes, few repetitions

Thread counts (``--thread-rows``): only the fused offload step and the roofline, on one flat tensor (the
engine's case), at each ``--threads`` count (``cores``, ``cores-2``: counted from the usable cores),
all counts interleaved in one measurement, with ``--busy`` K spinning processes beside it standing in
for the threads an accelerator run keeps busy (launch thread, autograd thread):

    python benchmarks/cpu_adam.py --thread-rows --threads cores cores-2 --busy 0 2

bf16 state (``--bf16-state``): kernels.adam_step_bf16_state (bf16 p, m, v, stochastically
rounded; fp32 or bf16 grad) beside the fp32-state step that publishes the same bf16 params, on one flat
tensor, every row interleaved in one measurement per (threads, N), with each row's byte count and its
fraction of the roofline for that byte count, the per-repetition ratios' quartiles (each repetition
runs every row back to back, so a ratio within one repetition shares the machine's load), and the
compute cost per element of each row in cache (one thread, fastest of many calls at 2^14 elements
minus the fastest at 64: the call overhead cancels); writes results/cpu_adam_bf16_state.json:

    python benchmarks/cpu_adam.py --bf16-state
    # beside another build's kernel, e.g. a worktree at an older commit built with setup.py build_ext --inplace:
    python benchmarks/cpu_adam.py --bf16-state --baseline-native /tmp/old/lightning_zero_offload/_native.abi3.so
    # every timed call from a cold cache (2 GiB read before each, untimed), not after the row before it:
    python benchmarks/cpu_adam.py --bf16-state --cold-cache
    # the step at other prefetch distances (elements ahead into L1; into L2 four times as far) beside this
    # CPU's default, in one build:
    python benchmarks/cpu_adam.py --bf16-state --cold-cache --bf16-prefetch 512 1024 2048
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.infra import memory
from lightning_zero_offload.kernels._native import lib as native_lib
from lightning_zero_offload.optim import CPUAdam

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from memory_probe import transparent_huge_pages  # noqa: E402

HP = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
ADAMW = kernels.AdamArgs(**HP, adamw_mode=True)
FACTOR = 0.5  # the unscale x clip factor applied to the gradient in the offload rows
RESULTS = Path(__file__).parent / "results" / "cpu_adam.json"


def split_sizes(n: int, count: int, seed: int = 0) -> list[int]:
    """`count` mixed sizes (log-normal, like a model's weights and biases) that sum to `n`."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.empty(count).log_normal_(0.0, 2.0, generator=gen)
    sizes = [max(1, int(w)) for w in (weights / weights.sum() * n).tolist()]
    sizes[sizes.index(max(sizes))] += n - sum(sizes)
    return sizes


SMALL_PAGES = False  # --small-pages: buffers on 4 KiB pages instead of the engine's huge-page advice


def make(sizes: list[int], dtype: torch.dtype = torch.float32, fill: str = "randn") -> list[torch.Tensor]:
    """Buffers allocated as the engine allocates its host state (``memory.host_empty``: huge pages where
    Linux offers them), filled after the advice so that their pages fault in huge."""
    out = []
    for s in sizes:
        t = torch.empty(s, dtype=dtype) if SMALL_PAGES else memory.host_empty(s, dtype, pin=False)
        out.append(t.zero_() if fill == "zeros" else t.copy_(torch.randn(s)))
    return out


def build_cases(sizes: list[int], threads: int) -> dict[str, Callable[[], None]]:
    """One closure per row, each with its own buffers, all doing one optimizer step per call."""
    grads = make(sizes)
    grads_bf16 = [g.to(torch.bfloat16) for g in grads]
    single = len(sizes) == 1
    cases: dict[str, Callable[[], None]] = {}

    # The memory limit does not depend on how the params are split: one flat probe for both layouts.
    probe = [torch.randn(sum(sizes)) for _ in range(4)]

    def memory_roofline() -> None:
        roofline.probe(*probe, num_threads=threads)

    cases["roofline"] = memory_roofline

    def torch_optimizer(**flags: bool) -> Callable[[], None]:
        params = [torch.nn.Parameter(t) for t in make(sizes)]
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.AdamW(
            params,
            lr=HP["lr"],
            betas=(HP["beta1"], HP["beta2"]),
            eps=HP["eps"],
            weight_decay=HP["weight_decay"],
            **flags,
        )
        return opt.step

    cases["torch foreach"] = torch_optimizer(foreach=True)
    cases["torch fused"] = torch_optimizer(fused=True)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        params = [torch.nn.Parameter(t) for t in make(sizes)]
        for p, g in zip(params, grads):
            p.grad = g
        ds = DeepSpeedCPUAdam(params, lr=HP["lr"], weight_decay=HP["weight_decay"], adamw_mode=True)
        ds.step()
        cases["deepspeed"] = ds.step
    except Exception:  # optional baseline: not installed, or its JIT build failed
        pass

    params = [torch.nn.Parameter(t) for t in make(sizes)]
    exp_avg, exp_avg_sq = make(sizes, fill="zeros"), make(sizes, fill="zeros")
    if single:  # the kernel itself
        counter = {"step": 0}

        def ours_fp32() -> None:
            counter["step"] += 1
            kernels.adam_step(
                params[0].data,
                grads[0],
                exp_avg[0],
                exp_avg_sq[0],
                hparams=ADAMW,
                step=counter["step"],
                num_threads=threads,
            )

        cases["ours fp32"] = ours_fp32
    else:  # the optimizer, with its per-tensor Python work
        for p, g in zip(params, grads):
            p.grad = g
        cpu_adam = CPUAdam(
            params,
            lr=HP["lr"],
            betas=(HP["beta1"], HP["beta2"]),
            eps=HP["eps"],
            weight_decay=HP["weight_decay"],
        )
        cases["ours fp32"] = cpu_adam.step

    # The offload step: fp32 master/moments, bf16 grads in, bf16 params out, the torch way.
    # "torch offload2" is a stronger variant than the brief's composition: fused AdamW divides the
    # gradient by its grad_scale argument, which saves the separate multiply pass.
    def torch_offload(fold_factor: bool) -> Callable[[], None]:
        master, m, v = make(sizes), make(sizes, fill="zeros"), make(sizes, fill="zeros")
        g32 = make(sizes, fill="zeros")
        out = make(sizes, torch.bfloat16, fill="zeros")
        steps = [torch.tensor(0.0) for _ in sizes]
        scale = {"grad_scale": torch.tensor(1.0 / FACTOR)} if fold_factor else {}

        def run() -> None:
            torch._foreach_copy_(g32, grads_bf16)
            if not fold_factor:
                torch._foreach_mul_(g32, FACTOR)
            torch._foreach_add_(steps, 1.0)
            torch._fused_adamw_(
                master,
                g32,
                m,
                v,
                [],
                steps,
                lr=HP["lr"],
                beta1=HP["beta1"],
                beta2=HP["beta2"],
                weight_decay=HP["weight_decay"],
                eps=HP["eps"],
                amsgrad=False,
                maximize=False,
                **scale,
            )
            torch._foreach_copy_(out, master)

        return run

    cases["torch offload"] = torch_offload(fold_factor=False)
    cases["torch offload2"] = torch_offload(fold_factor=True)

    def ours_offload(extrapolate: float) -> Callable[[], None]:
        master, m, v = make(sizes), make(sizes, fill="zeros"), make(sizes, fill="zeros")
        out = make(sizes, torch.bfloat16, fill="zeros")
        step = {"step": 0}

        def run() -> None:
            step["step"] += 1
            kernels.adam_step_multi(
                master,
                grads_bf16,
                m,
                v,
                [step["step"]] * len(sizes),
                hparams=ADAMW,
                grad_scale=FACTOR,
                params_out=out,
                extrapolate=extrapolate,
                num_threads=threads,
            )

        return run

    cases["ours offload"] = ours_offload(0.0)
    cases["ours predict"] = ours_offload(1.0)

    def ours_in_place(checked: bool) -> Callable[[], None]:
        master, m, v = make(sizes), make(sizes, fill="zeros"), make(sizes, fill="zeros")
        steps = [1] * len(sizes)  # a fixed step number: the work per call does not depend on it

        def run() -> None:
            if checked:
                kernels.adam_step_multi_if_finite(master, grads, m, v, steps, hparams=ADAMW, num_threads=threads)
                return
            for g in grads:
                kernels.sum_of_squares(g, num_threads=threads)
            kernels.adam_step_multi(master, grads, m, v, steps, hparams=ADAMW, num_threads=threads)

        return run

    cases["ours checked"] = ours_in_place(True)
    cases["ours sum+step"] = ours_in_place(False)
    return cases


def thread_count(token: str) -> int:
    """``"8"``, ``"cores"`` or ``"cores-2"`` (the usable cores minus 2, at least 1)."""
    if token.startswith("cores"):
        return max(1, kernels.usable_cores() + int(token[5:] or 0))  # the suffix is signed: cores-2 is cores + (-2)
    return int(token)


def offload_case(n: int, threads: int) -> Callable[[], None]:
    """The engine's CPU step on one flat shard: bf16 gradient in, fp32 master + moments, bf16 params out."""
    master, m, v = make([n]), make([n], fill="zeros"), make([n], fill="zeros")
    grad, out = make([n], torch.bfloat16), make([n], torch.bfloat16, fill="zeros")
    step = {"step": 0}

    def run() -> None:
        step["step"] += 1
        kernels.adam_step_multi(
            master,
            grad,
            m,
            v,
            [step["step"]],
            hparams=ADAMW,
            grad_scale=FACTOR,
            params_out=out,
            num_threads=threads,
        )

    return run


def roofline_case(n: int, threads: int) -> Callable[[], None]:
    probe = make([n] * 4)
    return lambda: roofline.probe(*probe, num_threads=threads)


class Busy:
    """``count`` processes spinning on a core each while the measurement runs (stand-ins for busy threads)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Busy:
        spin = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end: pass"
        self.procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(self.count)]
        time.sleep(0.3 if self.count else 0)  # let them start spinning
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def thread_rows(threads: list[int], n: int, reps: int, busy: int = 0) -> dict[str, object]:
    """The fused offload step and the roofline at each thread count, interleaved in one measurement.

    Issue 20 item 5: the kernels default to every usable core, while on an accelerator the launch and
    autograd threads need cores too; ``busy`` spinning processes stand in for them. Reports Mparam/s per
    count and each count's step time relative to the first count's (below 1: faster than it).
    """
    threads = list(dict.fromkeys(threads))  # cores-2 is cores on a 2-core machine: measure each once
    cases: dict[str, Callable[[], None]] = {}
    for t in threads:
        cases[f"ours offload @{t}"] = offload_case(n, t)
        cases[f"roofline @{t}"] = roofline_case(n, t)
    with Busy(busy):
        load = os.getloadavg()[0]
        medians = measure(cases, reps=reps, warmup=3)
    first = medians[f"ours offload @{threads[0]}"]
    return {
        "n": n,
        "busy": busy,
        "threads": threads,
        "cores_usable": kernels.usable_cores(),
        "load_average_1min": load,
        "seconds": medians,
        "mparam_per_s": {k: n / t / 1e6 for k, t in medians.items()},
        "offload_time_vs_first": {t: medians[f"ours offload @{t}"] / first for t in threads},
    }


def print_thread_rows(row: dict[str, object]) -> None:
    times = row["offload_time_vs_first"]
    cells = "  ".join(
        f"{t} threads: {row['mparam_per_s'][f'ours offload @{t}']:6.0f} Mparam/s"
        f" (roofline {row['mparam_per_s'][f'roofline @{t}']:6.0f}), time {times[t]:.2f}x"
        for t in row["threads"]
    )
    print(
        f"busy {row['busy']}  N 2^{row['n'].bit_length() - 1}  {cells}  (load average {row['load_average_1min']:.1f})"
    )


def measure(cases: dict[str, Callable[[], None]], reps: int, warmup: int) -> dict[str, float]:
    """Median seconds per call; every repetition runs every case once, in a rotating order."""
    return {name: statistics.median(ts) for name, ts in measure_samples(cases, reps, warmup).items()}


# Bytes per param moved by each bf16-state row and the fp32-state step it replaces (read + write).
BF16_STATE_ROWS = {
    "fp32 state, fp32 grad": 28,  # p, g, m, v read (16), p, m, v written (12)
    "fp32 state, fp32 grad, bf16 out": 30,  # + the bf16 copy to publish
    "bf16 state, fp32 grad": 16,  # p, m, v bf16 read and written (12), fp32 g read (4); p is the copy
    "fp32 state, bf16 grad, bf16 out": 28,
    "bf16 state, bf16 grad": 14,  # p, m, v bf16 read and written (12), bf16 g read (2)
}
BF16_STATE_PAIRS = [  # (bf16 state, the fp32-state step publishing the same bf16 params)
    ("bf16 state, fp32 grad", "fp32 state, fp32 grad, bf16 out"),
    ("bf16 state, fp32 grad", "fp32 state, fp32 grad"),
    ("bf16 state, bf16 grad", "fp32 state, bf16 grad, bf16 out"),
    # the steps as the engine runs them at one micro-batch on one rank: bf16 state reads the staged bf16
    # grad, fp32 state its fp32 gradient buffer
    ("bf16 state, bf16 grad", "fp32 state, fp32 grad, bf16 out"),
]
RESULTS_BF16_STATE = Path(__file__).parent / "results" / "cpu_adam_bf16_state.json"
BASELINE_ROWS = {"baseline bf16 state, fp32 grad": 16, "baseline bf16 state, bf16 grad": 14}
BASELINE_PAIRS = [(k[len("baseline ") :], k) for k in BASELINE_ROWS]  # (this build, the baseline build)
baseline = None  # --baseline-native: (ffi, lib) of another build of the extension
prefetch_sweep: list[int] = []  # --bf16-prefetch: distances timed beside the default


def prefetch_rows() -> dict[str, int]:
    return {f"bf16 state, {g} grad, prefetch {d}": b for d in prefetch_sweep for g, b in (("fp32", 16), ("bf16", 14))}


def backend_prefetches() -> bool:
    """Whether the active backend's bf16-state step prefetches (the SIMD ones; native/dispatch.c)."""
    return kernels.backend() in ("avx512", "avx2")


def set_prefetch(elements: int) -> int:
    """The bf16-state step's prefetch distance for the next calls (-1: this CPU's default); the value set."""
    return native_lib.lzo_set_bf16_prefetch(elements)


def load_baseline(path: Path) -> None:
    """Load another build's ``_native`` shared object (e.g. a worktree at an older commit) beside this one,
    on the same instruction set, so its bf16-state kernel runs interleaved with this build's rows."""
    global baseline
    import importlib.util

    from lightning_zero_offload.kernels._native import ISAS

    spec = importlib.util.spec_from_file_location("lzo_baseline._native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.lib.lzo_set_isa(ISAS[kernels.backend()]) != 0:
        raise SystemExit(f"--baseline-native {path}: cannot run the {kernels.backend()} backend")
    baseline = (module.ffi, module.lib)


def state_rows() -> dict[str, int]:
    """The bf16-state rows and their bytes per param, with the baseline build's if one is loaded."""
    return BF16_STATE_ROWS | (BASELINE_ROWS if baseline else {}) | prefetch_rows()


def state_pairs() -> list[tuple[str, str]]:
    # (the default distance, another): the ratio is above 1 where the default is faster
    sweep = [(name.rsplit(", prefetch", 1)[0], name) for name in prefetch_rows()]
    return BF16_STATE_PAIRS + (BASELINE_PAIRS if baseline else []) + sweep


def quartiles(xs: list[float]) -> list[float]:
    q = statistics.quantiles(xs, n=4)
    return [q[0], statistics.median(xs), q[2]]


def bf16_state_cases(n: int, threads: int) -> dict[str, Callable[[], None]]:
    """kernels.adam_step_bf16_state against kernels.adam_step on one flat tensor, with the roofline."""
    probe = make([n] * 4)
    cases: dict[str, Callable[[], None]] = {"roofline": lambda: roofline.probe(*probe, num_threads=threads)}
    step = 1  # a fixed step number: the work per call does not depend on it
    for name in state_rows():
        grad = make([n], torch.bfloat16 if "bf16 grad" in name else torch.float32)[0]
        if name.startswith("baseline"):
            ffi, lib = baseline
            p, m, v = make([n], torch.bfloat16)[0], make([n], torch.bfloat16)[0], make([n], torch.bfloat16)[0].abs_()
            hp = ffi.new("lzo_adam_hparams *", dict(HP, adamw_mode=1, maximize=0))
            code = lib.LZO_BFLOAT16 if grad.dtype == torch.bfloat16 else lib.LZO_FLOAT32

            def run(p=p, grad=grad, m=m, v=v, hp=hp, code=code, ffi=ffi, lib=lib) -> None:
                words = [ffi.cast("uint16_t *", t.data_ptr()) for t in (p, m, v)]
                g = ffi.cast("void *", grad.data_ptr())
                lib.lzo_adam_step_bf16state(hp, FACTOR, 1, step, 0, words[0], g, *words[1:], n, code, threads)
        elif name.startswith("bf16 state"):
            p, m, v = make([n], torch.bfloat16)[0], make([n], torch.bfloat16)[0], make([n], torch.bfloat16)[0].abs_()
            ahead = int(name.rsplit("prefetch ", 1)[1]) if ", prefetch " in name else -1

            def run(p=p, grad=grad, m=m, v=v, ahead=ahead) -> None:
                if prefetch_sweep:
                    set_prefetch(ahead)
                kernels.adam_step_bf16_state(
                    p, grad, m, v, hparams=ADAMW, step=step, seed=1, grad_scale=FACTOR, num_threads=threads
                )
        else:
            p, m, v = make([n])[0], make([n])[0], make([n])[0].abs_()
            out = make([n], torch.bfloat16, fill="zeros")[0] if "bf16 out" in name else None

            def run(p=p, grad=grad, m=m, v=v, out=out) -> None:
                kernels.adam_step(
                    p, grad, m, v, hparams=ADAMW, step=step, grad_scale=FACTOR, param_out=out, num_threads=threads
                )

        cases[name] = run
    return cases


def measure_samples(
    cases: dict[str, Callable[[], None]], reps: int, warmup: int, before: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """measure()'s interleaved repetitions, returning every timed sample (seconds) per case; ``before``
    runs untimed ahead of every call."""
    names = list(cases)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            if before is not None:
                before()
            start = time.perf_counter()
            cases[name]()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def cache_flush(gib: float = 2.0) -> Callable[[], None]:
    """Read a buffer larger than the last-level cache: the lines a call leaves (dirty ones written back
    here, untimed) are replaced by clean ones, so every timed call starts from the same cold cache, as
    the engine's step does after a forward and backward pass."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    return lambda: buffer.sum()


def bf16_state_rows(
    threads: list[int], sizes_n: list[int], reps: int, cold_cache: bool = False
) -> list[dict[str, object]]:
    """Issue 19: the bf16-state step beside the fp32-state fused step it replaces, in one measurement.

    The roofline column converts the probe's 28 B/param into GB/s and divides it by each row's own
    byte count (BF16_STATE_ROWS): the fraction of the memory bandwidth the row achieves.
    """
    before = cache_flush() if cold_cache else None
    rows = []
    print(f"{'threads':>7} {'N':>5} {'impl':<38} {'B/param':>7} {'ms':>8} {'Mparam/s':>9} {'% roof':>7}")
    for t in threads:
        for n in sizes_n:
            cases = bf16_state_cases(n, t)
            load = os.getloadavg()[0]
            samples = measure_samples(cases, reps=reps, warmup=3, before=before)
            medians = {k: statistics.median(ts) for k, ts in samples.items()}
            best = {k: min(ts) for k, ts in samples.items()}
            gb_s = 28 * n / medians["roofline"] / 1e9
            row = {
                "threads": t,
                "n": n,
                "load_average_1min": load,
                "roofline_gb_per_s": gb_s,
                "bytes_per_param": state_rows(),
                "seconds": medians,
                "mparam_per_s": {k: n / s / 1e6 for k, s in medians.items()},
                "percent_of_roofline": {
                    k: 100 * n * size / medians[k] / 1e9 / gb_s for k, size in state_rows().items()
                },
                "ratios": {f"{a} / {b}": medians[b] / medians[a] for a, b in state_pairs()},
                # the ratio within each repetition (rows run back to back), its quartiles: the spread
                "ratio_quartiles": {
                    f"{a} / {b}": quartiles([tb / ta for ta, tb in zip(samples[a], samples[b])])
                    for a, b in state_pairs()
                },
                "seconds_quartiles": {k: quartiles(ts) for k, ts in samples.items()},
                # the fastest repetition: what the kernels do when the shared machine lets them run
                "best_seconds": best,
                "best_ratios": {f"{a} / {b}": best[b] / best[a] for a, b in state_pairs()},
                "best_percent_of_roofline": {
                    k: 100 * size / best[k] * best["roofline"] / 28 for k, size in state_rows().items()
                },
            }
            rows.append(row)
            for name, s in medians.items():
                size = state_rows().get(name, 28)
                pct = 100 * n * size / s / 1e9 / gb_s
                label = f"2^{n.bit_length() - 1}"
                print(f"{t:>7} {label:>5} {name:<38} {size:>7} {s * 1e3:8.2f} {n / s / 1e6:9.0f} {pct:6.1f}%")
            ratios = "  ".join(
                f"{k}: {v:.2f}x [{q[0]:.2f}-{q[2]:.2f}]"
                for (k, v), q in zip(row["ratios"].items(), row["ratio_quartiles"].values())
            )
            print(f"{'':>7} ratios [quartiles]  {ratios}  (roofline {gb_s:.1f} GB/s, load average {load:.1f})")
            best_gb_s = 28 * n / best["roofline"] / 1e9
            cells = "  ".join(
                f"{k}: {n / best[k] / 1e6:.0f} Mparam/s {row['best_percent_of_roofline'][k]:.0f}%" for k in state_rows()
            )
            ratios = "  ".join(f"{k}: {v:.2f}x" for k, v in row["best_ratios"].items())
            print(f"{'':>7} fastest repetitions  {cells}  (roofline {best_gb_s:.1f} GB/s)  ratios  {ratios}")
            del cases
    return rows


def bf16_state_compute(reps: int, big: int = 1 << 14, small: int = 64) -> dict[str, object]:
    """Each row's compute cost per element, one thread, in cache: the fastest of ``reps`` calls at ``big``
    elements minus the fastest at ``small`` (what a call costs besides its elements), per element."""
    cases = {f"{name} @{n}": fn for n in (big, small) for name, fn in bf16_state_cases(n, 1).items()}
    del cases[f"roofline @{big}"], cases[f"roofline @{small}"]
    load = os.getloadavg()[0]
    best = {k: min(ts) for k, ts in measure_samples(cases, reps=reps, warmup=20).items()}
    ns = {name: 1e9 * (best[f"{name} @{big}"] - best[f"{name} @{small}"]) / (big - small) for name in state_rows()}
    print(
        f"compute per element in cache (1 thread, N 2^{big.bit_length() - 1}, fastest of {reps},"
        f" load average {load:.1f}):"
    )
    print("  " + "  ".join(f"{name}: {v:.2f} ns" for name, v in ns.items()))
    return {"n": big, "n_overhead": small, "reps": reps, "load_average_1min": load, "ns_per_element": ns}


def cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it (else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def machine_info() -> dict[str, object]:
    model = cpu_model()
    pages = "4 KiB" if SMALL_PAGES else f"huge-page advice, transparent_hugepage {transparent_huge_pages()}"
    return {
        "cpu": model,
        "machine": platform.machine(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": kernels.backend(),
        "available_backends": kernels.available_backends(),
        "pages": pages,
        # elements the bf16-state step prefetches ahead by default on this CPU (native/dispatch.c)
        "bf16_prefetch": set_prefetch(-1) if backend_prefetches() else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 2^18, 2^20 and 5 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per case")
    parser.add_argument("--threads", nargs="+", default=["1", "2"], help="counts, or cores / cores-2 (usable cores)")
    parser.add_argument("--tensors", type=int, default=200, help="tensors in the many-tensor layout")
    parser.add_argument("--thread-rows", action="store_true", help="only the offload step per --threads count")
    parser.add_argument("--busy", type=int, nargs="+", default=[0], help="--thread-rows: spinning processes beside")
    parser.add_argument(
        "--bf16-state", action="store_true", help=f"only the bf16-state rows, to {RESULTS_BF16_STATE.name}"
    )
    parser.add_argument(
        "--baseline-native",
        type=Path,
        default=None,
        help="--bf16-state: another build's lightning_zero_offload/_native*.so, whose bf16-state kernel runs beside",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"JSON report (default: {RESULTS}; --quick: none)")
    parser.add_argument(
        "--log2-sizes", type=int, nargs="+", default=None, help="N = 2^k for each k (default: 22 25; --quick: 18 20)"
    )
    parser.add_argument(
        "--cold-cache",
        action="store_true",
        help="--bf16-state: read 2 GiB before every timed call, so none inherits what the last one left in cache",
    )
    parser.add_argument(
        "--bf16-prefetch",
        type=int,
        nargs="+",
        default=[],
        help="--bf16-state: also time the step at these prefetch distances (elements ahead into L1; into L2 four"
        " times as far), beside the default",
    )
    parser.add_argument(
        "--small-pages", action="store_true", help="buffers on 4 KiB pages (default: the engine's, huge where offered)"
    )
    args = parser.parse_args()
    global SMALL_PAGES
    SMALL_PAGES = args.small_pages
    args.threads = [thread_count(t) for t in args.threads]
    sizes_n = [1 << k for k in args.log2_sizes or ([18, 20] if args.quick else [22, 25])]
    reps = args.reps or (5 if args.quick else 30)
    if args.thread_rows:
        report = {"machine": machine_info(), "reps": reps, "rows": []}
        for busy in args.busy:
            report["rows"].append(thread_rows(args.threads, sizes_n[-1], reps, busy))
            print_thread_rows(report["rows"][-1])
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
        return
    if args.bf16_state:
        if args.baseline_native is not None:
            load_baseline(args.baseline_native)
        if args.bf16_prefetch:
            if not backend_prefetches():
                raise SystemExit(f"--bf16-prefetch: the {kernels.backend()} backend does not prefetch")
            prefetch_sweep[:] = [set_prefetch(d) for d in args.bf16_prefetch]  # as the kernel rounds them
            set_prefetch(-1)
        report = {
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(),
            "config": {
                "sizes": sizes_n,
                "reps": reps,
                "warmup": 3,
                "hparams": HP,
                "grad_factor": FACTOR,
                "baseline_native": str(args.baseline_native) if args.baseline_native else None,
                "cold_cache": args.cold_cache,
                "bf16_prefetch_sweep": prefetch_sweep,
            },
            "compute_in_cache": bf16_state_compute(reps=20 * reps),
            "rows": bf16_state_rows(args.threads, sizes_n, reps, cold_cache=args.cold_cache),
        }
        out = args.out or (None if args.quick else RESULTS_BF16_STATE)
        if out is not None:
            out.write_text(json.dumps(report, indent=2) + "\n")
            print(f"wrote {out}")
        return

    rows = []
    header = f"{'threads':>7} {'N':>9} {'layout':>11} {'impl':<14} {'ms':>8} {'Mparam/s':>9} {'% roof':>7}"
    print(header)
    print("-" * len(header))
    for threads in args.threads:
        torch.set_num_threads(threads)
        kernels.set_num_threads(threads)  # CPUAdam uses the module default
        for n in sizes_n:
            for layout, sizes in (
                ("1 tensor", [n]),
                (f"{args.tensors} tensors", split_sizes(n, args.tensors)),
            ):
                cases = build_cases(sizes, threads)
                load = os.getloadavg()[0]  # other processes on the machine skew 2-thread rows most
                medians = measure(cases, reps=reps, warmup=3)
                roof = n / medians["roofline"]
                result = {
                    "threads": threads,
                    "n": n,
                    "layout": layout,
                    "load_average_1min": load,
                    "seconds": medians,
                    "mparam_per_s": {k: n / t / 1e6 for k, t in medians.items()},
                    "percent_of_roofline": {k: 100 * n / t / roof for k, t in medians.items()},
                    "ratios": {
                        "ours fp32 / torch fused": medians["torch fused"] / medians["ours fp32"],
                        "ours fp32 / roofline": medians["roofline"] / medians["ours fp32"],
                        "ours offload / torch offload": medians["torch offload"] / medians["ours offload"],
                        "ours offload / torch offload2": medians["torch offload2"] / medians["ours offload"],
                        "ours predict time / ours offload time": medians["ours predict"] / medians["ours offload"],
                        "ours checked time / torch fused time": medians["ours checked"] / medians["torch fused"],
                        "ours checked time / ours sum+step time": medians["ours checked"] / medians["ours sum+step"],
                    },
                }
                rows.append(result)
                for name, t in medians.items():
                    print(
                        f"{threads:>7} {f'2^{n.bit_length() - 1}':>9} {layout:>11} {name:<14} {t * 1e3:8.2f} "
                        f"{n / t / 1e6:9.0f} {100 * n / t / roof:6.1f}%"
                    )
                ratios = "  ".join(f"{k}: {v:.2f}x" for k, v in result["ratios"].items())
                print(f"{'':>7} ratios  {ratios}  (load average {load:.1f})")
                del cases

    report = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": {
            "sizes": sizes_n,
            "reps": reps,
            "warmup": 3,
            "tensors": args.tensors,
            "hparams": HP,
            "offload_grad_factor": FACTOR,
            "quick": args.quick,
        },
        "rows": rows,
    }
    out = args.out or (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
