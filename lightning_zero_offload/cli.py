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

import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only

# The package's __init__.py, run before this module, registered "zero_offload": `trainer.strategy: zero_offload`
# resolves.
from lightning_zero_offload.demo import GPT, StdlibCorpusDataModule
from lightning_zero_offload.planner.cli import importable_cwd

DEFAULT_MODEL = f"{GPT.__module__}.{GPT.__qualname__}"
DEFAULT_DATA = f"{StdlibCorpusDataModule.__module__}.{StdlibCorpusDataModule.__qualname__}"
DEMO = {"model": DEFAULT_MODEL, "data": DEFAULT_DATA}


class ZeroOffloadCLI(LightningCLI):
    """``LightningCLI`` with the demo defaults, the ``block_size`` link and a baseline report after fit."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({key: {"class_path": class_path} for key, class_path in DEMO.items()})
        # Skipped by jsonargparse when the chosen data or model class has no `block_size` argument.
        parser.link_arguments("data.init_args.block_size", "model.init_args.block_size")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """The demo's classes are defaults only where the command names no model or data class: jsonargparse carries
        a default's init_args into the class named instead wherever the names match (the demo's ``lr`` and
        ``batch_size`` became the user's), even in ``--print_config``."""
        given = sys.argv[1:] if args is None else args
        named = {key: None for key in DEMO if names_class(key, given)}
        for each in getattr(self, "_subcommand_parsers", {}).values() or [parser]:
            each.set_defaults(named)
        with_class_path = strategy_name_as_class_path(given)
        if with_class_path is not None:
            self.config = parser.parse_args(with_class_path)
        else:
            super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        trainer = config["trainer"]
        self.precision_choice: dict[str, Any] = {"precision": trainer.get("precision"), "precision_source": "given"}
        if trainer.get("precision") is None and trainer.get("accelerator") == "cpu":
            self.precision_choice = measured_cpu_precision()
            trainer["precision"] = self.precision_choice["precision"]

    def before_fit(self) -> None:
        # In the run's hparams.yaml too (config.yaml holds only the result): two runs of one config that
        # trained in different precisions say so, and why.
        choice = getattr(self, "precision_choice", None)
        if choice is not None and choice["precision"] is not None:
            for logger in self.trainer.loggers:
                logger.log_hyperparams(choice)

    def after_fit(self) -> None:
        report_fit(self.trainer, self.datamodule)


def names_class(key: str, args: Any) -> bool:
    """Whether the command line (or a config file it gives) sets ``key`` (``model``, ``data``) itself."""
    if hasattr(args, "as_dict"):  # a jsonargparse Namespace, as LightningCLI takes too
        args = args.as_dict()
    if isinstance(args, dict):
        return key in args or any(isinstance(v, dict) and key in v for v in args.values())
    args = [str(arg) for arg in args or []]
    for index, arg in enumerate(args):
        if arg == f"--{key}" or arg.startswith((f"--{key}=", f"--{key}.class_path")):
            return True
        config = _config_file(args, index)
        if config is not None and key in config:
            return True
    return False


# The registered names of the strategy, and the options each stands for.
STRATEGY_NAMES = {"zero_offload": [], "zero_offload_params": ["--trainer.strategy.offload_params=true"]}
STRATEGY_CLASS_PATH = "lightning_zero_offload.ZeroOffloadStrategy"


def strategy_name_as_class_path(args: Any) -> list[str] | None:
    """Options for a strategy given by its registered name (``--trainer.strategy zero_offload``, or
    ``strategy: zero_offload`` in a config file) followed by ``--trainer.strategy.cpu_step sync``: jsonargparse
    takes options only for a class path ("Does not validate against any of the Union subtypes"), so the class
    path is given just before them. None where the arguments have nothing to rewrite."""
    if not isinstance(args, (list, tuple)):
        return None
    args = [str(arg) for arg in args]
    name = None
    for index, arg in enumerate(args):
        if arg.startswith("--trainer.strategy."):
            if not isinstance(name, str) or name not in STRATEGY_NAMES:
                return None
            return [*args[:index], f"--trainer.strategy={STRATEGY_CLASS_PATH}", *STRATEGY_NAMES[name], *args[index:]]
        if arg == "--trainer.strategy" and index + 1 < len(args):
            name = args[index + 1]
        elif arg.startswith("--trainer.strategy="):
            name = arg.split("=", 1)[1]
        config = _config_file(args, index)
        trainer = config.get("trainer") if config is not None else None
        if isinstance(trainer, dict):  # not a path to another file, which jsonargparse takes there too
            name = trainer.get("strategy", name)
    return None


