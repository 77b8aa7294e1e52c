"""The `zero-offload` command (LightningCLI): every shipped config parses, and a short real fit runs."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
EXPECTED_CONFIGS = {
    "cpu_demo.yaml",
    "gpu_bf16.yaml",
    "gpu_fp16.yaml",
    "dpu.yaml",
    "multi_gpu.yaml",
    "multi_node.yaml",
}

# A model and corpus small enough for a fit of a few steps in seconds.
TINY = [
    "--model.n_layer=1",
    "--model.n_head=2",
    "--model.n_embd=32",
    "--model.warmup_steps=1",
    "--data.block_size=32",
    "--data.batch_size=4",
    "--data.max_bytes=400000",
    "--data.val_fraction=0.2",
    "--data.val_samples=16",
]


@pytest.fixture(autouse=True)
def _clean_argv(monkeypatch, tmp_path):
    # LightningCLI warns when given `args` while sys.argv has extra entries (pytest's own).
    monkeypatch.setattr(sys, "argv", ["zero-offload"])
    # Relative paths in the configs (runs/) must land in the test's directory, not the repo.
    monkeypatch.chdir(tmp_path)


def print_config(*args: str) -> None:
    from lightning_zero_offload.cli import cli_main

    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", *args, "--print_config"])
    assert exc.value.code in (0, None)


def printed(capsys) -> dict:
    return yaml.safe_load(capsys.readouterr().out)


def test_all_configs_are_shipped():
    assert set(CONFIGS) >= EXPECTED_CONFIGS


def test_zero_offload_strategy_is_registered():
    """The name used by the configs resolves once `lightning_zero_offload` is imported."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_zero_offload

    assert "zero_offload" in StrategyRegistry
    assert StrategyRegistry["zero_offload"]["strategy"] is lightning_zero_offload.ZeroOffloadStrategy


@pytest.mark.parametrize("name", CONFIGS)
def test_print_config(name, capsys):
    print_config("--config", str(REPO / "configs" / name))
    cfg = printed(capsys)
    assert cfg["seed_everything"] == 1234
    strategy = cfg["trainer"]["strategy"]
    if isinstance(strategy, dict):
        assert strategy["class_path"] == "lightning_zero_offload.ZeroOffloadStrategy"
    else:
        assert strategy == "zero_offload"
    assert cfg["model"]["class_path"].endswith("GPT")
    assert cfg["data"]["class_path"].endswith("StdlibCorpusDataModule")
    assert cfg["trainer"]["logger"]["class_path"].endswith("CSVLogger")
    # Linked: the model's block_size is not a separate setting, it comes from the data.
    assert "block_size" not in cfg["model"]["init_args"]
    assert cfg["data"]["init_args"]["block_size"] >= 128


def test_config_specifics(capsys):
    print_config("--config", str(REPO / "configs" / "dpu.yaml"))
    dpu = printed(capsys)["trainer"]["strategy"]["init_args"]
    assert dpu["cpu_step"] == "delayed" and dpu["dpu_warmup_steps"] == 40
    print_config("--config", str(REPO / "configs" / "gpu_fp16.yaml"))
    assert printed(capsys)["trainer"]["precision"] == "16-mixed"
    print_config("--config", str(REPO / "configs" / "multi_gpu.yaml"))
    assert printed(capsys)["trainer"]["devices"] == 4
    print_config("--config", str(REPO / "configs" / "multi_node.yaml"))
    trainer = printed(capsys)["trainer"]
    assert trainer["num_nodes"] == 2 and trainer["devices"] == 8
    print_config("--config", str(REPO / "configs" / "cpu_demo.yaml"))
    trainer = printed(capsys)["trainer"]
    assert trainer["accelerator"] == "cpu" and trainer["precision"] is None  # measured at start (cpu_precision)


def test_cpu_precision_is_bf16_only_where_bf16_matmuls_are_fast():
    from lightning_zero_offload.cli import cpu_precision, pick_cpu_precision

    assert pick_cpu_precision(bf16_matmul_s=0.5, fp32_matmul_s=1.0) == "bf16-mixed"
    assert pick_cpu_precision(bf16_matmul_s=30.0, fp32_matmul_s=1.0) == "32-true"
    assert cpu_precision(size=32, repeats=1) in ("bf16-mixed", "32-true")


