"""Does ``cpu_state="bf16"`` converge like ``"fp32"``? One arm of the convergence cases per call.

Each call trains one arm (``--case``, ``--state``) with the same seed and data order as every other arm and
writes its per-step train loss and its periodic validation loss to ``--out/<case>_<state>.json``;
``--report`` reads those files, prints the table (final validation loss per arm, relative difference
against fp32, pass/fail against the issue's bar) and draws the curves.

Cases: ``demo`` (configs/cpu_demo.yaml's GPT and data, 600 steps), ``llama`` (a ~20M-parameter Hugging
Face ``LlamaForCausalLM`` from config on the same byte corpus, lr 1e-3) and ``llama-low-lr`` (lr 1e-4).
States: ``fp32``, ``bf16`` (stochastic rounding) and ``bf16-nearest``, the control: bf16 state stored
with round-to-nearest, done here by replacing ``kernels.adam_step_bf16_state`` for the run. Two ablations
say which part of the bf16 state moves the result: fp32 state whose master weights (``fp32-sr-weights``)
or whose two moments (``fp32-sr-moments``) are stochastically rounded to bf16 values after every step
(kept in fp32 tensors, random bits from a seeded torch generator), done by wrapping ``kernels.adam_step``;
their control, ``fp32-sr-once``, rounds the master that way after the first step only, then trains in
fp32: one perturbation of the same size, to tell the noise's effect from the spread that any
perturbation of a chaotic trajectory gives.

Every arm runs ``precision="32-true"`` on the CPU on the offload path (``in_place_on_cpu=False``): forward
and backward are fp32 in every arm, which differ only in the optimizer state's precision (the bf16 arms'
forward sees bf16-valued weights, the fp32 arm's full fp32 weights).

    python benchmarks/compact_state_convergence.py --case llama --state bf16
    python benchmarks/compact_state_convergence.py --case llama --state fp32 --steps 3   # a smoke run
    python benchmarks/compact_state_convergence.py --report
    # one (fp32, bf16) pair per directory, e.g. one directory per seed: the differences' mean and spread
    python benchmarks/compact_state_convergence.py --pairs benchmarks/results/compact_state/*1000_steps*
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "compact_state"
FIGURE = ROOT / "docs" / "figures" / "compact_state_convergence.png"
CASES = ("demo", "llama", "llama-low-lr")
STATES = ("fp32", "bf16", "bf16-nearest", "fp32-sr-weights", "fp32-sr-moments", "fp32-sr-once")
BAR = {"demo": 0.005, "llama": 0.005, "llama-low-lr": 0.01}  # the bars on the final val loss (docs/compact-state.md)
SEED = 1234
DEFAULT_STEPS = {"demo": 600, "llama": 1000, "llama-low-lr": 1000}
LLAMA_LR = {"llama": 1e-3, "llama-low-lr": 1e-4}


def nearest_bf16_state_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    hparams: Any,
    step: int,
    seed: int,
    offset: int = 0,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
) -> None:
    """``adam_step_bf16_state`` with round-to-nearest stores: the same fp32 arithmetic (``adam_step``)."""
    from lightning_zero_offload import kernels

    p32, m32, v32 = param.float(), exp_avg.float(), exp_avg_sq.float()
    kernels.adam_step(p32, grad, m32, v32, hparams=hparams, step=step, grad_scale=grad_scale, num_threads=num_threads)
    param.copy_(p32)
    exp_avg.copy_(m32)
    exp_avg_sq.copy_(v32)


def round_to_bf16_values(x: torch.Tensor, generator: torch.Generator) -> None:
    """Stochastically round fp32 ``x`` in place to bf16 values: the kernel's rule
    (``reference.round_bf16_stochastic``), with torch's generator instead of the hash."""
    from lightning_zero_offload.kernels import reference

    bits = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=generator)
    x.copy_(reference.round_bf16_stochastic(x, bits))


def round_after_fp32_step(rounded: str, seed: int):
    """``kernels.adam_step`` followed by stochastic rounding of the master (``"weights"``), of both
    moments (``"moments"``) or of the master after step 1 only (``"once"``) to bf16 values: the
    ablation arms."""
    from lightning_zero_offload import kernels

    fp32_step, generator = kernels.adam_step, torch.Generator().manual_seed(seed)

    def step(param, grad, exp_avg, exp_avg_sq, **kwargs) -> None:
        fp32_step(param, grad, exp_avg, exp_avg_sq, **kwargs)
        if rounded == "once" and kwargs["step"] != 1:
            return
        for t in (exp_avg, exp_avg_sq) if rounded == "moments" else (param,):
            round_to_bf16_values(t, generator)
        if kwargs.get("param_out") is not None:
            kwargs["param_out"].copy_(param)

    return step