def _config_file(args: list[str], index: int) -> dict[str, Any] | None:
    """The config file ``args[index]`` gives (``--config F``, ``-c F``, ``--config=F``), read; else None."""
    arg = args[index]
    path = arg.split("=", 1)[1] if arg.startswith("--config=") else None
    if arg in ("-c", "--config") and index + 1 < len(args):
        path = args[index + 1]
    if path is None or not Path(path).is_file():
        return None
    config = yaml.safe_load(Path(path).read_text()) or {}
    return config if isinstance(config, dict) else None


BF16_MAX_SLOWDOWN = 1.5  # bf16-mixed is chosen where a bf16 matmul takes at most this many times the fp32 one
# Measured slowdowns this close to the threshold (a factor of 1.3 either side) may fall on either side on
# another start: the choice is then announced as unstable.
NEAR_THRESHOLD = 1.3


def pick_cpu_precision(bf16_matmul_s: float, fp32_matmul_s: float) -> str:
    """bf16 weights halve memory and traffic, but only pay where the CPU multiplies bf16 natively."""
    return "bf16-mixed" if bf16_matmul_s <= BF16_MAX_SLOWDOWN * fp32_matmul_s else "32-true"


def native_bf16() -> bool | None:
    """Whether this CPU multiplies bf16 natively (x86: AVX-512 BF16 or AMX), by torch's CPU feature checks;
    None where they cannot tell (another architecture, a torch without them)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if not all(callable(check) for check in checks):
        return None
    return any(check() for check in checks)


def measured_cpu_precision(size: int = 128, repeats: int = 3) -> dict[str, Any]:
    """The precision the CPU trains fastest in, and why: CPUs without AVX-512 BF16 or AMX run bf16 matmuls
    many times slower than fp32 (docs/benchmarks.md, "The demo"), which turns minutes into hours. Decided by the
    CPU's features where torch can tell (the same answer at every start), else measured. Prints the choice
    and why; the dict goes to the run's hparams (``before_fit``)."""
    native = native_bf16()
    if native is not None:
        choice = "bf16-mixed" if native else "32-true"
        has = "has AVX-512 BF16 or AMX" if native else "has neither AVX-512 BF16 nor AMX"
        print(
            f"[zero-offload] precision not given: {choice}, because this CPU {has} (torch.cpu feature check). "
            f"Pass --trainer.precision to choose another.",
            flush=True,
        )
        return {"precision": choice, "precision_source": f"CPU features: {has}"}

    def seconds(dtype: torch.dtype) -> float:
        # A generator of its own: LightningCLI has seeded the global one already, and drawing from it here
        # would give the model another initialisation (and the data another order) than the same config
        # with --trainer.precision given (the demo and the benchmarks diverged from the first step).
        generator = torch.Generator().manual_seed(0)
        # A training-shaped product (tokens x width times width x 4 width, as in an MLP): a square bf16
        # matmul timed too close to the threshold to be stable on an AVX2 CPU (docs/benchmarks.md, "The demo").
        a = torch.randn(4 * size, size, generator=generator).to(dtype)
        b = torch.randn(size, 4 * size, generator=generator).to(dtype)
        a @ b  # warm-up: kernel selection
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        return time.perf_counter() - start

    bf16_s, fp32_s = seconds(torch.bfloat16), seconds(torch.float32)
    choice = pick_cpu_precision(bf16_s, fp32_s)
    slowdown = bf16_s / max(fp32_s, 1e-12)
    print(
        f"[zero-offload] precision not given: {choice}, because a {4 * size}x{size} @ {size}x{4 * size} bf16 "
        f"matmul took {slowdown:.2f}x the fp32 one on this CPU (bf16-mixed where <= {BF16_MAX_SLOWDOWN}x). "
        f"Pass --trainer.precision={choice} to fix it.",
        flush=True,
    )
    if 1 / NEAR_THRESHOLD <= slowdown / BF16_MAX_SLOWDOWN <= NEAR_THRESHOLD:
        print(
            f"[zero-offload] {slowdown:.2f}x is close to {BF16_MAX_SLOWDOWN}x: another start on this machine may "
            "measure the other side and train in the other precision. Runs meant to be compared should pass "
            "--trainer.precision.",
            flush=True,
        )
    return {
        "precision": choice,
        "precision_source": f"measured: bf16 matmul {slowdown:.2f}x fp32 (bf16-mixed where <= {BF16_MAX_SLOWDOWN}x)",
        "bf16_matmul_s": bf16_s,
        "fp32_matmul_s": fp32_s,
    }


def cpu_precision(size: int = 128, repeats: int = 3) -> str:
    """The precision :func:`measured_cpu_precision` picks (and prints)."""
    return measured_cpu_precision(size, repeats)["precision"]


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