@pytest.mark.parametrize("features", ["known", "unknown"])
def test_choosing_the_cpu_precision_says_why_and_leaves_the_seeded_global_rng_alone(features, monkeypatch, capsys):
    """LightningCLI seeds before the choice: drawing from the global RNG there gave the demo another
    initialisation than the same config with --trainer.precision (3.743 vs 3.646 perplexity)."""
    from lightning_zero_offload import cli

    if features == "unknown":  # another architecture: measured
        monkeypatch.setattr(cli, "native_bf16", lambda: None)
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    choice = cli.measured_cpu_precision(size=32, repeats=1)
    assert torch.equal(torch.rand(4), expected)
    assert choice["precision"] in ("bf16-mixed", "32-true")
    source = "CPU features: " if features == "known" and cli.native_bf16() is not None else "measured: bf16 matmul"
    assert choice["precision_source"].startswith(source)
    out = capsys.readouterr().out
    assert f"precision not given: {choice['precision']}, because" in out and "--trainer.precision" in out


def test_the_cpu_feature_check_matches_the_cpu_flags():
    from lightning_zero_offload.cli import native_bf16

    cpuinfo = Path("/proc/cpuinfo")
    if native_bf16() is None or not cpuinfo.is_file():
        pytest.skip("no x86 feature check or no /proc/cpuinfo here")
    flags = set(cpuinfo.read_text().split())
    assert native_bf16() == bool({"avx512_bf16", "amx_bf16", "amx_tile"} & flags)


def test_gpu_configs_use_a_model_of_100m_plus_parameters(capsys):
    from lightning_zero_offload.demo import GPT

    for name in ("gpu_bf16.yaml", "gpu_fp16.yaml", "dpu.yaml", "multi_gpu.yaml", "multi_node.yaml"):
        print_config("--config", str(REPO / "configs" / name))
        cfg = printed(capsys)
        args = dict(cfg["model"]["init_args"], block_size=cfg["data"]["init_args"]["block_size"])
        with torch.device("meta"):
            n = GPT(**args).num_parameters()
        assert n >= 100_000_000, (name, n)


def resolve(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_defaults_without_config(capsys):
    from lightning_zero_offload.demo import GPT, StdlibCorpusDataModule

    print_config()
    cfg = printed(capsys)
    assert cfg["seed_everything"] == 1234
    assert resolve(cfg["model"]["class_path"]) is GPT
    assert resolve(cfg["data"]["class_path"]) is StdlibCorpusDataModule


def test_any_user_model_and_datamodule_by_class_path():
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    from lightning_zero_offload.cli import cli_main

    cli = cli_main(
        [
            "--model=lightning.pytorch.demos.boring_classes.BoringModel",
            "--data=lightning.pytorch.demos.boring_classes.BoringDataModule",
            "--trainer.logger=false",
        ],
        run=False,
    )
    assert type(cli.model) is BoringModel and type(cli.datamodule) is BoringDataModule


def test_block_size_link(tmp_path):
    from lightning_zero_offload.cli import cli_main

    cli = cli_main(["--data.block_size=48", "--trainer.logger=false"], run=False)
    assert cli.datamodule.block_size == 48 and cli.model.block_size == 48
    assert cli.model.hparams.block_size == 48


def read_metrics(log_dir: Path) -> list[dict[str, str]]:
    with open(log_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def run_tiny_fit(tmp_path: Path, capsys, strategy: str, *extra: str) -> tuple[object, list[dict[str, str]], str]:
    from lightning_zero_offload.cli import cli_main

    cli = cli_main(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "cpu_demo.yaml"),
            f"--trainer.strategy={strategy}",
            "--trainer.max_steps=3",
            "--trainer.limit_val_batches=2",
            "--trainer.val_check_interval=3",
            "--trainer.log_every_n_steps=1",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
            f"--trainer.default_root_dir={tmp_path}",
            *TINY,
            *extra,
        ]
    )
    out = capsys.readouterr().out
    log_dir = Path(cli.trainer.log_dir)
    return cli, read_metrics(log_dir), out


