"""The ``zero-offload`` command: a ``LightningCLI`` whose defaults train the embedded demo.

Examples::

    zero-offload fit --config configs/cpu_demo.yaml
    python -m lightning_zero_offload fit --config configs/cpu_demo.yaml --trainer.max_steps 100
    zero-offload fit --model my_pkg.MyModule --data my_pkg.MyData --trainer.strategy zero_offload

Model and data default to :class:`~lightning_zero_offload.demo.GPT` and
:class:`~lightning_zero_offload.demo.StdlibCorpusDataModule`; any ``LightningModule`` /
``LightningDataModule`` can be chosen with ``class_path``. When both sides have a ``block_size`` argument,
``data.block_size`` sets ``model.block_size``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only

# Importing the package registers the "zero_offload" strategy, so `trainer.strategy: zero_offload` resolves.
import lightning_zero_offload  # noqa: F401
from lightning_zero_offload.demo import GPT, StdlibCorpusDataModule
from lightning_zero_offload.planner.cli import importable_cwd

DEFAULT_MODEL = f"{GPT.__module__}.{GPT.__qualname__}"
DEFAULT_DATA = f"{StdlibCorpusDataModule.__module__}.{StdlibCorpusDataModule.__qualname__}"


class ZeroOffloadCLI(LightningCLI):
    """``LightningCLI`` with the demo defaults, the ``block_size`` link and a baseline report after fit."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})
        # Skipped by jsonargparse when the chosen data or model class has no `block_size` argument.
        parser.link_arguments("data.init_args.block_size", "model.init_args.block_size")

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        trainer = config["trainer"]
        if trainer.get("precision") is None and trainer.get("accelerator") == "cpu":
            trainer["precision"] = cpu_precision()

    def after_fit(self) -> None:
        report_fit(self.trainer, self.datamodule)


def pick_cpu_precision(bf16_matmul_s: float, fp32_matmul_s: float) -> str:
    """bf16 weights halve memory and traffic, but only pay where the CPU multiplies bf16 natively."""
    return "bf16-mixed" if bf16_matmul_s <= 1.5 * fp32_matmul_s else "32-true"


def cpu_precision(size: int = 256, repeats: int = 5) -> str:
    """The precision the CPU trains fastest in, measured: CPUs without AVX-512 BF16 or AMX run bf16
    matmuls some 30x slower than fp32 (measured on an AVX2 server), which turns minutes into hours."""

    def seconds(dtype: torch.dtype) -> float:
        a = torch.randn(size, size).to(dtype)
        a @ a  # warm-up: kernel selection
        start = time.perf_counter()
        for _ in range(repeats):
            a @ a
        return time.perf_counter() - start

    choice = pick_cpu_precision(seconds(torch.bfloat16), seconds(torch.float32))
    print(f"[zero-offload] precision not given: {choice}, measured fastest on this CPU", flush=True)
    return choice


def final_metrics(trainer: Any, datamodule: Any) -> dict[str, float]:
    """The last validation perplexity/loss logged, and the datamodule's unigram baseline if it has one."""
    out: dict[str, float] = {}
    for key in ("val_ppl", "val_loss", "train_loss"):
        value = trainer.callback_metrics.get(key)
        if value is not None:
            out[key] = float(value)
    baseline = getattr(datamodule, "unigram_perplexity", None)
    if callable(baseline):
        out["unigram_ppl"] = float(baseline())
    return out


def output_paths(trainer: Any) -> dict[str, str]:
    """Where this fit wrote its checkpoint and its CSV metrics (the keys present are those that exist)."""
    out: dict[str, str] = {}
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        path = getattr(callback, "best_model_path", "") or getattr(callback, "last_model_path", "")
        if path:
            out["checkpoint"] = str(path)
            break
    for logger in trainer.loggers:
        metrics = getattr(getattr(logger, "experiment", None), "metrics_file_path", None)
        if metrics:
            out["metrics"] = str(metrics)
            break
    return out


@rank_zero_only
def report_fit(trainer: Any, datamodule: Any) -> None:
    metrics = final_metrics(trainer, datamodule)
    if "val_ppl" in metrics:
        line = f"[zero-offload] after {trainer.global_step} steps: last val perplexity {metrics['val_ppl']:.3f}"
        if "unigram_ppl" in metrics:
            ratio = metrics["val_ppl"] / metrics["unigram_ppl"]
            line += f" | unigram byte baseline {metrics['unigram_ppl']:.3f} (ratio {ratio:.3f})"
        print(line, flush=True)
    paths = output_paths(trainer)
    if "checkpoint" in paths:
        print(f"[zero-offload] checkpoint: {paths['checkpoint']}", flush=True)
    if "metrics" in paths:
        print(f"[zero-offload] metrics (CSV): {paths['metrics']} (plot: python scripts/plot_logs.py <dir>)", flush=True)


def cli_main(args: Any = None, **kwargs: Any) -> ZeroOffloadCLI:
    """Build (and by default run) the CLI; ``args`` as for ``LightningCLI`` (``None``: ``sys.argv``)."""
    kwargs.setdefault("subclass_mode_model", True)
    kwargs.setdefault("subclass_mode_data", True)
    kwargs.setdefault("seed_everything_default", 1234)
    kwargs.setdefault("save_config_kwargs", {"overwrite": True})
    return ZeroOffloadCLI(None, None, args=args, **kwargs)


def main(args: Any = None) -> None:
    """Console-script entry point (``zero-offload``). The current directory is importable, as for
    ``python -m lightning_zero_offload`` or a LightningCLI script: ``--model mymod.MyModule`` works next
    to ``mymod.py``."""
    importable_cwd()
    cli_main(args)


if __name__ == "__main__":
    main()