def build_llama(lr: float, steps: int):
    import lightning.pytorch as pl
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_zero_offload.demo.data import VOCAB_SIZE

    class LlamaLM(pl.LightningModule):
        """A Hugging Face Llama from config, AdamW with linear warm-up then cosine to 0.1 x lr."""

        def __init__(self) -> None:
            super().__init__()
            config = LlamaConfig(
                vocab_size=VOCAB_SIZE,
                hidden_size=512,
                intermediate_size=1376,
                num_hidden_layers=6,
                num_attention_heads=8,
                num_key_value_heads=8,
                max_position_embeddings=128,
                tie_word_embeddings=False,
            )
            self.model = LlamaForCausalLM(config)
            self.val_sum = 0.0
            self.val_count = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=x).logits

        def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = self(x)
            return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.loss(*batch)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.val_sum += float(self.loss(x, y)) * y.numel()
            self.val_count += y.numel()

        def on_validation_epoch_end(self) -> None:
            self.log("val_loss", self.val_sum / self.val_count)
            self.val_sum, self.val_count = 0.0, 0

        def configure_optimizers(self) -> dict[str, Any]:
            decay = [p for p in self.parameters() if p.ndim >= 2]
            no_decay = [p for p in self.parameters() if p.ndim < 2]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
            optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
            warmup = min(100, steps // 10)  # a tenth of a shortened run

            def fn(step: int) -> float:
                if step < warmup:
                    return (step + 1) / (warmup + 1)
                progress = min(1.0, (step - warmup) / max(1, steps - warmup))
                return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return LlamaLM()


def build(case: str, steps: int):
    """The module, the datamodule and the validation interval of ``case``."""
    from lightning_zero_offload.demo import GPT, StdlibCorpusDataModule

    if case == "demo":  # configs/cpu_demo.yaml's model and data
        model = GPT(n_layer=4, n_head=4, n_embd=256, dropout=0.0, lr=0.002, weight_decay=0.1, warmup_steps=50)
        data = StdlibCorpusDataModule(
            block_size=128, batch_size=32, max_bytes=8_000_000, val_fraction=0.05, val_samples=256
        )
        return model, data, 100
    model = build_llama(LLAMA_LR[case], steps)
    data = StdlibCorpusDataModule(block_size=64, batch_size=4, max_bytes=8_000_000, val_fraction=0.05, val_samples=64)
    return model, data, 50


def code_version() -> dict[str, str]:
    """The commit (``-dirty`` with uncommitted changes) and a hash of the native library the run loaded."""
    import hashlib
    import subprocess

    describe = ["git", "-C", str(ROOT), "describe", "--always", "--dirty"]
    commit = subprocess.run(describe, capture_output=True, text=True).stdout.strip()
    try:
        import lightning_zero_offload._native as native
    except ImportError:  # no native build: the torch reference kernels run
        return {"commit": commit, "native_sha256": "none"}
    return {"commit": commit, "native_sha256": hashlib.sha256(Path(native.__file__).read_bytes()).hexdigest()[:16]}


def train(
    case: str, state: str, steps: int, threads: int, out: Path, val_every: int | None = None, seed: int = SEED
) -> Path:
    import lightning.pytorch as pl

    from lightning_zero_offload import ZeroOffloadStrategy, kernels

    # Lightning's launcher sets torch's thread count to the machine's cores unless OMP_NUM_THREADS is set.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    if state == "bf16-nearest":
        kernels.adam_step_bf16_state = nearest_bf16_state_step  # cpu_state.py calls it through the module
    if state.startswith("fp32-sr-"):
        kernels.adam_step = round_after_fp32_step(state.removeprefix("fp32-sr-"), seed)
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cpu_adam import cpu_model  # the one /proc/cpuinfo reader of the benchmarks

    version = code_version()  # at the start: the tree may change while the arm runs
    pl.seed_everything(seed, workers=True)
    model, data, default_val_every = build(case, steps)
    val_every = val_every or default_val_every
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{case}: {n_params} parameters", flush=True)

    record: dict[str, Any] = {"train": [], "val": [], "batch_sums": [], "seconds_at": []}

    class Recorder(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            record["train"].append([step, float(outputs["loss"])])
            record["seconds_at"].append(round(time.time() - start, 2))
            record["batch_sums"].append(int(batch[0].sum()))  # the data order, checked by --report
            if step == 1:
                assert torch.get_num_threads() == threads, torch.get_num_threads()
            if step % 50 == 0:
                print(f"step {step} loss {float(outputs['loss']):.4f} {time.time() - start:.0f} s", flush=True)

        def on_validation_end(self, trainer, module) -> None:
            if trainer.sanity_checking:
                return
            val = float(trainer.callback_metrics["val_loss"])
            record["val"].append([trainer.global_step, val])
            print(f"val step {trainer.global_step} loss {val:.4f}", flush=True)

    strategy = ZeroOffloadStrategy(
        cpu_state="fp32" if state.startswith("fp32") else "bf16",
        cpu_threads=threads,
        in_place_on_cpu=False,
        metrics=False,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision="32-true",
        max_steps=steps,
        val_check_interval=min(val_every, steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder()],
    )
    start = time.time()
    trainer.fit(model, datamodule=data)
    if not record["val"] or record["val"][-1][0] != trainer.global_step:
        trainer.validate(model, datamodule=data, verbose=False)  # the final val loss is at the last step
        record["val"].append([trainer.global_step, float(trainer.callback_metrics["val_loss"])])
    record.update(
        case=case,
        seed=seed,
        state=state,
        steps=steps,
        parameters=n_params,
        threads=threads,
        seconds=round(time.time() - start, 1),
        torch=torch.__version__,
        cpu=cpu_model(),
        backend=kernels.backend(),
        **version,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{case}_{state}.json"
    path.write_text(json.dumps(record) + "\n")
    print(f"wrote {path} ({record['seconds']} s)", flush=True)
    return path


def late_train_loss(run: dict[str, Any], last: int = 50) -> float:
    """The mean train loss of the last ``last`` steps (one step's loss is one noisy batch)."""
    losses = [loss for _, loss in run["train"][-last:]]
    return sum(losses) / len(losses)


def report(out: Path, figure: Path) -> None:
    runs = {}
    for case in CASES:
        for state in STATES:
            path = out / f"{case}_{state}.json"
            if path.exists():
                runs[case, state] = json.loads(path.read_text())
    header = (
        f"{'case':<13} {'state':<13} {'steps':>5} {'final val':>10} {'vs fp32':>9} {'bar':>6}  {'result':<6} "
        f"{'max |val diff|':>14} {'train, last 50':>14} {'vs fp32':>8}  data order"
    )
    print(header)
    print("-" * len(header))
    for case in CASES:
        base = runs.get((case, "fp32"))
        for state in STATES:
            run = runs.get((case, state))
            if run is None:
                continue
            final, tail = run["val"][-1][1], late_train_loss(run)
            if base is None or state == "fp32":
                rel, verdict, worst, tail_rel, order = "", "", "", "", ""
            else:
                diff = (final - base["val"][-1][1]) / base["val"][-1][1]
                rel = f"{100 * diff:+.2f}%"
                verdict = "pass" if abs(diff) <= BAR[case] else "FAIL"
                # Every validation point, not only the last: the largest relative gap along the curve.
                points = dict(base["val"])
                worst = max(abs(v - points[s]) / points[s] for s, v in run["val"] if s in points)
                worst = f"{100 * worst:.2f}%"
                tail_rel = f"{100 * (tail - late_train_loss(base)) / late_train_loss(base):+.2f}%"
                n = min(len(run["batch_sums"]), len(base["batch_sums"]))
                order = "same" if run["batch_sums"][:n] == base["batch_sums"][:n] else "DIFFERENT"
            bar = f"{100 * BAR[case]:.1f}%"
            print(
                f"{case:<13} {state:<13} {run['steps']:>5} {final:>10.4f} {rel:>9} {bar:>6}  {verdict:<6} "
                f"{worst:>14} {tail:>14.4f} {tail_rel:>8}  {order}"
            )
    if not runs:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in CASES if any(k[0] == c for k in runs)]
    fig, axes = plt.subplots(2, len(cases), figsize=(5 * len(cases), 7), squeeze=False)
    colors = {
        "fp32": "black",
        "bf16": "tab:blue",
        "bf16-nearest": "tab:red",
        "fp32-sr-weights": "tab:green",
        "fp32-sr-moments": "tab:orange",
        "fp32-sr-once": "tab:gray",
    }
    for col, case in enumerate(cases):
        for state in STATES:
            run = runs.get((case, state))
            if run is None:
                continue
            steps, losses = zip(*run["train"])
            window = 25  # a running mean: the per-step loss is noisy
            smooth = [
                sum(losses[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
                for i in range(len(losses))
            ]
            axes[0][col].plot(steps, smooth, color=colors[state], label=state, lw=1)
            vs, vl = zip(*run["val"])
            axes[1][col].plot(vs, vl, "o-", color=colors[state], label=state, ms=3)
        axes[0][col].set_title(f"{case}: train loss (running mean of {window})")
        axes[1][col].set_title(f"{case}: validation loss")
        axes[1][col].set_xlabel("step")
        for row in (0, 1):
            axes[row][col].legend()
            axes[row][col].grid(alpha=0.3)
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)
    print(f"wrote {figure}")


# Student's t, 97.5% quantile, by degrees of freedom: the two-sided 95% interval of a mean of few pairs.
T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
T_975 |= {11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11, 18: 2.10, 19: 2.09, 20: 2.09}
T_975 |= {21: 2.08, 22: 2.07, 23: 2.07, 24: 2.06, 25: 2.06, 26: 2.06, 27: 2.05, 28: 2.05, 29: 2.05, 30: 2.04}


def pairs(dirs: list[Path], case: str = "llama", state: str = "bf16", against: str = "fp32") -> dict[str, Any]:
    """The relative difference of the final validation loss, ``state`` against ``against``, of the pair in
    each directory (the same seed, data and machine), and their mean with its standard error and 95%
    interval. One pair's difference mixes any effect of the state with the spread between trajectories;
    the mean over many pairs separates the two."""
    rows = []
    for d in dirs:
        paths = [d / f"{case}_{s}.json" for s in (against, state)]
        if not all(p.exists() for p in paths):
            continue
        base, run = (json.loads(p.read_text()) for p in paths)
        n = min(len(run["batch_sums"]), len(base["batch_sums"]))
        if run["batch_sums"][:n] != base["batch_sums"][:n] or run["steps"] != base["steps"]:
            raise SystemExit(f"{d}: the two arms did not train on the same batches for the same steps")
        final, ref = run["val"][-1][1], base["val"][-1][1]
        rows.append(
            {
                "dir": d.name,
                "seed": base.get("seed"),
                "cpu": base.get("cpu", "not recorded"),
                against: ref,
                state: final,
                "difference": (final - ref) / ref,
            }
        )
    if not rows:
        raise SystemExit(f"no directory holds both {case}_{against}.json and {case}_{state}.json")
    diffs = [r["difference"] for r in rows]
    mean = sum(diffs) / len(diffs)
    summary: dict[str, Any] = {"case": case, "state": state, "against": against, "bar": BAR[case], "pairs": rows}
    summary |= {"n": len(diffs), "mean": mean, "within_bar": sum(abs(x) <= BAR[case] for x in diffs)}
    if len(diffs) > 1:
        sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1))
        se = sd / math.sqrt(len(diffs))
        half = T_975.get(len(diffs) - 1, 2.0) * se
        summary |= {"sd": sd, "se": se, "ci95": [mean - half, mean + half]}
    return summary


def print_pairs(summary: dict[str, Any]) -> None:
    state, against = summary["state"], summary["against"]
    print(f"{'directory':<28} {'seed':>5} {against:>8} {state:>8} {'vs ' + against:>9}  cpu")
    for r in summary["pairs"]:
        print(
            f"{r['dir']:<28} {r['seed'] if r['seed'] is not None else '?':>5} {r[against]:>8.4f} {r[state]:>8.4f}"
            f" {100 * r['difference']:>+8.2f}%  {r['cpu']}"
        )
    bar = 100 * summary["bar"]
    line = f"{summary['n']} pairs: mean {100 * summary['mean']:+.2f}%"
    if "sd" in summary:
        lo, hi = (100 * x for x in summary["ci95"])
        inside = "inside" if -bar <= lo and hi <= bar else "not inside"
        line += (
            f", standard deviation {100 * summary['sd']:.2f}%, standard error {100 * summary['se']:.2f}%,"
            f" 95% interval [{lo:+.2f}%, {hi:+.2f}%] ({inside} +-{bar:.1f}%)"
        )
    print(line + f"; {summary['within_bar']} of {summary['n']} pairs within +-{bar:.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--state", choices=STATES)
    parser.add_argument("--steps", type=int, help="default: 600 (demo), 1000 (llama cases)")
    parser.add_argument("--val-every", type=int, help="steps between validations; default: 100 (demo), 50 (llama)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=SEED, help="another seed measures the run-to-run spread")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--pairs", type=Path, nargs="+", help="directories of one (fp32, bf16) pair each")
    parser.add_argument("--pairs-out", type=Path, help="--pairs: also write them as JSON here")
    parser.add_argument("--report", action="store_true", help="print the table of --out's arms, draw --figure")
    parser.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args()
    if args.report:
        report(args.out, args.figure)
        return
    if args.pairs:
        summary = pairs(args.pairs, case=args.case or "llama", state=args.state or "bf16")
        print_pairs(summary)
        if args.pairs_out:
            args.pairs_out.write_text(json.dumps(summary, indent=2) + "\n")
        return
    if args.case is None or args.state is None:
        parser.error("--case and --state are required (or --report)")
    steps = args.steps or DEFAULT_STEPS[args.case]
    train(args.case, args.state, steps, args.threads, args.out, args.val_every, args.seed)


if __name__ == "__main__":
    main()