def check_tiny_fit(cli, rows, out) -> None:
    assert cli.trainer.global_step == 3
    assert cli.model.block_size == 32  # linked from data.block_size
    train = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    val = [r for r in rows if r.get("val_ppl")]
    assert len(train) == 3 and all(math.isfinite(v) for v in train)
    assert len(val) == 1
    assert float(val[0]["val_ppl"]) == pytest.approx(math.exp(float(val[0]["val_loss"])), rel=1e-5)
    # The report line: final val perplexity next to the unigram baseline.
    assert "val perplexity" in out and "unigram byte baseline" in out
    assert (Path(cli.trainer.log_dir) / "config.yaml").is_file()
    # The precision the CLI measured for the CPU, and why, is in the run's hparams next to the model's.
    hparams = yaml.safe_load((Path(cli.trainer.log_dir) / "hparams.yaml").read_text())
    assert hparams["precision"] in ("bf16-mixed", "32-true") and hparams["n_embd"] == 32
    assert hparams["precision_source"].startswith(("CPU features: ", "measured: bf16 matmul"))
    assert f"[zero-offload] precision not given: {hparams['precision']}, because" in out
    # Where the run went, printed at the end of fit: the CSV log, and the checkpoint when one is written.
    metrics_line = next(line for line in out.splitlines() if line.startswith("[zero-offload] metrics (CSV): "))
    assert Path(metrics_line.split(": ", 1)[1].split(" (plot")[0]).is_file()
    checkpoint_line = next(line for line in out.splitlines() if line.startswith("[zero-offload] checkpoint: "))
    assert Path(checkpoint_line.split(": ", 1)[1]).exists()


@pytest.mark.slow  # a Trainer run through the CLI
def test_tiny_fit_with_auto_strategy(tmp_path, capsys):
    cli, rows, out = run_tiny_fit(tmp_path, capsys, "auto")
    check_tiny_fit(cli, rows, out)
    check_plot_script(Path(cli.trainer.log_dir), tmp_path / "plots", capsys)


def check_plot_script(log_dir: Path, out_dir: Path, capsys) -> None:
    """scripts/plot_logs.py reads the run's metrics.csv; it plots when matplotlib (an extra) is installed."""
    spec = importlib.util.spec_from_file_location("plot_logs", REPO / "scripts" / "plot_logs.py")
    plot_logs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_logs)
    series = plot_logs.read_metrics(log_dir)
    assert len(series["train_loss"]) == 3 and len(series["val_ppl"]) == 1
    assert plot_logs.time_columns([series]) == []  # the auto strategy logs no offload/*_ms timings
    code = plot_logs.main([str(log_dir), "--label", "tiny", "--out", str(out_dir)])
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 1
        assert "lightning-zero-offload[plot]" in capsys.readouterr().err
    else:
        assert code == 0
        assert (out_dir / "loss.png").stat().st_size > 0


def test_plot_script_draws_each_phase_from_a_tiny_csv(tmp_path, capsys):
    """time_breakdown.png from OffloadMetrics' columns: phases in step order, the whole step apart, zeros named."""
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("plot_logs", REPO / "scripts" / "plot_logs.py")
    plot_logs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_logs)
    phases = ["forward", "backward", "cpu_step", "update_wait"]
    header = ["step", "train_loss", *(f"offload/{p}_ms" for p in phases), "offload/step_ms"]
    rows = [[s, 5.0 - s, 40.0 + s, 600.0, 3.0, 0.0, 650.0 + s] for s in range(4)]
    (tmp_path / "metrics.csv").write_text("\n".join(",".join(map(str, r)) for r in [header, *rows]) + "\n")
    columns = plot_logs.time_columns([plot_logs.read_metrics(tmp_path)])
    assert plot_logs.phase_columns(columns) == ([f"offload/{p}_ms" for p in phases], "offload/step_ms")
    assert plot_logs.main([str(tmp_path), "--out", str(tmp_path / "plots")]) == 0
    for name in ("loss.png", "time_breakdown.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 0
    assert "time_breakdown.png" in capsys.readouterr().out


def test_tiny_fit_with_zero_offload_strategy(tmp_path, capsys):
    """The main job's config as shipped (strategy zero_offload), shrunk to 3 steps."""
    import lightning_zero_offload

    cli, rows, out = run_tiny_fit(tmp_path, capsys, "zero_offload")
    assert isinstance(cli.trainer.strategy, lightning_zero_offload.ZeroOffloadStrategy)
    check_tiny_fit(cli, rows, out)


@pytest.mark.slow  # fresh interpreters
def test_python_dash_m_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_zero_offload",
            "fit",
            "--config",
            str(REPO / "configs" / "cpu_demo.yaml"),
            "--print_config",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load(proc.stdout)["trainer"]["strategy"] == "zero_offload"


def test_main_returns_none_for_console_script(capsys):
    # `zero-offload` passes main()'s return value to sys.exit: it must not be the CLI object.
    from lightning_zero_offload.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(REPO / "configs" / "cpu_demo.yaml"), "--print_config"])
    assert exc.value.code in (0, None)


STRATEGY_YAML = """\
trainer:
  accelerator: cpu
  devices: 1
  precision: bf16-mixed
  max_steps: 2
  limit_val_batches: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  strategy:
    class_path: lightning_zero_offload.ZeroOffloadStrategy
    init_args:
      bucket_size_mb: 1
      cpu_step: delayed
      dpu_warmup_steps: 1
"""

PLAIN_CLI = """\
import sys

import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel


class AdamBoring(BoringModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


cli = LightningCLI(AdamBoring, BoringDataModule, save_config_callback=None)
assert "lightning_zero_offload" in sys.modules  # imported by jsonargparse from the class_path, not by us
strategy = cli.trainer.strategy
print(type(strategy).__name__, strategy.options.cpu_step, cli.trainer.global_step)
"""


@pytest.mark.slow  # fresh interpreters
def test_class_path_strategy_in_a_plain_lightning_cli_script_without_import(tmp_path):
    """`class_path: lightning_zero_offload.ZeroOffloadStrategy` + `init_args:` works in any LightningCLI."""
    (tmp_path / "config.yaml").write_text(STRATEGY_YAML)
    (tmp_path / "train.py").write_text(PLAIN_CLI)
    done = subprocess.run(
        [sys.executable, "train.py", "fit", "--config", "config.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ZeroOffloadStrategy delayed 2"


@pytest.mark.slow  # fresh interpreters
def test_print_config_lists_only_the_strategy_own_options(tmp_path):
    import inspect

    import yaml

    from lightning_zero_offload import ZeroOffloadStrategy

    (tmp_path / "config.yaml").write_text(STRATEGY_YAML)
    done = subprocess.run(
        [sys.executable, "-m", "lightning_zero_offload", "fit", "--config", "config.yaml", "--print_config"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = yaml.safe_load(done.stdout)["trainer"]["strategy"]["init_args"]
    own = set(inspect.signature(ZeroOffloadStrategy.__init__).parameters) - {"self"}
    assert set(printed) <= own and "find_unused_parameters" not in printed and "bucket_size_mb" in printed
    assert printed["cpu_step"] == "delayed" and printed["bucket_size_mb"] == 1
    assert "delayed_param_update" not in printed  # removed in 0.1.0 (CHANGELOG.md)


USER_MODULE = """\
import torch
from lightning.pytorch.demos.boring_classes import BoringModel


class MyModule(BoringModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)
"""


@pytest.mark.slow  # fresh interpreters
def test_console_scripts_import_a_user_module_from_the_current_directory(tmp_path):
    """`zero-offload fit --model mymod.MyModule` next to mymod.py, as LightningCLI users expect (the console
    script's sys.path starts at its bin/ directory, not the current one)."""
    (tmp_path / "mymod.py").write_text(USER_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bin_dir = Path(sys.executable).parent
    fit = subprocess.run(
        [str(bin_dir / "zero-offload"), "fit", "--model", "mymod.MyModule", "--print_config"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-2000:]
    assert yaml.safe_load(fit.stdout)["model"]["class_path"] == "mymod.MyModule"
    planned = subprocess.run(
        [str(bin_dir / "zero-offload-plan"), "--model", "mymod.MyModule", "--batch-size", "2", "--seq-len", "32"]
        + ["--host", "Grace (GH200, LPDDR5X)", "--device", "GH200 (NVLink-C2C)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "recommended: cpu_step=" in planned.stdout


@pytest.mark.slow  # a Trainer run through the CLI
def test_tiny_fit_with_parameters_offloaded(tmp_path, capsys):
    """strategy: zero_offload_params in the shipped config's place: the demo GPT (its layers on the
    LightningModule itself) on FSDP2, with the same logs, validation and checkpoint."""
    import lightning_zero_offload

    cli, rows, out = run_tiny_fit(tmp_path, capsys, "zero_offload_params", "--model.n_layer=2")  # blocks to shard
    assert isinstance(cli.trainer.strategy, lightning_zero_offload.ZeroOffloadStrategy)
    assert cli.trainer.strategy.options.offload_params
    check_tiny_fit(cli, rows, out)


@pytest.mark.parametrize("given", ["argument", "config"])
def test_a_named_model_and_data_take_their_own_defaults_not_the_demos(given, tmp_path, capsys):
    """jsonargparse carries a default class's init_args into the class named instead wherever the names match: the
    demo's lr (1e-3) and batch_size (32) became a user's Classifier's and data's, silently (0.8 off in a run)."""
    model, data = "helpers.Classifier", "lightning.pytorch.demos.boring_classes.BoringDataModule"
    if given == "argument":
        print_config(f"--model={model}", "--data", data)
    else:
        (tmp_path / "run.yaml").write_text(f"model:\n  class_path: {model}\ndata:\n  class_path: {data}\n")
        print_config("--config", str(tmp_path / "run.yaml"))
    cfg = printed(capsys)
    assert cfg["model"] == {"class_path": model, "init_args": {"width": 32, "lr": 0.01, "scheduler": True, "seed": 0}}
    assert cfg["data"] == {"class_path": data}


def test_names_class_reads_every_form_of_arguments_lightningcli_takes(tmp_path):
    from jsonargparse import Namespace

    from lightning_zero_offload.cli import names_class

    (tmp_path / "run.yaml").write_text("data:\n  class_path: my.Data\n")
    assert names_class("model", ["fit", "--model", "my.Model"]) and names_class("model", ["--model=my.Model"])
    assert names_class("model", ["fit", "--model.class_path", "my.Model"])
    assert names_class("data", ["fit", "-c", str(tmp_path / "run.yaml")])
    assert not names_class("model", ["fit", f"--config={tmp_path / 'run.yaml'}", "--model.lr", "1"])
    assert names_class("model", {"fit": {"model": "my.Model"}}) and not names_class("data", {"fit": {}})
    assert names_class("model", Namespace(fit=Namespace(model="my.Model")))


@pytest.mark.parametrize(
    ("given", "offload_params"),
    [
        (["--trainer.strategy", "zero_offload"], False),
        (["--trainer.strategy=zero_offload_params"], True),
        (["--config", str(REPO / "configs" / "cpu_demo.yaml")], False),  # strategy: zero_offload in the file
        (["--config", str(REPO / "configs" / "dpu.yaml")], False),  # a class path there already
    ],
)
def test_strategy_options_follow_its_registered_name(given, offload_params, capsys):
    """``--trainer.strategy zero_offload --trainer.strategy.cpu_step sync`` (or after a config file naming it):
    jsonargparse refused options for a registered name ("Does not validate against any of the Union subtypes")."""
    print_config(*given, "--trainer.strategy.cpu_step", "sync")
    strategy = printed(capsys)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_zero_offload.ZeroOffloadStrategy"
    assert strategy["init_args"]["cpu_step"] == "sync"
    assert strategy["init_args"]["offload_params"] is offload_params


def test_registered_names_are_rewritten_only_where_options_follow(tmp_path):
    from lightning_zero_offload.cli import strategy_name_as_class_path

    (tmp_path / "run.yaml").write_text("trainer: trainer.yaml\n")  # a path to another file: no dict to read
    assert strategy_name_as_class_path(["--config", str(tmp_path / "run.yaml"), "--trainer.strategy.x=1"]) is None

    assert strategy_name_as_class_path(["fit", "--trainer.strategy", "zero_offload"]) is None
    assert strategy_name_as_class_path(["--trainer.strategy", "ddp", "--trainer.strategy.static_graph", "1"]) is None
    assert strategy_name_as_class_path({"trainer": {"strategy": "zero_offload"}}) is None
    rewritten = strategy_name_as_class_path(["--trainer.strategy=zero_offload", "--trainer.strategy.cpu_step=sync"])
    assert rewritten == [
        "--trainer.strategy=zero_offload",
        "--trainer.strategy=lightning_zero_offload.ZeroOffloadStrategy",
        "--trainer.strategy.cpu_step=sync",
    ]
